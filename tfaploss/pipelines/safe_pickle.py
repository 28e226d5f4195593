"""A restricted pickle reader for the untrusted revisited Oxford/Paris ground truth.

The revisited ground truth (``gnd_roxford5k.pkl``, ``gnd_rparis6k.pkl``) ships as
pickles, and ``pickle.load`` runs whatever a pickle says. Even an allow-list of
"harmless" globals is not enough: ``numpy.dtype`` plus ``_reconstruct`` build an object
array of attacker-chosen pointers (a segfault, or a live ``os.system``), and
``bytes(1 << 30)`` allocates a GiB from a 68-byte file.

Design
------
Two designs were weighed:

(a) keep a restricted reader, bounded in its *total* work, wherever a pickle is read
    (the Beam job and evaluation's ``--gnd``);
(b) pin the SHA-256 of each published file and convert it once to JSON, so that
    evaluation never unpickles.

Kept: (b)'s shape with (a) inside it. The revisited job
(:mod:`tfaploss.pipelines.revisited`) is the only code that reads a pickle: it reads it once,
with this reader, checks the structure, and writes ``gnd_<dataset>.json`` atomically next
to the records (with the pickle's SHA-256, so that a copy can be compared with the
published file). :func:`tfaploss.evaluation.load_revisited_gnd` reads JSON only.

A pickle given to evaluation is refused with a ``ValueError`` that names the conversion
command (``python -m tfaploss.pipelines.revisited ... --ground_truth_only``) rather than
converted on the fly: converting there would put this reader below ``pipelines`` in the
layers (``tfaploss.evaluation`` may not import it) and make untrusted bytes reach it at
every evaluation instead of once per dataset, when the data is prepared. So the
unpickling surface is this one module, next to its one user.

The SHA-256 of the published files is not pinned: the files are not available where
this was written, so no hash could be verified, and a wrong pin would refuse the genuine
file; the hash recorded in the JSON leaves the comparison to the user. Without a pin the
pickle stays untrusted, hence this reader rather than :mod:`pickle`, with bounds on its
total work as defence in depth.

What it does
------------
It never hands a byte of the file to :mod:`pickle`. It decodes the opcodes itself
(every length is checked against the bytes actually present before anything is sliced
or allocated) and interprets the few opcodes that a container of numbers needs, on its
own stack. What it can produce is closed:

* ``None``, ``bool``, ``int`` (at most 64 bits), ``float``, ``str``;
* ``list``, ``tuple``, ``dict`` (``str``/``int`` keys), at most ``max_depth`` deep;
* numpy arrays of a numeric dtype (bool, signed/unsigned int, float; any shape
  including 0-d), rebuilt here by :func:`numpy.frombuffer` from a shape, a dtype code and
  raw bytes that are checked to match *before* numpy sees the shape; numpy scalars
  become Python numbers.

The only globals a pickle may name are numpy's array/scalar/dtype rebuilders (under
``numpy.core`` or ``numpy._core``), ``_codecs.encode`` (Python 3 writes ``bytes`` that
way in protocols 0-2) and ``bytes()`` with no argument; each resolves to a checking
function of this module, never to the real callable. A second reference (memo ``GET``)
may only name an immutable leaf or a finished array; a second reference to a list,
dict or tuple is refused, so the result is a tree and cannot be a cycle. ``DUP``,
``NEWOBJ``, persistent ids, extension codes, sets and out-of-band buffers are refused.

Bounds on the total work (:class:`PickleLimits`)
------------------------------------------------
Every opcode costs O(1) plus the bytes it reads (amortized: an object is pushed once and
moved into a container once), and these budgets cap the whole file, not each object:

====================  =========  ===============================================
limit                 default    a real file needs (rparis6k, the larger one)
====================  =========  ===============================================
``max_bytes``         16 MiB     < 4 MiB even if every query listed every image
``max_opcodes``       200 000    ~20 000 (2 per name, ~100 per query)
``max_stack``         50 000     ~2 000 (the pickler batches 1 000 items)
``max_memo``          100 000    ~10 000
``max_depth``         32         5 (containers, and open MARKs)
``max_items``         2 000 000  < 500 000 container and array elements
``max_alloc_bytes``   64 MiB     < 12 MiB of str/bytes/array data (per reference)
====================  =========  ===============================================

So a megabyte of one-byte container opcodes stops at ``max_stack`` or ``max_opcodes``,
a ``MEMOIZE``/``BINPUT`` flood at ``max_memo``, ``BINGET`` of an index never set at once,
memo references that would repeat a long string (or an array) many times at
``max_alloc_bytes`` / ``max_items``, and deep nesting at ``max_depth``, whether it
opens with ``MARK`` or with ``EMPTY_LIST`` + ``APPEND``. An array shape is refused before
numpy sees it when a dimension is negative or above ``max_items`` (so ``(0, 2**62)`` is
refused although its product is 0), when the product is above ``max_items``, or when
it disagrees with the bytes given. Memory is O(file size + ``max_alloc_bytes``); over
the crafted 1 MiB inputs of ``tests/reliability/stress_pickles.py`` the worst took 0.2 to 0.4 s
(2 shared cores at load 10) and the worst peak was 10 MB.

Every refusal raises :class:`UnsafePickleError` (a ``ValueError``) naming the file and
the byte offset; a ``MemoryError`` or ``RecursionError`` inside the reader (which the
bounds should make impossible) is reported the same way.
"""

