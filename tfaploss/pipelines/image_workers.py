"""Where the image work runs, and how its results reach the shard writers.

A worker writes each task's framed records to a part file and hands Beam only where
they lie. Locally the tasks run in forked processes (one per core), elsewhere on
``--image_threads`` threads; a worker that dies is named by its notes on a
shared-memory board (:func:`worker_deaths`). docs/pipelines.md has the figures.
"""

from __future__ import annotations

import contextlib
import ctypes
import functools
import gc
import hashlib
import importlib
import json
import multiprocessing
import os
import signal
import sys
import time
import uuid
from concurrent.futures import Future, ProcessPoolExecutor

from tfaploss.data.framing import frame_record
from tfaploss.durable import faults
from tfaploss.pipelines import images as I
from tfaploss.pipelines import storage
from tfaploss.pipelines import tf_example as X

# The fewest images of a task on a process pool; a batch is cut into one task per process
# (each task is a hand-off through the pool's feeder thread, scheduled late when busy).
PROCESS_TASK_IMAGES = 4


def process_task(records: list[dict], settings: dict, root: str | None,
                 part_path: str, where: dict | None = None) -> list:
    """Process ``records`` and write their framed records to ``part_path`` (none when all
    failed); returns per record its dead letter or ``(offset, length, jpeg_offset,
    jpeg_length)`` in the part file. ``where`` (split, shard, num_shards) goes on the
    board."""
    results, pieces, offset = [], [], 0
    for record in records:
        if _WORKER is not None:
            _starting(where, record)
        out = _one(record, settings, root)
        if isinstance(out, dict):
            results.append(out)
            continue
        framed, jpeg_at, jpeg_length = out
        results.append((offset, len(framed), offset + jpeg_at, jpeg_length))
        pieces.append(framed)
        offset += len(framed)
    if pieces:
        storage.write_atomic(part_path, b"".join(pieces), durable=False, fault="part")
    if _WORKER is not None:
        _note({"doing": "idle"})
    return results


def _one(record: dict, s: dict, root: str | None):
    try:
        data = _image_bytes(record, root)
        jpeg, h, w = I.process_image_bytes(
            data, max_side=s["max_side"], jpeg_quality=s["jpeg_quality"],
            min_side=s["min_side"], max_pixels=s["max_pixels"], bbox=record.get("bbox"))
        framed = frame_record(X.image_example(record, jpeg, h, w))
        return framed, _find(framed, jpeg), len(jpeg)
    except I.ImageError as e:
        return I.dead_letter(record, e.code, e.detail)
    except Exception as e:  # noqa: BLE001 - one odd file must not stop the job
        return I.dead_letter(record, I.UNDECODABLE, f"{type(e).__name__}: {e}")


def _image_bytes(record: dict, root: str | None) -> bytes:
    """A record's encoded image: under ``_bytes`` (TFDS), drawn from its ``render``
    recipe (``{"fn": "tfaploss.pipelines.<module>:<function>", "args": {...}}``), or read."""
    data = record.pop("_bytes", None)
    if data is not None:
        return data
    recipe = record.get("render")
    if recipe is not None:
        return _renderer(recipe["fn"])(**recipe["args"])
    return I.read_bytes(record["path"], record.get("root", root))


@functools.cache
def _renderer(name: str):
    module, _, function = name.partition(":")
    if not module.startswith("tfaploss.pipelines.") or not function:
        raise ValueError(f"a render recipe names {name!r}; only functions of the "
                         "tfaploss.pipelines package "
                         "('tfaploss.pipelines.<module>:<function>') are called")
    return getattr(importlib.import_module(module), function)


def _find(framed: bytes, jpeg: bytes) -> int:
    # A JPEG starts with 0xFF, which no UTF-8 text field holds; checking the whole match
    # covers the rare length varint that does.
    at = framed.find(jpeg[:64])
    if at < 0 or framed[at:at + len(jpeg)] != jpeg:
        at = framed.find(jpeg)
    return at


