"""ScaNN as a search backend: :class:`ScannSearcher` (exact brute force, ``"scann"``, or
tree + anisotropic hashing + re-ordering, ``"scann_ah"``), and the tuner's plan for
ScaNN (:class:`ScannSpace`) with its costs.
"""

from __future__ import annotations

import math
import os
from dataclasses import dataclass
from typing import Any, ClassVar

import numpy as np

from tfaploss import extras
from tfaploss.durable import atomic
from tfaploss.evaluation.arrays import check_int
from tfaploss.evaluation.searchers import (
    MIN_PARTITION_POINTS,
    Searcher,
    exact_cost,
    partitioned_cost,
    probe_counts,
)

__all__ = ["ScannSearcher", "ScannSetting", "ScannSpace", "candidate_settings",
           "estimated_cost", "scann_ah_params"]

_MIN_POINTS_PER_LEAF = 16


def _unit_rows(database, tolerance: float = 1e-3) -> bool:
    """True when every row of ``database`` has an L2 norm within ``tolerance`` of 1."""
    norms = np.linalg.norm(database, axis=1)
    return bool(norms.size) and bool(np.all(np.abs(norms - 1) <= tolerance))


def scann_ah_params(num_database: int, dim: int) -> dict[str, Any]:
    """Tree + AH + reorder parameters for a database of ``num_database`` x ``dim``.

    * ``num_leaves`` about sqrt(N) (at most 4,000), ``num_leaves_to_search`` =
      max(50, 5 % of them); the tree's k-means trains on 250 points per leaf.
    * AH: 2 dimensions per 4-bit block, anisotropic threshold 0.2, codebooks trained on
      at most 100k points; exact re-ordering of at least 250 candidates (``10 * k``).

    Below 100,000 points there is no tree: scanning every code is already fast, and a
    tree costs recall. The measurements behind each value are in ``docs/search.md``.
    """
    n = int(num_database)
    params: dict[str, Any] = {
        "dimensions_per_block": 2, "anisotropic_quantization_threshold": 0.2,
        "reorder_num_neighbors": 250, "training_sample_size": min(n, 100_000),
        "num_leaves": None, "num_leaves_to_search": None, "tree_training_sample_size": None}
    if n >= 100_000:
        num_leaves = int(min(round(math.sqrt(n)), 4000))
        params["num_leaves"] = num_leaves
        params["num_leaves_to_search"] = min(num_leaves, max(50, math.ceil(0.05 * num_leaves)))
        params["tree_training_sample_size"] = min(n, 250 * num_leaves)
    return params


def configure_ah(builder, p: dict[str, Any], reorder: int | None = None):
    """ScaNN's ``builder`` (pybind's or the TensorFlow ops') with the tree, leaf scoring
    and re-ordering of the AH parameters ``p`` (:func:`scann_ah_params`'s keys)."""
    if p.get("num_leaves"):
        builder = builder.tree(num_leaves=int(p["num_leaves"]),
                               num_leaves_to_search=int(p["num_leaves_to_search"]),
                               training_sample_size=int(p["tree_training_sample_size"]),
                               spherical=bool(p.get("spherical")))
    if p.get("leaf_scoring", "ah") == "brute_force":
        return builder.score_brute_force()
    threshold = p["anisotropic_quantization_threshold"]
    builder = builder.score_ah(
        int(p["dimensions_per_block"]),
        anisotropic_quantization_threshold=float("nan") if threshold is None else float(threshold),
        training_sample_size=int(p["training_sample_size"]))
    return builder.reorder(int(p["reorder_num_neighbors"]) if reorder is None else reorder)


