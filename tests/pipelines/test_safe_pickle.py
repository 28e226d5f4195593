"""The restricted ground-truth pickle reader against real-shaped and hostile pickles.

Real revisited gnd files are pickled dicts of lists of dicts holding numpy integer
arrays and float boxes, written by numpy 1 (``numpy.core``) or numpy 2
(``numpy._core``) under protocols 2..5. Hostile files are run in a subprocess: a
regression there would be a segfault or a memory blow-up, not a failed assertion.
The attacks on the total work (floods, memo abuse, deep nesting, ~1 MiB each) and on
array shapes and dtypes come from :mod:`tests.reliability.hostile_pickles`, class by class.
"""

import gc
import json
import os
import pickle
import pickletools
import random
import struct
import subprocess
import sys
import threading
import time
import tracemalloc
import warnings

import numpy as np
import pytest

from tests.reliability import hostile_pickles as H
from tests.support import timing
from tfaploss.evaluation import load_revisited_gnd
from tfaploss.evaluation.revisited import check_revisited_gnd
from tfaploss.pipelines.safe_pickle import (
    PickleLimits,
    UnsafePickleError,
    safe_load_path,
    safe_loads,
)


def _load_pickled(path):
    """What the revisited job does with a gnd pickle: the restricted reader, then the
    structure check (``tfaploss.pipelines.revisited.read_pickled_ground_truth`` without Beam)."""
    return check_revisited_gnd(safe_load_path(str(path)), str(path))

REPO_ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


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
    got = safe_loads(data)
    assert got.keys() == expected.keys()
    assert got["imlist"] == expected["imlist"] and got["qimlist"] == expected["qimlist"]
    for g, e in zip(got["gnd"], expected["gnd"], strict=True):
        for key in ("easy", "hard", "junk"):
            assert g[key].dtype == e[key].dtype == np.int64
            np.testing.assert_array_equal(g[key], e[key])
            assert g[key].flags.writeable  # a copy, not a view of the file's bytes
        assert g["bbx"] == e["bbx"]


def test_reads_every_numeric_dtype_layout_and_scalar():
    values = {"i4be": np.arange(6, dtype=">i4").reshape(2, 3),
              "fortran": np.asfortranarray(np.arange(6.0).reshape(2, 3)),
              "u1": np.array([0, 255], dtype=np.uint8), "b1": np.array([True, False]),
              "f2": np.array([0.5], dtype=np.float16), "scalar": np.int64(-3),
              "f8scalar": np.float64(0.25), "tuple": (1, "x", None, True)}
    for protocol in range(6):
        got = safe_loads(pickle.dumps(values, protocol=protocol))
        for key in ("i4be", "fortran", "u1", "b1", "f2"):
            assert got[key].dtype == values[key].dtype, (protocol, key)
            np.testing.assert_array_equal(got[key], values[key])
        assert got["fortran"].flags.f_contiguous
        assert got["scalar"] == -3 and type(got["scalar"]) is int
        assert got["f8scalar"] == 0.25 and type(got["f8scalar"]) is float
        assert got["tuple"] == (1, "x", None, True)


# ---------------------------------------------------------------------------------------
# Hostile pickles
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


