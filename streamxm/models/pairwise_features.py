"""The pairwise classifier's inputs: power-mapped, L2-normalised, centred and whitened by
their running covariance, with a constant 1 appended.

Menon, Surian and Chawla, "Cross-Modal Retrieval: A Pairwise Classification Approach",
SDM 2015, Sec. 5.1.
"""

from __future__ import annotations

import numpy as np
from numpy.typing import NDArray
from scipy.linalg.blas import dtrmv as _trmv

from streamxm.models.base import CrossModalModel
from streamxm.models.history import History
from streamxm.models.moments import RunningMoments, append_constant, power_normalize, ridge_whitener
from streamxm.models.slots import SlotRows

__all__ = ["WhitenedFeatures"]


class WhitenedFeatures(CrossModalModel):
    """The features of :class:`~streamxm.models.pairwise.PairwiseLogistic`, a base of it: the
    inputs' running moments and the whiteners refreshed from them. Reads the settings that the
    classifier's constructor sets (the attributes are documented there)."""

    power: float
    whiten: bool
    ridge: float

    def __init__(self, img_dim: int, txt_dim: int) -> None:
        super().__init__(img_dim, txt_dim)
        self.moments = RunningMoments(img_dim, txt_dim, cross=False)
        self.mean_x = np.zeros(img_dim)
        self.mean_y = np.zeros(txt_dim)
        self.white_x = np.eye(img_dim)
        self.white_y = np.eye(txt_dim)
        self._cache = SlotRows()

    def _features(
        self, x: NDArray[np.floating], mean: NDArray[np.float64], white: NDArray[np.float64]
    ) -> NDArray[np.float32]:
        centred = power_normalize(np.atleast_2d(x), self.power) - mean
        if not self.whiten:
            z = centred  # the whitener is the identity
        elif len(centred) == 1:
            # One row (the arriving pair, a stale slot): a triangular product reads the half of
            # the lower-triangular whitener that is not zero.
            z = _triangular_product(white, centred[0])[None, :]
        else:
            z = centred @ white.T
        return append_constant(z).astype(np.float32)

    def image_features(self, x: NDArray[np.floating]) -> NDArray[np.float32]:
        return self._features(x, self.mean_x, self.white_x)

    def text_features(self, x: NDArray[np.floating]) -> NDArray[np.float32]:
        return self._features(x, self.mean_y, self.white_y)

    def buffer_features(
        self, history: History, rows: NDArray[np.intp]
    ) -> tuple[NDArray[np.float32], NDArray[np.float32]]:
        """:meth:`image_features` and :meth:`text_features` of the pairs stored at ``rows``,
        each stored pair whitened once per whitener (:class:`~streamxm.models.slots.SlotRows`)."""
        return self._cache.rows(history, rows, self.image_features, self.text_features)

    def _refresh_whitener(self) -> None:
        m = self.moments
        self.mean_x, self.mean_y = m.mean_x(), m.mean_y()
        if self.whiten:
            self.white_x = ridge_whitener(m.cov_xx(full=False), self.ridge, overwrite=True)
            self.white_y = ridge_whitener(m.cov_yy(full=False), self.ridge, overwrite=True)
        self._cache.clear()


def _triangular_product(lower: NDArray[np.float64], v: NDArray[np.float64]) -> NDArray[np.float64]:
    """``lower @ v`` for a lower-triangular matrix, BLAS ``trmv`` on its own layout (a copy of
    the whitener into the other order would cost more than the product saves)."""
    if lower.flags.f_contiguous:
        return np.asarray(_trmv(lower, v, lower=1))
    return np.asarray(_trmv(lower.T, v, lower=0, trans=1))  # C order: the transpose is F
