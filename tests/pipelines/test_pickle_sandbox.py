"""The ground-truth pickle reader against real-shaped and hostile pickles.

Real revisited gnd files are pickled dicts of lists of dicts holding numpy integer
arrays and float boxes, written by numpy 1 (``numpy.core``) or numpy 2
(``numpy._core``) under protocols 2..5. Hostile files go the way the revisited job reads
a file the user named (``read_pickled_ground_truth``): the allow-list unpickler in the
sandbox's child, then the structure check. Each must be refused with one line naming the
file, within time, and whatever the child meets (a memory bomb, a crash, a hang) stays
in the child. The attacks on the total work (floods, memo abuse, deep nesting, ~1 MiB
each) and on array shapes and dtypes come from :mod:`tests.reliability.hostile_pickles`.
In-house pickles (the tests' own) are read in-process with ``loads_plain``, the child's
own reading.
"""

import json
import os
import pickle
import pickletools
import random
import resource
import struct
import subprocess
import sys
import time
import warnings

import numpy as np
import pytest

from tests.reliability import hostile_pickles as H
from tests.support import timing
from tfaploss.evaluation import load_revisited_gnd
from tfaploss.evaluation.revisited import check_revisited_gnd
from tfaploss.pipelines import pickle_sandbox
from tfaploss.pipelines.pickle_sandbox import UnsafePickleError, loads_plain, read_pickle
from tfaploss.pipelines.revisited import read_pickled_ground_truth

REPO_ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def _read_named(path):
    """What the revisited job does with a pickle the user named (--ground_truth)."""
    return read_pickled_ground_truth(str(path), None, named=True)


def _real_gnd():
    """The structure of gnd_roxford5k.pkl, in miniature."""
    return {
        "imlist": [f"all_souls_{i:06d}" for i in range(12)],
        "qimlist": ["all_souls_000013", "radcliffe_camera_000519"],
        "gnd": [
            {"easy": np.array([0, 3, 7], dtype=np.int64), "hard": np.array([5], dtype=np.int64),
             "junk": np.array([], dtype=np.int64), "bbx": [136.5, 34.25, 648.5, 955.75]},
            {"easy": np.array([1, 2], dtype=np.int64), "hard": np.array([], dtype=np.int64),
             "junk": np.array([11, 4], dtype=np.int64), "bbx": [1.0, 2.0, 3.0, 4.0]},
        ],
    }


def _without_frames(data: bytes) -> bytes:
    """Drop FRAME opcodes (optional in protocol 4+), so byte edits keep the pickle valid."""
    out, last = [], 0
    for opcode, _, pos in pickletools.genops(data):
        if opcode.name == "FRAME":
            out.append(data[last:pos])
            last = pos + 9
    return b"".join(out) + data[last:]


def _numpy1_names(data: bytes) -> bytes:
    """Rewrite numpy 2's ``numpy._core`` globals as numpy 1 wrote them (``numpy.core``)."""
    data = _without_frames(data)
    for new, old in (("numpy.core.multiarray", "numpy._core.multiarray"),
                     ("numpy.core.numeric", "numpy._core.numeric")):
        data = data.replace(old.encode() + b"\n", new.encode() + b"\n")  # GLOBAL (proto 2)
        data = data.replace(bytes([0x8C, len(old)]) + old.encode(),      # SHORT_BINUNICODE
                            bytes([0x8C, len(new)]) + new.encode())
    return data


