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

PROTOCOLS = ("easy", "medium", "hard")


def protocol_sets(gnd_entry: dict, protocol: str) -> tuple[np.ndarray, np.ndarray]:
    """``(positives, junk)`` index arrays of one query under ``protocol``."""
    if protocol not in PROTOCOLS:
        raise ValueError(f"`protocol` must be one of {PROTOCOLS}; received {protocol!r}.")
    missing = [k for k in ("easy", "hard", "junk") if k not in gnd_entry]
    if missing:
        raise ValueError(f"ground-truth entry lacks key(s) {missing}; each query needs "
                         "'easy', 'hard' and 'junk' index lists.")
    easy, hard, junk = (np.asarray(gnd_entry[k], dtype=np.int64).reshape(-1)
                        for k in ("easy", "hard", "junk"))
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
    out = []
    for k in ks:
        kq = min(max_pos, k)
        out.append((pos1 <= kq).sum() / kq)
    return np.asarray(out, dtype=np.float64)


def _evaluate_ranks(ranks: np.ndarray, gnd, protocol: str, ks):
    ks = tuple(int(k) for k in ks)
    if not ks or min(ks) < 1:
        raise ValueError(f"`ks` must hold positive integers; received {ks!r}.")
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

    For large databases (+1M distractors) only a searcher's top-K is available.
    Positives not in the top K contribute 0 to AP, so when ``K < database_size`` the
    returned ``map`` is a **lower bound** (``"lower_bound": True`` in the result).
    mP@k is exact when the top K still holds at least k non-junk images.
    """
    ranks = np.asarray(ranks)
    if ranks.ndim != 2:
        raise ValueError(f"`ranks` must be (queries x K); received shape {ranks.shape}.")
    truncated = database_size is None or ranks.shape[1] < int(database_size)
    result, _ = _evaluate_ranks(ranks, gnd, protocol, ks)
    result["lower_bound"] = bool(truncated)
    return result


def load_revisited_gnd(path: str) -> dict:
    """Load ``gnd_roxford5k.pkl`` / ``gnd_rparis6k.pkl`` or a JSON conversion of it.

    Pickles are read through :func:`tfaploss.utils.safe_pickle.safe_load_path`, which
    refuses any pickle that would create objects other than plain containers,
    numbers, strings and numpy arrays (a downloaded pickle can otherwise run code).

    Returns a dict with ``imlist``, ``qimlist`` and ``gnd`` (a list of dicts whose
    ``easy``/``hard``/``junk`` are lists of ints and ``bbx`` a list of 4 floats when
    present).
    """
    if str(path).endswith(".json"):
        import json

        import tensorflow as tf

        with tf.io.gfile.GFile(path, "r") as f:
            data = json.load(f)
    else:
        from tfaploss.utils.safe_pickle import safe_load_path

        data = safe_load_path(path)
    if not isinstance(data, dict) or "gnd" not in data:
        raise ValueError(f"{path!r} is not a revisited ground-truth file: expected a dict "
                         "with a 'gnd' list (and 'imlist', 'qimlist').")
    gnd = []
    for i, entry in enumerate(data["gnd"]):
        if not isinstance(entry, dict):
            raise ValueError(  # noqa: TRY004 - bad file content, not a bad argument
                f"{path!r}: gnd[{i}] is {type(entry).__name__}, not a dict.")
        clean = {k: [int(v) for v in np.asarray(entry.get(k, []), dtype=np.int64).reshape(-1)]
                 for k in ("easy", "hard", "junk")}
        if "bbx" in entry and entry["bbx"] is not None:
            clean["bbx"] = [float(v) for v in np.asarray(entry["bbx"]).reshape(-1)]
        gnd.append(clean)
    return {"imlist": [str(s) for s in data.get("imlist", [])],
            "qimlist": [str(s) for s in data.get("qimlist", [])],
            "gnd": gnd}
