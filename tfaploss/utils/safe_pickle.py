"""A restricted pickle reader for untrusted ground-truth files.

The revisited Oxford/Paris ground truth (``gnd_roxford5k.pkl``, ``gnd_rparis6k.pkl``)
ships as pickles. ``pickle.load`` runs whatever a pickle says, and even an allow-list
of "harmless" globals is not enough: ``numpy.dtype`` plus ``_reconstruct`` build an
object array of attacker-chosen pointers (a segfault, or a live ``os.system``), and
``bytes(1 << 30)`` allocates a GiB from a 68-byte file.

So this module never hands a byte of the file to :mod:`pickle`. It walks the opcodes
with :func:`pickletools.genops` (pure parsing: every length is checked against the
bytes actually present) and interprets the few opcodes a container of numbers needs,
on its own stack. What it can produce is closed:

* ``None``, ``bool``, ``int`` (at most 64 bits), ``float``, ``str``;
* ``list``, ``tuple``, ``dict`` (``str``/``int`` keys), at most ``max_depth`` deep;
* numpy arrays of a numeric dtype (bool, signed/unsigned int, float), rebuilt here by
  :func:`numpy.frombuffer` from a shape, a dtype code and raw bytes that are checked to
  match *before* anything is allocated; numpy scalars become Python numbers.

The only globals a pickle may name are numpy's array/scalar/dtype rebuilders (under
``numpy.core`` or ``numpy._core``), ``_codecs.encode`` (Python 3 writes ``bytes`` that
way in protocol 2) and ``bytes()`` with no argument; each resolves to a checking
function of this module, never to the real callable. Shared references to containers,
``DUP``, ``NEWOBJ``, persistent ids, extension codes and out-of-band buffers are
refused, so the result is a tree that costs no more to walk than the file has bytes.
Anything else raises :class:`UnsafePickleError` (a ``ValueError``) naming the file.

Cost: one pass over the opcodes, O(file size) time and memory; the limits
(:class:`PickleLimits`) cap the file size, the container items, the nesting depth and
the bytes allocated for arrays.
"""

from __future__ import annotations

import _compat_pickle
import inspect
import io
import math
import pickle
import pickletools
from dataclasses import dataclass
from typing import Any, BinaryIO

import numpy as np

__all__ = ["PickleLimits", "UnsafePickleError", "safe_load", "safe_load_path", "safe_loads"]


class UnsafePickleError(ValueError, pickle.UnpicklingError):
    """A pickle this reader refuses: something other than plain data, too big, or broken.

    The message names the file (or ``<bytes>``) and what was refused.
    """


@dataclass(frozen=True)
class PickleLimits:
    """Caps on what one pickle may make.

    The real revisited ground truth is well under 1 MB, a few thousand strings and
    ~100 small integer arrays, 3 levels deep; the defaults leave a wide margin.
    """

    max_bytes: int = 64 << 20       # size of the pickle file
    max_items: int = 5_000_000      # container elements, in total
    max_depth: int = 32             # nesting of containers
    max_alloc_bytes: int = 64 << 20  # bytes allocated for arrays and bytes, in total
    max_int_bits: int = 64


DEFAULT_LIMITS = PickleLimits()

# Array element types the ground truth can hold: bool, integers, floats.
_DTYPE_CODES = frozenset({"b1", "i1", "i2", "i4", "i8", "u1", "u2", "u4", "u8",
                          "f2", "f4", "f8"})
_MAX_NDIM = 32


class _Mark:
    """The MARK opcode's stack marker."""


class _Global:
    """A global the pickle named, resolved to one of our own checking functions."""

    def __init__(self, qualname: str, build=None):
        self.qualname, self.build = qualname, build

    def __repr__(self):
        return f"<global {self.qualname}>"


class _Dtype:
    """A numeric numpy dtype under construction (``numpy.dtype(code)`` + its state)."""

    def __init__(self, code: str):
        self.dtype = np.dtype(code)
        self.built = False


class _PendingArray:
    """``_reconstruct(ndarray, (0,), b'b')`` waiting for its BUILD state."""


_ATOMS = (type(None), bool, int, float, str, bytes, _Global, _Dtype)
_OUTPUT_ATOMS = (type(None), bool, int, float, str)


