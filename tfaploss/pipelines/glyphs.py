"""A folder of fonts -> a retrieval dataset: one class per character, one image per face.

Seeded (a rerun writes the same bytes); every file and every (character, face) pair
ends up in the records, the dead letters or ``ignored_files.jsonl`` with its reason.
The rules: docs/pipelines.md; figures: docs/data.md.

    python -m tfaploss.pipelines.glyphs --input_dir data/fonts/extracted --output_dir data/glyphs
"""

from __future__ import annotations

import collections
import logging
import multiprocessing
import os
import re
import sys
import unicodedata
from concurrent.futures import ProcessPoolExecutor, as_completed
from dataclasses import dataclass, field

from tfaploss.pipelines import console, storage
from tfaploss.pipelines import fonts as F
from tfaploss.pipelines import glyph_render as G
from tfaploss.pipelines import image_workers as W
from tfaploss.pipelines import images as I
from tfaploss.pipelines import links as LK
from tfaploss.pipelines import options as opts
from tfaploss.pipelines import runner as R
from tfaploss.process_settings import available_cores

LOG = logging.getLogger("tfaploss.pipelines.glyphs")  # not __name__: "__main__" under -m

NAMED_SETS = {
    "cjk": ((0x4E00, 0x9FFF),),
    "hangul": ((0xAC00, 0xD7A3),),
    "latin": ((0x0021, 0x007E), (0x00A1, 0x017F)),
}
_RANGE = re.compile(r"U\+([0-9A-F]{1,6})(?:-U\+([0-9A-F]{1,6}))?", re.IGNORECASE)
SPLITS = ("train", "val", "test")

NO_INK = "no ink when rendered"
BROKEN = "broken"  # a glyph fontTools or FreeType fails on: a dead letter
SAME_OUTLINE = "same outline as another face"
NO_CHARSET = "no character of --charset"
FEW_IMAGES = "character with fewer than --min_images images"
RENDER_FN = "tfaploss.pipelines.glyph_render:render_png"


def parser():
    return opts.build_parser(__doc__.splitlines()[0], (
        ("--charset", str, "cjk", (
            "characters: cjk, hangul, latin, several joined by '+' (cjk+hangul), or "
            "comma-separated ranges U+4E00-U+4FFF,U+AC00")),
        ("--min_coverage", float, 0.9, (
            "fraction of the faces taking part in a character's set that must have it in "
            "their cmap")),
        ("--max_classes", int, 3000,
         "most characters kept (a seeded sample of the covered ones); 0: all"),
        ("--test_fraction", float, 0.5, "fraction of the characters in the 'test' split"),
        ("--val_fraction", float, 0.1,
         "fraction of the characters in the 'val' split (0: no val split)"),
        opts.FOLLOW_EXTERNAL_LINKS,
        ("--seed", int, 0, "seeds the class sample, the split and every image's jitter"),
        ("--canvas_size", int, 64, "width and height of the images in pixels"),
        ("--margin", float, 0.08, "blank border on each side, as a fraction of the canvas"),
        ("--scale_jitter", float, 0.15,
         "each glyph is drawn at 1 - U(0, this) of its full size"),
        ("--shift_jitter", float, 0.04, (
            "each glyph is shifted by U(-this, this) canvas widths in x and y (never past "
            "the canvas edge)")),
        ("--stroke_jitter", float, 1.0, "strokes are thickened by U(0, this) canvas pixels"),
        ("--min_images", int, 2, (
            "characters left with fewer images than this (after the checks below) are "
            "dropped: a class needs two images to be retrieved")),
        ("--keep_duplicate_outlines", bool, False, (
            "also render a face whose glyph has the same outline as an earlier face's (by "
            "default listed as ignored)")),
    ))