HOSTILE = {
    # the 168-byte pointer trick, at top level and inside a gnd entry
    "object_array": _object_pointer_array(),
    "object_array_in_gnd": _gnd_with(_object_pointer_array()[2:-1]),
    # an int64 dtype whose state claims it holds objects (numpy internal errors before)
    "dtype_object_flags": _object_pointer_array("i8", 63),
    # 1 GiB from a tiny file via bytes()/bytearray()
    "bytes_1gib": b"\x80\x02" + _g("__builtin__", "bytes") + b"J\x00\x00\x00@\x85R.",
    "bytearray_1gib": b"\x80\x02" + _g("__builtin__", "bytearray") + b"J\x00\x00\x00@\x85R.",
    # a declared 1 TiB bytes object in a 20-byte file
    "binbytes8_1tib": b"\x80\x04\x8e" + struct.pack("<Q", 1 << 40) + b"xxxx.",
    # an array declaring 2**40 elements over 8 bytes of data
    "array_shape_lie": pickle.dumps(np.array([7], dtype=np.int64), protocol=2).replace(
        b"K\x01\x85", b"\x8a\x06\x00\x00\x00\x00\x00\x01\x85"),
    "memo_index_4g": b"\x80\x02Nr\xff\xff\xff\xff.",
    "deep_200k": b"\x80\x02" + b"(" * 200_000 + b"l" * 200_000 + b".",
    "deep_200k_in_gnd": _gnd_with(b"(" * 200_000 + b"l" * 200_000),
    "self_cycle": b"\x80\x02]q\x00h\x00a.",
    "tuple_laughs": b"\x80\x02)q\x00" + b"".join(
        b"h" + bytes([i]) + b"h" + bytes([i]) + b"\x86q" + bytes([i + 1]) for i in range(60))
    + b".",
    "dup": b"\x80\x02]2a.",
    "newobj": b"\x80\x02" + _g("numpy", "ndarray") + b")\x81.",
    "next_buffer": b"\x80\x05\x97.",
    "persid": b"\x80\x02Pabc\n.",
    "ext1": b"\x80\x02\x82\x01.",
    "huge_int": b"\x80\x02\x8a\xff" + b"\x7f" * 255 + b".",
    "complex_dtype": pickle.dumps(np.array([1j]), protocol=2),
    "set": pickle.dumps({1, 2}, protocol=2),
    "truncated": pickle.dumps(_real_gnd(), protocol=2)[:300],
    "truncated_p5": pickle.dumps(_real_gnd(), protocol=5)[:200],
    "empty": b"",
    "not_a_pickle": b"PNG\r\n\x1a\n garbage",
    "unknown_opcode": b"\x80\x02\xff.",
}


class _System:
    def __reduce__(self):
        return (os.system, ("echo pwned",))


HOSTILE["os_system"] = pickle.dumps({"gnd": [_System()]}, protocol=2)

# Each hostile file gets a ValueError naming the file; the second item is a phrase the
# message must hold, so each case is refused for its own reason.
EXPECTED = {
    "object_array": "dtype 'O8'", "object_array_in_gnd": "dtype 'O8'",
    "dtype_object_flags": "not that of a plain numeric type",
    "bytes_1gib": "arguments", "bytearray_1gib": "builtins.bytearray",
    "binbytes8_1tib": "truncated", "array_shape_lie": "array shape",
    "os_system": "system", "memo_index_4g": "top level",
    "deep_200k": "nested more than 32", "deep_200k_in_gnd": "nested more than 32",
    "self_cycle": "second reference to a list", "tuple_laughs": "second reference to a tuple",
    "dup": "DUP", "newobj": "NEWOBJ", "next_buffer": "NEXT_BUFFER", "persid": "PERSID",
    "ext1": "EXT1", "huge_int": "bits", "complex_dtype": "dtype 'c16'",
    "set": "builtins.set", "truncated": "truncated", "truncated_p5": "truncated",
    "empty": "truncated", "not_a_pickle": "refusing", "unknown_opcode": "truncated",
}

_RUNNER = r"""
import json, sys
from tfaploss.pipelines.safe_pickle import safe_load_path
from tfaploss.evaluation.revisited import check_revisited_gnd
out = {}
for path in sys.argv[1:]:
    try:
        check_revisited_gnd(safe_load_path(path), path)
        out[path] = ["loaded", ""]
    except Exception as err:
        out[path] = [type(err).__name__ + ("/ValueError" if isinstance(err, ValueError)
                                           else ""), str(err)]
print("RESULT" + json.dumps(out))
"""


