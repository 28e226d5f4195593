"""AP-surrogate losses as ``keras.losses.Loss`` subclasses.

Use integer class labels as ``y_true`` and embeddings as ``y_pred``::

    model.compile(optimizer="adam", loss=tfaploss.losses.APLoss())
"""

from tfaploss.losses.base import RetrievalLoss
from tfaploss.losses.baselines import ContrastiveLoss, TripletLoss
from tfaploss.losses.blackbox import BlackBoxAPLoss
from tfaploss.losses.fastap import FastAPLoss
from tfaploss.losses.hap import ClusterProxies, HAPLoss
from tfaploss.losses.histogram import APLoss, TieAwareAPLoss
from tfaploss.losses.pnp import PNPLoss
from tfaploss.losses.recall_at_k import RecallAtKLoss
from tfaploss.losses.roadmap import CalibrationLoss, ROADMAPLoss
from tfaploss.losses.smooth_ap import SmoothAPLoss, SupAPLoss
from tfaploss.losses.suprank import SupNDCGLoss, SupRecallLoss
from tfaploss.losses.xbm import XBMLoss

__all__ = [
    "APLoss", "BlackBoxAPLoss", "CalibrationLoss", "ClusterProxies", "ContrastiveLoss",
    "FastAPLoss", "HAPLoss", "PNPLoss", "ROADMAPLoss", "RecallAtKLoss", "RetrievalLoss",
    "SmoothAPLoss", "SupAPLoss", "SupNDCGLoss", "SupRecallLoss", "TieAwareAPLoss",
    "TripletLoss", "XBMLoss",
]
