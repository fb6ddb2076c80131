"""CCA baseline: canonical correlation from covariance statistics accumulated over the stream.

The baseline of Menon, Surian and Chawla, SDM 2015 (Table 1) and of most cross-modal papers.
"""

from __future__ import annotations

from typing import Any

import numpy as np
from numpy.typing import NDArray

from streamxm.buffer.replay import ReplayBuffer
from streamxm.models.base import (
    Arrays,
    CrossModalModel,
    LearnStats,
    MergeParts,
    observe_triplet,
    require,
)
from streamxm.models.heads import LinearHead, power_features
from streamxm.models.moments import ResolveSchedule, RunningMoments, power_normalize, ridge_whitener
from streamxm.stream.messages import Pair

__all__ = ["CCA"]


class CCA(CrossModalModel, name="cca", online=False, shared_space=True):
    """Regularised CCA, re-solved from running moments; cosine similarity in ``k`` dimensions.

    Each arriving pair adds its (normalised) vectors to running sums of ``x``, ``y``, ``x x^T``,
    ``y y^T`` and ``x y^T`` (:class:`~streamxm.models.moments.RunningMoments`); nothing else of
    the pair is kept, so memory is ``O(d^2)`` however long the stream. The canonical directions
    are re-solved on a :class:`~streamxm.models.moments.ResolveSchedule` (after 32, 64, 128, ...
    pairs, then every ``solve_every``): with ``K_x (C_xx + r_x I) K_x^T = I`` (likewise ``K_y``),
    the SVD ``K_x C_xy K_y^T = U S V^T`` gives the projections ``P_x = K_x^T U_k`` and
    ``P_y = K_y^T V_k``. One streaming pass ends with the same statistics as the offline fit, so
    after a solve on the last pair the two are the same model; several passes over the same data
    leave the covariances unchanged.

    Choices where the paper is silent (each a parameter, tuned on the Wikipedia features in
    ``docs/benchmarks.md``):

    - inputs L2-normalised (``power=1``; ``0.5`` is the Hellinger map) before the moments;
    - ridge ``r = ridge * trace(C) / d`` on each modality's covariance (``ridge=0.3``): the
      unregularised solution over-fits the 128-d visual words (0.261 image->text vs 0.275);
    - each canonical coordinate is scaled by its correlation before the cosine
      (``scale_by_correlation``), so weakly correlated directions count less (0.275 vs 0.249
      image->text).

    Several ranks (``streamxm worker --world-size N``) **sum** their moments after each round:
    the statistics are sums over pairs, so the merged ones are exactly one learner's on the same
    pairs (up to float rounding), and the directions are re-solved from them when the round
    crossed a point of the schedule.

    Parameters
    ----------
    img_dim, txt_dim
        Input sizes.
    k
        Canonical components kept (capped at the smaller input size).
    ridge
        Relative ridge on each covariance.
    power
        Input power map before L2 normalisation.
    scale_by_correlation
        Weight coordinates by their canonical correlation.
    solve_first, solve_every
        Re-solve schedule (pairs).

    Examples
    --------
    >>> rng = np.random.default_rng(0)
    >>> z = rng.normal(size=(500, 2))
    >>> imgs = np.hstack([z, rng.normal(size=(500, 3))])
    >>> txts = np.hstack([z @ [[1.0, 0.5], [0.0, 1.0]], rng.normal(size=(500, 2))])
    >>> m = CCA(5, 4, k=2, ridge=0.0, power=1.0, solve_first=500)
    >>> m.fit_arrays(imgs, txts)
    >>> bool(m.correlations[0] > 0.5 and m.correlations[1] > 0.5)
    True
    """

    reads_labels = False

    def __init__(
        self, img_dim: int, txt_dim: int,
        k: int = 10,
        ridge: float = 0.3,
        power: float = 1.0,
        scale_by_correlation: bool = True,
        solve_first: int = 32, solve_every: int = 256,
    ) -> None:
        super().__init__(img_dim, txt_dim)
        require(locals(), k=">= 1", ridge=">= 0", power="> 0")
        self.k = min(int(k), img_dim, txt_dim)
        self.ridge = float(ridge)
        self.power = float(power)
        self.scale_by_correlation = bool(scale_by_correlation)
        self.solve_first, self.solve_every = solve_first, solve_every
        self.schedule = ResolveSchedule(solve_first, solve_every)
        self.moments = RunningMoments(img_dim, txt_dim)
        self.proj_x = np.zeros((img_dim, self.k))
        self.proj_y = np.zeros((txt_dim, self.k))
        self.mean_x = np.zeros(img_dim)
        self.mean_y = np.zeros(txt_dim)
        self.correlations = np.zeros(self.k)
        self.solves = 0

    def update(self, pair: Pair, slot: int, buffer: ReplayBuffer, rng: np.random.Generator,
                  stats: LearnStats) -> None:
        # CCA learns no triplets; once it has solved, one is scored before the update for the
        # mistake metrics and the drift detector (the model itself never reads the RNG).
        if self.solves:
            observe_triplet(self, pair, slot, buffer, rng, stats)
        self.moments.add(power_normalize(pair.img, self.power),
                         power_normalize(pair.txt, self.power))
        if self.schedule.due(self.moments.n):
            self.solve()

    def fit_arrays(self, imgs: NDArray[np.floating], txts: NDArray[np.floating]) -> None:
        """Add a whole batch to the statistics and solve (the offline fit)."""
        self.moments.add(power_normalize(imgs, self.power), power_normalize(txts, self.power))
        self.solve()

    def solve(self) -> None:
        """Canonical directions from the statistics so far."""
        m = self.moments
        if m.n < 2:
            return
        kx = ridge_whitener(m.cov_xx(), self.ridge)
        ky = ridge_whitener(m.cov_yy(), self.ridge)
        u, s, vt = np.linalg.svd(kx @ m.cov_xy() @ ky.T, full_matrices=False)
        self.proj_x = kx.T @ u[:, : self.k]
        self.proj_y = ky.T @ vt.T[:, : self.k]
        self.correlations = np.clip(s[: self.k], 0.0, None)
        self.mean_x, self.mean_y = m.mean_x(), m.mean_y()
        self.solves += 1

    def _embed(self, x: NDArray[np.floating], mean: NDArray[np.float64],
               proj: NDArray[np.float64]) -> NDArray[np.float32]:
        z = (power_normalize(np.atleast_2d(x), self.power) - mean) @ proj
        if self.scale_by_correlation:
            z = z * self.correlations
        return power_normalize(z).astype(np.float32)

    def embed_images(self, x: NDArray[np.floating]) -> NDArray[np.float32]:
        return self._embed(x, self.mean_x, self.proj_x)

    def linear_head(self, modality: str) -> LinearHead:
        """:meth:`_embed` as ``l2((x - mean) P c)``: weight ``P c``, bias ``-mean P c``."""
        mean, proj = ((self.mean_x, self.proj_x) if modality == "image"
                      else (self.mean_y, self.proj_y))
        if self.scale_by_correlation:
            proj = proj * self.correlations
        return LinearHead(power_features(self.power), proj, -(mean @ proj), "l2")

    def embed_texts(self, x: NDArray[np.floating]) -> NDArray[np.float32]:
        return self._embed(x, self.mean_y, self.proj_y)

    def merge_parts(self) -> MergeParts:
        return {k: ("sum", np.asarray(v)) for k, v in self.moments.sums("moments.").items()}

    def set_merged(self, merged: Arrays) -> None:
        self.moments.load_state(merged, "moments.")

    def after_merge(self, pairs_before: int, pairs_after: int, rng: np.random.Generator) -> None:
        if self.schedule.crossed(pairs_before, pairs_after):
            self.solve()

    def state(self) -> tuple[Arrays, dict[str, Any]]:
        arrays = {**self.moments.state("moments."), "proj_x": self.proj_x,
                  "proj_y": self.proj_y, "mean_x": self.mean_x, "mean_y": self.mean_y,
                  "correlations": self.correlations}
        return arrays, {"solves": self.solves}

    def load_state(self, arrays: Arrays, meta: dict[str, Any]) -> None:
        self.moments.load_state(arrays, "moments.")
        for key in ("proj_x", "proj_y", "mean_x", "mean_y", "correlations"):
            setattr(self, key, np.array(arrays[key], dtype=np.float64))
        self.solves = int(meta["solves"])