def _load_in_subprocess(paths):
    env = dict(os.environ, PYTHONPATH=REPO_ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""))
    proc = subprocess.run([sys.executable, "-c", _RUNNER, *map(str, paths)], env=env,
                          capture_output=True, text=True, timeout=600, check=False)
    assert proc.returncode == 0, f"loader process died ({proc.returncode}): {proc.stderr[-2000:]}"
    line = next(x for x in proc.stdout.splitlines() if x.startswith("RESULT"))
    return json.loads(line[len("RESULT"):])


def test_hostile_pickles_are_refused_in_a_subprocess(tmp_path):
    assert len(HOSTILE["object_array"]) < 200 and len(HOSTILE["bytes_1gib"]) < 70
    paths = {}
    for name, data in HOSTILE.items():
        paths[name] = tmp_path / f"gnd_{name}.pkl"
        paths[name].write_bytes(data)
    results = _load_in_subprocess(paths.values())
    assert set(results) == {str(p) for p in paths.values()}
    for name, path in paths.items():
        kind, message = results[str(path)]
        assert kind.endswith("/ValueError"), (name, kind, message)
        assert str(path) in message, (name, message)
        assert EXPECTED[name] in message, (name, message)


def test_mutated_real_pickles_never_crash(tmp_path):
    """Random byte flips, cuts and splices of real gnd pickles: each loads or is refused
    with a ValueError naming the file; the process survives all of them."""
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
        paths.append(path)
    results = _load_in_subprocess(paths)
    kinds = {kind for kind, _ in results.values()}
    assert kinds <= {"loaded", "UnsafePickleError/ValueError", "ValueError/ValueError"}, kinds
    for path, (kind, message) in results.items():
        if kind != "loaded":
            assert path in message, message
    refused = sum(kind != "loaded" for kind, _ in results.values())
    assert refused > 200  # the mutations do reach the checks


def test_limits_are_enforced():
    data = pickle.dumps({"a": list(range(100))}, protocol=2)
    with pytest.raises(UnsafePickleError, match="container and array elements"):
        safe_loads(data, limits=PickleLimits(max_items=50))
    with pytest.raises(UnsafePickleError, match="bytes, more than"):
        safe_loads(data, limits=PickleLimits(max_bytes=100))
    arrays = pickle.dumps([np.zeros(100, dtype=np.int64)] * 2, protocol=2)
    with pytest.raises(UnsafePickleError, match="bytes of strings and array data"):
        safe_loads(arrays, limits=PickleLimits(max_alloc_bytes=1000))
    deep = pickle.dumps([[[[1]]]], protocol=2)
    assert safe_loads(deep, limits=PickleLimits(max_depth=4)) == [[[[1]]]]
    with pytest.raises(UnsafePickleError, match="nested more than 3"):
        safe_loads(deep, limits=PickleLimits(max_depth=3))


# ---------------------------------------------------------------------------------------
# Ground-truth structure
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
    "easy_missing": ({"gnd": [_entry(easy=_DROP)]}, "has no 'easy'"),
    "easy_float_array": ({"gnd": [_entry(easy=np.array([0.5]))]}, "'gnd'[0]['easy']"),
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
def test_wrong_structure_names_file_and_key(tmp_path, case):
    payload, phrase = BAD_STRUCTURES[case]
    path = tmp_path / f"gnd_{case}.pkl"
    path.write_bytes(pickle.dumps(payload, protocol=2))
    with pytest.raises(ValueError) as info:
        _load_pickled(path)
    assert str(path) in str(info.value) and phrase in str(info.value)


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


# ---------------------------------------------------------------------------------------
# Bounds on the total work: crafted ~1 MiB inputs, class by class
# ---------------------------------------------------------------------------------------

ONE_MB = H.one_megabyte_cases()


def _cpu_seconds_since(started: float) -> float:
    """CPU seconds this thread spent since ``time.thread_time()`` gave ``started``.

    The bound is on the work an input causes, so it is timed in the reader's own CPU
    time: on CI's loaded 2-core machine, wall time once read 2.21 s for a refusal that
    costs 0.01 s of CPU, while the thread waited for the other test workers."""
    return time.thread_time() - started