class ScannSearcher(Searcher):
    """ScaNN search: exact brute force (``mode="brute_force"``) or tree + asymmetric
    hashing + re-ordering (``mode="ah"``).

    AH cost per query: ``num_leaves * D`` to pick leaves, a 4-bit LUT scan of
    ``N * num_leaves_to_search / num_leaves`` codes, and ``reorder_num_neighbors``
    exact re-scores. Parameters not given come from :func:`scann_ah_params`.

    Args:
      database: (N, D) embeddings.
      mode: ``"brute_force"`` or ``"ah"``.
      num_neighbors: default k stored in the ScaNN config (searches may ask more).
      num_leaves, num_leaves_to_search, dimensions_per_block,
      anisotropic_quantization_threshold, reorder_num_neighbors, training_sample_size
        (AH codebooks), tree_training_sample_size (k-means of the tree): ScaNN
        parameters (``mode="ah"`` only); ``num_leaves=None`` disables the tree.
      leaf_scoring: ``"ah"`` (default: 4-bit AH codes + exact re-ordering) or
        ``"brute_force"`` (exact scores of every point of the leaves searched).
      reorder_factor: a search for ``k`` re-orders ``max(reorder_factor * k,
        reorder_num_neighbors)`` candidates (default 10; the tuner sets 1).
      anisotropic_quantization_threshold: ``None`` turns the anisotropic loss off
        (plain AH).
      spherical: spherical k-means for the tree. ``None`` (default): when every row
        has norm 1 (± 1e-3); raw centres favour tight clusters (``docs/search.md``).
      num_threads: search/training threads (0 = ScaNN's default, all cores).
    """

    backend = "scann"
    _restores = ("scann", "scann_ah")
    _AH_KEYS = ("num_leaves", "num_leaves_to_search", "dimensions_per_block",
                "anisotropic_quantization_threshold", "reorder_num_neighbors",
                "training_sample_size", "tree_training_sample_size", "leaf_scoring",
                "reorder_factor", "spherical")
    # Defaults of the keys scann_ah_params leaves out (and saved searchers may lack).
    _EXTRA_DEFAULTS: ClassVar[dict[str, Any]] = {"leaf_scoring": "ah", "reorder_factor": 10,
                                                 "spherical": None}

    def __init__(self, database, mode: str = "ah", num_neighbors: int = 100,
                 num_threads: int = 0, _searcher=None, **ah_params):
        if _searcher is None:
            database = self._take(database)
        if mode not in ("brute_force", "ah"):
            raise ValueError(f"`mode` must be 'brute_force' or 'ah'; received {mode!r}.")
        unknown = set(ah_params) - set(self._AH_KEYS)
        if unknown:
            raise ValueError(f"unknown ScaNN parameter(s) {sorted(unknown)}; "
                             f"allowed: {list(self._AH_KEYS)}.")
        if mode == "brute_force" and ah_params:
            raise ValueError(f"parameters {sorted(ah_params)} only apply to mode='ah'.")
        self.mode = mode
        self.num_neighbors = int(num_neighbors)
        self.num_threads = int(num_threads)
        self.backend = "scann" if mode == "brute_force" else "scann_ah"
        self.approximate = mode == "ah"
        if _searcher is not None:  # restored by load_searcher
            self._searcher, self.size, self.dim, self.params = _searcher
            return
        self.params = {}
        if mode == "ah":
            self.params = {**scann_ah_params(*database.shape), **self._EXTRA_DEFAULTS,
                           **ah_params}
            if self.params["leaf_scoring"] not in ("ah", "brute_force"):
                raise ValueError(f"`leaf_scoring` must be 'ah' or 'brute_force'; received "
                                 f"{self.params['leaf_scoring']!r}.")
            check_int("reorder_factor", self.params["reorder_factor"])
            if self.params["spherical"] is None:
                self.params["spherical"] = _unit_rows(database)
            leaves = self.params.get("num_leaves")
            if leaves:
                if not 1 <= int(leaves) <= database.shape[0]:
                    raise ValueError(f"`num_leaves` must be in [1, {database.shape[0]}] (the "
                                     f"database size); received {leaves!r}.")
                if not self.params.get("num_leaves_to_search"):
                    self.params["num_leaves_to_search"] = math.ceil(0.1 * int(leaves))
                if "tree_training_sample_size" not in ah_params:
                    self.params["tree_training_sample_size"] = min(database.shape[0],
                                                                   250 * int(leaves))
        self._searcher = self._build(database)

    def _build(self, db):
        scann = extras.import_extra(
            "scann", f"ScaNN search (backend {self.backend!r}, or a tuned target_recall)")

        nn = max(1, min(self.num_neighbors, db.shape[0]))
        builder = scann.scann_ops_pybind.builder(db, nn, "dot_product")
        if self.mode == "brute_force":
            builder = builder.score_brute_force()
        else:
            builder = configure_ah(builder, self.params)
        builder.set_n_training_threads(self.num_threads)
        searcher = builder.build()
        if self.num_threads:
            searcher.set_num_threads(self.num_threads)
        return searcher

    def _config(self):
        return {"mode": self.mode, "num_neighbors": self.num_neighbors,
                "num_threads": self.num_threads, **self.params}

    def describe(self) -> str:
        if self.mode == "brute_force":
            return "ScaNN float32 brute force"
        p = self.params
        leaves = p.get("num_leaves")
        return ScannSetting(leaves, p.get("num_leaves_to_search") if leaves else None,
                            p.get("leaf_scoring", "ah"), p.get("dimensions_per_block"),
                            p.get("anisotropic_quantization_threshold"),
                            p.get("reorder_num_neighbors")).describe()

    def set_search_params(self, num_leaves_to_search: int | None = None,
                          reorder_num_neighbors: int | None = None) -> ScannSearcher:
        """Change the speed/recall trade-off of later searches without rebuilding."""
        if self.mode != "ah":
            raise ValueError("search parameters only apply to mode='ah'.")
        if num_leaves_to_search is not None:
            if not self.params.get("num_leaves"):
                raise ValueError("`num_leaves_to_search` needs a tree (num_leaves was None).")
            if not 1 <= num_leaves_to_search <= self.params["num_leaves"]:
                raise ValueError(f"`num_leaves_to_search` must be in [1, "
                                 f"{self.params['num_leaves']}]; received "
                                 f"{num_leaves_to_search!r}.")
            self.params["num_leaves_to_search"] = int(num_leaves_to_search)
        if reorder_num_neighbors is not None:
            if reorder_num_neighbors < 1:
                raise ValueError(f"`reorder_num_neighbors` must be >= 1; received "
                                 f"{reorder_num_neighbors!r}.")
            self.params["reorder_num_neighbors"] = int(reorder_num_neighbors)
        return self

    def _search(self, queries, k):
        kwargs = {}
        if self.mode == "ah":
            if self.params.get("leaf_scoring", "ah") == "ah":
                kwargs["pre_reorder_num_neighbors"] = max(
                    int(self.params.get("reorder_factor", 10)) * k,
                    int(self.params["reorder_num_neighbors"]))
            if self.params.get("num_leaves"):
                kwargs["leaves_to_search"] = int(self.params["num_leaves_to_search"])
        idx, dist = self._searcher.search_batched_parallel(
            queries, final_num_neighbors=k, **kwargs)
        idx = np.asarray(idx, np.int64)
        dist = np.asarray(dist, np.float32)
        # Batched ScaNN pads a row it cannot fill (fewer points in the leaves searched
        # than asked for) with index 0 and a NaN score: padding, not neighbours.
        pad = np.isnan(dist)
        if pad.any():
            idx = np.where(pad, -1, idx)
            dist = np.where(pad, -np.inf, dist).astype(np.float32)
        if idx.shape[1] < k:  # ScaNN may return fewer rows than asked (tiny leaves)
            pad = k - idx.shape[1]
            idx = np.pad(idx, ((0, 0), (0, pad)), constant_values=-1)
            dist = np.pad(dist, ((0, 0), (0, pad)), constant_values=-np.inf)
        return idx, dist

    def _save(self, directory):
        sub = os.path.join(directory, "scann")
        os.makedirs(sub, exist_ok=True)
        # relative_path=True: the assets file names the artefacts relative to `sub`, so
        # the directory can be moved or copied.
        try:
            self._searcher.searcher.serialize(sub, True)
        except Exception as err:  # ScaNN reports a full disk in a RuntimeError's text
            if atomic.is_disk_full(err):
                raise atomic.DiskFullError(sub, None, atomic.free_bytes(directory)) \
                    from None
            raise

    @classmethod
    def _load(cls, directory, meta):
        # importing scann puts scann_pybind on sys.path
        extras.import_extra("scann", f"loading the ScaNN searcher of {directory!r}")
        from scann.scann_ops.py import scann_ops_pybind

        sub = os.path.join(directory, "scann")
        with open(os.path.join(sub, "scann_assets.pbtxt"), encoding="utf-8") as f:
            assets = f.read()
        # Built directly rather than through scann's load_searcher, which unpickles an
        # optional docids file with plain pickle.
        raw = scann_ops_pybind.scann_pybind.ScannNumpy(sub, assets)
        searcher = scann_ops_pybind.ScannSearcher(raw)
        params = {k: meta[k] for k in cls._AH_KEYS if k in meta}
        if meta["mode"] == "ah":
            params = {**cls._EXTRA_DEFAULTS, **params}
        obj = cls(None, mode=meta["mode"], num_neighbors=meta["num_neighbors"],
                  num_threads=meta["num_threads"],
                  _searcher=(searcher, int(meta["size"]), int(meta["dim"]), params))
        if obj.num_threads:
            searcher.set_num_threads(obj.num_threads)
        return obj


