"""Hostile pickles crafted by class, for the ground-truth reader.

:func:`one_megabyte_cases` gives about 1 MiB of each attack on a reader's total work
(opcode floods, memo abuse, deep nesting), each with the phrase its refusal must hold
(what refused it: the sandbox's bounds, the unpickler, or the ground truth's structure
check); :func:`shape_cases` and :func:`dtype_cases` give small arrays whose shape or
element type must be refused before numpy sees them. The tests in
``tests/pipelines/test_pickle_sandbox.py`` refuse each, and
``tests/reliability/stress_pickles.py`` measures the worst time and memory over them.
"""

from __future__ import annotations

import pickle
import struct

import numpy as np

SIZE = 1 << 20
P2 = b"\x80\x02"
P4 = b"\x80\x04"

# The refusal phrases: the sandbox's bounds, the unpickler's own errors, and the
# structure check (the C unpickler returns the top of a flooded stack, which is no
# ground truth).
DEPTH = "nested more than 32 deep"
BUDGET = "more than 2000000 items or"
UNDERFLOW = "stack underflow"
UNSET = "Memo value not found"
MARK = "unexpected MARK"
TRUTH = "a revisited ground truth is a dict"


def _fill(unit: bytes, *, head: bytes = P2, tail: bytes = b".", size: int = SIZE) -> bytes:
    """``head + unit * n + tail``, about ``size`` bytes."""
    n = max(1, (size - len(head) - len(tail)) // len(unit))
    return head + unit * n + tail


def _u(text: str) -> bytes:  # BINUNICODE
    raw = text.encode()
    return b"X" + struct.pack("<I", len(raw)) + raw


def floods() -> dict[str, tuple[bytes, str]]:
    """A megabyte of one (or two) short opcodes, container opcodes first."""
    return {
        "flood EMPTY_LIST": (_fill(b"]"), TRUTH),
        "flood EMPTY_DICT": (_fill(b"}"), TRUTH),
        "flood EMPTY_TUPLE": (_fill(b")"), TRUTH),
        "flood MARK": (_fill(b"("), MARK),
        "flood MARK+LIST": (_fill(b"(l"), TRUTH),
        "flood MARK+TUPLE": (_fill(b"(t"), TRUTH),
        "flood MARK+DICT": (_fill(b"(d"), TRUTH),
        "flood MARK+POP_MARK": (_fill(b"(1"), UNDERFLOW),
        "flood TUPLE1": (_fill(b"\x85", head=P2 + b"N"), DEPTH),
        "flood APPEND": (_fill(b"Na", head=P2 + b"]"), TRUTH),
        "flood APPENDS": (_fill(b"N", head=P2 + b"](", tail=b"e."), TRUTH),
        "flood SETITEM": (_fill(b"K\x01Ns", head=P2 + b"}"), TRUTH),
        "flood SETITEMS": (_fill(b"K\x01N", head=P2 + b"}(", tail=b"u."), TRUTH),
        "flood NONE": (_fill(b"N"), TRUTH),
        "flood NONE+POP": (_fill(b"N0"), UNDERFLOW),
        "flood empty strings": (_fill(b"\x8c\x00"), TRUTH),
        "flood PROTO": (_fill(b"\x80\x02"), UNDERFLOW),
        "flood FRAME": (_fill(b"\x95" + bytes(8), head=P4), UNDERFLOW),
    }


def memo_abuse() -> dict[str, tuple[bytes, str]]:
    """Memo floods, references to indices never set, and references that would repeat
    a container (a cycle, or an exponential tree), a long string or an array."""
    long_text = _u("x" * (64 << 10)) + b"q\x00"          # 64 KiB, memo 0
    repeat_text = P2 + b"](" + long_text + b"e" + b"".join(
        b"(" + b"h\x00" * 1000 + b"e" for _ in range(160))
    array = np.zeros(900_000, dtype=np.uint8)               # 900 kB of zeros, one memo entry
    tuple_laughs = P2 + b")q\x00" + b"".join(
        b"h" + bytes([i]) + b"h" + bytes([i]) + b"\x86q" + bytes([i + 1]) for i in range(60))
    list_laughs = P2 + b"]q\x00" + b"".join(
        b"](h" + bytes([i]) + b"h" + bytes([i]) + b"eq" + bytes([i + 1]) for i in range(60))
    return {
        "memo MEMOIZE flood": (_fill(b"\x94", head=P4 + b"N"), TRUTH),
        "memo LONG_BINPUT distinct": (P2 + b"N" + b"".join(
            b"r" + struct.pack("<I", i) for i in range((SIZE - 4) // 5)) + b".", TRUTH),
        "memo BINPUT same index": (_fill(b"q\x00", head=P2 + b"N"), TRUTH),
        "memo BINGET flood": (_fill(b"h\x00", head=P2 + b"Nq\x000"), TRUTH),
        "memo BINGET unset index": (_fill(b"h\x07", head=P2 + b"Nq\x000"), UNSET),
        "memo LONG_BINGET 2**32-1": (_fill(b"j\xff\xff\xff\xff", head=P2 + b"Nq\x000"),
                                     UNSET),
        "memo list appends itself": (_fill(b"h\x00a", head=P2 + b"]q\x00"), DEPTH),
        "memo dict holds itself": (_fill(b"K\x01h\x00s", head=P2 + b"}q\x00"), DEPTH),
        "memo tuple laughs (2**60)": (tuple_laughs + b".", DEPTH),
        "memo list laughs (2**60)": (list_laughs + b".", DEPTH),
        "memo 64 KiB string x 160000": (repeat_text + b".", BUDGET),
        "memo 900 kB array x 4": (pickle.dumps([array] * 4, protocol=2), BUDGET),
        "memo 900 kB array x 4, p5": (pickle.dumps([array] * 4, protocol=5), BUDGET),
    }


def deep_nesting() -> dict[str, tuple[bytes, str]]:
    """Containers nested far deeper than the ground truth's 3 levels."""
    n = 100_000
    return {
        "deep 100k MARK then LIST": (P2 + b"(" * n + b"l" * n + b".", DEPTH),
        "deep 100k EMPTY_LIST+APPEND": (P2 + b"]" * n + b"a" * (n - 1) + b".", DEPTH),
        "deep 40k EMPTY_LIST+APPEND": (P2 + b"]" * 40_000 + b"a" * 39_999 + b".", DEPTH),
        "deep 20k dicts by SETITEM": (P2 + b"}K\x00" * 20_000 + b"}" + b"s" * 20_000 + b".",
                                      DEPTH),
        "deep TUPLE1 around a list": (_fill(b"\x85", head=P2 + b"]"), DEPTH),
        "deep MARK+LIST in each": (_fill(b"((l"), TRUTH),
    }


def one_megabyte_cases() -> dict[str, tuple[bytes, str]]:
    """Every attack on the total work, about 1 MiB each (a few tiny ones are refused at
    their first offending opcode): ``{name: (bytes, phrase of the refusal)}``."""
    return {**floods(), **memo_abuse(), **deep_nesting()}


# ---------------------------------------------------------------------------------------
# Arrays: shapes and element types
# ---------------------------------------------------------------------------------------

_RECONSTRUCT = np.zeros(1).__reduce__()[0]          # numpy's own _reconstruct
_FROMBUFFER = np.zeros(1).__reduce_ex__(5)[0]       # numpy's _frombuffer (protocol 5)


class ForgedArray:
    """Pickles exactly as numpy writes an array, with any shape, dtype and data."""

    def __init__(self, shape, dtype, data: bytes, *, protocol5: bool = False):
        self.shape, self.dtype, self.data, self.protocol5 = shape, dtype, data, protocol5

    def __reduce__(self):
        if self.protocol5:
            return (_FROMBUFFER, (self.data, np.dtype(self.dtype), self.shape, "C"))
        return (_RECONSTRUCT, (np.ndarray, (0,), b"b"),
                (1, self.shape, np.dtype(self.dtype), False, self.data))


def forged(shape, dtype="<i8", data: bytes = b"", protocol: int = 2,
           protocol5: bool = False) -> bytes:
    return pickle.dumps({"gnd": [{"easy": ForgedArray(shape, dtype, data,
                                                      protocol5=protocol5)}]},
                        protocol=protocol)


def shape_cases() -> dict[str, bytes]:
    """Shapes refused before numpy sees them (each with data that numpy would accept
    for *some* reading of the shape, where one exists)."""
    cases = {
        "(2**40, 2**40)": forged((2 ** 40, 2 ** 40)),
        "(2**32, 2**32) int64 product overflow": forged((2 ** 32, 2 ** 32)),
        "(0, 2**62)": forged((0, 2 ** 62)),
        "(2**62, 0)": forged((2 ** 62, 0)),
        "(0, 2**63 - 1, 0)": forged((0, 2 ** 63 - 1, 0)),
        "(-1,)": forged((-1,)),
        "(3, -2) with 48 bytes": forged((3, -2), data=bytes(48)),
        "(-2, -3) with 48 bytes": forged((-2, -3), data=bytes(48)),
        "(2000, 2000): 4 * 10**6 elements": forged((2000, 2000)),
        "33 dimensions": forged((1,) * 33, data=bytes(8)),
        "(True,)": forged((True,), data=bytes(8)),
        "(1.0,)": forged((1.0,), data=bytes(8)),
        "('1',)": forged(("1",), data=bytes(8)),
        "[1] (a list)": forged([1], data=bytes(8)),
        "(2, 3) with 8 bytes": forged((2, 3), data=bytes(8)),
        "() with 0 bytes": forged((), data=b""),
    }
    for name in ("(0, 2**62)", "(2**40, 2**40)", "(-1,)", "(2, 3) with 8 bytes"):
        data = {"(2, 3) with 8 bytes": bytes(8)}.get(name, b"")
        shape = {"(0, 2**62)": (0, 2 ** 62), "(2**40, 2**40)": (2 ** 40, 2 ** 40),
                 "(-1,)": (-1,), "(2, 3) with 8 bytes": (2, 3)}[name]
        cases[f"{name}, protocol 5 _frombuffer"] = forged(shape, data=data, protocol=5,
                                                          protocol5=True)
    return cases


def dtype_cases() -> dict[str, bytes]:
    """Element types that a ground truth never holds (``object`` above all)."""
    return {
        "object": forged((1,), "O", struct.pack("<Q", 0x4141414141414141)),
        "complex128": forged((1,), "<c16", bytes(16)),
        "unicode <U3": forged((1,), "<U3", bytes(12)),
        "bytes S4": forged((1,), "S4", bytes(4)),
        "void V8": forged((1,), "V8", bytes(8)),
        "datetime64[s]": forged((1,), "<M8[s]", bytes(8)),
        "structured": forged((1,), [("a", "<i4"), ("b", "<f4")], bytes(8)),
    }


# ---------------------------------------------------------------------------------------
# The genuine article, for contrast
# ---------------------------------------------------------------------------------------

def realistic_gnd(num_db: int = 6322, num_queries: int = 70, *, index_dtype=np.int64,
                  bbx_array: bool = False, seed: int = 0) -> dict:
    """A ground truth shaped like ``gnd_rparis6k.pkl`` (the larger of the two):
    ``imlist``/``qimlist`` names, and per query a box (a list of floats, or a float
    array) and ``easy``/``hard``/``junk`` sorted index arrays of ``index_dtype``."""
    rng = np.random.default_rng(seed)
    imlist = [f"paris_{['defense', 'eiffel', 'louvre'][i % 3]}_{i:06d}" for i in range(num_db)]
    qimlist = [imlist[i] for i in rng.choice(num_db, num_queries, replace=False)]
    gnd = []
    for _ in range(num_queries):
        picked = rng.permutation(num_db)[:int(rng.integers(30, 400))]
        easy, hard, junk = np.array_split(picked, [len(picked) // 3, len(picked) // 2])
        x0, y0 = rng.uniform(0, 500, 2)
        box = [float(x0), float(y0), float(x0 + rng.uniform(50, 400)),
               float(y0 + rng.uniform(50, 400))]
        gnd.append({"bbx": np.array(box) if bbx_array else box,
                    "easy": np.sort(easy).astype(index_dtype),
                    "hard": np.sort(hard).astype(index_dtype),
                    "junk": np.sort(junk).astype(index_dtype)})
    return {"imlist": imlist, "qimlist": qimlist, "gnd": gnd}
