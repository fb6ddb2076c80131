"""CCA baseline: canonical correlation from covariance statistics accumulated over the stream.

The baseline of Menon, Surian and Chawla, SDM 2015 (Table 1) and of most cross-modal papers.
"""

from __future__ import annotations

from typing import Any

import numpy as np
from numpy.typing import NDArray
from scipy.linalg import solve_triangular
from scipy.linalg.blas import dtrsm

from streamxm.models.base import (
    Arrays,
    LearnStats,
    MergeParts,
    observe_triplet,
    require,
)
from streamxm.models.embedding import EmbeddingKind, linear_heads
from streamxm.models.heads import LinearHead, power_features
from streamxm.models.history import Example, History
from streamxm.models.moments import (
    ResolveSchedule,
    RunningMoments,
    covariance_work,
    fold_work,
    power_normalize,
    power_normalize_work,
    ridge_cholesky,
    ridge_cholesky_work,
    top_singular,
)
from streamxm.models.opt_in import CountsWork, MergesRanks
from streamxm.models.state_arrays import ArrayAttributes, attribute_arrays, restore_attribute_arrays
from streamxm.models.work import Work, elementwise, gemm

__all__ = ["CCA"]

#: What a solve sets, kept by a checkpoint beside the running sums.
_SOLVED: ArrayAttributes = dict.fromkeys(
    ("proj_x", "proj_y", "mean_x", "mean_y", "correlations"), np.float64
)