# -- the tuner's plan for ScaNN ----------------------------------------------------------
@dataclass(frozen=True)
class ScannSetting:
    """One point of ScaNN's search space (``num_leaves=None``: no partitioning)."""

    num_leaves: int | None
    leaves_to_search: int | None
    leaf_scoring: str  # "ah" | "brute_force"
    dimensions_per_block: int | None = None
    anisotropic_quantization_threshold: float | None = None
    reorder_num_neighbors: int | None = None

    @property
    def build_key(self):
        return (self.num_leaves, self.leaf_scoring, self.dimensions_per_block,
                self.anisotropic_quantization_threshold)

    def searcher_params(self) -> dict[str, Any]:
        """Keyword arguments of :class:`ScannSearcher` (``mode="ah"``)."""
        p: dict[str, Any] = {"num_leaves": self.num_leaves,
                             "num_leaves_to_search": self.leaves_to_search,
                             "leaf_scoring": self.leaf_scoring, "reorder_factor": 1}
        if self.leaf_scoring == "ah":
            p.update(dimensions_per_block=self.dimensions_per_block,
                     anisotropic_quantization_threshold=self.anisotropic_quantization_threshold,
                     reorder_num_neighbors=self.reorder_num_neighbors)
        return p

    def describe(self) -> str:
        part = ("no partitions" if not self.num_leaves else
                f"{self.leaves_to_search}/{self.num_leaves} leaves")
        if self.leaf_scoring == "brute_force":
            return f"{part}, brute force"
        thr = self.anisotropic_quantization_threshold
        return (f"{part}, AH {self.dimensions_per_block} dims/block, anisotropic "
                f"{'off' if thr is None else f'{thr:g}'}, reorder {self.reorder_num_neighbors}")