def _as_lists(value):
    """What pickle itself reads, with arrays as lists (a 0-d array as a list of one)."""
    if isinstance(value, np.ndarray):
        return value.tolist() if value.ndim else [value.item()]
    if isinstance(value, dict):
        return {k: _as_lists(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_as_lists(v) for v in value]
    return value.item() if isinstance(value, np.generic) else value


REAL_VARIANTS = [(protocol, numpy1) for protocol in (2, 3, 4, 5) for numpy1 in (False, True)]


@pytest.mark.parametrize("protocol,numpy1", REAL_VARIANTS,
                         ids=[f"p{p}-{'numpy.core' if n else 'numpy._core'}"
                              for p, n in REAL_VARIANTS])
def test_reads_real_structure_like_pickle_does(protocol, numpy1):
    data = pickle.dumps(_real_gnd(), protocol=protocol)
    if numpy1:
        data = _numpy1_names(data)
        assert b"numpy.core." in data and b"numpy._core" not in data
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", DeprecationWarning)  # numpy.core shim
        expected = pickle.loads(data)
    got = loads_plain(data)
    assert got == _as_lists(expected)
    assert got["gnd"][0]["easy"] == [0, 3, 7] and got["gnd"][1]["junk"] == [11, 4]
    assert type(got["gnd"][0]["easy"][0]) is int


def test_reads_every_numeric_dtype_layout_and_scalar():
    values = {"i4be": np.arange(6, dtype=">i4").reshape(2, 3),
              "fortran": np.asfortranarray(np.arange(6.0).reshape(2, 3)),
              "u1": np.array([0, 255], dtype=np.uint8), "b1": np.array([True, False]),
              "f2": np.array([0.5], dtype=np.float16), "scalar": np.int64(-3),
              "f8scalar": np.float64(0.25), "tuple": (1, "x", None, True)}
    for protocol in range(6):
        got = loads_plain(pickle.dumps(values, protocol=protocol))
        assert got["i4be"] == [[0, 1, 2], [3, 4, 5]], protocol
        assert got["fortran"] == [[0.0, 1.0, 2.0], [3.0, 4.0, 5.0]], protocol
        assert got["u1"] == [0, 255] and got["b1"] == [True, False] and got["f2"] == [0.5]
        assert got["scalar"] == -3 and type(got["scalar"]) is int
        assert got["f8scalar"] == 0.25 and type(got["f8scalar"]) is float
        assert got["tuple"] == [1, "x", None, True]


def test_the_sandbox_reads_a_real_file_as_pickle_does(tmp_path):
    """Through the child, as the job reads it: the structure check's output equals what
    pickle itself reads, and the source is recorded."""
    truth = H.realistic_gnd()
    for protocol in (2, 5):
        path = tmp_path / f"gnd_p{protocol}.pkl"
        path.write_bytes(pickle.dumps(truth, protocol=protocol))
        got = _read_named(path)
        assert got.pop("source")["file"] == path.name
        assert got == check_revisited_gnd(pickle.loads(path.read_bytes()))


# ---------------------------------------------------------------------------------------
# Hostile pickles, through the sandbox
# ---------------------------------------------------------------------------------------

def _g(module, name):
    return b"c" + module.encode() + b"\n" + name.encode() + b"\n"


def _u(text):  # BINUNICODE
    return b"X" + struct.pack("<I", len(text)) + text.encode()


def _object_pointer_array(code="O8", flags=63, address=0x4141414141414141):
    """A one-element array of dtype ``code`` whose dtype state claims ``flags`` (63: holds
    Python objects) and whose data is a raw pointer: the old allow-list's hole."""
    return (b"\x80\x02" + _g("numpy.core.multiarray", "_reconstruct") + _g("numpy", "ndarray")
            + b"K\x00\x85C\x01b\x87R" + b"(K\x01K\x01\x85" + _g("numpy", "dtype")
            + _u(code) + b"\x89\x88\x87R(K\x03" + _u("|") + b"NNN"
            + b"J\xff\xff\xff\xffJ\xff\xff\xff\xffK" + bytes([flags]) + b"tb"
            + b"\x89C\x08" + struct.pack("<Q", address) + b"tb.")


def _gnd_with(entry_bytes: bytes) -> bytes:
    """``{'gnd': [<entry>]}`` around a raw pickled value."""
    return b"\x80\x02}(" + _u("gnd") + b"](" + entry_bytes + b"eu."


class _System:
    def __reduce__(self):
        return (os.system, ("echo pwned",))


# Each hostile file with a phrase its one-line refusal must hold, so that each is
# refused for its own reason.
HOSTILE = {
    # the 168-byte pointer trick, at top level and inside a gnd entry
    "object_array": (_object_pointer_array(), "dtype 'O8'"),
    "object_array_in_gnd": (_gnd_with(_object_pointer_array()[2:-1]), "dtype 'O8'"),
    # an int64 dtype whose state claims it holds objects
    "dtype_object_flags": (_object_pointer_array("i8", 63), "not a plain number"),
    # 1 GiB from a tiny file via bytes()/bytearray()
    "bytes_1gib": (b"\x80\x02" + _g("__builtin__", "bytes") + b"J\x00\x00\x00@\x85R.",
                   "positional argument"),
    "bytearray_1gib": (b"\x80\x02" + _g("__builtin__", "bytearray") + b"J\x00\x00\x00@\x85R.",
                       "bytearray"),
    # a declared 1 TiB bytes object in a 20-byte file: the child's memory limit
    "binbytes8_1tib": (b"\x80\x04\x8e" + struct.pack("<Q", 1 << 40) + b"xxxx.", "MemoryError"),
    # an array declaring 2**40 elements over 8 bytes of data
    "array_shape_lie": (pickle.dumps(np.array([7], dtype=np.int64), protocol=2).replace(
        b"K\x01\x85", b"\x8a\x06\x00\x00\x00\x00\x00\x01\x85"), "array shape"),
    # a memo of 2**32 entries: the child's memory limit
    "memo_index_4g": (b"\x80\x02Nr\xff\xff\xff\xff.", "MemoryError"),
    "deep_200k": (b"\x80\x02" + b"(" * 200_000 + b"l" * 200_000 + b".", H.DEPTH),
    "deep_200k_in_gnd": (_gnd_with(b"(" * 200_000 + b"l" * 200_000), H.DEPTH),
    "self_cycle": (b"\x80\x02]q\x00h\x00a.", H.DEPTH),
    "tuple_laughs": (b"\x80\x02)q\x00" + b"".join(
        b"h" + bytes([i]) + b"h" + bytes([i]) + b"\x86q" + bytes([i + 1]) for i in range(60))
        + b".", H.DEPTH),
    "dup": (b"\x80\x02]2a.", H.DEPTH),
    "newobj": (b"\x80\x02" + _g("numpy", "ndarray") + b")\x81.", "NEWOBJ"),
    "next_buffer": (b"\x80\x05\x97.", "out-of-band"),
    "persid": (b"\x80\x02Pabc\n.", "persistent"),
    "ext1": (b"\x80\x02\x82\x01.", "extension"),
    "huge_int": (b"\x80\x02\x8a\xff" + b"\x7f" * 255 + b".", "more than 64 bits"),
    "complex_dtype": (pickle.dumps(np.array([1j]), protocol=2), "dtype 'c16'"),
    "set": (pickle.dumps({1, 2}, protocol=2), "__builtin__.set"),
    "set_p4": (pickle.dumps({1, 2}, protocol=4), "holds a set"),
    "truncated": (pickle.dumps(_real_gnd(), protocol=2)[:300], "EOFError"),
    "truncated_p5": (pickle.dumps(_real_gnd(), protocol=5)[:200], "truncated"),
    "empty": (b"", "EOFError"),
    "not_a_pickle": (b"PNG\r\n\x1a\n garbage", "UnpicklingError"),
    "unknown_opcode": (b"\x80\x02\xff.", "invalid load key"),
    "os_system": (pickle.dumps({"gnd": [_System()]}, protocol=2), "posix.system"),
}
ONE_MB = H.one_megabyte_cases()
CORPUS = {**HOSTILE, **ONE_MB}


def _children_cpu() -> float:
    usage = resource.getrusage(resource.RUSAGE_CHILDREN)
    return usage.ru_utime + usage.ru_stime


@pytest.mark.parametrize("case", list(CORPUS))
def test_hostile_pickles_are_refused_in_one_line_within_time(tmp_path, case):
    """A ValueError of one line naming the file and its own reason, within 3 CPU seconds
    of the child and of this thread (a child's start, with numpy, takes ~0.15 s; the
    worst 1 MiB flood 0.6 s on a loaded CI machine)."""
    data, phrase = CORPUS[case]
    path = tmp_path / "gnd_hostile.pkl"
    path.write_bytes(data)
    started, children = time.thread_time(), _children_cpu()
    peak_before = resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss
    with pytest.raises(ValueError) as info:
        _read_named(path)
    elapsed = time.thread_time() - started + _children_cpu() - children
    message = str(info.value)
    assert "\n" not in message and message.startswith(f"{path}: "), message
    assert phrase in message, (case, message)
    budget = timing.budget(3.0)
    assert elapsed < budget, f"{case}: {elapsed:.2f} s (budget {budget:.2f} s)"
    # The child's memory limit held. ru_maxrss of the children is the largest of every
    # child this worker ever waited for (other tests' training runs included), so only a
    # new peak is the sandbox's, and a new peak must stay under its limit. A child
    # started by vfork carries this process's own peak RSS into its figure until it
    # execs (Linux records the shared address space's high-water mark at exec), so a
    # new peak up to this worker's own is not the child's either.
    peak = resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss
    own = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    assert (peak == peak_before or peak <= own
            or peak * 1024 < pickle_sandbox.MEMORY_BYTES), (case, peak, own)


def test_attack_sizes_are_what_they_claim():
    assert len(HOSTILE["object_array"][0]) < 200 and len(HOSTILE["bytes_1gib"][0]) < 70
    floods = {**H.floods(), **H.memo_abuse()}
    big = [len(data) for case, (data, _) in floods.items() if "laughs" not in case]
    assert min(big) > 350_000 and max(big) <= H.SIZE
    assert sum(len(d) >= H.SIZE - 16 for d, _ in H.floods().values()) == len(H.floods())


@pytest.mark.parametrize("child, phrase", [
    ("import os, signal; os.kill(os.getpid(), signal.SIGKILL)", "killed by SIGKILL"),
    ("import time; time.sleep(60)", "the reader was stopped"),
    ("import sys; sys.stderr.write('warning\\nthe reason'); sys.exit(1)", "the reason"),
])
def test_a_child_that_dies_hangs_or_fails_is_one_line(monkeypatch, child, phrase):
    """What happens to the child stays there: the caller gets one line, and a hang ends
    at the wall-clock limit."""
    monkeypatch.setattr(pickle_sandbox, "_CHILD", [sys.executable, "-c", child])
    monkeypatch.setattr(pickle_sandbox, "WALL_SECONDS", 2)
    started = time.perf_counter()
    with pytest.raises(UnsafePickleError) as info:
        read_pickle(b"\x80\x02N.", "gnd_x.pkl")
    message = str(info.value)
    assert message.startswith("gnd_x.pkl: refusing this pickle: ") and "\n" not in message
    assert phrase in message, message
    assert time.perf_counter() - started < 30


def test_the_child_runs_under_its_limits():
    code = ("import resource; from tfaploss.pipelines.pickle_sandbox import "
            "limit_this_process; limit_this_process(); print([resource.getrlimit(r)[0] "
            "for r in (resource.RLIMIT_AS, resource.RLIMIT_CPU, resource.RLIMIT_CORE)])")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         check=True, cwd=REPO_ROOT).stdout
    assert json.loads(out) == [pickle_sandbox.MEMORY_BYTES, pickle_sandbox.CPU_SECONDS, 0]
    with pytest.raises(UnsafePickleError, match="more than 16777216 bytes"):
        read_pickle(bytes(pickle_sandbox.MAX_BYTES + 1), "gnd_big.pkl")  # no child started