class _Interpreter:
    def __init__(self, data: bytes, name: str, limits: PickleLimits):
        self.data, self.name, self.limits = data, name, limits
        self.stack: list = []
        self.marks: list[int] = []
        self.memo: dict[int, Any] = {}
        # id(container) -> (container, nesting depth); holding the container keeps its id
        # from being reused by a later object.
        self.depth: dict[int, tuple[Any, int]] = {}
        self.items = 0
        self.allocated = 0
        self.pos = 0

    # -- errors and budgets -----------------------------------------------------------

    def fail(self, what: str) -> UnsafePickleError:
        return UnsafePickleError(
            f"{self.name}: refusing this pickle at byte {self.pos}: {what}. Ground-truth "
            "pickles may only hold dicts, lists, strings, numbers and numeric numpy arrays.")

    def _count_items(self, n: int):
        self.items += n
        if self.items > self.limits.max_items:
            raise self.fail(f"more than {self.limits.max_items} container items")

    def _allocate(self, n: int):
        self.allocated += n
        if self.allocated > self.limits.max_alloc_bytes:
            raise self.fail(f"more than {self.limits.max_alloc_bytes} bytes of array data")

    def _depth_of(self, obj, empty: int = 0) -> int:
        return self.depth.get(id(obj), (None, empty))[1]

    def _contain(self, container, children):
        d = max([self._depth_of(container, 1)] + [self._depth_of(c) + 1 for c in children])
        if d > self.limits.max_depth:
            raise self.fail(f"containers nested more than {self.limits.max_depth} deep")
        self.depth[id(container)] = (container, d)

    def _new_container(self, container, children=()):
        self._count_items(len(children))
        self._contain(container, children)
        return container

    # -- stack ------------------------------------------------------------------------

    def push(self, obj):
        self.stack.append(obj)

    def pop(self):
        if len(self.stack) <= (self.marks[-1] if self.marks else 0):
            raise self.fail("stack underflow")
        return self.stack.pop()

    def top(self):
        if len(self.stack) <= (self.marks[-1] if self.marks else 0):
            raise self.fail("stack underflow")
        return self.stack[-1]

    def pop_mark(self) -> list:
        if not self.marks:
            raise self.fail("no MARK on the stack")
        start = self.marks.pop()
        items = self.stack[start:]
        del self.stack[start:]
        return items

    def int_value(self, value: int) -> int:
        if value.bit_length() > self.limits.max_int_bits:
            raise self.fail(f"an integer of {value.bit_length()} bits")
        return value

    # -- the opcodes ------------------------------------------------------------------

    def run(self) -> Any:
        if len(self.data) > self.limits.max_bytes:
            raise UnsafePickleError(f"{self.name}: {len(self.data)} bytes, more than the "
                                    f"{self.limits.max_bytes} a ground-truth pickle may have")
        ops = pickletools.genops(io.BytesIO(self.data))
        while True:
            try:
                opcode, arg, pos = next(ops)
            except StopIteration:  # genops ends after STOP, handled below
                raise self.fail("no STOP opcode") from None
            except (ValueError, OverflowError, UnicodeDecodeError) as err:
                # genops checks every length against the bytes present: truncated and
                # garbled files end here, never in an allocation.
                raise UnsafePickleError(f"{self.name}: not a readable pickle "
                                        f"(truncated or corrupt): {err}") from None
            self.pos = pos if pos is not None else self.pos
            name = opcode.name
            if name == "STOP":
                return self.finish()
            handler = getattr(self, f"op_{name}", None)
            if handler is None:
                raise self.fail(f"opcode {name} is not allowed")
            handler(arg)

    def op_PROTO(self, arg):
        if not 0 <= arg <= 5:
            raise self.fail(f"unknown pickle protocol {arg}")

    def op_FRAME(self, arg):
        pass  # framing only groups reads; genops reads the bytes themselves

    def op_MARK(self, arg):
        self.marks.append(len(self.stack))

    def op_POP(self, arg):
        if self.marks and len(self.stack) == self.marks[-1]:
            self.marks.pop()
        else:
            self.pop()

    def op_POP_MARK(self, arg):
        self.pop_mark()

    def op_NONE(self, arg):
        self.push(None)

    def op_NEWTRUE(self, arg):
        self.push(True)

    def op_NEWFALSE(self, arg):
        self.push(False)

    def op_INT(self, arg):
        self.push(arg if isinstance(arg, bool) else self.int_value(arg))

    op_BININT = op_BININT1 = op_BININT2 = op_LONG = op_LONG1 = op_LONG4 = op_INT

    def op_FLOAT(self, arg):
        self.push(float(arg))

    op_BINFLOAT = op_FLOAT

    def op_UNICODE(self, arg):
        self.push(str(arg))

    # Python 2 ``str`` reads as latin-1 text, as ``pickle.load(encoding="latin1")`` does.
    op_BINUNICODE = op_SHORT_BINUNICODE = op_BINUNICODE8 = op_UNICODE
    op_STRING = op_BINSTRING = op_SHORT_BINSTRING = op_UNICODE

    def op_BINBYTES(self, arg):
        self.push(bytes(arg))

    op_SHORT_BINBYTES = op_BINBYTES8 = op_BYTEARRAY8 = op_BINBYTES

    def op_READONLY_BUFFER(self, arg):
        if not isinstance(self.top(), bytes):
            raise self.fail("READONLY_BUFFER on something other than bytes")

    def op_EMPTY_LIST(self, arg):
        self.push(self._new_container([]))

    def op_EMPTY_DICT(self, arg):
        self.push(self._new_container({}))

    def op_EMPTY_TUPLE(self, arg):
        self.push(())

    def op_LIST(self, arg):
        items = self.pop_mark()
        self.push(self._new_container(list(items), items))

    def op_TUPLE(self, arg):
        items = self.pop_mark()
        self.push(self._new_container(tuple(items), items))

    def _tuple_n(self, n):
        items = [self.pop() for _ in range(n)][::-1]
        self.push(self._new_container(tuple(items), items))

    def op_TUPLE1(self, arg):
        self._tuple_n(1)

    def op_TUPLE2(self, arg):
        self._tuple_n(2)

    def op_TUPLE3(self, arg):
        self._tuple_n(3)

    def op_DICT(self, arg):
        items = self.pop_mark()
        d = self._new_container({})
        self._set_items(d, items)
        self.push(d)

    def _list_target(self):
        target = self.top()
        if not isinstance(target, list):
            raise self.fail(f"APPEND to a {type(target).__name__}, not a list")
        return target

    def op_APPEND(self, arg):
        value = self.pop()
        target = self._list_target()
        self._count_items(1)
        self._contain(target, [value])
        target.append(value)

    def op_APPENDS(self, arg):
        values = self.pop_mark()
        target = self._list_target()
        self._count_items(len(values))
        self._contain(target, values)
        target.extend(values)

    def _set_items(self, target, flat):
        if not isinstance(target, dict):
            raise self.fail(f"SETITEM on a {type(target).__name__}, not a dict")
        if len(flat) % 2:
            raise self.fail("SETITEMS with an odd number of items")
        keys, values = flat[0::2], flat[1::2]
        for key in keys:
            if isinstance(key, bool) or not isinstance(key, (str, int)):
                raise self.fail(f"a dict key of type {type(key).__name__}")
        self._count_items(len(keys))
        self._contain(target, values)
        target.update(zip(keys, values))

    def op_SETITEM(self, arg):
        value = self.pop()
        key = self.pop()
        self._set_items(self.top(), [key, value])

    def op_SETITEMS(self, arg):
        items = self.pop_mark()
        self._set_items(self.top(), items)

    def op_PUT(self, arg):
        self.memo[arg] = self.top()

    op_BINPUT = op_LONG_BINPUT = op_PUT

    def op_MEMOIZE(self, arg):
        self.memo[len(self.memo)] = self.top()

    def op_GET(self, arg):
        if arg not in self.memo:
            raise self.fail(f"memo key {arg} used before it was set")
        value = self.memo[arg]
        # Only immutable leaves may be shared: a second reference to a container could
        # make a cycle or an exponentially large tree out of a few bytes.
        if not isinstance(value, _ATOMS):
            raise self.fail(f"a second reference to a {type(value).__name__}")
        self.push(value)

    op_BINGET = op_LONG_BINGET = op_GET

    def op_GLOBAL(self, arg):
        module, _, name = str(arg).partition(" ")
        self.push(self._resolve(module, name))

    def op_STACK_GLOBAL(self, arg):
        name = self.pop()
        module = self.pop()
        if not (isinstance(module, str) and isinstance(name, str)):
            raise self.fail("STACK_GLOBAL with non-string names")
        self.push(self._resolve(module, name))

    def _resolve(self, module: str, name: str) -> _Global:
        # Protocol-2 pickles name Python 2 modules (``__builtin__``); check the Python 3 name.
        module, name = _compat_pickle.NAME_MAPPING.get((module, name), (module, name))
        module = _compat_pickle.IMPORT_MAPPING.get(module, module)
        qualname = f"{module}.{name}"
        if module in ("numpy.core.multiarray", "numpy._core.multiarray"):
            build = {"_reconstruct": self.reconstruct, "scalar": self.scalar}.get(name)
        elif module in ("numpy.core.numeric", "numpy._core.numeric") and name == "_frombuffer":
            build = self.frombuffer
        elif module == "numpy" and name in ("ndarray", "dtype"):
            build = self.dtype if name == "dtype" else None
        elif (module, name) == ("_codecs", "encode"):
            build = self.encode
        elif (module, name) == ("builtins", "bytes"):
            build = self.empty_bytes
        else:
            build = None
            qualname = None
        if qualname is None or (build is None and (module, name) != ("numpy", "ndarray")):
            raise UnsafePickleError(
                f"{self.name}: refusing to unpickle global '{module}.{name}': only plain "
                "containers, numbers, strings and numeric numpy arrays are allowed in "
                "ground-truth files. If this file is genuine, convert it to JSON with a "
                "trusted tool.")
        return _Global(qualname, build)

    def op_REDUCE(self, arg):
        args = self.pop()
        func = self.pop()
        if not isinstance(func, _Global) or func.build is None:
            raise self.fail(f"calling {func!r}")
        if not isinstance(args, tuple):
            raise self.fail(f"{func.qualname} called with {type(args).__name__} arguments")
        try:
            inspect.signature(func.build).bind(*args)
        except TypeError:
            raise self.fail(f"{func.qualname} called with {len(args)} arguments") from None
        self.push(func.build(*args))

    def op_BUILD(self, arg):
        state = self.pop()
        target = self.top()
        if isinstance(target, _Dtype) and not target.built:
            self.dtype_state(target, state)
        elif isinstance(target, _PendingArray):
            self.stack[-1] = self.array_state(state)
        else:
            raise self.fail(f"BUILD on a {type(target).__name__}")

    # -- the constructors a global may resolve to -------------------------------------

    def _raw(self, value, what) -> bytes:
        if isinstance(value, str):  # Python 2 ``str`` read as latin-1 text
            try:
                value = value.encode("latin-1")
            except UnicodeEncodeError:
                raise self.fail(f"{what} holds text, not bytes") from None
        if not isinstance(value, bytes):
            raise self.fail(f"{what} is a {type(value).__name__}, not bytes")
        return value

    def encode(self, text, encoding="utf-8"):
        if not isinstance(text, str) or encoding not in ("latin1", "latin-1"):
            raise self.fail("_codecs.encode used for something other than latin-1 bytes")
        self._allocate(len(text))
        return self._raw(text, "_codecs.encode")

    def empty_bytes(self):
        return b""

    def dtype(self, code, align=False, copy=True):
        if not isinstance(code, str) or code not in _DTYPE_CODES:
            raise self.fail(f"numpy dtype {code!r}: only bool, integer and float arrays "
                            "are allowed")
        if not all(isinstance(flag, (bool, int)) for flag in (align, copy)):
            raise self.fail("numpy dtype with non-boolean flags")
        return _Dtype(code)

    def dtype_state(self, target: _Dtype, state):
        # numpy writes (version, byteorder, subarray, names, fields, elsize, alignment,
        # flags[, metadata]); for a plain numeric dtype all but the byte order are fixed.
        if (not isinstance(state, tuple) or len(state) not in (8, 9)
                or state[0] not in (3, 4) or state[1] not in ("<", ">", "|", "=")
                or state[2:5] != (None, None, None) or state[5:8] != (-1, -1, 0)
                or (len(state) == 9 and state[8] is not None)):
            raise self.fail(f"numpy dtype state {state!r} is not that of a plain numeric type")
        if state[1] in "<>":
            target.dtype = target.dtype.newbyteorder(state[1])
        target.built = True

    def _check_dtype(self, dtype) -> np.dtype:
        if not isinstance(dtype, _Dtype):
            raise self.fail(f"an array dtype given as {type(dtype).__name__}")
        return dtype.dtype

    def _array(self, raw, dtype, shape, fortran: bool) -> np.ndarray:
        dtype = self._check_dtype(dtype)
        if (not isinstance(shape, tuple) or len(shape) > _MAX_NDIM
                or not all(isinstance(n, int) and not isinstance(n, bool) and n >= 0
                           for n in shape)):
            raise self.fail(f"array shape {shape!r}")
        raw = self._raw(raw, "array data")
        # Check the sizes agree before allocating anything.
        if math.prod(shape) * dtype.itemsize != len(raw):
            raise self.fail(f"array of shape {shape} and dtype {dtype} with "
                            f"{len(raw)} bytes of data")
        self._allocate(len(raw))
        flat = np.frombuffer(raw, dtype=dtype)
        return flat.reshape(shape, order="F" if fortran else "C").copy(
            order="F" if fortran else "C")

    def reconstruct(self, cls, shape, typecode):
        if not (isinstance(cls, _Global) and cls.qualname == "numpy.ndarray"
                and shape == (0,) and typecode in (b"b", "b")):
            raise self.fail("numpy _reconstruct with unexpected arguments")
        return _PendingArray()

    def array_state(self, state) -> np.ndarray:
        if isinstance(state, tuple) and len(state) == 5 and state[0] == 1:
            state = state[1:]
        if not (isinstance(state, tuple) and len(state) == 4
                and isinstance(state[2], (bool, int))):
            raise self.fail("numpy array state is not (version, shape, dtype, fortran, data)")
        shape, dtype, fortran, raw = state
        return self._array(raw, dtype, shape, bool(fortran))

    def frombuffer(self, buf, dtype, shape, order):
        if order not in ("C", "F"):
            raise self.fail(f"array order {order!r}")
        return self._array(buf, dtype, shape, order == "F")

    def scalar(self, dtype, raw=None):
        dtype = self._check_dtype(dtype)
        raw = self._raw(raw, "numpy scalar data")
        if len(raw) != dtype.itemsize:
            raise self.fail(f"a {dtype} scalar with {len(raw)} bytes")
        return np.frombuffer(raw, dtype=dtype)[0].item()

    # -- the result -------------------------------------------------------------------

    def finish(self):
        if len(self.stack) != 1 or self.marks:
            raise self.fail("a pickle that leaves more than one object")
        result = self.stack[0]
        self._check_output(result, "")
        return result

    def _check_output(self, value, where):
        # Depth is bounded by max_depth and every container is reached once (no shared
        # containers), so this walk costs at most the number of items made.
        if isinstance(value, (np.ndarray, *_OUTPUT_ATOMS)):
            return
        if isinstance(value, dict):
            for key, item in value.items():
                self._check_output(item, f"{where}[{key!r}]")
        elif isinstance(value, (list, tuple)):
            for i, item in enumerate(value):
                self._check_output(item, f"{where}[{i}]")
        else:
            kind = "an unfinished numpy array" if isinstance(value, _PendingArray) else \
                type(value).__name__ if not isinstance(value, _Global) else repr(value)
            raise UnsafePickleError(
                f"{self.name}: refusing this pickle: the value at {where or 'top level'} "
                f"is {kind}; ground-truth pickles may only hold dicts, lists, strings, "
                "numbers and numeric numpy arrays.")