def _validate(args) -> None:
    if storage.is_url(args.input_dir):
        raise ValueError(f"--input_dir must be a local folder (FreeType reads the font "
                         f"files), got {args.input_dir!r}")
    if not 0.0 < args.min_coverage <= 1.0:
        raise ValueError(f"--min_coverage must be in (0, 1], got {args.min_coverage}")
    if args.max_classes < 0:
        raise ValueError(f"--max_classes must be >= 0 (0: all), got {args.max_classes}")
    if not 0.0 < args.test_fraction < 1.0:
        raise ValueError(f"--test_fraction must be in (0, 1), got {args.test_fraction}")
    if not 0.0 <= args.val_fraction < 1.0:
        raise ValueError(f"--val_fraction must be in [0, 1), got {args.val_fraction}")
    if args.test_fraction + args.val_fraction >= 1.0:
        raise ValueError(
            f"--test_fraction + --val_fraction must be below 1 (the rest is train), got "
            f"{args.test_fraction} + {args.val_fraction} = "
            f"{args.test_fraction + args.val_fraction:g}")
    if args.min_images < 1:
        raise ValueError(f"--min_images must be >= 1, got {args.min_images}")
    if args.canvas_size < 8:
        raise ValueError(f"--canvas_size must be >= 8, got {args.canvas_size}")
    if not 0.0 <= args.margin < 0.4:
        raise ValueError(f"--margin must be in [0, 0.4), got {args.margin}")
    if not 0.0 <= args.scale_jitter < 1.0:
        raise ValueError(f"--scale_jitter must be in [0, 1), got {args.scale_jitter}")
    if not 0.0 <= args.shift_jitter <= 0.5:
        raise ValueError(f"--shift_jitter must be in [0, 0.5], got {args.shift_jitter}")
    if args.stroke_jitter < 0.0:
        raise ValueError(f"--stroke_jitter must be >= 0, got {args.stroke_jitter}")
    parse_charset(args.charset)


def _graphic(cp: int) -> bool:
    return unicodedata.category(chr(cp))[0] in "LNPS"


def parse_charset(spec: str) -> list[tuple[str, list[int]]]:
    """``--charset`` -> ``[(set name, sorted code points)]`` per named set or range (a
    character in two counts in the first)."""
    parts: list[tuple[str, list[tuple[int, int]]]] = []
    for token in (t.strip() for t in spec.split(",")):
        m = _RANGE.fullmatch(token)
        if m:
            lo = int(m.group(1), 16)
            hi = int(m.group(2), 16) if m.group(2) else lo
            if not lo <= hi <= 0x10FFFF:
                raise ValueError(f"--charset: range {token!r} is empty or beyond U+10FFFF "
                                 f"(in {spec!r})")
            parts.append((token.upper(), [(lo, hi)]))
            continue
        names = [n.strip().lower() for n in token.split("+")]
        unknown = [n for n in names if n not in NAMED_SETS]
        if not token or unknown:
            raise ValueError(
                f"--charset: unknown character set {token!r} in {spec!r}; use "
                f"{', '.join(NAMED_SETS)}, several joined by '+' (cjk+hangul) or "
                "comma-separated ranges like U+4E00-U+4FFF,U+AC00-U+ACFF")
        parts.extend((n, list(NAMED_SETS[n])) for n in names)
    seen: set[int] = set()
    out = []
    for name, ranges in parts:
        cps = [cp for lo, hi in ranges for cp in range(lo, hi + 1)
               if cp not in seen and _graphic(cp)]
        seen.update(cps)
        if cps:
            out.append((name, sorted(cps)))
    if not out:
        raise ValueError(f"--charset {spec!r} holds no graphic character")
    return out


def char_name(cp: int) -> str:
    return f"U+{cp:04X}"


@dataclass
class Listing:
    """What :func:`list_fonts` found: ``fonts`` ``[(relpath, path)]``, ``dead`` letters,
    ``ignored`` entries."""

    fonts: list[tuple[str, str]] = field(default_factory=list)
    dead: list[dict] = field(default_factory=list)
    ignored: list[dict] = field(default_factory=list)

    def add_dead(self, rel: str, code: str, detail: str) -> None:
        self.dead.append({"id": rel, "path": rel, "reason": code, "detail": detail})

    def add_ignored(self, rel: str, reason: str) -> None:
        self.ignored.append({"path": rel, "reason": reason})


