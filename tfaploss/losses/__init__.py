"""AP-surrogate losses as ``keras.losses.Loss`` subclasses: integer class labels as
``y_true``, embeddings as ``y_pred``."""

from tfaploss.losses.base import RetrievalLoss
from tfaploss.losses.baselines import ContrastiveLoss, TripletLoss
from tfaploss.losses.blackbox import BlackBoxAPLoss
from tfaploss.losses.fastap import FastAPLoss
from tfaploss.losses.hap import HAPLoss
from tfaploss.losses.histogram import APLoss, TieAwareAPLoss
from tfaploss.losses.multi_similarity import MultiSimilarityLoss
from tfaploss.losses.pnp import PNPLoss
from tfaploss.losses.proxies import ClassProxies, ClusterProxies, proxies_multipliers
from tfaploss.losses.proxy_anchor import ProxyAnchorLoss
from tfaploss.losses.recall_at_k import RecallAtKLoss
from tfaploss.losses.roadmap import CalibrationLoss, ROADMAPLoss
from tfaploss.losses.smooth_ap import SmoothAPLoss, SupAPLoss
from tfaploss.losses.supcon import SupConLoss
from tfaploss.losses.suprank import SupNDCGLoss, SupRecallLoss
from tfaploss.losses.xbm import XBMLoss

__all__ = [
    "APLoss", "BlackBoxAPLoss", "CalibrationLoss", "ClassProxies", "ClusterProxies",
    "ContrastiveLoss", "FastAPLoss", "HAPLoss", "MultiSimilarityLoss", "PNPLoss",
    "ProxyAnchorLoss", "ROADMAPLoss", "RecallAtKLoss", "RetrievalLoss", "SmoothAPLoss",
    "SupAPLoss", "SupConLoss", "SupNDCGLoss", "SupRecallLoss", "TieAwareAPLoss",
    "TripletLoss", "XBMLoss", "proxies_multipliers",
]
