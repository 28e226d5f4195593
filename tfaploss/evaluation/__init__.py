"""Retrieval evaluation: searchers (exact / ScaNN / faiss, tuned to a recall or not), the
metrics the papers report, revisited Oxford/Paris, query expansion and whitening,
``evaluate`` and figures. ScaNN, faiss, matplotlib and Keras are imported only by the
functions that need them.
"""

from tfaploss.evaluation.embed import embed_dataset
from tfaploss.evaluation.evaluator import EvaluationResult, evaluate, load_embeddings
from tfaploss.evaluation.exact_search import ExactSearcher
from tfaploss.evaluation.faiss_search import FaissSearcher, faiss_params
from tfaploss.evaluation.metrics import gldv2_map_at_k, hierarchical_metrics
from tfaploss.evaluation.query_expansion import PCAWhitening, alpha_query_expansion
from tfaploss.evaluation.retrieval import retrieval_metrics
from tfaploss.evaluation.revisited import (
    load_revisited_gnd,
    revisited_map,
    revisited_map_from_ranks,
    revisited_per_query_ap,
    trapezoid_ap,
)
from tfaploss.evaluation.scann_search import ScannSearcher, scann_ah_params
from tfaploss.evaluation.search import build_searcher, search_report
from tfaploss.evaluation.search_plan import BACKENDS, SearchPlan
from tfaploss.evaluation.searchers import Searcher, load_searcher
from tfaploss.evaluation.tuner import measure_recall, tune_searcher

__all__ = [
    "BACKENDS", "EvaluationResult", "ExactSearcher", "FaissSearcher", "PCAWhitening",
    "ScannSearcher", "SearchPlan", "Searcher", "alpha_query_expansion", "build_searcher",
    "embed_dataset", "evaluate", "faiss_params", "gldv2_map_at_k", "hierarchical_metrics",
    "load_embeddings", "load_revisited_gnd", "load_searcher", "measure_recall",
    "retrieval_metrics", "revisited_map", "revisited_map_from_ranks",
    "revisited_per_query_ap", "scann_ah_params", "search_report", "trapezoid_ap",
    "tune_searcher",
]