from __future__ import annotations

import _compat_pickle
import codecs
import hashlib
import math
import pickle
import pickletools
import struct
from dataclasses import dataclass
from typing import Any, BinaryIO

import numpy as np

from tfaploss.process_settings import COLLECTOR_OFF

__all__ = ["PickleLimits", "UnsafePickleError", "safe_load", "safe_load_path", "safe_loads",
           "sha256_of"]


class UnsafePickleError(ValueError, pickle.UnpicklingError):
    """A pickle this reader refuses: something other than plain data, too big, or broken.

    The message names the file (or ``<bytes>``) and what was refused.
    """


@dataclass(frozen=True)
class PickleLimits:
    """Caps on the total work one pickle may cause (see the module docstring's table)."""

    max_bytes: int = 16 << 20        # size of the pickle file
    max_opcodes: int = 200_000       # opcodes executed
    max_stack: int = 50_000          # objects on the pickle stack at once
    max_memo: int = 100_000          # memo entries
    max_depth: int = 32              # nesting of containers, and of open MARKs
    max_items: int = 2_000_000       # container and array elements, in total
    max_alloc_bytes: int = 64 << 20  # str/bytes/array bytes made, per reference
    max_int_bits: int = 64


DEFAULT_LIMITS = PickleLimits()

# Array element types the ground truth can hold: bool, integers, floats.
_DTYPE_CODES = frozenset({"b1", "i1", "i2", "i4", "i8", "u1", "u2", "u4", "u8",
                          "f2", "f4", "f8"})
_MAX_NDIM = 32
_NUMBER_LINE = 64     # longest protocol-0 number (a 64-bit int has 20 digits)
_NAME_LINE = 256      # longest module or attribute name in a GLOBAL


class _Global:
    """A global the pickle named, resolved to one of our own checking functions."""

    __slots__ = ("build", "max_args", "min_args", "qualname")

    def __init__(self, qualname: str, build=None, min_args: int = 0, max_args: int = 0):
        self.qualname, self.build = qualname, build
        self.min_args, self.max_args = min_args, max_args

    def __repr__(self):
        return f"<global {self.qualname}>"


class _Dtype:
    """A numeric numpy dtype under construction (``numpy.dtype(code)`` + its state)."""

    __slots__ = ("built", "dtype")

    def __init__(self, code: str):
        self.dtype = np.dtype(code)
        self.built = False


class _PendingArray:
    """``_reconstruct(ndarray, (0,), b'b')`` waiting for its BUILD state; ``array`` once
    built (a memo reference to it then means the array)."""

    __slots__ = ("array",)

    def __init__(self):
        self.array = None


# What a memo reference (GET) may name: immutable leaves (and finished arrays, below).
_SHAREABLE = (type(None), bool, int, float, str, bytes, _Global, _Dtype)
_OUTPUT_ATOMS = (type(None), bool, int, float, str)


