"""Read an untrusted pickle of plain data (the revisited ground truth) in a child process.

Three walls: an allow-list ``find_class`` resolving to checking functions here, a walk
of the result into JSON-able data with caps (:data:`MAX_DEPTH`, :data:`MAX_ITEMS`,
:data:`MAX_TEXT`), and a child process under ``RLIMIT_AS``, ``RLIMIT_CPU`` and a
timeout; docs/pipelines.md has the details. Cost: about 0.2 s per file.
"""

from __future__ import annotations

import contextlib
import io
import json
import math
import os
import pickle
import signal
import subprocess
import sys

import numpy as np

MAX_BYTES = 16 << 20    # a real file has < 4 MiB even if every query listed every image
MAX_ITEMS = 2_000_000   # values and array elements in the result (rparis6k: < 500 000)
MAX_TEXT = 64 << 20     # bytes of strings in the result
MAX_DEPTH = 32          # a real file nests 4 deep
MEMORY_BYTES = 1 << 30  # the child's address space (Python and numpy take ~250 MiB)
CPU_SECONDS, WALL_SECONDS = 20, 60
_NUMERIC = frozenset(("b1", "i1", "i2", "i4", "i8", "u1", "u2", "u4", "u8", "f2", "f4", "f8"))
_CHILD = [sys.executable, "-m", __name__]


class UnsafePickleError(ValueError):
    """A pickle that :func:`read_pickle` refused; the message is one line naming it."""


def read_pickle(data: bytes, name: str) -> object:
    """The plain data of the pickle ``data``, read in a sandboxed child; ``name`` names
    it in the one-line :class:`UnsafePickleError`."""
    if len(data) > MAX_BYTES:
        raise UnsafePickleError(f"{name}: more than {MAX_BYTES} bytes; not a ground truth")
    env = dict(os.environ, OPENBLAS_NUM_THREADS="1", OMP_NUM_THREADS="1")
    try:
        proc = subprocess.run(_CHILD, input=data, env=env, capture_output=True,
                              timeout=WALL_SECONDS, check=False)
    except subprocess.TimeoutExpired:
        proc = None
    if proc is not None and proc.returncode == 0:
        return json.loads(proc.stdout)
    if proc is None or proc.returncode < 0:
        how = f"killed by {signal.Signals(-proc.returncode).name}" if proc else "stopped"
        why = (f"the reader was {how} (limits: {MEMORY_BYTES >> 20} MiB, {CPU_SECONDS} CPU "
               f"s, {WALL_SECONDS} s)")
    else:
        why = (proc.stderr.decode("utf-8", "replace").strip().splitlines() or ["?"])[-1]
    raise UnsafePickleError(f"{name}: refusing this pickle: {why[:400]}")


# The child's side.
class _Dtype:
    """``numpy.dtype(code)`` of a numeric code; its pickled state may set the byte order."""

    def __init__(self, code, *_):  # (code, align, copy)
        if type(code) is not str or code not in _NUMERIC:
            raise UnsafePickleError(f"numpy dtype {str(code)[:40]!r}: not bool, int or float")
        self.dtype = np.dtype(code)

    def __setstate__(self, state):
        # (version, byteorder, subarray, names, fields, elsize, alignment, flags[, meta])
        if not (type(state) is tuple and len(state) in (8, 9) and type(state[1]) is str
                and state[1] in ("<", ">", "|", "=") and state[5:8] == (-1, -1, 0)
                and all(v is None for v in state[2:5] + state[8:])):
            raise UnsafePickleError(f"numpy dtype state {str(state)[:80]}: not a plain number")
        if state[1] in "<>":
            self.dtype = self.dtype.newbyteorder(state[1])


class _Array:
    """A numeric array: built by ``_frombuffer``, or by ``_reconstruct`` and its state."""

    def __init__(self, value=None):
        self.value = value

    def __setstate__(self, state):
        if type(state) is tuple and len(state) == 5:
            state = state[1:]  # (version, shape, dtype, fortran, data)
        if self.value is not None or type(state) is not tuple or len(state) != 4:
            raise UnsafePickleError("numpy array state is not (shape, dtype, fortran, data)")
        shape, dtype, fortran, raw = state
        self.value = _array(raw, dtype, shape, "F" if fortran is True else "C")