class CCA(CountsWork, MergesRanks, name="cca", online=False, shared_space=True):
    """Regularised CCA, re-solved from running moments; cosine similarity in ``k`` dimensions.

    The stream adds to running sums of ``x``, ``y``, ``x x^T``, ``y y^T`` and ``x y^T``; with
    ``K_x (C_xx + r_x I) K_x^T = I`` (likewise ``K_y``), the SVD ``K_x C_xy K_y^T = U S V^T``
    gives the projections ``P_x = K_x^T U_k`` and ``P_y = K_y^T V_k``, re-solved on a schedule.

    See ``docs/design.md``, section "cca", for the method and the streaming choices.

    Parameters
    ----------
    img_dim, txt_dim : int
        Input sizes.
    k : int, default=10
        Canonical components kept, ``>= 1`` (capped at the smaller input size).
    ridge : float, default=0.3
        Ridge on each covariance relative to its mean eigenvalue, ``r = ridge * trace(C) / d``,
        ``>= 0``; chosen on the Wikipedia stream (``docs/benchmarks.md``).
    power : float, default=1.0
        Input power map before L2 normalisation, ``> 0`` (0.5: the Hellinger map).
    scale_by_correlation : bool, default=True
        Weight coordinates by their canonical correlation before the cosine.
    solve_first : int, default=32
        First re-solve (pairs); the gaps double from it up to ``solve_every``, ``>= 1``.
    solve_every : int, default=256
        Pairs between re-solves once the doubling ends, ``>= 1``.

    Attributes
    ----------
    proj_x, proj_y : ndarray of shape (img_dim, k) and (txt_dim, k)
        The canonical projections ``P_x`` and ``P_y``.
    mean_x, mean_y : ndarray of shape (img_dim,) and (txt_dim,)
        The inputs' means at the last solve.
    correlations : ndarray of shape (k,)
        The canonical correlations.
    moments : RunningMoments
        The running sums.
    solves : int
        Solves so far.

    References
    ----------
    .. [1] Menon, Surian and Chawla, "Cross-Modal Retrieval: A Pairwise Classification
       Approach", SDM 2015, Table 1 (the CCA baseline).

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
        self,
        img_dim: int,
        txt_dim: int,
        k: int = 10,
        ridge: float = 0.3,
        power: float = 1.0,
        scale_by_correlation: bool = True,
        solve_first: int = 32,
        solve_every: int = 256,
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

    def learn_one(
        self, pair: Example, history: History, rng: np.random.Generator, stats: LearnStats
    ) -> None:
        # CCA learns no triplets; once it has solved, one is scored before the update for the
        # mistake metrics and the drift detector (the model itself never reads the RNG).
        if self.solves:
            observe_triplet(self, pair, history, rng, stats)
        self.moments.add(
            power_normalize(pair.img, self.power), power_normalize(pair.txt, self.power)
        )
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
        lx = ridge_cholesky(m.cov_xx(full=False, reuse=True), self.ridge, overwrite=True)
        ly = ridge_cholesky(m.cov_yy(full=False, reuse=True), self.ridge, overwrite=True)
        # M = K_x C_xy K_y' with K = L^-1: two triangular solves in place on C_xy (``L_x X =
        # C_xy``, then ``M L_y' = X`` from the right) instead of two inverses and two products.
        whitened = dtrsm(1.0, lx, m.cov_xy(reuse=True), lower=1, overwrite_b=1)
        whitened = dtrsm(1.0, ly, whitened, side=1, lower=1, trans_a=1, overwrite_b=1)
        u, s, v = top_singular(whitened, self.k)
        self.proj_x = solve_triangular(lx, u, lower=True, trans="T", check_finite=False)
        self.proj_y = solve_triangular(ly, v, lower=True, trans="T", check_finite=False)
        self.correlations = np.clip(s, 0.0, None)
        self.mean_x, self.mean_y = m.mean_x(), m.mean_y()
        self.solves += 1

    def _embed(
        self, x: NDArray[np.floating], mean: NDArray[np.float64], proj: NDArray[np.float64]
    ) -> NDArray[np.float32]:
        z = (power_normalize(np.atleast_2d(x), self.power) - mean) @ proj
        if self.scale_by_correlation:
            z = z * self.correlations
        return power_normalize(z).astype(np.float32)

    def embed_images(self, x: NDArray[np.floating]) -> NDArray[np.float32]:
        return self._embed(x, self.mean_x, self.proj_x)

    def embedding(self) -> EmbeddingKind:
        return linear_heads(self)

    def linear_head(self, modality: str) -> LinearHead:
        """:meth:`_embed` as ``l2((x - mean) P c)``: weight ``P c``, bias ``-mean P c``."""
        mean, proj = (
            (self.mean_x, self.proj_x) if modality == "image" else (self.mean_y, self.proj_y)
        )
        if self.scale_by_correlation:
            proj = proj * self.correlations
        return LinearHead(power_features(self.power), proj, -(mean @ proj), "l2")

    def embed_texts(self, x: NDArray[np.floating]) -> NDArray[np.float32]:
        return self._embed(x, self.mean_y, self.proj_y)

    # -- the work counted (streamxm/models/work.py) ----------------------------------------
    def learning_work(self) -> Work:
        """Per pair in the steady state (solved once, so a triplet is scored), all in float64,
        with ``d_x, d_y`` the input sizes, ``B`` = :attr:`RunningMoments.BLOCK` and
        ``n = solve_every``:

        ``T + N(1, d_x) + N(1, d_y) + F / B + R / n``

        - ``T = (E_x(1) + E_y(2) + E_y(1) + E_x(2)) / 2``: the scored triplet
          (:func:`~streamxm.models.base.observe_triplet`, directions alternating: a query row
          and two item rows), ``E`` the :meth:`embedding_work`;
        - ``N(r, d)``: ``r`` rows power-normalised into the moments (:func:`power_normalize_work`);
        - ``F``: a fold of ``B`` rows (:func:`~streamxm.models.moments.fold_work`);
        - ``R``: a re-solve (:func:`_solve_work`).
        """
        dx, dy = self.img_dim, self.txt_dim
        triplet = 0.5 * (
            self.embedding_work(1, "image")
            + self.embedding_work(2, "text")
            + self.embedding_work(1, "text")
            + self.embedding_work(2, "image")
        )
        block = RunningMoments.BLOCK
        return (
            triplet
            + power_normalize_work(dx, self.power)
            + power_normalize_work(dy, self.power)
            + fold_work(dx, dy, block) * (1.0 / block)
            + _solve_work(dx, dy, self.k) * (1.0 / self.solve_every)
        )

    def embedding_work(self, rows: int, modality: str) -> Work:
        """:meth:`_embed` on ``r`` rows of size ``d`` (float64, ``k`` components):
        ``N(r, d)`` (:func:`power_normalize_work`), the mean subtracted (``r d`` flops, three
        passes), ``(x - mean) P``: ``2 r d k`` flops, the correlation scaling (``r k``) and the
        L2 normalisation of the ``r x k`` result."""
        dim = _dim(self, modality)
        scale = elementwise(rows * self.k, passes=3) if self.scale_by_correlation else Work()
        return (
            power_normalize_work(rows * dim, self.power)
            + elementwise(rows * dim, passes=3)
            + gemm(rows, self.k, dim)
            + scale
            + power_normalize_work(rows * self.k, 1.0)
            + elementwise(rows * self.k, itemsize=4, flops_per_item=0.0)
        )

    def merge_parts(self) -> MergeParts:
        return {k: ("sum", np.asarray(v)) for k, v in self.moments.sums("moments.").items()}

    def set_merged(self, merged: Arrays) -> None:
        self.moments.load_state(merged, "moments.")

    def after_merge(self, pairs_before: int, pairs_after: int, rng: np.random.Generator) -> None:
        if self.schedule.crossed(pairs_before, pairs_after):
            self.solve()

    def state(self) -> tuple[Arrays, dict[str, Any]]:
        arrays = {**self.moments.state("moments."), **attribute_arrays(self, _SOLVED)}
        return arrays, {"solves": self.solves}

    def load_state(self, arrays: Arrays, meta: dict[str, Any]) -> None:
        self.moments.load_state(arrays, "moments.")
        restore_attribute_arrays(self, arrays, _SOLVED)
        self.solves = int(meta["solves"])


def _dim(model: CCA, modality: str) -> int:
    if modality not in ("image", "text"):
        raise ValueError(f"modality must be 'image' or 'text', got {modality!r}")
    return model.img_dim if modality == "image" else model.txt_dim


def _triangular_solve_work(d: int, columns: int) -> Work:
    """``L X = B`` for a ``d x d`` triangle and ``columns`` right-hand sides: ``d^2`` flops a
    column; the triangle read, ``B`` read and written."""
    return Work(float(d * d * columns), 8.0 * (d * d / 2 + 2 * d * columns))


def _top_singular_work(dx: int, dy: int, k: int) -> Work:
    """:func:`~streamxm.models.moments.top_singular` of a ``d_x x d_y`` matrix: the Gram
    matrix of its smaller side ``n`` (``syrk``: ``N n^2`` flops, ``N`` the longer side), the
    top ``k`` eigenpairs (tridiagonal reduction ``4 n^3 / 3``, then ``O(n^2 k)``) and the
    vectors of the other side (``2 N n k``)."""
    long, short = max(dx, dy), min(dx, dy)
    return (
        Work(float(long * short * short), 8.0 * (long * short + short * short))
        + Work(4.0 * short**3 / 3 + 6.0 * short * short * k, 16.0 * short * short)
        + gemm(long, k, short)
    )


def _solve_work(dx: int, dy: int, k: int) -> Work:
    """One :meth:`CCA.solve` (float64):

    - the covariances ``S / n - (s / n)(s / n)'``: the lower triangles of ``C_xx``, ``C_yy``
      and all of ``C_xy`` (:func:`~streamxm.models.moments.covariance_work`);
    - the Cholesky factors ``L_x``, ``L_y``
      (:func:`~streamxm.models.moments.ridge_cholesky_work`);
    - ``M = L_x^-1 C_xy L_y^-T`` by two triangular solves (``d_x^2 d_y + d_y^2 d_x``);
    - its top ``k`` singular triplets (:func:`_top_singular_work`);
    - ``P_x = L_x^-T U_k``, ``P_y = L_y^-T V_k``: triangular solves (``d_x^2 k + d_y^2 k``).
    """
    return (
        covariance_work(dx * (dx + 1) // 2 + dy * (dy + 1) // 2 + dx * dy)
        + ridge_cholesky_work(dx)
        + ridge_cholesky_work(dy)
        + _triangular_solve_work(dx, dy)
        + _triangular_solve_work(dy, dx)
        + _top_singular_work(dx, dy, k)
        + _triangular_solve_work(dx, k)
        + _triangular_solve_work(dy, k)
    )