_BATCH = r"""
import json, sys
from tfaploss.pipelines.pickle_sandbox import limit_this_process, loads_plain
from tfaploss.evaluation.revisited import check_revisited_gnd
limit_this_process()
out = {}
for path in sys.argv[1:]:
    try:
        check_revisited_gnd(loads_plain(open(path, "rb").read()), path)
        out[path] = "loaded"
    except Exception as err:
        out[path] = type(err).__name__ + ": " + str(err)
print("RESULT" + json.dumps(out))
"""


def test_mutated_real_pickles_never_crash(tmp_path):
    """Random byte flips, cuts and splices of real gnd pickles, read the child's way
    under the child's limits in one process: each loads or raises; none crashes it."""
    rng = random.Random(1234)
    sources = [pickle.dumps(_real_gnd(), protocol=p) for p in (2, 4, 5)]
    sources.append(_numpy1_names(sources[0]))
    paths = []
    for i in range(400):
        data = bytearray(rng.choice(sources))
        for _ in range(rng.randint(1, 4)):
            pos = rng.randrange(len(data))
            action = rng.random()
            if action < 0.6:
                data[pos] = rng.randrange(256)
            elif action < 0.8:
                del data[pos:pos + rng.randint(1, 8)]
            else:
                data[pos:pos] = bytes(rng.randrange(256) for _ in range(rng.randint(1, 8)))
        path = tmp_path / f"gnd_mut{i}.pkl"
        path.write_bytes(bytes(data))
        paths.append(str(path))
    env = dict(os.environ, PYTHONPATH=REPO_ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""))
    proc = subprocess.run([sys.executable, "-c", _BATCH, *paths], env=env,
                          capture_output=True, text=True, timeout=600, check=False)
    assert proc.returncode == 0, f"reader process died ({proc.returncode}): {proc.stderr[-2000:]}"
    line = next(x for x in proc.stdout.splitlines() if x.startswith("RESULT"))
    results = json.loads(line[len("RESULT"):])
    assert sorted(results) == sorted(paths)
    refused = [r for r in results.values() if r != "loaded"]
    assert len(refused) > 200  # the mutations do reach the checks