class _Corrupt(Exception):
    """Raised by the byte readers; reported as a truncated or corrupt file."""


class _Interpreter:
    def __init__(self, data: bytes, name: str, limits: PickleLimits):
        self.data, self.name, self.limits = data, name, limits
        self.size = len(data)
        self.pos = 0          # next byte to read
        self.op_pos = 0       # where the current opcode starts (for messages)
        # The stack, and beside it each entry's nesting height (0 for a leaf).
        self.stack: list = []
        self.heights: list[int] = []
        self.marks: list[int] = []
        self.memo: dict[int, Any] = {}
        self.items = 0
        self.allocated = 0

    # -- errors and budgets -----------------------------------------------------------

    def fail(self, what: str) -> UnsafePickleError:
        return UnsafePickleError(
            f"{self.name}: refusing this pickle at byte {self.op_pos}: {what}. Ground-truth "
            "pickles may only hold dicts, lists, strings, numbers and numeric numpy arrays.")

    def corrupt(self, what: str) -> UnsafePickleError:
        return UnsafePickleError(f"{self.name}: not a readable pickle (truncated or "
                                 f"corrupt) at byte {self.op_pos}: {what}")

    def _count_items(self, n: int):
        self.items += n
        if self.items > self.limits.max_items:
            raise self.fail(f"more than {self.limits.max_items} container and array "
                            "elements in total")

    def _allocate(self, n: int):
        self.allocated += n
        if self.allocated > self.limits.max_alloc_bytes:
            raise self.fail(f"more than {self.limits.max_alloc_bytes} bytes of strings and "
                            "array data in total (a value counts at every reference)")

    def _check_height(self, height: int):
        if height > self.limits.max_depth:
            raise self.fail(f"containers nested more than {self.limits.max_depth} deep")

    # -- reading the bytes --------------------------------------------------------------

    def take(self, n: int) -> bytes:
        if n < 0 or n > self.size - self.pos:
            raise _Corrupt(f"an argument of {n} bytes, {self.size - self.pos} left")
        start = self.pos
        self.pos += n
        return self.data[start:self.pos]

    def byte(self) -> int:
        pos = self.pos
        if pos >= self.size:
            raise _Corrupt("a one-byte argument after the end of the file")
        self.pos = pos + 1
        return self.data[pos]

    def unpack(self, fmt: struct.Struct):
        if fmt.size > self.size - self.pos:
            raise _Corrupt(f"an argument of {fmt.size} bytes, {self.size - self.pos} left")
        value = fmt.unpack_from(self.data, self.pos)[0]
        self.pos += fmt.size
        return value

    def line(self, max_len: int) -> bytes:
        end = self.data.find(b"\n", self.pos, self.pos + max_len + 1)
        if end < 0:
            raise _Corrupt(f"a text argument longer than {max_len} bytes or without its "
                           "newline")
        start, self.pos = self.pos, end + 1
        return self.data[start:end]

    # -- stack ------------------------------------------------------------------------

    def push(self, obj, height: int = 0):
        stack = self.stack
        if len(stack) >= self.limits.max_stack:
            raise self.fail(f"more than {self.limits.max_stack} objects on the pickle stack")
        stack.append(obj)
        self.heights.append(height)

    def push_text(self, value):
        self._allocate(len(value))
        self.push(value)

    def _floor(self) -> int:
        return self.marks[-1] if self.marks else 0

    def pop(self):
        if len(self.stack) <= self._floor():
            raise self.fail("stack underflow")
        self.heights.pop()
        return self.stack.pop()

    def pop_with_height(self):
        if len(self.stack) <= self._floor():
            raise self.fail("stack underflow")
        return self.stack.pop(), self.heights.pop()

    def top(self):
        stack = self.stack
        if len(stack) <= (self.marks[-1] if self.marks else 0):
            raise self.fail("stack underflow")
        return stack[-1]

    def pop_mark(self) -> tuple[list, list[int]]:
        if not self.marks:
            raise self.fail("no MARK on the stack")
        start = self.marks.pop()
        items, heights = self.stack[start:], self.heights[start:]
        del self.stack[start:], self.heights[start:]
        return items, heights

    def int_value(self, value: int) -> int:
        if value.bit_length() > self.limits.max_int_bits:
            raise self.fail(f"an integer of {value.bit_length()} bits")
        return value

    # -- the loop -----------------------------------------------------------------------

    def run(self) -> Any:
        if self.size > self.limits.max_bytes:
            raise UnsafePickleError(f"{self.name}: {self.size} bytes, more than the "
                                    f"{self.limits.max_bytes} a ground-truth pickle may have")
        data, table, max_ops = self.data, _TABLE, self.limits.max_opcodes
        ops = 0
        try:
            while True:
                self.op_pos = pos = self.pos
                if pos >= self.size:
                    raise _Corrupt("the file ends before its STOP opcode")
                code = data[pos]
                self.pos = pos + 1
                ops += 1
                if ops > max_ops:
                    raise self.fail(f"more than {max_ops} opcodes")
                handler = table[code]
                if handler is None:
                    op = _CODE2OP.get(code)
                    if op is None:
                        raise _Corrupt(f"unknown opcode 0x{code:02x}")
                    raise self.fail(f"opcode {op.name} is not allowed")
                if handler is _stop:
                    return self.finish()
                handler(self)
        except _Corrupt as err:
            raise self.corrupt(str(err)) from None
        except UnsafePickleError:
            raise
        except (MemoryError, RecursionError) as err:  # the bounds should prevent these
            raise self.fail(f"{type(err).__name__} while reading") from None
        except Exception as err:  # noqa: BLE001 -- a check this reader lacks: still refuse
            raise self.fail(f"unexpected {type(err).__name__}: {str(err)[:200]}") from None

    # -- the opcodes ------------------------------------------------------------------

    def op_PROTO(self):
        proto = self.byte()
        if proto > 5:
            raise self.fail(f"unknown pickle protocol {proto}")

    def op_FRAME(self):
        self.unpack(_U8)  # framing only groups reads; the bytes are read as they come

    def op_MARK(self):
        if len(self.marks) >= self.limits.max_depth:
            raise self.fail(f"MARKs nested more than {self.limits.max_depth} deep")
        self.marks.append(len(self.stack))

    def op_POP(self):
        if self.marks and len(self.stack) == self.marks[-1]:
            self.marks.pop()
        else:
            self.pop()

    def op_POP_MARK(self):
        self.pop_mark()

    def op_NONE(self):
        self.push(None)

    def op_NEWTRUE(self):
        self.push(True)

    def op_NEWFALSE(self):
        self.push(False)

    def op_INT(self):
        text = self.line(_NUMBER_LINE)
        if text in (b"00", b"01"):  # protocol 0 writes booleans this way
            self.push(text == b"01")
            return
        self.push(self.int_value(self._decimal(text)))

    def op_LONG(self):
        text = self.line(_NUMBER_LINE)
        self.push(self.int_value(self._decimal(text[:-1] if text.endswith(b"L") else text)))

    @staticmethod
    def _decimal(text: bytes) -> int:
        try:
            return int(text)
        except ValueError:
            raise _Corrupt(f"{text[:40]!r} is not an integer") from None

    def op_BININT(self):
        self.push(self.unpack(_I4))

    def op_BININT1(self):
        self.push(self.byte())

    def op_BININT2(self):
        self.push(self.unpack(_U2))

    def _long(self, n: int):
        if n < 0:
            raise _Corrupt(f"a LONG of {n} bytes")
        if n * 8 > self.limits.max_int_bits + 8:
            raise self.fail(f"an integer of {n * 8} bits")
        self.push(self.int_value(int.from_bytes(self.take(n), "little", signed=True)))

    def op_LONG1(self):
        self._long(self.byte())

    def op_LONG4(self):
        self._long(self.unpack(_I4))

    def op_FLOAT(self):
        text = self.line(_NUMBER_LINE)
        try:
            self.push(float(text))
        except ValueError:
            raise _Corrupt(f"{text[:40]!r} is not a float") from None

    def op_BINFLOAT(self):
        self.push(self.unpack(_F8))

    def _utf8(self, raw: bytes) -> str:
        try:
            return raw.decode("utf-8", "surrogatepass")
        except UnicodeDecodeError as err:
            raise _Corrupt(f"text that is not UTF-8: {err.reason}") from None

    def op_BINUNICODE(self):
        self.push_text(self._utf8(self.take(self.unpack(_U4))))

    def op_SHORT_BINUNICODE(self):
        self.push_text(self._utf8(self.take(self.byte())))

    def op_BINUNICODE8(self):
        self.push_text(self._utf8(self.take(self.unpack(_U8))))

    def op_UNICODE(self):
        raw = self.line(self.size)
        try:
            self.push_text(raw.decode("raw-unicode-escape"))
        except UnicodeDecodeError as err:
            raise _Corrupt(f"a UNICODE argument: {err.reason}") from None

    # Python 2 ``str`` reads as latin-1 text, as ``pickle.load(encoding="latin1")`` does.
    def op_STRING(self):
        raw = self.line(self.size)
        if len(raw) < 2 or raw[:1] not in (b"'", b'"') or raw[-1:] != raw[:1]:
            raise _Corrupt("a STRING argument without its quotes")
        try:
            self.push_text(codecs.escape_decode(raw[1:-1])[0].decode("latin-1"))
        except ValueError as err:
            raise _Corrupt(f"a STRING argument: {err}") from None

    def op_BINSTRING(self):
        self.push_text(self.take(self.unpack(_I4)).decode("latin-1"))

    def op_SHORT_BINSTRING(self):
        self.push_text(self.take(self.byte()).decode("latin-1"))

    def op_BINBYTES(self):
        self.push_text(self.take(self.unpack(_U4)))

    def op_SHORT_BINBYTES(self):
        self.push_text(self.take(self.byte()))

    def op_BINBYTES8(self):
        self.push_text(self.take(self.unpack(_U8)))

    op_BYTEARRAY8 = op_BINBYTES8  # read as bytes: nothing here mutates it

    def op_READONLY_BUFFER(self):
        if not isinstance(self.top(), bytes):
            raise self.fail("READONLY_BUFFER on something other than bytes")

    # containers

    def op_EMPTY_LIST(self):
        self.push([], 1)

    def op_EMPTY_DICT(self):
        self.push({}, 1)

    def op_EMPTY_TUPLE(self):
        self.push((), 1)

    def _container(self, obj, heights: list[int]):
        self._count_items(len(heights))
        height = 1 + max(heights, default=0)
        self._check_height(height)
        self.push(obj, height)

    def op_LIST(self):
        items, heights = self.pop_mark()
        self._container(items, heights)

    def op_TUPLE(self):
        items, heights = self.pop_mark()
        self._container(tuple(items), heights)

    def _tuple_n(self, n):
        pairs = [self.pop_with_height() for _ in range(n)][::-1]
        self._container(tuple(obj for obj, _ in pairs), [h for _, h in pairs])

    def op_TUPLE1(self):
        self._tuple_n(1)

    def op_TUPLE2(self):
        self._tuple_n(2)

    def op_TUPLE3(self):
        self._tuple_n(3)

    def op_DICT(self):
        items, heights = self.pop_mark()
        if not items:
            self.push({}, 1)
            return
        d = {}
        self._set_items(d, items)
        self.push(d, self._grown(1, heights[1::2]))

    def _grown(self, height: int, child_heights) -> int:
        height = max(height, 1 + max(child_heights, default=0))
        self._check_height(height)
        return height

    def _list_target(self):
        target = self.top()
        if not isinstance(target, list):
            raise self.fail(f"APPEND to a {type(target).__name__}, not a list")
        return target

    def op_APPEND(self):  # the hot path of protocol 0, kept short
        stack, heights = self.stack, self.heights
        if len(stack) <= (self.marks[-1] if self.marks else 0) + 1:
            raise self.fail("stack underflow")
        value, height = stack.pop(), heights.pop()
        target = stack[-1]
        if type(target) is not list:
            raise self.fail(f"APPEND to a {type(target).__name__}, not a list")
        self._count_items(1)
        if height >= heights[-1]:
            self._check_height(height + 1)
            heights[-1] = height + 1
        target.append(value)

    def op_APPENDS(self):
        values, heights = self.pop_mark()
        target = self._list_target()
        self._count_items(len(values))
        self.heights[-1] = self._grown(self.heights[-1], heights)
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
        target.update(zip(keys, values))

    def op_SETITEM(self):  # the hot path of protocol 0, kept short
        stack, heights = self.stack, self.heights
        if len(stack) <= (self.marks[-1] if self.marks else 0) + 2:
            raise self.fail("stack underflow")
        value, height = stack.pop(), heights.pop()
        key = stack.pop()
        heights.pop()
        target = stack[-1]
        if type(target) is not dict:
            raise self.fail(f"SETITEM on a {type(target).__name__}, not a dict")
        if type(key) is not str and type(key) is not int:
            raise self.fail(f"a dict key of type {type(key).__name__}")
        self._count_items(1)
        if height >= heights[-1]:
            self._check_height(height + 1)
            heights[-1] = height + 1
        target[key] = value

    def op_SETITEMS(self):
        items, heights = self.pop_mark()
        self._set_items(self.top(), items)
        self.heights[-1] = self._grown(self.heights[-1], heights[1::2])

    # memo

    def _put(self, index: int):
        memo = self.memo
        if len(memo) >= self.limits.max_memo and index not in memo:
            raise self.fail(f"more than {self.limits.max_memo} memo entries")
        memo[index] = self.top()

    def op_PUT(self):
        self._put(self._decimal(self.line(_NUMBER_LINE)))

    def op_BINPUT(self):
        self._put(self.byte())

    def op_LONG_BINPUT(self):
        self._put(self.unpack(_U4))

    def op_MEMOIZE(self):
        self._put(len(self.memo))

    def _get(self, index: int):
        if index not in self.memo:
            raise self.fail(f"memo key {index} used before it was set")
        value = self.memo[index]
        if isinstance(value, _PendingArray):
            if value.array is None:
                raise self.fail("a second reference to an unfinished numpy array")
            value = value.array
        if isinstance(value, np.ndarray):
            # A repeated array is repeated in the output: it costs again.
            self._count_items(value.size)
            self._allocate(value.nbytes)
        elif not isinstance(value, _SHAREABLE):
            # A second reference to a container could make a cycle, or an exponentially
            # large tree out of a few bytes.
            raise self.fail(f"a second reference to a {type(value).__name__}")
        elif isinstance(value, (str, bytes)):
            self._allocate(len(value))
        self.push(value)

    def op_GET(self):
        self._get(self._decimal(self.line(_NUMBER_LINE)))

    def op_BINGET(self):
        self._get(self.byte())

    def op_LONG_BINGET(self):
        self._get(self.unpack(_U4))

    # globals and calls

    def op_GLOBAL(self):
        module = self._utf8(self.line(_NAME_LINE))
        name = self._utf8(self.line(_NAME_LINE))
        self.push(self._resolve(module, name))

    def op_STACK_GLOBAL(self):
        name = self.pop()
        module = self.pop()
        if not (isinstance(module, str) and isinstance(name, str)):
            raise self.fail("STACK_GLOBAL with non-string names")
        self.push(self._resolve(module, name))

    def _resolve(self, module: str, name: str) -> _Global:
        # Protocol-2 pickles name Python 2 modules (``__builtin__``); check the Python 3 name.
        module, name = _compat_pickle.NAME_MAPPING.get((module, name), (module, name))
        module = _compat_pickle.IMPORT_MAPPING.get(module, module)
        spec = _GLOBALS.get((module, name))
        if spec is None:
            raise UnsafePickleError(
                f"{self.name}: refusing to unpickle global '{module}.{name}' (at byte "
                f"{self.op_pos}): only plain containers, numbers, strings and numeric numpy "
                "arrays are allowed in ground-truth files.")
        method, min_args, max_args = spec
        return _Global(f"{module}.{name}", method and getattr(self, method), min_args,
                       max_args)

    def op_REDUCE(self):
        args = self.pop()
        func = self.pop()
        if not isinstance(func, _Global) or func.build is None:
            raise self.fail(f"calling {func!r}")
        if not isinstance(args, tuple):
            raise self.fail(f"{func.qualname} called with {type(args).__name__} arguments")
        if not func.min_args <= len(args) <= func.max_args:
            raise self.fail(f"{func.qualname} called with {len(args)} arguments")
        self.push(func.build(*args))

    def op_BUILD(self):
        state = self.pop()
        target = self.top()
        if isinstance(target, _Dtype) and not target.built:
            self.dtype_state(target, state)
        elif isinstance(target, _PendingArray) and target.array is None:
            target.array = self.array_state(state)
            self.stack[-1] = target.array
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
        if type(text) is not str or type(encoding) is not str or encoding not in (
                "latin1", "latin-1"):
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
        # (Types first: a shared numpy array compared with == is neither true nor false.)
        if (type(state) is not tuple or len(state) not in (8, 9)
                or not all(type(v) is int for v in (state[0], *state[5:8]))
                or state[0] not in (3, 4) or state[5:8] != (-1, -1, 0)
                or type(state[1]) is not str or state[1] not in ("<", ">", "|", "=")
                or any(v is not None for v in state[2:5])
                or (len(state) == 9 and state[8] is not None)):
            raise self.fail(f"numpy dtype state {str(state)[:200]} is not that of a plain "
                            "numeric type")
        if state[1] in "<>":
            target.dtype = target.dtype.newbyteorder(state[1])
        target.built = True

    def _check_dtype(self, dtype) -> np.dtype:
        if not isinstance(dtype, _Dtype) or not dtype.built:
            what = "an unfinished dtype" if isinstance(dtype, _Dtype) else type(dtype).__name__
            raise self.fail(f"an array dtype given as {what}")
        return dtype.dtype

    def _check_shape(self, shape) -> int:
        """The number of elements of ``shape``, refused before numpy sees it when a
        dimension is negative or huge, or the product is (whatever the other dims)."""
        cap = self.limits.max_items
        if not isinstance(shape, tuple) or len(shape) > _MAX_NDIM:
            raise self.fail(f"array shape {str(shape)[:200]}: not a tuple of at most "
                            f"{_MAX_NDIM} dimensions")
        for n in shape:
            if not isinstance(n, int) or isinstance(n, bool) or not 0 <= n <= cap:
                raise self.fail(f"array shape {str(shape)[:200]}: each dimension must be an "
                                f"integer in 0..{cap}")
        count = math.prod(shape)  # at most cap ** 32: exact and cheap
        if count > cap:
            raise self.fail(f"array shape {str(shape)[:200]}: more than {cap} elements")
        return count

    def _array(self, raw, dtype, shape, fortran: bool) -> np.ndarray:
        dtype = self._check_dtype(dtype)
        count = self._check_shape(shape)
        raw = self._raw(raw, "array data")
        if count * dtype.itemsize != len(raw):
            raise self.fail(f"array shape {shape} of dtype {dtype} with {len(raw)} bytes "
                            "of data")
        self._count_items(count)
        self._allocate(len(raw))
        order = "F" if fortran else "C"
        return np.frombuffer(raw, dtype=dtype).reshape(shape, order=order).copy(order=order)

    def reconstruct(self, cls, shape, typecode):
        if not (isinstance(cls, _Global) and cls.qualname == "numpy.ndarray"
                and type(shape) is tuple and len(shape) == 1 and type(shape[0]) is int
                and shape[0] == 0 and type(typecode) in (bytes, str)
                and typecode in (b"b", "b")):
            raise self.fail("numpy _reconstruct with unexpected arguments")
        return _PendingArray()

    def array_state(self, state) -> np.ndarray:
        if type(state) is tuple and len(state) == 5 and type(state[0]) is int \
                and state[0] == 1:
            state = state[1:]
        if not (type(state) is tuple and len(state) == 4
                and type(state[2]) in (bool, int)):
            raise self.fail("numpy array state is not (version, shape, dtype, fortran, data)")
        shape, dtype, fortran, raw = state
        return self._array(raw, dtype, shape, bool(fortran))

    def frombuffer(self, buf, dtype, shape, order):
        if type(order) is not str or order not in ("C", "F"):
            raise self.fail(f"array order {str(order)[:40]!r}")
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
            raise self.fail(f"a pickle that leaves {len(self.stack)} objects and "
                            f"{len(self.marks)} MARKs, not one object")
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


