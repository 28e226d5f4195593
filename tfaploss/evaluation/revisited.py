"""Revisited Oxford / Paris evaluation (Radenović et al., CVPR 2018).

Each query's ground truth lists ``easy``, ``hard`` and ``junk`` database indices.
The three protocols:

======== =============== ====================
protocol positives        ignored (junk)
======== =============== ====================
easy     easy             junk + hard
medium   easy + hard      junk
hard     hard             junk + easy
======== =============== ====================

Junk images are removed from the ranking *before* positions are counted (a positive
at rank 3 behind one junk image sits at rank 2). AP is the trapezoidal rule of the
authors' ``compute_ap``: with positives at 0-based positions ``r_0 < r_1 < ...`` and
``n`` positives,

    AP = sum_j (1/n) * (P0_j + P1_j) / 2,  P0_j = j / r_j (1 if r_j = 0),
                                           P1_j = (j + 1) / (r_j + 1).

mP@k follows the authors' ``compute_map``: ``kq = min(max position, k)`` (1-based)
and precision ``#{positives at position <= kq} / kq``. Queries without positives
under a protocol are left out of both means.

Rankings are by score, descending, ties broken by database index (lower first).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np

from tfaploss.evaluation.metrics import check_ks

PROTOCOLS = ("easy", "medium", "hard")
_GND_INDEX_KEYS = ("easy", "hard", "junk")  # the index lists of each query's ground truth


def protocol_sets(gnd_entry: dict, protocol: str) -> tuple[np.ndarray, np.ndarray]:
    """``(positives, junk)`` index arrays of one query under ``protocol``."""
    if protocol not in PROTOCOLS:
        raise ValueError(f"`protocol` must be one of {PROTOCOLS}; received {protocol!r}.")
    missing = [k for k in _GND_INDEX_KEYS if k not in gnd_entry]
    if missing:
        raise ValueError(f"ground-truth entry lacks key(s) {missing}; each query needs "
                         "'easy', 'hard' and 'junk' index lists.")
    easy, hard, junk = (np.asarray(gnd_entry[k], dtype=np.int64).reshape(-1)
                        for k in _GND_INDEX_KEYS)
    if protocol == "easy":
        return easy, np.concatenate([junk, hard])
    if protocol == "medium":
        return np.concatenate([easy, hard]), junk
    return hard, np.concatenate([junk, easy])


def trapezoid_ap(positions, num_positives: int) -> float:
    """Radenović's trapezoidal AP from the 0-based, junk-free ``positions`` of the
    positives found (sorted ascending); missing positives contribute 0."""
    pos = np.asarray(positions, dtype=np.float64)
    if num_positives <= 0:
        raise ValueError(f"`num_positives` must be positive; received {num_positives}.")
    j = np.arange(len(pos), dtype=np.float64)
    p0 = np.where(pos == 0, 1.0, j / np.maximum(pos, 1.0))
    p1 = (j + 1.0) / (pos + 1.0)
    return float(np.sum((p0 + p1) / 2.0) / num_positives)


def _junk_free_positions(ranked_row: np.ndarray, positives: np.ndarray, junk: np.ndarray):
    """0-based positions of the positives in ``ranked_row`` after junk removal."""
    in_pos = np.isin(ranked_row, positives)
    in_junk = np.isin(ranked_row, junk) & ~in_pos
    where_pos = np.flatnonzero(in_pos)
    where_junk = np.flatnonzero(in_junk)
    return where_pos - np.searchsorted(where_junk, where_pos)


def _precisions_at(positions: np.ndarray, ks: Sequence[int], all_found: bool) -> np.ndarray:
    pos1 = positions + 1  # 1-based
    # Positives beyond a truncated ranking sit after every returned one.
    max_pos = pos1.max() if (all_found and len(pos1)) else np.inf
    kq = np.minimum(max_pos, np.asarray(ks))
    return (pos1[None, :] <= kq[:, None]).sum(axis=1) / kq


def _evaluate_ranks(ranks: np.ndarray, gnd, protocol: str, ks):
    ks = check_ks(ks)
    if len(gnd) != ranks.shape[0]:
        raise ValueError(f"`gnd` has {len(gnd)} entries but there are {ranks.shape[0]} queries.")
    aps = np.full(len(gnd), np.nan)
    prs = np.full((len(gnd), len(ks)), np.nan)
    for i, entry in enumerate(gnd):
        positives, junk = protocol_sets(entry, protocol)
        positives = np.unique(positives)
        if len(positives) == 0:
            continue  # left out, as in compute_map
        positions = _junk_free_positions(ranks[i], positives, junk)
        aps[i] = trapezoid_ap(positions, len(positives))
        prs[i] = _precisions_at(positions, ks, all_found=len(positions) == len(positives))
    valid = ~np.isnan(aps)
    if not np.any(valid):
        raise ValueError(f"no query has a positive under protocol {protocol!r}.")
    result: dict[str, Any] = {"map": float(aps[valid].mean())}
    for j, k in enumerate(ks):
        result[f"mp@{k}"] = float(prs[valid, j].mean())
    return result, aps


def _rank_scores(scores) -> np.ndarray:
    scores = np.asarray(scores)
    if scores.ndim != 2:
        raise ValueError(f"`scores` must be a (queries x database) matrix; received shape "
                         f"{scores.shape}.")
    return np.argsort(-scores.astype(np.float64), axis=1, kind="stable")


def revisited_map(scores, gnd, protocol: str = "medium", ks=(1, 5, 10)) -> dict:
    """mAP and mP@k of revisited Oxford/Paris under ``protocol``.

    Args:
      scores: (queries x database) similarity matrix, higher is better.
      gnd: per-query dicts with ``easy``, ``hard`` and ``junk`` database indices.
      protocol: ``"easy"``, ``"medium"`` or ``"hard"``.
      ks: cut-offs for mP@k.

    Returns ``{"map": ..., "mp@k": ...}`` (fractions in [0, 1], not percentages).
    Cost: a sort of each query's scores, ``O(Q N log N)``.
    """
    result, _ = _evaluate_ranks(_rank_scores(scores), gnd, protocol, ks)
    return result


def revisited_per_query_ap(scores, gnd, protocol: str = "medium", ranks=None) -> np.ndarray:
    """Per-query AP (NaN where the query has no positive under ``protocol``), from the
    score matrix or from precomputed (possibly truncated) ``ranks``."""
    ranks = _rank_scores(scores) if ranks is None else np.asarray(ranks)
    _, aps = _evaluate_ranks(ranks, gnd, protocol, (1,))
    return aps


def revisited_map_from_ranks(ranks, gnd, protocol: str = "medium", ks=(1, 5, 10),
                             database_size: int | None = None) -> dict:
    """Like :func:`revisited_map` from the top-K database indices of each query.
    Positives not in the top K contribute 0 to AP, so when ``K < database_size``
    ``map`` is a **lower bound** (``"lower_bound": True``); mP@k is exact while the top K
    holds at least k non-junk images.
    """
    ranks = np.asarray(ranks)
    if ranks.ndim != 2:
        raise ValueError(f"`ranks` must be (queries x K); received shape {ranks.shape}.")
    truncated = database_size is None or ranks.shape[1] < int(database_size)
    result, _ = _evaluate_ranks(ranks, gnd, protocol, ks)
    result["lower_bound"] = bool(truncated)
    return result


_MAX_GND_BYTES = 64 << 20


def load_revisited_gnd(path: str) -> dict:
    """Load the JSON ground truth that ``tfaploss.pipelines.revisited`` wrote
    (``gnd_roxford5k.json`` / ``gnd_rparis6k.json``), checked by
    :func:`check_revisited_gnd`: a dict with ``imlist``, ``qimlist`` and ``gnd``.

    Evaluation never unpickles (the published ``gnd_*.pkl`` is untrusted and converted
    once by the revisited job): a pickle raises a ``ValueError`` naming the conversion
    command. Anything unusable raises ``ValueError`` naming the file.
    """
    path = str(path)
    return check_revisited_gnd(_load_json(path), path)


def _pickle_refusal(path: str) -> ValueError:
    name = path.replace("\\", "/").rsplit("/", 1)[-1]
    dataset = next((d for d in ("roxford5k", "rparis6k") if d in name), "roxford5k")
    return ValueError(
        f"{path}: a pickle; evaluation reads the ground truth as JSON only (a downloaded "
        "pickle can run code). Convert it once with `python -m tfaploss.pipelines.revisited "
        f"--input_dir <folder of {name}> --dataset {dataset} --output_dir <out> "
        "--ground_truth_only --expected_sha256 <the published file's SHA-256>` and pass "
        f"<out>/gnd_{dataset}.json (the full revisited job writes that file next to its "
        "records too).")


def _load_json(path: str):
    import json

    import tensorflow as tf

    if path.endswith((".pkl", ".pickle")):
        raise _pickle_refusal(path)
    with tf.io.gfile.GFile(path, "rb") as f:
        raw = f.read(_MAX_GND_BYTES + 1)
    if raw[:1] == b"\x80":  # a pickle's PROTO opcode; JSON text cannot start so
        raise _pickle_refusal(path)
    if len(raw) > _MAX_GND_BYTES:
        raise ValueError(f"{path}: more than {_MAX_GND_BYTES} bytes; not a ground-truth file.")
    try:
        return json.loads(raw.decode("utf-8"))
    except (ValueError, RecursionError) as err:  # bad UTF-8/JSON, absurd nesting
        raise ValueError(f"{path}: not a readable JSON ground-truth file: "
                         f"{type(err).__name__}: {str(err)[:200]}") from None


def check_revisited_gnd(data, source: str = "ground truth") -> dict:
    """Check the structure of a loaded revisited ground truth and return it as plain
    Python data (see :func:`load_revisited_gnd`); ``source`` names it in errors."""
    def fail(key: str, what: str) -> ValueError:
        return ValueError(f"{source}: {key} {what}; a revisited ground truth is a dict "
                          "with 'imlist' and 'qimlist' (lists of names) and 'gnd' (one dict "
                          "per query with 'easy', 'hard', 'junk' index lists and 'bbx').")

    if not isinstance(data, dict) or "gnd" not in data:
        raise fail("the top level", f"is {_kind(data)}" if not isinstance(data, dict)
                   else "has no 'gnd' key")
    names = {}
    for key in ("imlist", "qimlist"):
        value = data.get(key, [])
        if not isinstance(value, (list, tuple)):
            raise fail(f"'{key}'", f"is {_kind(value)}, not a list of names")
        for i, name in enumerate(value):
            if not isinstance(name, str):
                raise fail(f"'{key}'[{i}]", f"is {_kind(name)}, not a name")
        names[key] = list(value)
    entries = data["gnd"]
    if not isinstance(entries, (list, tuple)):
        raise fail("'gnd'", f"is {_kind(entries)}, not a list")
    if names["qimlist"] and len(entries) != len(names["qimlist"]):
        raise fail("'gnd'", f"has {len(entries)} entries for {len(names['qimlist'])} "
                   "queries in 'qimlist'")
    database_size = len(names["imlist"])
    gnd = []
    for i, entry in enumerate(entries):
        where = f"'gnd'[{i}]"
        if not isinstance(entry, dict):
            raise fail(where, f"is {_kind(entry)}, not a dict")
        clean = {}
        for key in _GND_INDEX_KEYS:
            if key not in entry:
                raise fail(where, f"has no {key!r} key")
            clean[key] = _index_list(entry[key], f"{where}[{key!r}]", database_size, fail)
        bbx = entry.get("bbx")
        if bbx is not None:
            clean["bbx"] = _box(bbx, f"{where}['bbx']", fail)
        gnd.append(clean)
    return {"imlist": names["imlist"], "qimlist": names["qimlist"], "gnd": gnd}


def _kind(value) -> str:
    if value is None:
        return "None"
    if isinstance(value, np.ndarray):
        return f"a {value.dtype} array of shape {value.shape}"
    return f"{type(value).__name__} {str(value)[:40]!r}"


def _index_list(value, where, database_size, fail) -> list[int]:
    if isinstance(value, np.ndarray):
        if value.dtype.kind not in "iu" or value.ndim > 1:
            raise fail(where, f"is {_kind(value)}, not a 1-D integer array")
        out = [int(v) for v in value.reshape(-1)]  # a 0-d array is one index
    elif isinstance(value, (list, tuple)):
        if not all(isinstance(v, int) and not isinstance(v, bool) for v in value):
            bad = next(v for v in value if not isinstance(v, int) or isinstance(v, bool))
            raise fail(where, f"holds {_kind(bad)}, not a database index")
        out = list(value)
    else:
        raise fail(where, f"is {_kind(value)}, not a list of database indices")
    bad = [v for v in out if v < 0 or (database_size and v >= database_size)]
    if bad:
        raise fail(where, f"holds index {bad[0]}, outside the database "
                   f"(0..{database_size - 1 if database_size else 'n'})")
    return out


def _box(value, where, fail) -> list[float]:
    if isinstance(value, np.ndarray):
        if value.dtype.kind not in "iuf" or value.shape != (4,):
            raise fail(where, f"is {_kind(value)}, not 4 numbers")
        out = [float(v) for v in value]
    elif isinstance(value, (list, tuple)) and len(value) == 4 and all(
            isinstance(v, (int, float)) and not isinstance(v, bool) for v in value):
        out = [float(v) for v in value]
    else:
        raise fail(where, f"is {_kind(value)}, not a list of 4 numbers (x0, y0, x1, y1)")
    if not all(np.isfinite(out)):
        raise fail(where, f"holds a non-finite number {out}")
    return out