# ---------------------------------------------------------------------------------------
# The bounds and the allow-list, on in-house pickles
# ---------------------------------------------------------------------------------------

def test_bounds_are_enforced(monkeypatch):
    data = pickle.dumps({"a": list(range(100)), "b": ["xy"] * 3}, protocol=2)
    assert loads_plain(data)["a"] == list(range(100))
    for bound, value in (("MAX_ITEMS", 50), ("MAX_TEXT", 5)):
        with monkeypatch.context() as patch:
            patch.setattr(pickle_sandbox, bound, value)
            with pytest.raises(UnsafePickleError, match="a shared value counts"):
                loads_plain(data)
    arrays = pickle.dumps([np.zeros(100, dtype=np.int64)] * 2, protocol=2)
    monkeypatch.setattr(pickle_sandbox, "MAX_ITEMS", 150)  # one array fits, not twice
    with pytest.raises(UnsafePickleError, match="more than 150 items"):
        loads_plain(arrays)
    deep = pickle.dumps([[[[1]]]], protocol=2)
    monkeypatch.setattr(pickle_sandbox, "MAX_DEPTH", 4)
    assert loads_plain(deep) == [[[[1]]]]
    monkeypatch.setattr(pickle_sandbox, "MAX_DEPTH", 3)
    with pytest.raises(UnsafePickleError, match="nested more than 3"):
        loads_plain(deep)