def list_fonts(input_dir: str, follow_external_links: bool = False) -> Listing:
    """Every file under ``input_dir``: a font to read, a dead letter or ignored (links as
    :mod:`tfaploss.pipelines.links` decides)."""
    if not os.path.isdir(input_dir):
        raise FileNotFoundError(f"--input_dir {input_dir!r} is not a directory")
    listing = Listing()
    policy = LK.LinkPolicy(input_dir, follow_external_links)

    def add_font(rel: str, path: str, real: str) -> None:
        if policy.admit(rel, real, F.FONT_EXTENSIONS,
                        "not a font file (.ttf, .otf, .ttc, .otc)", listing.add_ignored):
            listing.fonts.append((rel, path))

    LK.walk(input_dir, "", policy, add_font, listing.add_ignored, listing.add_dead)
    policy.drain()
    listing.fonts.sort()
    return listing


@dataclass
class _FaceInfo:
    relpath: str
    path: str
    index: int
    name: str
    cmap: dict[int, int]  # the charset's characters in its cmap -> glyph id

    @property
    def id(self) -> str:
        return f"{self.relpath}#{self.index}"


def _map_files(fn, jobs: list[tuple], processes: int, what: str) -> list:
    """``[fn(*job) for job in jobs]``, over ``processes`` forked processes (largest
    font file first)."""
    progress = console.Progress(what, total=len(jobs))
    if processes <= 1 or len(jobs) <= 1:
        out = []
        for job in jobs:
            out.append(fn(*job))
            progress.add(1)
        return out
    order = sorted(range(len(jobs)), key=lambda i: -os.path.getsize(jobs[i][1]))
    with ProcessPoolExecutor(min(processes, len(jobs)),
                             mp_context=multiprocessing.get_context("fork")) as pool:
        futures = {i: pool.submit(fn, *jobs[i]) for i in order}
        for future in as_completed(futures.values()):
            future.result()
            progress.add(1)
    return [futures[i].result() for i in range(len(jobs))]


def _scan_file(rel: str, path: str, charset: frozenset[int]):
    """One font file's faces ``[(index, name, {cp: glyph id} of the charset)]``, or its
    dead letter."""
    try:
        with F.FontFile(path, rel) as font:
            faces = [(f.index, f.name, {cp: g for cp, g in f.cmap.items() if cp in charset})
                     for f in font.faces]
        for index, _, _ in faces:
            G.open_face(path, index)
        return faces
    except I.ImageError as e:  # FontError included
        return {"id": rel, "path": rel, "reason": e.code, "detail": e.detail}
    finally:
        G.close_fonts()


def _read_faces(listing: Listing, charset: set[int], processes: int) -> list[_FaceInfo]:
    """The faces of every listed font, with the charset's characters they map; unreadable
    files become dead letters."""
    chars = frozenset(charset)
    scans = _map_files(_scan_file, [(rel, path, chars) for rel, path in listing.fonts],
                       processes, "font files read")
    faces = []
    for (rel, path), scan in zip(listing.fonts, scans):
        if isinstance(scan, dict):
            listing.dead.append(scan)
        else:
            faces.extend(_FaceInfo(rel, path, index, name, cmap)
                         for index, name, cmap in scan)
    return faces


def _check_file(rel: str, path: str, cmaps: list[dict[int, int]],
                todo: list[list[int]]) -> list[list[tuple[str | None, str, bool]]]:
    """Per face of a font file and per ``todo`` character: ``(reason it gives no image or
    None, outline fingerprint, has ink)`` or ``(BROKEN, what went wrong, False)``."""
    ink: dict[tuple[int, str], bool] = {}
    out = []
    try:
        with F.FontFile(path, rel, cmaps=cmaps) as font:
            for face, cps in zip(font.faces, todo):
                rows = []
                for cp in cps:
                    try:
                        g = face.glyph(cp)
                        has = False
                        if g.reason is None:
                            key = (cp, g.fingerprint)
                            if key not in ink:
                                ink[key] = G.has_ink(path, face.index, cp)
                            has = ink[key]
                        rows.append((g.reason, g.fingerprint, has))
                    except F.FontError as e:
                        rows.append((BROKEN, e.detail, False))
                    except Exception as e:  # noqa: BLE001 - one bad glyph is one dead letter
                        why = f"cannot read its glyph: {type(e).__name__}: {e}"
                        rows.append((BROKEN, why, False))
                out.append(rows)
    finally:
        G.close_fonts()
    return out


