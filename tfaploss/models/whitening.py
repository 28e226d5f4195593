"""Post-hoc PCA whitening of descriptors ("square-rooted PCA", Revaud et al. ICCV'19),
learned after training and stored in the model as a layer (saved and exported with it):

    y = L2( (x - mu) . U^T / lambda^p )

``mu`` the descriptors' mean, ``U`` the covariance's eigenvectors (rows, by decreasing
eigenvalue ``lambda``), ``p = 0.25`` (full whitening: 0.5; its square root damps the
noisy low-variance directions less).
"""

from __future__ import annotations

import keras
import numpy as np
from keras import ops

from tfaploss.models.config_layer import ConfigLayer


@keras.saving.register_keras_serializable(package="tfaploss")
class PCAWhitening(ConfigLayer):
    """Apply a learned PCA whitening ``y = L2((x - mean) @ projection)``, ``projection``
    = ``U^T / lambda^p`` ``(D, units)`` fitted by ``fit_pca_whitening`` (non-trainable,
    saved with the model). ``power`` is recorded for reference (the weights include
    it); ``epsilon``: floor of the output norm. Cost: O(B·D·units).
    """

    CONFIG = ("units", "power", "l2_normalize", "epsilon")

    def __init__(self, units, power=0.25, l2_normalize=True, epsilon=1e-12, **kwargs):
        super().__init__(**kwargs)
        if int(units) < 1:
            raise ValueError(f"PCAWhitening: `units` must be >= 1, received units={units!r}")
        self.units = int(units)
        self.power = float(power)
        self.l2_normalize = bool(l2_normalize)
        self.epsilon = float(epsilon)

    def build(self, input_shape):
        dim = input_shape[-1]
        if dim is None or self.units > dim:
            raise ValueError(f"PCAWhitening: input dimension must be known and >= "
                             f"units={self.units}; received input_shape={input_shape}")
        self.mean = self.add_weight(name="mean", shape=(dim,), initializer="zeros",
                                    trainable=False)
        self.projection = self.add_weight(name="projection", shape=(dim, self.units),
                                          initializer="zeros", trainable=False)

    def call(self, inputs):
        x = ops.cast(inputs, self.compute_dtype)
        y = ops.matmul(x - ops.cast(self.mean, x.dtype), ops.cast(self.projection, x.dtype))
        if self.l2_normalize:
            norm = ops.sqrt(ops.sum(ops.square(y), axis=-1, keepdims=True))
            y = y / ops.maximum(norm, self.epsilon)
        return y

    def compute_output_shape(self, input_shape):
        return tuple(input_shape[:-1]) + (self.units,)


def pca_whitening_params(descriptors, power=0.25, dim=None, eigenvalue_floor=1e-6):
    """Fit ``(mean, projection, eigenvalues)`` of PCA whitening in float64 numpy.

    The covariance uses the unbiased ``1/(N-1)`` normalisation (as scikit-learn's
    ``explained_variance_``); the overall scale does not matter after the L2.
    Eigenvalues below ``eigenvalue_floor * max eigenvalue`` are raised to it so that
    directions with no variance (``N <= D``) are not blown up. Cost: O(N·D² + D³).
    """
    x = np.asarray(ops.convert_to_numpy(descriptors), dtype=np.float64)
    if x.ndim != 2 or x.shape[0] < 2:
        raise ValueError(
            "fit_pca_whitening: `descriptors` must be 2-D with at least 2 rows; received "
            f"shape {x.shape}"
        )
    n, d = x.shape
    dim = d if dim is None else int(dim)
    if not 1 <= dim <= d:
        raise ValueError(f"fit_pca_whitening: `dim` must be in [1, {d}]; received dim={dim!r}")
    if not power >= 0:
        raise ValueError(f"fit_pca_whitening: `power` must be >= 0; received power={power!r}")
    mean = x.mean(axis=0)
    centred = x - mean
    cov = centred.T @ centred / (n - 1)
    eigenvalues, eigenvectors = np.linalg.eigh(cov)
    order = np.argsort(eigenvalues)[::-1][:dim]
    eigenvalues = eigenvalues[order]
    eigenvectors = eigenvectors[:, order]  # columns = rows of U
    floor = max(eigenvalues[0], 0.0) * eigenvalue_floor
    eigenvalues = np.maximum(eigenvalues, floor if floor > 0 else np.finfo(np.float64).tiny)
    projection = eigenvectors / eigenvalues[None, :] ** power
    return mean, projection, eigenvalues


def fit_pca_whitening(descriptors, power=0.25, dim=None, eigenvalue_floor=1e-6,
                      l2_normalize=True, name="whitening"):
    """A built ``PCAWhitening`` layer fitted on training descriptors ``(N, D)`` (typically
    the L2-normalised training embeddings). ``power``: ``p`` in ``lambda^p`` (0.25:
    Revaud et al.'s square-rooted PCA, 0.5 full whitening, 0 a plain rotation);
    ``dim``: components kept (default all); ``eigenvalue_floor``: see
    :func:`pca_whitening_params`.
    """
    mean, projection, _ = pca_whitening_params(descriptors, power, dim, eigenvalue_floor)
    # float32 (float64 under a float64 policy) even under mixed precision: small
    # eigenvalues make the projection ill-conditioned in float16.
    layer = PCAWhitening(units=projection.shape[1], power=power, l2_normalize=l2_normalize,
                         name=name, dtype=keras.config.dtype_policy().variable_dtype)
    layer.build((None, projection.shape[0]))
    layer.mean.assign(mean.astype(layer.mean.dtype))
    layer.projection.assign(projection.astype(layer.projection.dtype))
    return layer


def with_whitening(model, whitening, name=None):
    """A new model ``images -> whitening(model(images))`` sharing ``model``'s weights.

    The result saves and exports as one model, whitening included.
    """
    inputs = keras.Input(shape=model.input_shape[1:], name="images")
    outputs = whitening(model(inputs))
    return keras.Model(inputs, outputs, name=name or f"{model.name}_whitened")
