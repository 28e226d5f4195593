"""``evaluate``: embed, search, score, and report as a table, JSON and figures.

Protocols and their default cut-offs:

================ ======================== =========================================
protocol         ks                       what
================ ======================== =========================================
``retrieval``    1, 10, 100               query set = database (self removed by index)
``sop``          1, 10, 100, 1000         Stanford Online Products (ROADMAP, FastAP)
``inaturalist``  1, 4, 16, 32             iNaturalist-2018 (Smooth-AP, ROADMAP)
``cub``/``cars`` 1, 2, 4, 8               CUB-200 / Cars-196
``revisited``    mP@1, 5, 10              ROxford5k / RParis6k, easy/medium/hard
``gldv2``        mAP@100                  Google Landmarks v2 retrieval
================ ======================== =========================================

``retrieval``-style protocols also accept a separate query set (``query=...``).

Every report states how the neighbours were searched (``details["search"]`` and a
``search:`` line under the table): the backend, the setting, and its recall@k (k: the
largest cut-off) against exact search on a sample, with its 95 % Wilson interval.
``revisited`` and ``gldv2`` need the query set and the ground truth (``gnd``).
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
from typing import Any

import numpy as np

from tfaploss import extras
from tfaploss.durable import atomic
from tfaploss.evaluation.embed import embed_dataset, split_element
from tfaploss.evaluation.embedding_files import load_embeddings
from tfaploss.evaluation.metrics import check_ks
from tfaploss.evaluation.retrieval import retrieval_metrics
from tfaploss.evaluation.search import build_searcher, search_report
from tfaploss.evaluation.search_plan import SearchPlan
from tfaploss.extras import MissingExtraError
from tfaploss.log import reporting

LOG = logging.getLogger(__name__)

__all__ = ["EvaluationResult", "embed_dataset", "evaluate", "load_embeddings"]

_PROTOCOL_KS = {
    "retrieval": (1, 10, 100), "sop": (1, 10, 100, 1000), "inaturalist": (1, 4, 16, 32),
    "cub": (1, 2, 4, 8), "cars": (1, 2, 4, 8),
    "revisited": (1, 5, 10), "roxford": (1, 5, 10), "rparis": (1, 5, 10), "gldv2": (100,),
}
PROTOCOLS = tuple(_PROTOCOL_KS)
_REVISITED = ("revisited", "roxford", "rparis")
# What `gnd` is for the protocols that need it (and a separate query set).
_GND_HELP = {**dict.fromkeys(_REVISITED, "the ground truth list, or the gnd_*.json path "
                             "that tfaploss.pipelines.revisited wrote"),
             "gldv2": "per-query lists of relevant database indices"}


class EvaluationResult:
    """Metrics of one evaluation, plus how they were obtained.

    ``result["recall@1"]`` reads a metric; ``print(result)`` shows a table;
    :meth:`save_json` writes ``{"protocol", "metrics", "details"}``.
    """

    def __init__(self, protocol: str, metrics: dict[str, float], details: dict[str, Any],
                 figures: list[str] | None = None):
        self.protocol = protocol
        self.metrics = dict(metrics)
        self.details = details
        self.figures = list(figures or [])

    def __getitem__(self, key: str) -> float:
        return self.metrics[key]

    def __contains__(self, key: str) -> bool:
        return key in self.metrics

    def to_dict(self) -> dict[str, Any]:
        return {"protocol": self.protocol, "metrics": self.metrics,
                "details": _jsonable(self.details), "figures": self.figures}

    def save_json(self, path: str) -> str:
        os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
        # Whole or absent, and a full disk is one DiskFullError naming the file.
        atomic.atomic_write_text(path, json.dumps(self.to_dict(), indent=2),
                                 fault="metrics")
        return path

    def table(self) -> str:
        width = max(len(k) for k in self.metrics)
        lines = [f"{'metric':<{width}}  value", f"{'-' * width}  ------"]
        lines += [f"{k:<{width}}  {100.0 * v:6.2f}" for k, v in self.metrics.items()]
        notes = [f"protocol: {self.protocol} (values in %)"]
        for key in ("backend", "num_queries", "num_database", "depth", "lone_queries"):
            if key in self.details:
                notes.append(f"{key}: {self.details[key]}")
        if self.details.get("search"):
            notes.append(describe_search(self.details["search"]))
        if self.details.get("map_is_lower_bound"):
            notes.append("map: computed on a truncated or approximate ranking, a lower bound")
        if self.details.get("lower_bound"):
            notes.append("revisited mAP: ranking truncated by the searcher, a lower bound")
        for k, v in self.details.get("conventions", {}).items():
            notes.append(f"{k}: {v}")
        return "\n".join(lines + [""] + notes)

    __str__ = table

    def __repr__(self) -> str:
        return f"EvaluationResult(protocol={self.protocol!r}, metrics={self.metrics!r})"


def describe_search(search: dict[str, Any]) -> str:
    """One line: backend, setting, recall@k on the sample with its interval, speed."""
    k = search.get("k")
    if search.get("backend") == "exact" and not search.get("tuned"):
        return f"search: exact, recall@{k} 1 (exact search)"
    lo, hi = search["recall_ci"]
    if search.get("backend") == "exact":  # a tuner that fell back
        line = f"search: exact, recall@{k} 1 (tuning fell back: {search.get('reason')})"
    else:
        line = (f"search: {search['backend']}, {search['setting']}; recall@{k} "
                f"{search['recall']:.4f} (95% Wilson CI {lo:.4f}-{hi:.4f}) on "
                f"{search['num_sample_queries']} sample queries")
    if search.get("tuned"):
        line += f"; target {search['target_recall']:g}"
        if search.get("backend") != "exact":
            line += f", {search['speedup']:.2f}x exact q/s ({search['speed']})"
        line += f", {search['settings_tried']} settings tried in {search['seconds']:.1f} s"
    return line


def _jsonable(obj):
    if isinstance(obj, dict):
        return {str(k): _jsonable(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [_jsonable(v) for v in obj]
    if isinstance(obj, np.ndarray):
        return _jsonable(obj.tolist())
    if isinstance(obj, np.generic):
        return obj.item()
    if isinstance(obj, float) and not np.isfinite(obj):
        return None
    return obj


def _is_dataset(x) -> bool:
    import tensorflow as tf

    return isinstance(x, tf.data.Dataset)


def _resolve(model_or_embeddings, data, labels, verbose, what: str):
    """Embeddings, labels and the model (None without one) from a model + dataset, an
    array + labels, or a directory written by the embed job."""
    if _is_dataset(model_or_embeddings):
        raise ValueError(f"a {what} dataset was given but no model to embed it: pass a model "
                         "as `model_or_embeddings`, or embeddings instead of the dataset.")
    if isinstance(model_or_embeddings, (str, os.PathLike)):
        emb, lab, _ = load_embeddings(str(model_or_embeddings))
        return emb, (lab if labels is None else np.asarray(labels)), None
    if isinstance(model_or_embeddings, np.ndarray) or hasattr(model_or_embeddings, "numpy"):
        emb = np.asarray(model_or_embeddings, np.float32)
        if labels is None and data is not None and not _is_dataset(data):
            labels = data  # evaluate(embeddings, labels)
        return emb, (None if labels is None else np.asarray(labels)), None
    if data is None:
        raise ValueError(f"a model was given but no {what} dataset to embed.")
    if not callable(model_or_embeddings):
        raise TypeError(f"`model_or_embeddings` must be a Keras model, a callable, an "
                         f"array of embeddings or a path; got {type(model_or_embeddings)}.")
    emb, lab, _ = embed_dataset(model_or_embeddings, data, verbose)
    return emb, (lab if labels is None else np.asarray(labels)), model_or_embeddings


def evaluate(model_or_embeddings, dataset=None, protocol: str = "retrieval", *,
             labels=None, query=None, query_labels=None, gnd=None, ks=None,
             backend: str | SearchPlan = "auto", target_recall: float | None = None,
             query_expansion: bool = False, qe_alpha: float = 2.0,
             qe_k: int = 10, whitening=None, depth: int | None = None,
             output_dir: str | None = None,
             figures: bool = True, num_examples: int = 6, examples_k: int = 5,
             label_names=None, verbose: int = 1, **searcher_kwargs) -> EvaluationResult:
    """Evaluate retrieval and return an :class:`EvaluationResult`.

    Args:
      model_or_embeddings: a Keras model (or any callable images -> embeddings), a
        (N, D) array of database embeddings, or an embed job's output directory.
      dataset: the database: a batched ``tf.data.Dataset`` of ``(images, labels)`` or
        ``(images, labels, ids)`` when a model is given; with an array of embeddings it
        may instead be the labels array.
      protocol: one of :data:`PROTOCOLS`.
      labels: database labels (overrides the dataset's).
      query, query_labels: a separate query set (dataset, embeddings or embed-job
        directory); ``None`` = the database is the query set.
      gnd: revisited ground truth (list of dicts or a file path) or, for ``gldv2``,
        per-query lists of relevant database indices.
      ks: cut-offs; default per protocol.
      backend, target_recall: a :class:`~tfaploss.evaluation.search_plan.SearchPlan`,
        or its backend (default ``"auto"``) and target recall (default ``None``: no
        tuning); its k defaults to the largest cut-off. With a target,
        ``searcher_kwargs`` go to the tuner (``max_settings``, ``max_seconds``, ...).
      query_expansion: apply α-QE (``qe_alpha``, ``qe_k``) to the queries.
      whitening: a fitted :class:`~tfaploss.evaluation.PCAWhitening` applied to
        queries and database.
      depth: ranking length read by the metrics (``map_depth`` of
        :func:`retrieval_metrics`; revisited with a searcher: default 1,000); shorter
        than the database, mAP is a lower bound.
      output_dir: where to write ``metrics.json`` (first) and the figures; a figure
        that cannot be drawn is skipped with a warning, never the metrics.
      figures: write figures into ``output_dir`` (retrieval examples when a dataset
        of images was given; per-query AP for revisited).
      label_names: optional mapping label -> class name shown in the figures.
      verbose: progress bars, and the table at the end (logged at INFO; see
        :func:`tfaploss.log.reporting`).
    """
    if protocol not in PROTOCOLS:
        raise ValueError(f"`protocol` must be one of {PROTOCOLS}; received {protocol!r}.")
    # Checked before embedding, so a bad value fails at once rather than after the model ran.
    ks = check_ks(ks) if ks is not None else _PROTOCOL_KS[protocol]
    plan = SearchPlan.of(backend, target_recall).with_k(max(ks))
    db, db_labels, model = _resolve(model_or_embeddings, dataset, labels, verbose, "database")
    q = q_labels = None
    if query is not None:
        embed = model is not None and _is_dataset(query)  # with the database's model
        q, q_labels, _ = _resolve(model if embed else query, query if embed else None,
                                  query_labels, verbose, "query")

    if whitening is not None:
        db = whitening.transform(db)
        q = whitening.transform(q) if q is not None else None
    if query_expansion:
        from tfaploss.evaluation.query_expansion import alpha_query_expansion

        if q is None:  # the database is the query set: a query is not its own neighbour
            q = alpha_query_expansion(db, db, alpha=qe_alpha, k=qe_k,
                                      exclude=np.arange(len(db)))
        else:
            q = alpha_query_expansion(q, db, alpha=qe_alpha, k=qe_k)

    if protocol in _GND_HELP and (q is None or gnd is None):
        raise ValueError(f"the {protocol} protocol needs `query=` and `gnd=` "
                         f"({_GND_HELP[protocol]}).")
    if protocol not in _GND_HELP and db_labels is None:
        raise ValueError("retrieval protocols need database labels: pass `labels=` or a "
                         "dataset yielding (images, labels).")
    if protocol not in _GND_HELP and query is not None and q_labels is None:
        raise ValueError("the query set has no labels: pass `query_labels=`.")
    drawers = []  # the figures, drawn once metrics.json is written
    if output_dir:
        os.makedirs(output_dir, exist_ok=True)
    # One searcher for every protocol, built (and tuned) once; exact revisited needs
    # none: it ranks the whole score matrix, so its mAP is exact at any database size.
    tuning_queries = q if query is not None else None
    searcher = (None if protocol in _REVISITED and plan.resolved == "exact"
                and plan.target_recall is None
                else _build(db, plan, tuning_queries, searcher_kwargs, verbose))
    if protocol in _REVISITED:
        metrics, details = _evaluate_revisited(q, db, gnd, ks, searcher, depth)
        aps = details["per_query_ap_medium"]
        drawers.append(("per-query AP", lambda: _per_query_ap_figure(aps, output_dir)))
    elif protocol == "gldv2":
        metrics, details = _evaluate_gldv2(q, db, gnd, ks, searcher)
    else:
        # q is None: self-retrieval. Else a query set, or α-expanded database rows, which
        # differ from their rows: ranked with their own row removed by index.
        expanded = q is not None and query is None
        sets = (db, db_labels, None, None) if q is None else (
            q, db_labels if expanded else q_labels, db, db_labels)
        metrics, details = retrieval_metrics(
            *sets, ks=ks, searcher=searcher, map_depth=depth, return_details=True,
            progress=bool(verbose), exclude=np.arange(len(q)) if expanded else None)
        if model is not None and _is_dataset(dataset):
            drawers.append(("retrieval examples", lambda: _retrieval_figure(
                searcher, db, db_labels, q, q_labels, dataset, query, output_dir,
                num_examples, examples_k, label_names)))
        details.pop("per_query", None)
    details["search"] = search_report(searcher, db, plan.tuned_k, tuning_queries)
    details["query_expansion"] = ({"alpha": qe_alpha, "k": qe_k} if query_expansion else None)
    details["whitening"] = whitening is not None
    result = EvaluationResult(protocol, metrics, details)
    if output_dir:
        path = result.save_json(os.path.join(output_dir, "metrics.json"))
        if figures and drawers:
            result.figures = _draw(drawers)
            if result.figures:  # metrics.json lists them
                result.save_json(path)
    if verbose:
        with reporting():
            LOG.info("%s", result.table())
    return result


def _draw(drawers) -> list[str]:
    """Draw each figure; one that cannot be drawn is skipped with a warning, but a full
    disk ends the evaluation, so that the rerun writes what an unfailed run writes."""
    paths = []
    for what, draw in drawers:
        try:
            paths.append(draw())
        except atomic.DiskFullError:
            raise
        except MissingExtraError as err:
            LOG.warning("warning: figure skipped (%s): %s", what, err)
        except Exception as err:  # noqa: BLE001  (a figure never costs the metrics)
            LOG.warning("warning: figure skipped (%s): %s: %s", what, type(err).__name__,
                        err)
    return paths


def _per_query_ap_figure(aps, output_dir: str) -> str:
    figures = _figures("the per-query AP figure")
    return figures.plot_per_query_ap(
        aps, os.path.join(output_dir, "per_query_ap_medium.png"),
        title="revisited, medium protocol: per-query AP")


def _figures(what: str):
    """:mod:`tfaploss.evaluation.figures`, once matplotlib is known to import."""
    extras.import_extra("viz", what, "matplotlib")
    from tfaploss.evaluation import figures

    return figures


def _build(db, plan, queries, searcher_kwargs, verbose=0):
    if plan.target_recall is None:
        return build_searcher(db, plan, **searcher_kwargs)
    # The tuner's progress lines (INFO) are shown as the table is (see reporting()).
    with reporting() if verbose else contextlib.nullcontext():
        return build_searcher(db, plan, queries=queries, **searcher_kwargs)


def _evaluate_revisited(q, db, gnd, ks, searcher, depth):
    from tfaploss.evaluation import revisited

    if isinstance(gnd, (str, os.PathLike)):
        gnd = revisited.load_revisited_gnd(str(gnd))["gnd"]
    metrics: dict[str, float] = {}
    details: dict[str, Any] = {"backend": "exact", "num_queries": len(q),
                               "num_database": len(db)}
    if searcher is None:
        scores = q @ db.T  # revisited sets have ~70 queries: (70 x N) fits at 1M
        for p in revisited.PROTOCOLS:
            r = revisited.revisited_map(scores, gnd, protocol=p, ks=ks)
            metrics.update({f"{p}/{k}": v for k, v in r.items()})
        aps = revisited.revisited_per_query_ap(scores, gnd, "medium")
    else:
        depth = min(len(db), depth or 1000)
        ranks, _ = searcher.search(q, depth)
        lower = False
        for p in revisited.PROTOCOLS:
            r = revisited.revisited_map_from_ranks(ranks, gnd, protocol=p, ks=ks,
                                                   database_size=len(db))
            lower = lower or r.pop("lower_bound") or searcher.approximate
            metrics.update({f"{p}/{k}": v for k, v in r.items()})
        details.update(depth=depth, lower_bound=lower, backend=searcher.backend)
        aps = revisited.revisited_per_query_ap(None, gnd, "medium", ranks=ranks)
    details["per_query_ap_medium"] = aps
    return metrics, details


def _evaluate_gldv2(q, db, gnd, ks, searcher):
    from tfaploss.evaluation.metrics import gldv2_map_at_k

    k = max(ks)
    ranks, _ = searcher.search(q, k)
    return ({f"map@{k}": gldv2_map_at_k(ranks, gnd, k=k)},
            {"backend": searcher.backend, "num_queries": len(q), "num_database": len(db)})


def _gather_images(dataset, wanted: np.ndarray) -> dict[int, np.ndarray]:
    """Images at the given dataset positions (one more pass over the dataset)."""
    wanted_set = {int(i) for i in wanted}
    found: dict[int, np.ndarray] = {}
    offset = 0
    for element in dataset:
        images, _, _ = split_element(element)
        images = np.asarray(images)
        for j in range(len(images)):
            if offset + j in wanted_set:
                found[offset + j] = images[j]
        offset += len(images)
        if len(found) == len(wanted_set):
            break
    return found


def _retrieval_figure(searcher, db, db_labels, q, q_labels, dataset, query, output_dir,
                      num_examples, k, label_names=None):
    figures = _figures("the retrieval-examples figure")
    self_mode = query is None
    queries = db if self_mode else q
    qlab = db_labels if self_mode else q_labels
    n = min(num_examples, len(queries))
    # Evenly spread queries rather than the first few (which often share a class).
    chosen = np.unique(np.linspace(0, len(queries) - 1, n).astype(np.int64))
    idx, scores = searcher.search(queries[chosen], k, exclude=chosen if self_mode else None)
    rel = db_labels[idx] == qlab[chosen][:, None]
    db_imgs = _gather_images(dataset, np.concatenate([idx.reshape(-1), chosen if self_mode
                                                      else np.zeros(0, np.int64)]))
    q_imgs = db_imgs if self_mode else _gather_images(query, chosen)
    path = os.path.join(output_dir, "retrieval_examples.png")
    return figures.plot_retrieval_examples(
        [q_imgs[int(i)] for i in chosen],
        [[db_imgs[int(j)] for j in row] for row in idx], rel, path, scores=scores,
        query_titles=[f"query {int(i)} ({_label_title(qlab[i], label_names)})"
                      for i in chosen])


def _label_title(label, label_names) -> str:
    """``class NAME`` from a label map (JSON keys are strings), else ``label N``."""
    if label_names:
        name = label_names.get(int(label), label_names.get(str(int(label))))
        if name is not None:
            return f"class {name}"
    return f"label {label}"