def test_a_full_size_ground_truth_fits_well_inside_the_bounds(monkeypatch):
    """rparis6k's size, with a margin below every bound (the MAX_* comments)."""
    truth = H.realistic_gnd()
    data = pickle.dumps(truth, protocol=4)
    for bound, value in (("MAX_ITEMS", 100_000), ("MAX_TEXT", 4 << 20), ("MAX_DEPTH", 6)):
        monkeypatch.setattr(pickle_sandbox, bound, value)
    assert len(data) < pickle_sandbox.MAX_BYTES // 8
    assert loads_plain(data) == _as_lists(truth)


@pytest.mark.parametrize("case", list(H.shape_cases()))
def test_array_shapes_are_refused_before_numpy_sees_them(case, monkeypatch):
    data = H.shape_cases()[case]

    def numpy_saw_it(*args, **kwargs):
        raise AssertionError(f"numpy was handed the array of {case}")

    monkeypatch.setattr(np, "frombuffer", numpy_saw_it)  # the reader's one way to numpy
    with pytest.raises(UnsafePickleError, match="array shape"):
        loads_plain(data)


@pytest.mark.parametrize("case", list(H.dtype_cases()))
def test_dtypes_a_ground_truth_never_holds_are_refused(case):
    with pytest.raises(UnsafePickleError, match="numpy dtype"):
        loads_plain(H.dtype_cases()[case])


GND_DTYPES = ["<i4", "<i8", "<f4", "<f8", ">i8", "<u4", "|b1"]


