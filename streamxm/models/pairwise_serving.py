"""The pairwise classifier's serving side: its embeddings and the fixed space's queries.

Menon, Surian and Chawla, "Cross-Modal Retrieval: A Pairwise Classification Approach",
SDM 2015, Sec. 4: ``s(a, b) = <f(a), W f(b)>`` over the whitened features.
"""

from __future__ import annotations

import numpy as np
from numpy.typing import NDArray

from streamxm.models.embedding import EmbeddingKind, fixed_space_or_towers
from streamxm.models.pairwise_features import WhitenedFeatures

__all__ = ["PairwiseServing"]


class PairwiseServing(WhitenedFeatures):
    """The serving side of :class:`~streamxm.models.pairwise.PairwiseLogistic`, a base of it:
    images embed as ``f(a) W``, texts as ``f(b)``; at ``power`` 1 the score is bilinear in the
    unit rows, so the gallery is searched in a fixed space by the queries built here."""

    #: The weights over the cross-product features (set by the classifier).
    W: NDArray[np.float32]

    def embed_images(self, x: NDArray[np.floating]) -> NDArray[np.float32]:
        return np.asarray(self.image_features(x) @ self.W, dtype=np.float32)

    def embed_texts(self, x: NDArray[np.floating]) -> NDArray[np.float32]:
        return self.text_features(x)

    def embedding(self) -> EmbeddingKind:
        return fixed_space_or_towers(self)

    @property
    def fixed_space(self) -> bool:
        # f(x) = [white (unit(x)^power - mean), 1]: bilinear in the unit rows only at power 1.
        return self.power == 1.0

    def _fixed_queries(
        self, left: NDArray[np.floating], white: NDArray[np.float64], mean: NDArray[np.float64]
    ) -> tuple[NDArray[np.float64], NDArray[np.float64]]:
        # s = a . [white (u - mean), 1] = (white^T a[:-1]) . u - (white^T a[:-1]) . mean + a[-1]
        a = left.astype(np.float64)
        q = a[:, :-1] @ white
        return q, a[:, -1] - q @ mean

    def queries_for_texts(
        self, imgs: NDArray[np.floating]
    ) -> tuple[NDArray[np.float64], NDArray[np.float64]]:
        return self._fixed_queries(self.embed_images(imgs), self.white_y, self.mean_y)

    def queries_for_images(
        self, txts: NDArray[np.floating]
    ) -> tuple[NDArray[np.float64], NDArray[np.float64]]:
        left = self.text_features(txts).astype(np.float64) @ self.W.T.astype(np.float64)
        return self._fixed_queries(left, self.white_x, self.mean_x)