def safe_loads(data: bytes, *, name: str = "<bytes>",
               limits: PickleLimits = DEFAULT_LIMITS) -> Any:
    """Read a pickle of plain data (see the module docstring) from ``data``.

    ``name`` is used in error messages. Raises :class:`UnsafePickleError` (a
    ``ValueError``) for anything else.
    """
    return _Interpreter(bytes(data), name, limits).run()


def safe_load(file: BinaryIO, *, name: str | None = None,
              limits: PickleLimits = DEFAULT_LIMITS) -> Any:
    """Like :func:`safe_loads` for an open binary file (read at most ``max_bytes + 1``)."""
    name = name or str(getattr(file, "name", "<file>"))
    data = file.read(limits.max_bytes + 1)
    return safe_loads(data, name=name, limits=limits)


def safe_load_path(path: str, *, limits: PickleLimits = DEFAULT_LIMITS) -> Any:
    """Open ``path`` (local, or a ``tf.io.gfile`` URL such as ``gs://``) and read it
    with :func:`safe_loads`; errors name the path."""
    path = str(path)
    if "://" in path:
        import tensorflow as tf

        if tf.io.gfile.isdir(path):
            raise IsADirectoryError(f"{path}: is a directory, not a pickle file")
        with tf.io.gfile.GFile(path, "rb") as f:
            data = f.read(limits.max_bytes + 1)
    else:
        with open(path, "rb") as f:
            data = f.read(limits.max_bytes + 1)
    return safe_loads(data, name=path, limits=limits)