_U2, _U4, _I4, _U8, _F8 = (struct.Struct(f) for f in ("<H", "<I", "<i", "<Q", ">d"))
_CODE2OP = {op.code.encode("latin-1")[0]: op for op in pickletools.opcodes}


def _stop(self):  # a sentinel: run() returns on STOP
    raise AssertionError("unreachable")


_TABLE: list = [None] * 256
for _code, _op in _CODE2OP.items():
    _TABLE[_code] = _stop if _op.name == "STOP" else getattr(_Interpreter, f"op_{_op.name}",
                                                             None)
del _code, _op

# (module, name) -> (the checking method it resolves to, min args, max args). A global
# with no method (``numpy.ndarray``) may only be an argument of ``_reconstruct``.
_GLOBALS: dict[tuple[str, str], tuple[str | None, int, int]] = {
    ("numpy", "ndarray"): (None, 0, 0),
    ("numpy", "dtype"): ("dtype", 1, 3),
    ("_codecs", "encode"): ("encode", 1, 2),
    ("builtins", "bytes"): ("empty_bytes", 0, 0),
}
for _core in ("numpy.core", "numpy._core"):
    _GLOBALS[(f"{_core}.multiarray", "_reconstruct")] = ("reconstruct", 3, 3)
    _GLOBALS[(f"{_core}.multiarray", "scalar")] = ("scalar", 1, 2)
    _GLOBALS[(f"{_core}.numeric", "_frombuffer")] = ("frombuffer", 4, 4)
