"""``tfaploss verify``: a split's record files against its manifest
(:func:`tfaploss.data.integrity.check_split`), with a progress bar on a terminal.

    tfaploss verify data/sop/train             # sizes and CRC-32C of every shard
    tfaploss verify data/sop                   # every split folder below it
    tfaploss verify data/sop/train --records   # also parse and check every record

One line per damaged file (``DAMAGED path at record r, byte b: problem``), then what
wrote the split and the command that rebuilds it.
"""

from __future__ import annotations

import logging
import os
import textwrap

from tfaploss.cli.arguments import add_command
from tfaploss.data.integrity import check_split, layout_files
from tfaploss.data.split_manifest import describe_source, is_job_output
from tfaploss.log import is_terminal

LOG = logging.getLogger(__name__)


def register(sub) -> None:
    add_command(
        sub, "verify", cmd_verify, _arguments,
        help="check a split's TFRecord files against its manifest (sizes, checksums)",
        description=textwrap.dedent("""\
            Check the record files of a split folder (or of every split folder below
            DIR) against its manifest.json in one pass: each file's size and CRC-32C
            and, with --records, every record (framing, features, labels among the
            manifest's classes). A manifest without checksums (older pipelines): each
            record's own CRCs. Exit 0 when all agree; 2 with one line per damaged
            file and the command that rebuilds the split."""))


def _arguments(p) -> None:
    p.add_argument("dir", metavar="DIR",
                   help="a split folder written by a pipelines job (OUT/train), or OUT")
    p.add_argument("--records", action="store_true",
                   help="also parse every record and check its features (slower)")
    p.add_argument("--sizes-only", action="store_true",
                   help="only sizes and file names against the manifest (no read)")


def split_dirs(path: str) -> list[str]:
    """``path`` when it holds a manifest.json, else its sub-folders that do."""
    if is_job_output(path):
        return [path]
    if not os.path.isdir(path):
        raise FileNotFoundError(f"{path!r} is not a folder (a split folder written by a "
                                "pipelines job)")
    found = sorted(os.path.join(path, d) for d in os.listdir(path)
                   if is_job_output(os.path.join(path, d)))
    if not found:
        raise FileNotFoundError(f"{path!r} holds no manifest.json, nor do its sub-folders: "
                                "not a split written by a pipelines job")
    return found


def _total_bytes(split: str) -> int:
    return sum(os.path.getsize(os.path.join(split, f)) for layout in ("images", "by_class")
               for f in layout_files(split, layout))


def cmd_verify(args) -> int:
    """Run ``tfaploss verify``; returns the exit status (0 all good, 2 damage)."""
    level = "sizes" if args.sizes_only else "records" if args.records else "full"
    splits = split_dirs(args.dir)
    total = sum(_total_bytes(s) for s in splits)
    bar = None
    # A bar only on a terminal (as the other commands): a log file gets the lines alone.
    if is_terminal() and not getattr(args, "quiet", False) and level != "sizes" and total:
        import keras

        bar = keras.utils.Progbar(max(1, total // (1 << 20)), unit_name="MiB")
    seen = [0]

    def progress(path, size):
        seen[0] += size
        if bar is not None:
            bar.update(seen[0] // (1 << 20))

    reports = [check_split(s, level, progress=progress) for s in splits]
    if bar is not None:
        bar.update(max(1, total // (1 << 20)), finalize=True)
    bad = 0
    for report in reports:
        for note in report.notes:
            LOG.info("%s: %s", report.split_dir, note)
        for damage in report.damaged:
            LOG.error("DAMAGED %s", damage.line())
        if report.damaged:
            bad += len(report.damaged)
            LOG.error("  %s: %s", report.split_dir,
                      describe_source(report.manifest, report.split_dir))
    files = sum(len(r.checked) for r in reports)
    what = {"sizes": "sizes", "full": "sizes and checksums",
            "records": "sizes, checksums and every record"}[level]
    if bad:
        LOG.error("%d damaged file(s) of %d checked (%s)", bad, files, what)
        return 2
    LOG.info("OK: %d file(s), %.1f MiB in %d split(s): %s agree with the manifest",
             files, sum(r.bytes for r in reports) / (1 << 20), len(reports), what)
    return 0
