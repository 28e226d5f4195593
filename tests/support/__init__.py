"""Helpers the tests share (no tests here)."""

import pytest

from tfaploss import extras

# Tests of ScaNN itself: skipped where the scann extra is not installed (it is built for
# TensorFlow 2.20, so the suite on 2.21 runs without it). `installed` imports nothing:
# this package is imported by the JAX and PyTorch runs, which must not load TensorFlow.
needs_scann = pytest.mark.skipif(not extras.installed("scann"),
                                 reason='ScaNN not installed: pip install "tfaploss[scann]"')