def estimated_cost(setting: ScannSetting | None, n: int, d: int) -> float:
    """Cost of one query in multiply-adds of exact search (``setting=None``: exact)."""
    if setting is None:
        return exact_cost(n, d)
    codes = (None if setting.leaf_scoring == "brute_force"
             else math.ceil(d / setting.dimensions_per_block))
    return partitioned_cost(n, d, setting.num_leaves, setting.leaves_to_search, codes=codes,
                            rescored=setting.reorder_num_neighbors or 0)


def candidate_settings(n: int, d: int, k: int) -> list[ScannSetting]:
    """ScaNN's search space for an (n, d) database and top-``k``, cheapest first:
    partitions (none, about sqrt(N) or 2 sqrt(N) leaves), leaves searched, 4-bit AH (2
    or 1 dimensions per block, anisotropic 0.2 or off) or exact scores inside the leaves,
    and the re-order size (2k, 4k, 10k)."""
    reorders = sorted({min(n, r) for r in (2 * k, 4 * k, 10 * k)})
    ah = [(2, 0.2), (2, None), (1, 0.2)]
    partitions: list[tuple[int | None, list[int | None]]] = [(None, [None])]
    if n >= MIN_PARTITION_POINTS:
        cap = min(4000, n // _MIN_POINTS_PER_LEAF)
        for leaves in sorted({min(cap, round(f * math.sqrt(n))) for f in (1, 2)}):
            partitions.append((leaves, probe_counts(leaves)))
    out = []
    for leaves, searched in partitions:
        for t in searched:
            if leaves:
                out.append(ScannSetting(leaves, t, "brute_force"))
            out += [ScannSetting(leaves, t, "ah", dpb, thr, r)
                    for dpb, thr in ah for r in reorders]
    out.sort(key=lambda s: (estimated_cost(s, n, d), s.describe()))
    return out


class ScannSpace:
    """ScaNN's plan for the tuner (a :class:`~tfaploss.evaluation.searchers.SearchSpace`)."""

    name = "ScaNN"
    candidates = staticmethod(candidate_settings)

    def check(self) -> None:
        pass  # ScaNN's import fails where the first searcher is built

    def cost(self, setting, n, d, k):
        return estimated_cost(setting, n, d)

    def dominates(self, a: ScannSetting, b: ScannSetting) -> bool:
        """True when ``a`` finds at least every neighbour ``b`` finds."""
        if a.num_leaves != b.num_leaves or (a.leaves_to_search or 0) < (b.leaves_to_search
                                                                       or 0):
            return False
        if a.leaf_scoring == "brute_force":
            return True  # exact scores over a superset of b's leaves
        return (b.leaf_scoring == "ah"
                and a.anisotropic_quantization_threshold
                == b.anisotropic_quantization_threshold
                and a.dimensions_per_block <= b.dimensions_per_block
                and a.reorder_num_neighbors >= b.reorder_num_neighbors)

    def probe(self, setting):
        """Brute force over the same leaves bounds the recall of an AH setting."""
        if setting.num_leaves and setting.leaf_scoring == "ah":
            return ScannSetting(setting.num_leaves, setting.leaves_to_search, "brute_force")
        return None

    def build(self, database, setting, k, num_threads):
        return ScannSearcher(database, mode="ah", num_neighbors=k, num_threads=num_threads,
                             **setting.searcher_params())

    def configure(self, searcher, setting):
        searcher.params.update(setting.searcher_params())
