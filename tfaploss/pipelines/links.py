"""One walker (:func:`walk`) and one symlink policy (:class:`LinkPolicy`) for the jobs
that list an input folder (folder, glyphs); the rules: docs/pipelines.md and
docs/reliability.md."""

from __future__ import annotations

import os
from collections import deque
from collections.abc import Callable

from tfaploss.pipelines import images as I
from tfaploss.pipelines import storage

LEAVES_ROOT = "symlink leaving --input_dir (not followed; --follow_external_links follows it)"


def inside(path: str, folder: str) -> bool:
    """Whether real ``path`` is ``folder`` or below it."""
    return os.path.commonpath([path, folder]) == folder


class LinkPolicy:
    """The state one walk of ``input_dir`` shares: what is listed, what waits."""

    def __init__(self, input_dir: str, follow_external: bool = False):
        self.root = os.path.realpath(input_dir)
        self.follow_external = follow_external
        self.dirs: dict[str, str] = {}  # real folder -> the path it was listed as
        self._files: dict[str, str] = {}
        self._pending: deque[Callable[[], None]] = deque()

    def dir_owner(self, real: str) -> str | None:
        """The path a listed folder containing (or equal to) ``real`` was listed as."""
        while real not in self.dirs:
            if os.path.dirname(real) == real:
                return None
            real = os.path.dirname(real)
        return self.dirs[real]

    def admit(self, rel: str, real: str, extensions: tuple[str, ...], other: str,
              ignore) -> bool:
        """Whether the walked file ``rel`` goes to the job (one of ``extensions``, not a
        second name of a listed file); else ``ignore(rel, reason)``."""
        if not rel.lower().endswith(extensions):
            ignore(rel, other)
        elif real in self._files:
            ignore(rel, f"same file as {self._files[real]}")
        else:
            self._files[real] = rel
            return True
        return False

    def leaves(self, real: str) -> bool:
        """Whether a link to ``real`` is refused for leaving the input root."""
        return not self.follow_external and not inside(real, self.root)

    def dir_link_reason(self, path: str, real_dir: str) -> str | None:
        """Why the folder link ``path`` (in ``real_dir``) is not followed, or None."""
        real = os.path.realpath(path)
        if self.leaves(real):
            return LEAVES_ROOT
        if inside(real_dir, real) or inside(self.root, real):
            return "symlink to a folder that contains it (loop; not followed)"
        owner = self.dir_owner(real)
        if owner is not None:
            return f"symlink to a folder already listed as {owner}/ (not followed again)"
        return None

    def bound(self, real: str) -> str:
        """The real folder a read of file ``real`` must stay in: the input root, or for
        a file outside it its own folder."""
        return self.root if inside(real, self.root) else os.path.dirname(real)

    def defer(self, step: Callable[[], None]) -> None:
        """Handle a link after every real entry listed so far."""
        self._pending.append(step)

    def drain(self) -> None:
        """Follow the deferred links, and those found behind them, in order."""
        while self._pending:
            self._pending.popleft()()


def hidden_reason(name: str) -> str:
    """Why a name starting with ``.`` or ``_`` is ignored."""
    return ("name starts with '.' (hidden)" if name.startswith(".")
            else "name starts with '_' (reserved, e.g. __MACOSX, _work)")


def screen(entry: os.DirEntry, rel: str, ignore, dead) -> bool:
    """Handle ``entry`` (shown as ``rel``) and everything below it if its name is not
    UTF-8 (dead letters) or hidden (ignored); ``False``: the name is fine."""
    if storage.printable_name(entry.name) is not None:
        if entry.is_dir(follow_symlinks=False):
            storage.walk_all_files(entry.path, rel, lambda r: dead(
                r, I.BAD_FILE_NAME, f"a folder name in {r!r} is not valid UTF-8"))
        else:
            dead(rel, I.BAD_FILE_NAME, f"file name {rel!r} is not valid UTF-8")
    elif entry.name.startswith((".", "_")):
        why = hidden_reason(entry.name)
        if entry.is_dir(follow_symlinks=False):
            storage.walk_all_files(entry.path, rel, lambda r: ignore(r, f"inside {rel}/: {why}"))
        else:
            ignore(rel, why)
    else:
        return False
    return True


def walk(path: str, rel_dir: str, policy: LinkPolicy, on_file, ignore, dead) -> None:
    """List folder ``path`` (shown as ``rel_dir``) and below: files (and those followed
    links reach) to ``on_file(rel, path, real)``, the rest to ``ignore(rel, reason)`` or
    ``dead(rel, code, detail)``; links wait in ``policy`` until the caller drains it.
    Costs one ``scandir`` per folder and one ``realpath`` per folder and file.
    """
    def join(rel_dir: str, name: str) -> str:
        return f"{rel_dir}/{name}" if rel_dir else name

    def follow(link: str, rel: str, real_dir: str) -> None:
        real = os.path.realpath(link)
        if os.path.isdir(link):
            why = policy.dir_link_reason(link, real_dir)
            if why:
                ignore(rel, why)
            else:
                policy.dirs[real] = rel
                visit(link, rel, real)
        elif policy.leaves(real):
            ignore(rel, LEAVES_ROOT)
        elif os.path.isfile(link):
            on_file(rel, link, real)
        else:
            ignore(rel, "not a regular file (device, pipe)")

    def visit(dirpath: str, rel_dir: str, real_dir: str) -> None:
        try:
            entries = sorted(os.scandir(dirpath), key=lambda e: e.name)
        except OSError as e:
            dead(rel_dir + "/", I.UNREADABLE_FOLDER,
                 f"cannot list folder {rel_dir or '.'}/: {e.strerror or e}")
            return
        for e in entries:
            rel = join(rel_dir, storage.printable_name(e.name) or e.name)
            if screen(e, rel, ignore, dead):
                continue
            if e.is_symlink() and not os.path.exists(e.path):
                dead(rel, I.MISSING_FILE, f"broken symlink to {os.readlink(e.path)}")
            elif e.is_symlink():
                policy.defer(lambda p=e.path, r=rel, d=real_dir: follow(p, r, d))
            elif e.is_dir():
                real = os.path.realpath(e.path)
                owner = policy.dirs.get(real)
                if owner is not None:  # a bind mount, or a followed folder holding it
                    ignore(rel, f"folder already listed as {owner}/")
                else:
                    policy.dirs[real] = rel
                    visit(e.path, rel, real)
            elif e.is_file():
                on_file(rel, e.path, os.path.realpath(e.path))
            else:
                ignore(rel, "not a regular file (device, pipe)")

    real_top = os.path.realpath(path)
    policy.dirs[real_top] = rel_dir
    visit(path, rel_dir, real_top)
