"""Cross-batch memory (XBM; Wang et al., "Cross-Batch Memory for Embedding Learning",
CVPR 2020), used as a baseline in ROADMAP (Ramzi et al., NeurIPS 2021, Table 2).

The ring buffer lives in :mod:`tfaploss.losses.xbm`, shared by
:class:`tfaploss.losses.XBMLoss` (a plain ``compile``/``fit``) and
:class:`tfaploss.training.MultiStageModel` (``xbm_size``), which threads its variables
through the stateless step on JAX and PyTorch; it is re-exported here.
"""

from tfaploss.losses.xbm import CrossBatchMemory

__all__ = ["CrossBatchMemory"]
