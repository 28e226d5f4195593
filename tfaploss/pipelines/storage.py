"""Files for the jobs: local paths and Beam filesystem URLs, atomic writes, and the
staged publish that keeps the previous dataset until the new one is complete
(docs/pipelines.md). No TensorFlow here.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import uuid

from tfaploss.data.split_manifest import MANIFEST
from tfaploss.durable import atomic, faults


def is_url(path: str) -> bool:
    return "://" in path


def join(root: str, *parts: str) -> str:
    if is_url(root):
        return "/".join([root.rstrip("/"), *parts])
    return os.path.join(root, *parts)


def _fs():
    from apache_beam.io.filesystems import FileSystems

    return FileSystems


def exists(path: str) -> bool:
    return _fs().exists(path) if is_url(path) else os.path.exists(path)


def isdir(path: str) -> bool:
    if is_url(path):
        return bool(_fs().match([path.rstrip("/") + "/*"])[0].metadata_list)
    return os.path.isdir(path)


def makedirs(path: str) -> None:
    if is_url(path):
        return  # object stores have no folders
    os.makedirs(path, exist_ok=True)


def glob(pattern: str) -> list[str]:
    if is_url(pattern):
        return sorted(m.path for m in _fs().match([pattern])[0].metadata_list)
    import glob as globlib

    return sorted(globlib.glob(pattern))


def listdir(path: str) -> list[str]:
    """Names directly inside ``path`` (files and folders)."""
    if is_url(path):
        prefix = path.rstrip("/") + "/"
        return sorted({p[len(prefix):].split("/")[0] for p in glob(prefix + "**")})
    return sorted(os.listdir(path))


def read_text(path: str) -> str:
    if is_url(path):
        with _fs().open(path) as f:
            return f.read().decode("utf-8")
    with open(path, encoding="utf-8") as f:
        return f.read()


def _open_binary(path: str):
    return _fs().open(path) if is_url(path) else open(path, "rb")


def read_binary(path: str) -> bytes:
    with _open_binary(path) as f:
        return f.read()


def read_range(path: str, offset: int, length: int) -> bytes:
    """``length`` bytes of ``path`` from byte ``offset``."""
    with _open_binary(path) as f:
        f.seek(offset)
        return f.read(length)


def write_atomic(path: str, data: bytes | str, *, durable: bool = True,
                 fault: str | None = None) -> None:
    """Write ``data`` to ``path`` through a temporary name renamed into place when
    complete. ``durable=False`` skips the fsync (a run's intermediate files, which a
    crash discards anyway); ``fault``: the site's fault point ``<fault>_enospc``."""
    if isinstance(data, str):
        data = data.encode("utf-8")
    tmp = f"{path}.tmp-{uuid.uuid4().hex[:8]}"
    if is_url(path):
        with _fs().create(tmp) as f:
            f.write(data)
        _fs().rename([tmp], [path])
        return
    try:
        with open(tmp, "wb") as f:
            f.write(data)
            f.flush()
            faults.no_space("storage_enospc", path=tmp)
            if fault:
                faults.no_space(f"{fault}_enospc", path=tmp)
            if durable:
                os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException as err:
        with contextlib.suppress(OSError):
            os.remove(tmp)  # a partial file would keep the disk full
        if atomic.is_disk_full(err) and not isinstance(err, atomic.DiskFullError):
            raise atomic.DiskFullError(path, len(data),
                                       atomic.free_bytes(os.path.dirname(path) or ".")) from None
        raise


def write_json(path: str, obj, *, fault: str | None = None, **kwargs) -> None:
    write_atomic(path, json.dumps(obj, **kwargs), fault=fault)


def json_lines(rows) -> str:
    """``rows`` (dicts) as JSON lines, keys sorted."""
    return "".join(json.dumps(r, sort_keys=True) + "\n" for r in rows)


def remove_tree(path: str) -> None:
    if is_url(path):
        files = glob(path.rstrip("/") + "/**")
        if files:
            _fs().delete(files)
        return
    shutil.rmtree(path, ignore_errors=True)


@contextlib.contextmanager
def disk_full_whole(stage: str):
    """Re-raise a ``DiskFullError`` behind an error of the block (however Beam wrapped
    it) whole, with the staging folder ``stage`` removed (it would keep the disk full)."""
    try:
        yield
    except Exception as err:
        full = atomic.disk_full_in(err, stage)
        if full is None:
            raise
        remove_tree(stage)
        raise full from None  # whole, not inside Beam's RuntimeError


def check_owned(folder: str) -> None:
    """Refuse to replace ``folder`` unless it is absent, empty, or its ``manifest.json``
    says one of these jobs wrote it: a mistyped output path must not wipe a user's files."""
    if not exists(folder) or not listdir(folder):
        return
    manifest = join(folder, MANIFEST)
    try:
        m = json.loads(read_text(manifest))
        ours = any(str(m.get(k, "")).startswith(("pipelines.", "tfaploss."))
                   for k in ("job", "format"))
    except (OSError, ValueError):
        ours = False
    if not ours:
        raise ValueError(
            f"{folder!r} exists and was not written by a tfaploss pipelines job (no "
            "manifest.json of ours); it would be replaced. Choose a new or empty output "
            "folder, or delete it yourself.")


def recover(final: str) -> None:
    """Undo a publish that was killed between its two renames (local folders)."""
    if not is_url(final):
        atomic.recover_folder(final)


def publish(staged: str, final: str) -> None:
    """Replace the folder ``final`` by the complete folder ``staged`` (see module doc)."""
    if is_url(final):
        _publish_objects(staged, final)
    else:
        atomic.replace_folder(staged, final)


def _publish_objects(staged: str, final: str) -> None:
    fs = _fs()
    prefix = staged.rstrip("/") + "/"
    new = glob(prefix + "**")
    old = glob(final.rstrip("/") + "/**")
    manifest = join(final, MANIFEST)
    if manifest in old:
        fs.delete([manifest])
    stale = [p for p in old if p != manifest]
    if stale:
        fs.delete(stale)
    rest = [p for p in new if not p.endswith("/manifest.json")]
    last = [p for p in new if p.endswith("/manifest.json")]
    for group in (rest, last):
        if group:
            fs.rename(group, [join(final, p[len(prefix):]) for p in group])


def printable_name(name: str) -> str | None:
    """``None`` if ``name`` is valid UTF-8, else a printable form of its bytes."""
    try:
        name.encode("utf-8")
        return None
    except UnicodeEncodeError:
        return os.fsencode(name).decode("utf-8", "backslashreplace")


def walk_all_files(path: str, rel: str, emit) -> None:
    """``emit(rel)`` for every file below ``path`` (links not followed); a folder that
    cannot be listed as ``rel + "/"``."""
    try:
        entries = sorted(os.scandir(path), key=lambda e: e.name)
    except OSError:
        emit(rel + "/")
        return
    for e in entries:
        sub = f"{rel}/{printable_name(e.name) or e.name}"
        if e.is_dir(follow_symlinks=False):
            walk_all_files(e.path, sub, emit)
        else:
            emit(sub)
