"""faiss as a search backend: flat, IVF-Flat, IVF-PQ and HNSW indexes.

:class:`FaissSearcher` answers the :class:`~tfaploss.evaluation.searchers.Searcher`
interface with one of faiss's inner-product indexes:

* ``kind="flat"``: exact search (``IndexFlatIP``);
* ``kind="ivf_flat"``: ``nlist`` k-means lists, ``nprobe`` of them scanned exactly;
* ``kind="ivf_pq"``: the same lists holding 4-bit fast-scan PQ codes of ``d / 2``
  sub-quantizers (the code size of ScaNN's AH at 2 dimensions per block), then the
  best ``k_factor * k`` re-scored exactly (``RFlat``: a float32 copy beside the codes);
* ``kind="hnsw"``: a graph of ``hnsw_m`` links per point, searched with a beam of
  ``ef_search``.

``device="auto"`` puts flat and IVF-Flat indexes on GPU 0 where faiss-gpu sees one
(faiss has no GPU HNSW nor GPU 4-bit fast-scan); the tests, on CPUs, do not cover it.
:class:`FaissSpace` is the tuner's plan for faiss. Saved as ``searcher.json`` plus
``index.faiss`` (faiss's binary format; nothing is pickled).
"""

from __future__ import annotations

import logging
import math
import os
from dataclasses import dataclass
from typing import Any, ClassVar

import numpy as np

from tfaploss import extras
from tfaploss.durable import atomic
from tfaploss.evaluation.arrays import check_int
from tfaploss.evaluation.searchers import (
    BRUTE_COST,
    MIN_PARTITION_POINTS,
    QUERY_OVERHEAD,
    Searcher,
    exact_cost,
    partitioned_cost,
    probe_counts,
)

LOG = logging.getLogger(__name__)

KINDS = ("flat", "ivf_flat", "ivf_pq", "hnsw")
DEVICES = ("auto", "cpu", "gpu")
_INDEX_FILE = "index.faiss"
# faiss's k-means warns below 39 training points per list: the default nlist keeps to it.
_MIN_POINTS_PER_LIST = 39


def import_faiss():
    """``import faiss``, or a :class:`~tfaploss.extras.MissingExtraError`."""
    return extras.import_extra("faiss", 'the "faiss" search backend')