def cut_tasks(records: list[dict], workers: int, task_images: int) -> list[list[dict]]:
    """A batch's records cut into one task per worker, of at least ``task_images``."""
    size = max(task_images, -(-len(records) // max(1, workers)))
    return [records[i:i + size] for i in range(0, len(records), size)]


def part_path(parts_dir: str, split: str, records: list[dict]) -> str:
    """The part file of a task: named by its ids, so a retried task rewrites its own."""
    digest = hashlib.sha1("\0".join(r["id"] for r in records).encode("utf-8")).hexdigest()
    return storage.join(parts_dir, f"{split}-{digest[:20]}.part")


def read_slices(ranges) -> list[memoryview]:
    """The bytes at each ``(part_path, start, length)``, reading each part file once."""
    cache: dict[str, memoryview] = {}
    out = []
    for path, start, length in ranges:
        data = cache.get(path)
        if data is None:
            data = cache[path] = memoryview(storage.read_binary(path))
        out.append(data[start:start + length])
    return out


_LOCAL_POOLS: dict[str, ProcessPoolExecutor] = {}
# Tasks submitted before Beam started: token -> part file -> (future, when submitted).
_AHEAD: dict[str, dict[str, tuple[Future, float]]] = {}


def can_fork() -> bool:
    return sys.platform.startswith("linux") and "fork" in multiprocessing.get_all_start_methods()


_SLOT = 512  # bytes of the board per worker: its pid and what it is doing, as JSON


class WorkerDiedError(RuntimeError):
    """An image worker process died during the job (SIGKILL, the OOM killer); nothing
    was published. The message names the worker, the signal and what it worked on."""


class _Pool:
    """A local pool, its worker processes (by pid) and their board."""

    def __init__(self, processes: int):
        ctx = multiprocessing.get_context("fork")
        self.processes = processes
        self.board = ctx.Array(ctypes.c_char, processes * _SLOT, lock=False)
        self.next_slot = ctx.Value(ctypes.c_int, 0)
        self.executor = ProcessPoolExecutor(
            processes, mp_context=ctx, initializer=_worker_init,
            initargs=(os.getpid(), self.board, self.next_slot))
        # Collected here, where its threads live: a tf.data iterator in a reference cycle
        # waits in its destructor for threads a forked child lacks (the child hung). The
        # rest is frozen out of the children's collections; unfrozen after the fork only
        # if the caller (a pre-fork server, a test runner) had frozen nothing itself.
        caller_froze = gc.get_freeze_count() > 0
        gc.collect()
        gc.freeze()
        try:
            self.executor.submit(os.getpid).result()  # forks every worker now, not in Beam
        finally:
            if not caller_froze:
                gc.unfreeze()
        # Kept to learn how each worker ended: a broken executor forgets them.
        self.workers = dict(getattr(self.executor, "_processes", None) or {})

    def doing(self, pid: int) -> dict | None:
        """What worker ``pid`` last noted on the board, else None."""
        raw = bytes(self.board)
        for at in range(0, len(raw), _SLOT):
            text = raw[at:at + _SLOT].rstrip(b"\0")
            try:
                note = json.loads(text) if text else None
            except ValueError:
                continue
            if isinstance(note, dict) and note.get("pid") == pid:
                return note
        return None


_WORKER: dict | None = None  # in a worker process: its board slot and fault threshold


def start_local_pool(processes: int) -> str:
    """Fork ``processes`` image workers now (before Beam starts threads whose locks a
    child could inherit held); returns the token a DoFn finds them by."""
    token = uuid.uuid4().hex
    _LOCAL_POOLS[token] = _Pool(processes)
    return token


def _worker_init(parent: int, board=None, next_slot=None) -> None:
    """Die with the job (killed, it runs no clean-up and its workers would wait on the
    pool's pipes forever); take a slot of the board."""
    global _WORKER
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C is the job's to handle
    with contextlib.suppress(OSError, AttributeError):
        ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG
    if os.getppid() != parent:  # the job died before prctl took effect
        os._exit(1)
    if board is not None:
        with next_slot.get_lock():
            slot = next_slot.value
            next_slot.value += 1
        _WORKER = {"board": board, "at": slot * _SLOT, "images": 0,
                   "kill_at": faults.threshold("worker_kill")}  # crash tests only; 0: never
        _note({"doing": "idle"})


def _note(note: dict) -> None:
    """Put what this worker is doing on its slot of the board (a memory copy)."""
    if _WORKER is None or _WORKER["at"] + _SLOT > len(_WORKER["board"]):
        return
    short = {k: v[:30] + "..." if isinstance(v, str) and len(v) > 30 else v
             for k, v in note.items()}  # a very long id or path, still valid JSON
    for fits in (note, short, {"doing": note.get("doing")}):
        data = json.dumps({"pid": os.getpid(), **fits}).encode("ascii")
        if len(data) <= _SLOT:
            break
    at = _WORKER["at"]
    _WORKER["board"][at:at + _SLOT] = data.ljust(_SLOT, b"\0")


def _starting(where: dict | None, record: dict) -> None:
    _note({"doing": "image", **(where or {}), "id": str(record.get("id")),
           "path": str(record.get("relpath") or record.get("path") or "")})
    _WORKER["images"] += 1
    if _WORKER["kill_at"] and _WORKER["images"] == _WORKER["kill_at"]:
        faults.sigkill_self(f"worker_kill:{_WORKER['kill_at']}",
                            f"image {record.get('id')!r} of split "
                            f"{(where or {}).get('split')!r}")


def noted(where: dict, fn, *args):
    """``fn(*args)``, noted on the board first (the shard writers' tasks in the pool)."""
    _note({"doing": "write", **where})
    out = fn(*args)
    _note({"doing": "idle"})
    return out


def worker_deaths(token: str | None) -> list[dict]:
    """The workers of the pool ``token`` that died other than by the pool's shutdown:
    ``pid``, ``exitcode`` (``-9``: SIGKILL), ``signal`` (name) and ``doing`` (last note)."""
    pool = _LOCAL_POOLS.get(token)
    if pool is None:
        return []
    dead = {pid: p.exitcode for pid, p in pool.workers.items() if p.exitcode not in (None, 0)}
    # When one worker dies, the executor terminates the others (SIGTERM): report those
    # only when nothing else explains the break.
    culprits = {pid: c for pid, c in dead.items() if c != -signal.SIGTERM} or dead
    out = []
    for pid, code in sorted(culprits.items()):
        name = None
        if code < 0:
            try:
                name = signal.Signals(-code).name
            except ValueError:
                name = f"signal {-code}"
        out.append({"pid": pid, "exitcode": code, "signal": name, "doing": pool.doing(pid)})
    return out


def describe_deaths(deaths: list[dict]) -> str:
    """One sentence per dead worker: who, how, on what."""
    parts = []
    for d in deaths:
        how = (f"was killed by {d['signal']}" + (
            " (what the kernel's OOM killer sends when memory runs out)"
            if d["signal"] == "SIGKILL" else "") if d["signal"]
            else f"exited with status {d['exitcode']}")
        note = d["doing"] or {}
        if note.get("doing") in ("image", "write"):
            where = f"split {note.get('split')!r}"
            if note.get("shard") is not None:
                where += f", shard {note['shard']} of {note.get('num_shards')}"
            if note.get("file"):
                where += f" ({note['file']})"
            path = note.get("path")
            image = f"{note.get('id')!r}" + (f" ({path})" if path and path != note.get("id")
                                             else "")
            what = (f"while processing image {image} of {where}" if note["doing"] == "image"
                    else f"while writing {where}")
        else:
            what = "between tasks"
        parts.append(f"image worker process {d['pid']} {how} {what}")
    return "; ".join(parts)


def submit_ahead(token: str, batches, settings: dict, root: str | None, parts_dir: str,
                 limit: int) -> int:
    """Submit the tasks of work-list ``batches`` to the pool ``token``, up to ``limit``
    images, before Beam is imported; returns how many. The DoFn cuts the same tasks and
    takes each one's future over (:func:`claim_ahead`): every image is processed once."""
    pool = _LOCAL_POOLS[token]
    ahead = _AHEAD.setdefault(token, {})
    submitted = 0
    for batch in batches:
        if submitted >= limit:
            break
        where = {k: batch[k] for k in ("split", "shard", "num_shards")}
        for task in cut_tasks(batch["records"], pool.processes, PROCESS_TASK_IMAGES):
            path = part_path(parts_dir, batch["split"], task)
            ahead[path] = (pool.executor.submit(process_task, task, settings, root, path,
                                                where), time.time())
        submitted += len(batch["records"])
    return submitted


def claim_ahead(token: str | None, path: str) -> tuple[Future, float] | None:
    """The future of the task writing ``path`` that :func:`submit_ahead` submitted, and
    when; once only (a retried bundle submits its task again)."""
    ahead = _AHEAD.get(token)
    return ahead.pop(path, None) if ahead else None


def local_pool(token: str | None) -> ProcessPoolExecutor | None:
    """The pool :func:`start_local_pool` made in this process, or None (another process:
    Beam's multi-process mode, a remote worker)."""
    pool = _LOCAL_POOLS.get(token)
    return pool.executor if pool is not None else None


def local_pool_size(token: str | None) -> int:
    """How many processes the pool ``token`` has (0: no pool in this process)."""
    pool = _LOCAL_POOLS.get(token)
    return pool.processes if pool is not None else 0


def stop_local_pool(token: str | None, forget: bool = True) -> None:
    """Shut the pool down (waiting for its workers); ``forget=False`` keeps it known,
    for :func:`worker_deaths`, until a later call forgets it."""
    pool = _LOCAL_POOLS.pop(token, None) if forget else _LOCAL_POOLS.get(token)
    _AHEAD.pop(token, None)
    if pool is not None:
        pool.executor.shutdown(wait=True, cancel_futures=True)


def caused_by(err: BaseException | None, types) -> bool:
    """Whether ``err`` or what it was raised from (Beam re-raises a DoFn's error in its
    own) is one of ``types``."""
    seen = set()
    while err is not None and id(err) not in seen:
        if isinstance(err, types):
            return True
        seen.add(id(err))
        err = err.__cause__ or err.__context__
    return False