@pytest.mark.parametrize("case", list(ONE_MB))
def test_total_work_attacks_are_refused_quickly(case):
    """Opcode floods, memo abuse and deep nesting: a ValueError naming the bound, within
    2 CPU seconds (each takes at most 0.06 s on this machine)."""
    data, phrase = ONE_MB[case]
    started = time.thread_time()
    with pytest.raises(UnsafePickleError) as info:
        safe_loads(data, name="gnd_hostile.pkl")
    elapsed = _cpu_seconds_since(started)
    assert isinstance(info.value, ValueError)
    assert "gnd_hostile.pkl" in str(info.value) and phrase in str(info.value), info.value
    budget = timing.budget(2.0)
    assert elapsed < budget, f"{case}: {elapsed:.2f} s (budget {budget:.2f} s)"


@pytest.mark.slow
def test_total_work_attacks_use_bounded_memory():
    """Peak Python + numpy allocation of each 1 MiB attack (tracemalloc)."""
    peaks = {}
    for case, (data, _) in ONE_MB.items():
        tracemalloc.start()
        try:
            with pytest.raises(UnsafePickleError):
                safe_loads(data)
            peaks[case] = tracemalloc.get_traced_memory()[1]
        finally:
            tracemalloc.stop()
    worst = max(peaks, key=peaks.get)
    assert peaks[worst] < 128 << 20, (worst, peaks[worst])


def test_attack_sizes_are_what_they_claim():
    floods = {**H.floods(), **H.memo_abuse()}
    big = [len(data) for case, (data, _) in floods.items() if "laughs" not in case]
    assert min(big) > 350_000 and max(big) <= H.SIZE
    assert sum(len(d) >= H.SIZE - 16 for d, _ in H.floods().values()) == len(H.floods())


@pytest.mark.parametrize("case", list(H.shape_cases()))
def test_array_shapes_are_refused_before_numpy_sees_them(case, monkeypatch):
    data = H.shape_cases()[case]

    def numpy_saw_it(*args, **kwargs):
        raise AssertionError(f"numpy was handed the array of {case}")

    monkeypatch.setattr(np, "frombuffer", numpy_saw_it)  # the reader's one way to numpy
    with pytest.raises(UnsafePickleError, match="array shape"):
        safe_loads(data)


@pytest.mark.parametrize("case", list(H.dtype_cases()))
def test_dtypes_a_ground_truth_never_holds_are_refused(case):
    with pytest.raises(UnsafePickleError, match="numpy dtype"):
        safe_loads(H.dtype_cases()[case])


GND_DTYPES = ["<i4", "<i8", "<f4", "<f8", ">i8", "<u4", "|b1"]


@pytest.mark.parametrize("protocol", [2, 3, 4, 5])
def test_zero_d_arrays_load(protocol):
    values = [np.array(7, dtype=d) for d in GND_DTYPES]
    data = pickle.dumps(values, protocol=protocol)
    for got in (safe_loads(data), safe_loads(_numpy1_names(data))):
        for g, v in zip(got, values, strict=True):
            assert g.shape == () and g.dtype == v.dtype and g == v


@pytest.mark.parametrize("protocol", [2, 3, 4, 5])
def test_every_ground_truth_dtype_loads(protocol):
    """int32/int64 index arrays (empty too) and float32/float64 boxes, as pickled."""
    values = {d: np.arange(5).astype(d) for d in GND_DTYPES}
    values.update({f"empty {d}": np.array([], dtype=d) for d in GND_DTYPES})
    values["2-D f4"] = np.arange(8, dtype=np.float32).reshape(2, 4)
    got = safe_loads(pickle.dumps(values, protocol=protocol))
    for key, v in values.items():
        assert got[key].dtype == v.dtype and got[key].shape == v.shape, key
        np.testing.assert_array_equal(got[key], v)