@pytest.mark.parametrize("protocol", [2, 3, 4, 5])
def test_zero_d_and_every_ground_truth_dtype_load(protocol):
    """int32/int64 index arrays (empty too), float32/float64 boxes, 0-d arrays (one
    value), as pickled by numpy 2 and, renamed, numpy 1."""
    values = {d: np.arange(5).astype(d) for d in GND_DTYPES}
    values.update({f"empty {d}": np.array([], dtype=d) for d in GND_DTYPES})
    values.update({f"0-d {d}": np.array(7, dtype=d) for d in GND_DTYPES})
    values["2-D f4"] = np.arange(8, dtype=np.float32).reshape(2, 4)
    data = pickle.dumps(values, protocol=protocol)
    for got in (loads_plain(data), loads_plain(_numpy1_names(data))):
        assert got == _as_lists(values)
        assert got["0-d <i8"] == [7] and got["0-d |b1"] == [True]


def test_zero_d_and_shared_arrays_pass_the_structure_check():
    easy = np.array([0, 2], dtype=np.int32)
    truth = {"imlist": ["a", "b", "c"], "qimlist": ["q", "r"],
             "gnd": [{"easy": easy, "hard": np.array(1), "junk": np.array([], np.int64),
                      "bbx": np.array([0.0, 1, 2, 3], np.float32)},
                     {"easy": easy, "hard": np.array(1), "junk": [], "bbx": [0, 1, 2, 3]}]}
    data = pickle.dumps(truth, protocol=2)  # `easy` is pickled once, then referenced
    got = check_revisited_gnd(loads_plain(data))
    assert got == check_revisited_gnd(pickle.loads(data))
    assert got["gnd"][0] == {"easy": [0, 2], "hard": [1], "junk": [],
                             "bbx": [0.0, 1.0, 2.0, 3.0]}


class _Call:
    """Pickles as ``func(*args)`` (then ``BUILD state``): any call the reader allows,
    with any arguments."""

    def __init__(self, func, args, state=None):
        self.func, self.args, self.state = func, args, state

    def __reduce__(self):
        return (self.func, self.args) if self.state is None else (self.func, self.args,
                                                                  self.state)


def test_a_shared_array_where_a_scalar_belongs_is_refused():
    """A memo reference may name a finished array; placed where a shape, a type code,
    an order, a dtype code or an encoding belongs, it is refused, not compared (the state's
    version is not read at all)."""
    import _codecs

    a = np.arange(3)
    i8 = np.dtype("<i8")
    calls = {
        "reconstruct shape": _Call(H._RECONSTRUCT, (np.ndarray, a, b"b")),
        "reconstruct typecode": _Call(H._RECONSTRUCT, (np.ndarray, (0,), a)),
        "array state shape": _Call(H._RECONSTRUCT, (np.ndarray, (0,), b"b"),
                                   (1, a, i8, False, bytes(8))),
        "frombuffer order": _Call(H._FROMBUFFER, (bytes(8), i8, (1,), a)),
        "encode encoding": _Call(_codecs.encode, ("x", a)),
        "dtype code": _Call(np.dtype, (a, False, True)),
    }
    for name, call in calls.items():
        with pytest.raises(UnsafePickleError, match=".") as info:
            loads_plain(pickle.dumps([a, call], protocol=2))
        assert "\n" not in str(info.value), name


# ---------------------------------------------------------------------------------------
# Ground-truth structure, and the JSON evaluation reads
# ---------------------------------------------------------------------------------------

def _entry(**change):
    entry = {"easy": np.array([0, 1]), "hard": np.array([2]), "junk": [], "bbx": [0.0, 0, 5, 5]}
    entry.update(change)
    return {k: v for k, v in entry.items() if v is not _DROP}


_DROP = object()