def _select(args, parts, faces: list[_FaceInfo]):
    """Covered characters -> the kept ones; also the faces taking part in each set."""
    taking_part = {name: [f for f in faces if not f.cmap.keys().isdisjoint(cps)]
                   for name, cps in parts}
    covered = []
    for name, cps in parts:
        members = taking_part[name]
        if not members:
            continue
        need = args.min_coverage * len(members) - 1e-9
        counts = collections.Counter(cp for f in members for cp in f.cmap)
        covered.extend(cp for cp in cps if counts[cp] >= need)
    covered.sort()
    kept = covered
    if args.max_classes and len(covered) > args.max_classes:
        kept = sorted(G.seeded_rng(args.seed, "classes").sample(covered, args.max_classes))
    return covered, kept, taking_part


def _split_characters(args, kept: list[int]) -> dict[str, list[int]]:
    n = len(kept)
    n_test = max(1, round(args.test_fraction * n))
    n_val = max(1, round(args.val_fraction * n)) if args.val_fraction > 0 else 0
    if n - n_test - n_val < 1:
        raise ValueError(
            f"only {n} characters are kept: too few for a train split beside "
            f"--test_fraction {args.test_fraction} and --val_fraction {args.val_fraction}; "
            "add faces, widen --charset or lower --min_coverage")
    order = list(kept)
    G.seeded_rng(args.seed, "splits").shuffle(order)
    groups = {"test": order[:n_test], "val": order[n_test:n_test + n_val],
              "train": order[n_test + n_val:]}
    return {s: sorted(groups[s]) for s in SPLITS if groups[s]}


def _check_glyphs(args, faces: list[_FaceInfo], part_of: dict[int, str],
                  taking_part: dict[str, list], kept: list[int], processes: int):
    """Sort every (kept character, face taking part) pair: ``{cp: [face]}`` to render,
    and the ignored entries and dead letters per character."""
    member_of = {name: {f.id for f in members} for name, members in taking_part.items()}
    by_file: dict[tuple[str, str], list[_FaceInfo]] = collections.defaultdict(list)
    for f in faces:
        by_file[(f.relpath, f.path)].append(f)
    files = sorted(by_file)
    todo = {f.id: [cp for cp in kept if f.id in member_of[part_of[cp]]] for f in faces}
    checks = _map_files(_check_file, [
        (rel, path, [f.cmap for f in by_file[(rel, path)]],
         [todo[f.id] for f in by_file[(rel, path)]]) for rel, path in files],
        processes, "font files checked")
    use: dict[int, list[_FaceInfo]] = collections.defaultdict(list)
    ignored: dict[int, list[dict]] = collections.defaultdict(list)
    dead: dict[int, list[dict]] = collections.defaultdict(list)
    first: dict[tuple[int, str], str] = {}  # (character, outline) -> first face drawing it
    for key, check in zip(files, checks):
        for info, rows in zip(by_file[key], check):
            for cp, (reason, fingerprint, ink) in zip(todo[info.id], rows):
                extra = {}
                if reason == BROKEN:
                    dead[cp].append({"id": f"{char_name(cp)}/{info.id}", "path": info.relpath,
                                     "reason": I.UNDECODABLE, "detail": fingerprint})
                    continue
                if reason is None and not ink:
                    reason = NO_INK
                elif reason is None and not args.keep_duplicate_outlines:
                    earlier = first.setdefault((cp, fingerprint), info.id)
                    if earlier != info.id:
                        reason, extra = SAME_OUTLINE, {"same_as": earlier}
                if reason is None:
                    use[cp].append(info)
                else:
                    ignored[cp].append({"path": info.relpath, "face": info.index,
                                        "char": char_name(cp), "reason": reason, **extra})
    return use, ignored, dead


def _render_args(args, info: _FaceInfo, cp: int) -> dict:
    return {"path": info.path, "index": info.index, "cp": cp, "canvas": args.canvas_size,
            "margin": args.margin,
            **G.jitter(args.seed, info.id, cp, scale=args.scale_jitter,
                       shift=args.shift_jitter, stroke=args.stroke_jitter)}