REALISTIC = [(p, idx, bbx_array) for p in (2, 3, 4, 5)
             for idx, bbx_array in ((np.int64, False), (np.int32, True))]


@pytest.mark.parametrize("protocol,index_dtype,bbx_array", REALISTIC,
                         ids=[f"p{p}-{np.dtype(i).name}-{'bbxarray' if b else 'bbxlist'}"
                              for p, i, b in REALISTIC])
def test_a_full_size_realistic_ground_truth_loads(protocol, index_dtype, bbx_array):
    truth = H.realistic_gnd(index_dtype=index_dtype, bbx_array=bbx_array)
    data = pickle.dumps(truth, protocol=protocol)
    started = time.thread_time()
    got = safe_loads(data)
    assert _cpu_seconds_since(started) < timing.budget(2.0)
    assert got["imlist"] == truth["imlist"] and got["qimlist"] == truth["qimlist"]
    for g, e in zip(got["gnd"], truth["gnd"], strict=True):
        for key in ("easy", "hard", "junk"):
            assert g[key].dtype == e[key].dtype
            np.testing.assert_array_equal(g[key], e[key])
        np.testing.assert_array_equal(g["bbx"], e["bbx"])
    # ... and then a margin below every default bound (the table in the docstring)
    safe_loads(data, limits=PickleLimits(max_opcodes=40_000, max_stack=3_000,
                                         max_memo=20_000, max_depth=6, max_items=100_000,
                                         max_alloc_bytes=4 << 20))


def test_json_round_trip_equals_the_pickle(tmp_path):
    """The conversion the revisited job does (restricted reader -> checked -> JSON)
    reads back, through evaluation's JSON-only loader, as what pickle itself reads."""
    truth = H.realistic_gnd(num_db=500, num_queries=12, bbx_array=True)
    for protocol in (2, 5):
        pkl = tmp_path / f"gnd_p{protocol}.pkl"
        pkl.write_bytes(pickle.dumps(truth, protocol=protocol))
        converted = tmp_path / f"gnd_p{protocol}.json"
        converted.write_text(json.dumps(_load_pickled(pkl)))
        expected = check_revisited_gnd(pickle.loads(pkl.read_bytes()))
        assert load_revisited_gnd(str(converted)) == expected
        assert expected["gnd"][0]["easy"] == [int(i) for i in truth["gnd"][0]["easy"]]


def test_new_limits_are_enforced():
    data = pickle.dumps({"a": list(range(100)), "b": ["x"] * 3}, protocol=2)
    assert safe_loads(data)["a"] == list(range(100))
    for limits, phrase in ((PickleLimits(max_opcodes=50), "more than 50 opcodes"),
                           (PickleLimits(max_stack=20), "more than 20 objects"),
                           (PickleLimits(max_memo=2), "more than 2 memo entries"),
                           (PickleLimits(max_alloc_bytes=3), "bytes of strings")):
        with pytest.raises(UnsafePickleError, match=phrase):
            safe_loads(data, limits=limits)


@pytest.mark.slow
def test_refusals_are_value_errors_not_recursion_or_memory_errors():
    """Even with the depth bound lifted, nesting ends in a ValueError."""
    deep = b"\x80\x02" + b"]" * 30_000 + b"a" * 29_999 + b"."
    with pytest.raises(UnsafePickleError):
        safe_loads(deep, limits=PickleLimits(max_depth=10 ** 9))