del _core


def safe_loads(data: bytes, *, name: str = "<bytes>",
               limits: PickleLimits = DEFAULT_LIMITS) -> Any:
    """Read a pickle of plain data (see the module docstring) from ``data``.

    ``name`` is used in error messages. Raises :class:`UnsafePickleError` (a
    ``ValueError``) for anything else.
    """
    # What the reader builds is a tree (a second reference to a container is refused),
    # so a collection during a read cannot find anything to free. Yet a flood of 50 000
    # lists triggers collections, full ones among them: each a pass over every object of
    # the process, a cost from the host, not from the file. CI charged 2.63 CPU s to a
    # refusal that costs 0.01 s, in a test worker holding millions of objects.
    with COLLECTOR_OFF.held():
        return _Interpreter(bytes(data), name, limits).run()


def safe_load(file: BinaryIO, *, name: str | None = None,
              limits: PickleLimits = DEFAULT_LIMITS) -> Any:
    """Like :func:`safe_loads` for an open binary file (read at most ``max_bytes + 1``)."""
    name = name or str(getattr(file, "name", "<file>"))
    data = file.read(limits.max_bytes + 1)
    return safe_loads(data, name=name, limits=limits)


def read_bounded(path: str, limit: int) -> bytes:
    """At most ``limit + 1`` bytes of ``path`` (local, or a ``tf.io.gfile`` URL such as
    ``gs://``)."""
    path = str(path)
    if "://" in path:
        import tensorflow as tf

        if tf.io.gfile.isdir(path):
            raise IsADirectoryError(f"{path}: is a directory, not a pickle file")
        with tf.io.gfile.GFile(path, "rb") as f:
            return f.read(limit + 1)
    with open(path, "rb") as f:
        return f.read(limit + 1)


def sha256_of(data: bytes) -> str:
    """Hex SHA-256 of the bytes that were read (recorded next to the JSON conversion)."""
    return hashlib.sha256(data).hexdigest()


def safe_load_path(path: str, *, limits: PickleLimits = DEFAULT_LIMITS,
                   with_sha256: bool = False) -> Any:
    """Open ``path`` (local, or a ``tf.io.gfile`` URL such as ``gs://``) and read it
    with :func:`safe_loads`; errors name the path. With ``with_sha256``, returns
    ``(value, sha256 hex of the file)``."""
    data = read_bounded(path, limits.max_bytes)
    value = safe_loads(data, name=str(path), limits=limits)
    return (value, sha256_of(data)) if with_sha256 else value