def _split_plan(args, split: str, cps: list[int], use, ignored, dead) -> R.SplitPlan:
    records = []
    per_face = collections.Counter()
    for label, cp in enumerate(cps):
        for info in use.get(cp, []):
            records.append({
                "id": f"{char_name(cp)}/{info.id}", "path": info.path,
                "relpath": info.relpath, "label": label, "super_label": -1,
                "class_text": chr(cp),
                "render": {"fn": RENDER_FN, "args": _render_args(args, info, cp)}})
            per_face[(info.id, info.name)] += 1
    records, failures = R.dedupe_and_index(records)
    by_class = (args.by_class != "none") if split == "val" else None
    extra = {"glyphs": {
        "charset": args.charset,
        "faces": [{"face": fid, "name": name, "images": n}
                  for (fid, name), n in sorted(per_face.items())],
        "canvas_size": args.canvas_size}}
    failures = [d for cp in cps for d in dead.get(cp, [])] + failures
    return R.SplitPlan(split, records, failures,
                       label_map={i: f"{char_name(cp)} {chr(cp)}" for i, cp in enumerate(cps)},
                       ignored=[d for cp in cps for d in ignored.get(cp, [])],
                       by_class=by_class, extra=extra)


def plan(args) -> list[R.SplitPlan]:
    _validate(args)
    if not getattr(args, "verbose", False):
        # fontTools warns about harmless oddities of real fonts ("'created' timestamp
        # seems very low"), once per face.
        logging.getLogger("fontTools").setLevel(logging.ERROR)
    parts = parse_charset(args.charset)
    part_of = {cp: name for name, cps in parts for cp in cps}
    listing = list_fonts(args.input_dir, getattr(args, "follow_external_links", False))
    processes = (args.image_processes or available_cores()) if W.can_fork() else 1
    faces = _read_faces(listing, set(part_of), processes)
    if not faces:
        raise ValueError(f"--input_dir {args.input_dir!r} holds no readable font file "
                         f"({', '.join(F.FONT_EXTENSIONS)}); {len(listing.dead)} unreadable")
    covered, kept, taking_part = _select(args, parts, faces)
    members = {f.id for fs in taking_part.values() for f in fs}
    face_ignored = [{"path": f.relpath, "face": f.index, "reason": NO_CHARSET}
                    for f in faces if f.id not in members]
    LOG.info("glyphs: %d faces in %d font files, %d of them taking part in --charset %s; "
             "%d dead letters, %d other files ignored", len(faces),
             len({f.relpath for f in faces}), len(members), args.charset,
             len(listing.dead), len(listing.ignored))
    if not kept:
        sizes = ", ".join(f"{n}: {len(fs)} faces" for n, fs in taking_part.items())
        raise ValueError(f"no character of --charset {args.charset!r} is in at least "
                         f"--min_coverage={args.min_coverage} of the faces taking part "
                         f"({sizes or 'none'}); lower --min_coverage or add fonts")
    use, ignored, dead = _check_glyphs(args, faces, part_of, taking_part, kept, processes)
    thin = [cp for cp in kept if len(use.get(cp, [])) < args.min_images]
    for cp in thin:
        for info in use.pop(cp, []):
            ignored[cp].append({"path": info.relpath, "face": info.index,
                                "char": char_name(cp), "reason": FEW_IMAGES})
    thin_ignored = [d for cp in thin for d in ignored.pop(cp, [])]
    thin_dead = [d for cp in thin for d in dead.pop(cp, [])]
    kept = [cp for cp in kept if cp in use]
    splits = _split_characters(args, kept)
    LOG.info("glyphs: %d characters kept of %d covered (%d with fewer than %d images "
             "dropped): %s", len(kept), len(covered), len(thin), args.min_images,
             ", ".join(f"{s} {len(c)}" for s, c in splits.items()))
    plans = [_split_plan(args, split, cps, use, ignored, dead)
             for split, cps in splits.items()]
    plans[0].failures = listing.dead + thin_dead + plans[0].failures
    plans[0].ignored = listing.ignored + face_ignored + thin_ignored + plans[0].ignored
    return plans


def run(argv: list[str] | None = None) -> dict[str, dict]:
    """Run the job in-process; returns ``{split: manifest}``."""
    return R.run_command("glyphs", parser(), plan, argv)


if __name__ == "__main__":
    sys.exit(R.main_wrapper(run))