BAD_STRUCTURES = {
    "gnd_entry_int": ({"imlist": ["a"], "gnd": [5]}, "'gnd'[0] is int"),
    "gnd_entry_none": ({"gnd": [None]}, "'gnd'[0] is None"),
    "bbx_strings": ({"gnd": [_entry(bbx=["1", "2", "3", "4"])]}, "'gnd'[0]['bbx']"),
    "bbx_three": ({"gnd": [_entry(bbx=[1.0, 2.0, 3.0])]}, "'gnd'[0]['bbx']"),
    "bbx_bool_array": ({"gnd": [_entry(bbx=np.ones(4, bool))]}, "'gnd'[0]['bbx']"),
    "easy_missing": ({"gnd": [_entry(easy=_DROP)]}, "has no 'easy'"),
    "easy_float_array": ({"gnd": [_entry(easy=np.array([0.5]))]}, "'gnd'[0]['easy']"),
    "easy_2d_array": ({"gnd": [_entry(easy=np.zeros((2, 2), int))]}, "'gnd'[0]['easy']"),
    "easy_strings": ({"gnd": [_entry(easy=["0"])]}, "'gnd'[0]['easy']"),
    "junk_out_of_range": ({"imlist": ["a", "b", "c"], "gnd": [_entry(junk=[3])]},
                          "'gnd'[0]['junk'] holds index 3"),
    "negative_index": ({"gnd": [_entry(hard=[-1])]}, "'gnd'[0]['hard'] holds index -1"),
    "gnd_not_list": ({"gnd": {"a": 1}}, "'gnd' is dict"),
    "no_gnd": ({"imlist": []}, "no 'gnd' key"),
    "top_list": ([1, 2], "top level is list"),
    "imlist_int": ({"imlist": ["a", 3], "gnd": []}, "'imlist'[1] is int"),
    "count_mismatch": ({"qimlist": ["q1", "q2"], "gnd": [_entry()]}, "has 1 entries for 2"),
}


@pytest.mark.parametrize("case", sorted(BAD_STRUCTURES))
def test_wrong_structure_names_file_and_key(case):
    payload, phrase = BAD_STRUCTURES[case]
    with pytest.raises(ValueError) as info:
        check_revisited_gnd(loads_plain(pickle.dumps(payload, protocol=2)), "gnd_bad.pkl")
    assert "gnd_bad.pkl" in str(info.value) and phrase in str(info.value)


def test_json_ground_truth_errors_name_the_file(tmp_path):
    deep = tmp_path / "gnd_deep.json"
    deep.write_text("[" * 200_000 + "]" * 200_000)
    latin = tmp_path / "gnd_latin.json"
    latin.write_bytes(b'{"gnd": [], "imlist": ["caf\xe9"]}')
    bad = tmp_path / "gnd_bad.json"
    bad.write_text('{"gnd": [{"easy": [0], "hard": [], "junk": [], "bbx": [1, "x", 2, 3]}]}')
    for path, phrase in ((deep, "RecursionError"), (latin, "UnicodeDecodeError"),
                         (bad, "'gnd'[0]['bbx']")):
        with pytest.raises(ValueError) as info:
            load_revisited_gnd(str(path))
        assert str(path) in str(info.value) and phrase in str(info.value), info.value
    good = tmp_path / "gnd_good.json"
    good.write_text(json.dumps({"imlist": ["a", "b"], "qimlist": ["q"],
                                "gnd": [{"easy": [1], "hard": [], "junk": [0],
                                         "bbx": [1, 2, 3, 4]}]}))
    assert load_revisited_gnd(str(good))["gnd"] == [
        {"easy": [1], "hard": [], "junk": [0], "bbx": [1.0, 2.0, 3.0, 4.0]}]


def test_json_round_trip_equals_the_pickle(tmp_path):
    """The conversion the revisited job does (sandbox -> checked -> JSON) reads back,
    through evaluation's JSON-only loader, as what pickle itself reads."""
    truth = H.realistic_gnd(num_db=500, num_queries=12, bbx_array=True)
    pkl = tmp_path / "gnd_p2.pkl"
    pkl.write_bytes(pickle.dumps(truth, protocol=2))
    converted = tmp_path / "gnd_p2.json"
    converted.write_text(json.dumps(_read_named(pkl)))
    expected = check_revisited_gnd(pickle.loads(pkl.read_bytes()))
    assert load_revisited_gnd(str(converted)) == expected
    assert expected["gnd"][0]["easy"] == [int(i) for i in truth["gnd"][0]["easy"]]
