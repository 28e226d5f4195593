"""Where the image work runs, and how its results reach the shard writers.

A *task* is a few work-list records of one shard. A worker reads (or, for a record
carrying a ``render`` recipe such as the glyphs job's, draws), decodes, resizes and
re-encodes each image (:mod:`pipelines.images`), wraps it in its Example and TFRecord
framing (:mod:`pipelines.tf_example`), and writes the framed records of the whole task
to one *part file* in the run's staging folder. What goes back to Beam is four numbers
per image (where its record and its JPEG lie in the part file), never the image: neither
Beam's data plane nor a pool's pipes carry pixels, and the shard writers assemble their
files from the parts, a copy from the page cache.

Tasks run

* on the local DirectRunner in its in-memory mode (the jobs' default), in a pool of
  forked worker processes, one per core, forked before Beam starts its own threads.
  PIL holds the GIL for part of every image (header parsing, mode conversion, the
  Python around the codecs), so two threads of one process reach about 1.75x one core
  on 2 cores where two processes reach 1.86x (``benchmarks/pipeline.py``);
* everywhere else (remote runners already run a worker process per core; Beam's
  multi-process mode; platforms without ``fork``; ``--image_processes 1``), on
  ``--image_threads`` threads of the Beam worker.

Workers import neither Beam nor TensorFlow. The part files stay in the staging folder
until the run is published, so a run needs free space for about twice its output.
"""

from __future__ import annotations

import ctypes
import functools
import hashlib
import importlib
import multiprocessing
import os
import signal
import sys
import uuid
from concurrent.futures import Executor, ProcessPoolExecutor, ThreadPoolExecutor

from pipelines import images as I
from pipelines import storage
from pipelines import tf_example as X

# How many images one task holds when it goes to a process pool: small enough that the
# last tasks of a run keep every process busy, large enough that the per-task cost
# (pickling the records, one part file) stays below 1 % of the image work.
PROCESS_TASK_IMAGES = 4


def process_task(records: list[dict], settings: dict, root: str | None,
                 part_path: str) -> list:
    """Process ``records`` and write their framed records to ``part_path``.

    Returns one entry per record, in order: its dead letter (a dict) or
    ``(offset, length, jpeg_offset, jpeg_length)`` in the part file. No part file is
    written when every record failed.
    """
    results, pieces, offset = [], [], 0
    for record in records:
        out = _one(record, settings, root)
        if isinstance(out, dict):
            results.append(out)
            continue
        framed, jpeg_at, jpeg_length = out
        results.append((offset, len(framed), offset + jpeg_at, jpeg_length))
        pieces.append(framed)
        offset += len(framed)
    if pieces:
        storage.write_atomic(part_path, b"".join(pieces), durable=False)
    return results


def _one(record: dict, s: dict, root: str | None):
    try:
        data = _image_bytes(record, root)
        jpeg, h, w = I.process_image_bytes(
            data, max_side=s["max_side"], jpeg_quality=s["jpeg_quality"],
            min_side=s["min_side"], max_pixels=s["max_pixels"], bbox=record.get("bbox"))
        framed = X.frame_record(X.image_example(record, jpeg, h, w))
        return framed, _find(framed, jpeg), len(jpeg)
    except I.ImageError as e:
        return I.dead_letter(record, e.code, e.detail)
    except Exception as e:  # noqa: BLE001 - one odd file must not stop the job
        return I.dead_letter(record, I.UNDECODABLE, f"{type(e).__name__}: {e}")


def _image_bytes(record: dict, root: str | None) -> bytes:
    """A record's encoded image: carried along under ``_bytes`` (TFDS), drawn from the
    recipe under ``render`` (``{"fn": "pipelines.<module>:<function>", "args": {...}}``,
    e.g. the glyphs job's fonts), or read from its ``path``."""
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
    if not module.startswith("pipelines.") or not function:
        raise ValueError(f"a render recipe names {name!r}; only functions of the "
                         "pipelines package ('pipelines.<module>:<function>') are called")
    return getattr(importlib.import_module(module), function)


def _find(framed: bytes, jpeg: bytes) -> int:
    # A JPEG starts with 0xFF, which no UTF-8 text field holds; checking the whole match
    # covers the rare length varint that does.
    at = framed.find(jpeg[:64])
    if at < 0 or framed[at:at + len(jpeg)] != jpeg:
        at = framed.find(jpeg)
    return at


def part_path(parts_dir: str, split: str, records: list[dict]) -> str:
    """The part file of a task: named by its ids, so a retried task rewrites its own."""
    digest = hashlib.sha1("\0".join(r["id"] for r in records).encode("utf-8")).hexdigest()
    return storage.join(parts_dir, f"{split}-{digest[:20]}.part")


def read_slices(ranges) -> list[memoryview]:
    """The bytes at ``(part_path, start, length)`` for each of ``ranges``, reading each
    part file once."""
    cache: dict[str, memoryview] = {}
    out = []
    for path, start, length in ranges:
        data = cache.get(path)
        if data is None:
            data = cache[path] = memoryview(storage.read_binary(path))
        out.append(data[start:start + length])
    return out


# ---------------------------------------------------------------------- local processes

_LOCAL_POOLS: dict[str, ProcessPoolExecutor] = {}


def can_fork() -> bool:
    return sys.platform.startswith("linux") and "fork" in multiprocessing.get_all_start_methods()


def start_local_pool(processes: int) -> str:
    """Fork ``processes`` image workers now; returns the token a DoFn finds them by.

    Call it before Beam starts its threads: a process forked while other threads hold
    locks could inherit them held.
    """
    pool = ProcessPoolExecutor(processes, mp_context=multiprocessing.get_context("fork"),
                               initializer=_worker_init, initargs=(os.getpid(),))
    pool.submit(os.getpid).result()  # forks every worker now, not inside Beam
    token = uuid.uuid4().hex
    _LOCAL_POOLS[token] = pool
    return token


def _worker_init(parent: int) -> None:
    """Tie a worker's life to the job's: a job killed with SIGKILL or ``os._exit`` runs no
    clean-up, and its workers, which share the pool's pipes, would wait forever."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C is the job's to handle
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        libc.prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG
    except (OSError, AttributeError):
        pass
    if os.getppid() != parent:  # the job died before prctl took effect
        os._exit(1)


def local_pool(token: str | None) -> ProcessPoolExecutor | None:
    """The pool :func:`start_local_pool` made in this process, or None (another process,
    as in Beam's multi-process mode or on a remote worker)."""
    return _LOCAL_POOLS.get(token) if token else None


def stop_local_pool(token: str | None) -> None:
    pool = _LOCAL_POOLS.pop(token, None) if token else None
    if pool is not None:
        pool.shutdown(wait=True, cancel_futures=True)


def thread_pool(threads: int) -> Executor | None:
    return ThreadPoolExecutor(threads) if threads > 1 else None
