"""Post-processing of descriptors: α-query expansion and learned PCA whitening.

* α-QE (Radenović et al., TPAMI 2019; reported by Revaud et al. ICCV'19): each query
  is replaced by the L2-normalised weighted sum of itself and its ``k`` nearest
  database descriptors, weights ``max(s_i, 0)^α`` (the query's own weight is 1).
  Defaults ``alpha=2``, ``k=10``.
* PCA whitening (Radenović et al.; Revaud et al. use the square-rooted variant):
  ``x -> normalize((x - mean) U^T / lambda^power)``, learned on training
  descriptors; ``power=0.5`` is full whitening, ``0.25`` the "square-rooted PCA".
"""

from __future__ import annotations

import json

import numpy as np

from tfaploss.evaluation.arrays import check_int


def _l2n(x: np.ndarray) -> np.ndarray:
    return x / np.maximum(np.linalg.norm(x, axis=-1, keepdims=True), 1e-12)


def alpha_query_expansion(queries, database, alpha: float = 2.0, k: int = 10,
                          searcher=None, exclude=None) -> np.ndarray:
    """α-QE of ``queries`` against ``database``; returns new (Q, D) unit vectors.

    ``exclude`` (one database index per query, as in :meth:`Searcher.search`) keeps a
    query that is itself a database row from being counted as its own neighbour.

    Cost: one top-``k`` search plus ``O(Q k D)``.
    """
    from tfaploss.evaluation.exact_search import ExactSearcher

    if alpha < 0:
        raise ValueError(f"`alpha` must be >= 0; received {alpha!r}.")
    check_int("k", k)
    queries = np.asarray(queries, np.float32)
    database = np.asarray(database, np.float32)
    searcher = searcher or ExactSearcher(database)
    idx, scores = searcher.search(queries, k, exclude=exclude)
    weights = np.maximum(scores, 0.0) ** alpha  # (Q, k)
    neighbours = database[idx]  # (Q, k, D)
    expanded = queries + np.einsum("qk,qkd->qd", weights, neighbours)
    return _l2n(expanded).astype(np.float32)


class PCAWhitening:
    """Learned PCA whitening, NumPy only, saved as JSON.

    Args:
      dim: output dimension (``None`` keeps all).
      power: eigenvalue exponent (0.5 = whitening, 0.25 = square-rooted PCA).
      eps: added to eigenvalues before the power, for stability.
    """

    def __init__(self, dim: int | None = None, power: float = 0.5, eps: float = 1e-6):
        check_int("dim", dim, none=True)
        self.dim, self.power, self.eps = dim, float(power), float(eps)
        self.mean = self.projection = None

    def fit(self, x) -> PCAWhitening:
        x = np.asarray(x, np.float64)
        if x.ndim != 2 or x.shape[0] < 2:
            raise ValueError(f"`x` must be (n >= 2, D); received shape {x.shape}.")
        dim = self.dim or x.shape[1]
        if dim > x.shape[1]:
            raise ValueError(f"`dim`={dim} exceeds the descriptor dimension {x.shape[1]}.")
        self.mean = x.mean(axis=0)
        cov = np.cov(x - self.mean, rowvar=False)
        eigval, eigvec = np.linalg.eigh(cov)
        order = np.argsort(eigval)[::-1][:dim]
        eigval, eigvec = eigval[order], eigvec[:, order]
        self.projection = (eigvec / (np.maximum(eigval, 0) + self.eps) ** self.power).T
        return self

    def transform(self, x) -> np.ndarray:
        if self.projection is None:
            raise ValueError("PCAWhitening is not fitted; call fit() first.")
        x = np.asarray(x, np.float64)
        return _l2n((x - self.mean) @ self.projection.T).astype(np.float32)

    def to_json(self) -> str:
        return json.dumps({"dim": self.dim, "power": self.power, "eps": self.eps,
                           "mean": None if self.mean is None else self.mean.tolist(),
                           "projection": None if self.projection is None
                           else self.projection.tolist()})

    @classmethod
    def from_json(cls, text: str) -> PCAWhitening:
        d = json.loads(text)
        obj = cls(d["dim"], d["power"], d["eps"])
        if d["mean"] is not None:
            obj.mean = np.asarray(d["mean"])
            obj.projection = np.asarray(d["projection"])
        return obj