def test_zero_d_and_shared_arrays_pass_the_structure_check():
    easy = np.array([0, 2], dtype=np.int32)
    truth = {"imlist": ["a", "b", "c"], "qimlist": ["q", "r"],
             "gnd": [{"easy": easy, "hard": np.array(1), "junk": np.array([], np.int64),
                      "bbx": np.array([0.0, 1, 2, 3], np.float32)},
                     {"easy": easy, "hard": np.array(1), "junk": [], "bbx": [0, 1, 2, 3]}]}
    data = pickle.dumps(truth, protocol=2)  # `easy` is pickled once, then referenced
    got = check_revisited_gnd(safe_loads(data))
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
    an order, a version or an encoding belongs, comparing it would raise numpy's own
    "truth value is ambiguous": the reader checks types first (found by fuzzing)."""
    import _codecs

    a = np.arange(3)
    i8 = np.dtype("<i8")
    calls = {
        "reconstruct shape": _Call(H._RECONSTRUCT, (np.ndarray, a, b"b")),
        "reconstruct typecode": _Call(H._RECONSTRUCT, (np.ndarray, (0,), a)),
        "array state version": _Call(H._RECONSTRUCT, (np.ndarray, (0,), b"b"),
                                     (a, (1,), i8, False, bytes(8))),
        "array state fortran": _Call(H._RECONSTRUCT, (np.ndarray, (0,), b"b"),
                                     (1, (1,), i8, a, bytes(8))),
        "frombuffer order": _Call(H._FROMBUFFER, (bytes(8), i8, (1,), a)),
        "encode encoding": _Call(_codecs.encode, ("x", a)),
    }
    for name, call in calls.items():
        data = pickle.dumps([a, call], protocol=2)
        with pytest.raises(UnsafePickleError) as info:
            safe_loads(data, name=f"gnd_{name}.pkl")
        assert f"gnd_{name}.pkl" in str(info.value), (name, info.value)


# ---------------------------------------------------------------------------------------
# The cycle collector: paused during a read, restored as found
# ---------------------------------------------------------------------------------------

@pytest.fixture
def collections_seen():
    """The cycle collections that start inside the reader's loop, with a gen-0 threshold
    of 1, so that any allocation would start one."""
    from tfaploss.pipelines.safe_pickle import _Interpreter

    seen: list[int] = []
    reading = _Interpreter.run.__code__

    def record(phase, info):
        frame = sys._getframe()
        while phase == "start" and frame is not None:
            if frame.f_code is reading:
                seen.append(info["generation"])
                return
            frame = frame.f_back

    thresholds = gc.get_threshold()
    gc.callbacks.append(record)
    gc.set_threshold(1, *thresholds[1:])
    try:
        yield seen
    finally:
        gc.set_threshold(*thresholds)
        gc.callbacks.remove(record)


@pytest.mark.parametrize("case", ["flood EMPTY_LIST", "deep 20k dicts by SETITEM"])
def test_a_read_never_starts_a_collection(case, collections_seen):
    """A flood of containers would otherwise trigger collections, full ones among them,
    each a pass over every object of the process (2.63 CPU s in a CI test worker)."""
    assert gc.isenabled()
    with pytest.raises(UnsafePickleError):
        safe_loads(ONE_MB[case][0], name="gnd_hostile.pkl")
    good = pickle.dumps({"gnd": [{"easy": list(range(500)), "hard": [i, 2]}
                                 for i in range(70)]}, protocol=4)
    assert len(safe_loads(good)["gnd"]) == 70
    assert collections_seen == []
    assert gc.isenabled()


def test_the_collector_is_restored_as_found_by_nested_and_threaded_reads():
    from tfaploss.process_settings import COLLECTOR_OFF

    data = ONE_MB["flood EMPTY_LIST"][0]
    with COLLECTOR_OFF.held():
        with COLLECTOR_OFF.held():
            assert not gc.isenabled()
        assert not gc.isenabled(), "an inner read turned the collector on under an outer one"
    assert gc.isenabled()

    errors = []

    def read():
        for _ in range(5):
            try:
                safe_loads(data)
            except UnsafePickleError:
                pass
            except Exception as err:  # noqa: BLE001 - reported below
                errors.append(err)

    threads = [threading.Thread(target=read) for _ in range(4)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert not errors and gc.isenabled()

    gc.disable()
    try:
        with pytest.raises(UnsafePickleError):
            safe_loads(data)
        assert not gc.isenabled(), "a read turned on a collector its caller had off"
    finally:
        gc.enable()