def faiss_params(num_database: int, dim: int, kind: str = "ivf_flat") -> dict[str, Any]:
    """Default parameters of a ``kind`` index over ``num_database`` x ``dim``.

    * ``nlist`` = 4 sqrt(N) (faiss's guideline is 4 to 16 sqrt(N)), at most N / 39;
    * ``nprobe`` = 1/16 of the lists, at least 8 (recall before speed when untuned);
    * ``k_factor`` = 10: ``10 k`` candidates re-scored, ScaNN's ``reorder_factor``;
    * ``hnsw_m`` = 32, ``ef_construction`` = 40 (faiss's default; larger costs minutes at
      1M points), ``ef_search`` = 64 (faiss's 16 is sized for k = 1);
    * ``spherical`` = True (faiss's own default for inner product);
    * ``training_sample_size`` = 50 points per list, at least 10,000 (the 4-bit PQ
      codebooks want 16 x 39 points).
    """
    if kind not in KINDS:
        raise ValueError(f"`kind` must be one of {KINDS}; received {kind!r}.")
    n = int(num_database)
    params: dict[str, Any] = {}
    if kind in ("ivf_flat", "ivf_pq"):
        nlist = max(1, min(round(4 * math.sqrt(n)), n // _MIN_POINTS_PER_LIST))
        params.update(nlist=nlist, nprobe=min(nlist, max(8, math.ceil(nlist / 16))),
                      training_sample_size=min(n, max(50 * nlist, 10_000)), spherical=True)
    if kind == "ivf_pq":
        params["k_factor"] = 10
    if kind == "hnsw":
        params.update(hnsw_m=32, ef_construction=40, ef_search=64)
    return params


class FaissSearcher(Searcher):
    """Inner-product search with a faiss index (see the module doc for the kinds).

    Cost per query: flat ``N * D``; IVF ``nlist * D`` to pick lists, then
    ``N * nprobe / nlist`` points scanned (float32 scores for IVF-Flat; 4-bit codes of
    ``D / 2`` bytes plus ``k_factor * k`` exact re-scores for IVF-PQ); HNSW about
    ``ef_search * hnsw_m`` distance computations.

    Args:
      kind: ``"flat"`` (default, exact), ``"ivf_flat"``, ``"ivf_pq"`` or ``"hnsw"``.
      nlist, nprobe, training_sample_size, spherical: IVF lists, lists scanned per
        query, k-means training points, spherical k-means (default ``True``, faiss's
        own for inner product: raw centres favour tight clusters, see
        ``docs/search.md``).
      k_factor: IVF-PQ: candidates re-scored exactly, as a multiple of k.
      hnsw_m, ef_construction, ef_search: HNSW links per point, build beam, search
        beam (faiss widens it to k when k is larger).
      device: ``"auto"`` (GPU 0 when faiss-gpu sees one and the kind runs there),
        ``"cpu"`` or ``"gpu"``.
      num_threads: faiss's OpenMP threads (0: every core); process-wide in faiss.
      seed: seed of the k-means training sample and of faiss's k-means.
    Parameters not given come from :func:`faiss_params`.
    """

    backend = "faiss"
    _restores = ("faiss",)
    _KIND_KEYS: ClassVar[dict[str, tuple[str, ...]]] = {
        "flat": (),
        "ivf_flat": ("nlist", "nprobe", "training_sample_size", "spherical"),
        "ivf_pq": ("nlist", "nprobe", "training_sample_size", "spherical", "k_factor"),
        "hnsw": ("hnsw_m", "ef_construction", "ef_search"),
    }

    def __init__(self, database, kind: str = "flat", *, nlist: int | None = None,
                 nprobe: int | None = None, k_factor: int | None = None,
                 hnsw_m: int | None = None, ef_construction: int | None = None,
                 ef_search: int | None = None, training_sample_size: int | None = None,
                 spherical: bool | None = None, device: str = "auto", num_threads: int = 0,
                 seed: int = 0):
        database = self._take(database)
        given = {"nlist": nlist, "nprobe": nprobe, "k_factor": k_factor, "hnsw_m": hnsw_m,
                 "ef_construction": ef_construction, "ef_search": ef_search,
                 "training_sample_size": training_sample_size, "spherical": spherical}
        faiss = import_faiss()
        self._set_options(kind, device, num_threads, seed)
        extra = sorted(k for k, v in given.items()
                       if v is not None and k not in self._KIND_KEYS[kind])
        if extra:
            raise ValueError(f"parameter(s) {extra} do not apply to kind={kind!r}; it takes "
                             f"{list(self._KIND_KEYS[kind]) or 'none'}.")
        params = faiss_params(self.size, self.dim, kind)
        params.update({k: v for k, v in given.items() if v is not None})
        self.params = self._checked(params)
        if kind == "ivf_pq" and self.dim % 2:
            raise ValueError(f"kind='ivf_pq' codes pairs of dimensions; the database has "
                             f"an odd dimension {self.dim}.")
        self._use_gpu = self._resolve_device(faiss)
        self._index = self._build(faiss, database)

    def _set_options(self, kind, device, num_threads, seed):
        if kind not in KINDS:
            raise ValueError(f"`kind` must be one of {KINDS}; received {kind!r}.")
        if device not in DEVICES:
            raise ValueError(f"`device` must be one of {DEVICES}; received {device!r}.")
        self.kind, self.device = kind, device
        self.num_threads = check_int("num_threads", num_threads, low=0)
        self.seed = check_int("seed", seed, low=0)
        self.approximate = kind != "flat"

    def _checked(self, params: dict[str, Any]) -> dict[str, Any]:
        out = dict(params)
        for key in ("nlist", "nprobe", "k_factor", "hnsw_m", "ef_construction", "ef_search",
                    "training_sample_size"):
            if key in out:
                out[key] = check_int(key, out[key])
        if "nlist" in out:
            if out["nlist"] > self.size:
                raise ValueError(f"`nlist` must be in [1, {self.size}] (the database size); "
                                 f"received {out['nlist']!r}.")
            if out["nprobe"] > out["nlist"]:
                raise ValueError(f"`nprobe` must be in [1, nlist={out['nlist']}]; received "
                                 f"{out['nprobe']!r}.")
            if out["training_sample_size"] < out["nlist"]:
                raise ValueError(f"`training_sample_size` must be >= nlist={out['nlist']}; "
                                 f"received {out['training_sample_size']!r}.")
            out["training_sample_size"] = min(out["training_sample_size"], self.size)
            out["spherical"] = bool(out["spherical"])
        if out.get("hnsw_m") == 1:
            raise ValueError("`hnsw_m` must be >= 2; received 1.")
        return out

    def _resolve_device(self, faiss) -> bool:
        if self.device == "cpu":
            return False
        gpus = faiss.get_num_gpus() if hasattr(faiss, "get_num_gpus") else 0
        # faiss has no GPU HNSW, and its GPU IVF-PQ has no 4-bit fast-scan codes.
        on_gpu = self.kind in ("flat", "ivf_flat")
        if self.device == "gpu":
            if not gpus:
                raise ValueError("`device` is 'gpu' but faiss sees no GPU (faiss-gpu is "
                                 "needed, not faiss-cpu).")
            if not on_gpu:
                raise ValueError(f"`device` 'gpu' does not run kind={self.kind!r}; use "
                                 "'flat' or 'ivf_flat', or device='cpu'.")
        return bool(gpus) and on_gpu

    def _factory(self) -> str:
        p = self.params
        return {"flat": "Flat", "ivf_flat": f"IVF{p.get('nlist')},Flat",
                "ivf_pq": f"IVF{p.get('nlist')},PQ{self.dim // 2}x4fs,RFlat",
                "hnsw": f"HNSW{p.get('hnsw_m')}"}[self.kind]

    def _build(self, faiss, database):
        if self.num_threads:
            faiss.omp_set_num_threads(self.num_threads)
        index = faiss.index_factory(self.dim, self._factory(), faiss.METRIC_INNER_PRODUCT)
        if self.kind in ("ivf_flat", "ivf_pq"):
            ivf = faiss.extract_index_ivf(index)
            ivf.cp.spherical = self.params["spherical"]
            ivf.cp.seed = self.seed
            m = self.params["training_sample_size"]
            rng = np.random.default_rng(self.seed)
            pick = np.sort(rng.choice(self.size, m, replace=False)) if m < self.size else None
            index.train(database if pick is None else database[pick])
        elif self.kind == "hnsw":
            faiss.downcast_index(index).hnsw.efConstruction = self.params["ef_construction"]
        index.add(database)
        index = self._place(faiss, index)
        LOG.debug("faiss %s index over %d x %d on %s", self._factory(), self.size, self.dim,
                  "GPU 0" if self._use_gpu else "the CPU")
        return index

    def _place(self, faiss, index):
        """``index`` on the device it runs on, with its search-time parameters."""
        if self._use_gpu:
            self._gpu_resources = faiss.StandardGpuResources()
            index = faiss.index_cpu_to_gpu(self._gpu_resources, 0, index)
        self._apply(faiss, index)
        return index

    def _apply(self, faiss, index) -> None:
        """Put the search-time parameters (nprobe, k_factor, ef_search) on ``index``."""
        p = self.params
        if self.kind in ("ivf_flat", "ivf_pq"):
            if self._use_gpu:
                faiss.GpuParameterSpace().set_index_parameter(index, "nprobe", p["nprobe"])
            else:
                faiss.extract_index_ivf(index).nprobe = p["nprobe"]
        if self.kind == "ivf_pq":
            faiss.downcast_index(index).k_factor = float(p["k_factor"])
        if self.kind == "hnsw":
            faiss.downcast_index(index).hnsw.efSearch = p["ef_search"]

    def set_search_params(self, nprobe: int | None = None, k_factor: int | None = None,
                          ef_search: int | None = None) -> FaissSearcher:
        """Change the speed/recall trade-off of later searches without rebuilding."""
        for name, value, kinds in (("nprobe", nprobe, ("ivf_flat", "ivf_pq")),
                                   ("k_factor", k_factor, ("ivf_pq",)),
                                   ("ef_search", ef_search, ("hnsw",))):
            if value is None:
                continue
            if self.kind not in kinds:
                raise ValueError(f"`{name}` does not apply to kind={self.kind!r}.")
            self.params = self._checked({**self.params, name: value})
        self._apply(import_faiss(), self._index)
        return self

    def _config(self):
        return {"kind": self.kind, "device": self.device, "num_threads": self.num_threads,
                "seed": self.seed, **self.params}

    def describe(self) -> str:
        if self.kind == "flat":
            return "flat (exact)"
        p = self.params
        return FaissSetting(self.kind, p.get("nlist"), p.get("nprobe"), p.get("k_factor"),
                            p.get("hnsw_m"), p.get("ef_search")).describe()

    def _search(self, queries, k):
        if self.num_threads:
            import_faiss().omp_set_num_threads(self.num_threads)
        scores, idx = self._index.search(queries, k)
        idx = np.asarray(idx, np.int64)
        # faiss fills what it could not find (too few points in the lists scanned) with
        # index -1 and the lowest float: padding, which sorts last.
        scores = np.where(idx < 0, -np.inf, np.asarray(scores, np.float32)).astype(np.float32)
        return idx, scores

    def _save(self, directory):
        faiss = import_faiss()
        index = faiss.index_gpu_to_cpu(self._index) if self._use_gpu else self._index
        # Never half an index under the name; a full disk is one DiskFullError.
        atomic.atomic_write(os.path.join(directory, _INDEX_FILE),
                            lambda tmp: faiss.write_index(index, tmp), fault="searcher")

    @classmethod
    def _load(cls, directory, meta):
        faiss = import_faiss()
        obj = cls.__new__(cls)
        obj.size, obj.dim = int(meta["size"]), int(meta["dim"])
        obj._set_options(meta["kind"], meta["device"], meta["num_threads"], meta["seed"])
        obj.params = obj._checked({k: meta[k] for k in cls._KIND_KEYS[obj.kind] if k in meta})
        index = faiss.read_index(os.path.join(directory, _INDEX_FILE))
        if index.ntotal != obj.size or index.d != obj.dim:
            raise ValueError(f"{_INDEX_FILE} in {directory!r} holds {index.ntotal} x "
                             f"{index.d}, but searcher.json says {obj.size} x {obj.dim}.")
        obj._use_gpu = obj._resolve_device(faiss)
        obj._index = obj._place(faiss, index)
        return obj


# -- the tuner's plan for faiss ----------------------------------------------------------
@dataclass(frozen=True)
class FaissSetting:
    """One point of faiss's search space for the tuner."""

    kind: str  # "ivf_flat" | "ivf_pq" | "hnsw"
    nlist: int | None = None
    nprobe: int | None = None
    k_factor: int | None = None
    hnsw_m: int | None = None
    ef_search: int | None = None

    @property
    def build_key(self):
        return (self.kind, self.nlist, self.hnsw_m)

    def searcher_params(self) -> dict[str, Any]:
        """Keyword arguments of :class:`FaissSearcher`."""
        if self.kind == "hnsw":
            return {"kind": "hnsw", "hnsw_m": self.hnsw_m, "ef_search": self.ef_search}
        p = {"kind": self.kind, "nlist": self.nlist, "nprobe": self.nprobe}
        if self.kind == "ivf_pq":
            p["k_factor"] = self.k_factor
        return p

    def search_params(self) -> dict[str, Any]:
        """The part of :meth:`searcher_params` a built index changes without a rebuild."""
        return {k: v for k, v in self.searcher_params().items()
                if k in ("nprobe", "k_factor", "ef_search")}

    def describe(self) -> str:
        if self.kind == "hnsw":
            return f"HNSW{self.hnsw_m}, efSearch {self.ef_search}"
        lists = f"{self.nprobe}/{self.nlist} lists"
        if self.kind == "ivf_flat":
            return f"IVF-Flat, {lists}"
        return f"IVF-PQ 4-bit fast-scan, {lists}, re-rank {self.k_factor} k"


def faiss_cost(setting: FaissSetting | None, n: int, d: int, k: int = 10) -> float:
    """Cost of one query in multiply-adds of exact search (``setting=None``: exact)."""
    if setting is None:
        return exact_cost(n, d)
    if setting.kind == "hnsw":  # each node of the beam expanded checks about M links
        return QUERY_OVERHEAD + setting.ef_search * setting.hnsw_m * d * BRUTE_COST
    if setting.kind == "ivf_flat":
        return partitioned_cost(n, d, setting.nlist, setting.nprobe)
    return partitioned_cost(n, d, setting.nlist, setting.nprobe, codes=math.ceil(d / 2),
                            rescored=setting.k_factor * k)


def faiss_candidates(n: int, d: int, k: int) -> list[FaissSetting]:
    """faiss's search space for an (n, d) database and top-``k``, cheapest first: IVF
    with sqrt(N) and 4 sqrt(N) lists (at most N / 39), exact or 4-bit PQ re-ranking 2, 4
    or 10 k; HNSW with 32 links and a beam of k .. 32 k (at least 16)."""
    out: list[FaissSetting] = []
    if n >= MIN_PARTITION_POINTS:
        cap = max(1, n // _MIN_POINTS_PER_LIST)
        for nlist in sorted({min(cap, round(f * math.sqrt(n))) for f in (1, 4)}):
            for p in probe_counts(nlist):
                out.append(FaissSetting("ivf_flat", nlist, p))
                if d % 2 == 0:
                    out += [FaissSetting("ivf_pq", nlist, p, f) for f in (2, 4, 10)]
    for ef in sorted({max(16, f * k) for f in (1, 2, 4, 8, 16, 32)}):
        out.append(FaissSetting("hnsw", hnsw_m=32, ef_search=ef))
    out.sort(key=lambda s: (faiss_cost(s, n, d, k), s.describe()))
    return out


class FaissSpace:
    """The tuner's plan for faiss (a :class:`~tfaploss.evaluation.searchers.SearchSpace`)."""

    name = "faiss"
    candidates = staticmethod(faiss_candidates)
    cost = staticmethod(faiss_cost)

    def check(self) -> None:
        import_faiss()

    def dominates(self, a: FaissSetting, b: FaissSetting) -> bool:
        """True when ``a`` finds at least every neighbour ``b`` finds: exact scores over
        as many lists or more of the same partition (both indexes train the same seeded
        k-means), or the same codes with as many lists and re-scores; for HNSW a wider
        beam on the same graph (monotone in practice, not by construction)."""
        if a.kind == "hnsw" or b.kind == "hnsw":
            return (a.kind == b.kind and a.hnsw_m == b.hnsw_m
                    and a.ef_search >= b.ef_search)
        if a.nlist != b.nlist or a.nprobe < b.nprobe:
            return False
        if a.kind == "ivf_flat":
            return True
        return b.kind == "ivf_pq" and a.k_factor >= b.k_factor

    def probe(self, setting: FaissSetting) -> FaissSetting | None:
        """IVF-Flat over the same lists bounds the recall of an IVF-PQ setting."""
        if setting.kind == "ivf_pq":
            return FaissSetting("ivf_flat", setting.nlist, setting.nprobe)
        return None

    def build(self, database, setting: FaissSetting, k: int, num_threads: int):
        return FaissSearcher(database, num_threads=num_threads, **setting.searcher_params())

    def configure(self, searcher: FaissSearcher, setting: FaissSetting) -> None:
        searcher.set_search_params(**setting.search_params())