def _array(raw, dtype, shape, order) -> np.ndarray:
    if isinstance(raw, str):
        raw = raw.encode("latin-1")  # a Python 2 ``str``
    if not isinstance(raw, (bytes, bytearray)) or not isinstance(dtype, _Dtype) \
            or type(order) is not str or order not in ("C", "F"):
        raise UnsafePickleError("a numpy array without bytes, a numeric dtype or an order")
    if (type(shape) is not tuple or len(shape) > MAX_DEPTH
            or not all(type(n) is int and 0 <= n <= MAX_ITEMS for n in shape)
            or math.prod(shape) > MAX_ITEMS):  # at most MAX_ITEMS ** 32: exact and cheap
        raise UnsafePickleError(f"array shape {str(shape)[:80]}: over {MAX_ITEMS} or not one")
    if math.prod(shape) * dtype.dtype.itemsize != len(raw):
        raise UnsafePickleError(f"array shape {shape} of {dtype.dtype} with {len(raw)} bytes")
    return np.frombuffer(bytes(raw), dtype.dtype).reshape(shape, order=order)


def _reconstruct(cls, *_):  # the array comes whole from its state: see _Array
    if cls is not _NDARRAY:
        raise UnsafePickleError("numpy _reconstruct of something other than an ndarray")
    return _Array()


def _encode(text, encoding="utf-8"):
    if type(text) is not str or encoding not in ("latin1", "latin-1"):
        raise UnsafePickleError("_codecs.encode used for something other than latin-1 bytes")
    return text.encode("latin-1")


_NDARRAY = object()  # numpy.ndarray: only an argument of _reconstruct, never called
_GLOBALS = {("numpy", "ndarray"): _NDARRAY, ("numpy", "dtype"): _Dtype,
            ("_codecs", "encode"): _encode, ("builtins", "bytes"): lambda: b"",
            ("__builtin__", "bytes"): lambda: b""}  # protocol 2 names it so
for _core in ("numpy.core", "numpy._core"):
    _GLOBALS.update({(f"{_core}.multiarray", "_reconstruct"): _reconstruct,
                     (f"{_core}.multiarray", "scalar"):
                         lambda dtype, raw=b"": _array(raw, dtype, (), "C").item(),
                     (f"{_core}.numeric", "_frombuffer"):
                         lambda buf, dtype, shape, order: _Array(_array(buf, dtype, shape, order))})


class _Unpickler(pickle.Unpickler):
    def find_class(self, module, name):
        if (module, name) not in _GLOBALS:
            raise UnsafePickleError(f"refusing global '{module}.{name}' (not plain data)")
        return _GLOBALS[module, name]


def loads_plain(data: bytes) -> object:
    """The pickle ``data`` read with the allow-list into JSON-able data, in this process
    (without the child's limits: for the child and in-house pickles)."""
    spent = [0, 0]  # items, bytes of text

    def walk(value, depth):
        kind = type(value)
        spent[0] += value.value.size if kind is _Array and value.value is not None else 1
        spent[1] += len(value) if kind is str else 0
        if depth > MAX_DEPTH or spent[0] > MAX_ITEMS or spent[1] > MAX_TEXT:
            raise UnsafePickleError(
                f"containers nested more than {MAX_DEPTH} deep" if depth > MAX_DEPTH else
                f"more than {MAX_ITEMS} items or {MAX_TEXT} bytes of text (a shared value "
                "counts at every use)")
        if value is None or kind in (bool, float, str) or kind is int and value.bit_length() <= 64:
            return value
        if kind in (list, tuple):
            return [walk(v, depth + 1) for v in value]
        if kind is dict and all(type(k) in (str, int) for k in value):
            return {k: walk(v, depth + 1) for k, v in value.items()}
        if kind is _Array and value.value is not None:
            return value.value.tolist() if value.value.ndim else [value.value.item()]
        raise UnsafePickleError(f"the pickle holds a {kind.__name__}"
                                f"{' of more than 64 bits' if kind is int else ''}; a ground "
                                "truth holds only containers, numbers, strings and arrays")

    return walk(_Unpickler(io.BytesIO(data), encoding="latin1").load(), 0)


def limit_this_process() -> None:
    """The child's limits: :data:`MEMORY_BYTES`, :data:`CPU_SECONDS`, no core file (one
    the system refuses, macOS' ``RLIMIT_AS``, leaves the timeout)."""
    import resource

    for limit, value in ((resource.RLIMIT_AS, MEMORY_BYTES), (resource.RLIMIT_CORE, 0),
                         (resource.RLIMIT_CPU, CPU_SECONDS)):
        with contextlib.suppress(ValueError, OSError):
            resource.setrlimit(limit, (value, value))


if __name__ == "__main__":
    limit_this_process()
    try:
        sys.stdout.write(json.dumps(loads_plain(sys.stdin.buffer.read(MAX_BYTES + 1))))
    except BaseException as err:  # noqa: BLE001 -- every failure is a refusal, in one line
        text = " ".join(str(err).split())[:300]
        sys.stderr.write(text if isinstance(err, UnsafePickleError) else
                         f"{type(err).__name__}: {text}".rstrip(": "))
        sys.exit(1)
