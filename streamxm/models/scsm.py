"""SCSM: unsupervised self-paced cross-modal subspace matching over a bounded working set.

Liang, Li, Cao, He and Wang, "Self-Paced Cross-Modal Subspace Matching", SIGIR 2016. The
alternation itself is in :mod:`streamxm.models.scsm_solver`.
"""

from __future__ import annotations

import dataclasses
from typing import Any, ClassVar, Literal

import numpy as np
from numpy.typing import NDArray
from scipy.optimize import linear_sum_assignment

from streamxm.models.array_types import F64
from streamxm.models.base import Arrays, LearnStats, observe_triplet, require
from streamxm.models.embedding import EmbeddingKind, linear_heads
from streamxm.models.heads import LinearHead, power_features
from streamxm.models.history import Example, History
from streamxm.models.moments import ResolveSchedule, append_constant, power_normalize
from streamxm.models.opt_in import CountsWork
from streamxm.models.scsm_solver import Problem, ProblemWork
from streamxm.models.state_arrays import ArrayAttributes, attribute_arrays, restore_attribute_arrays
from streamxm.models.work import Work, elementwise, gemm

__all__ = ["SCSM"]

#: The arrays a checkpoint keeps: the working set and its groups, the projections and the means.
_LEARNED: ArrayAttributes = {
    "xa": np.float64,
    "xb": np.float64,
    "y": np.int64,
    **dict.fromkeys(("ua", "ub", "mean_a", "mean_b"), np.float64),
}


class SCSM(CountsWork, name="scsm", shared_space=True, batch_fit=True):
    """Projections ``U_a``, ``U_b`` into ``c`` latent groups, learned without labels.

    Self-paced subspace matching (Eq. 14, Algorithm 1): the projections, the pairs' group
    assignment ``Y`` and the self-paced selection ``v`` alternate over a sliding working set of
    recent pairs, re-solved on a schedule. The similarity is the cosine of the centred
    projections, same-modality queries included. Labels are never read.

    See ``docs/design.md``, section "scsm", for the method and the streaming choices.

    Parameters
    ----------
    img_dim, txt_dim : int
        Input sizes.
    groups : int, default=10
        Latent groups ``c`` (the dimension of the space), ``>= 2``.
    alpha : float, default=0.3
        Eq. 14's ``alpha``, per pair (the solve weighs ``alpha / n``), ``>= 0``.
    gamma : float, default=1.0
        Eq. 14's ``gamma``, per pair (the solve weighs ``gamma * n``), ``>= 0``.
    beta : float, default=1e-4
        Eq. 14's ``beta``, per pair (the solve weighs ``beta * n``), ``> 0``.
    r : int, default=5
        Neighbours in the within-modality graphs, ``>= 1``.
    iterations : int, default=5
        Outer iterations per solve, ``>= 0``.
    growth : float, default=1.2
        Growth of the age threshold per outer iteration, ``>= 1``.
    window : int, default=2500
        Pairs in the working set, ``>= groups``.
    solve_first : int, default=64
        First re-solve (pairs); the gaps double from it up to ``solve_every``, ``>= 1``.
    solve_every : int, default=256
        Pairs between re-solves once the doubling ends, ``>= 1``.
    power_img : float or "auto", default="auto"
        Image power map before L2 normalisation, ``> 0`` (0.5: the Hellinger map, for
        histograms). ``"auto"`` picks it from the first pair learned: 0.5 when its image
        vector has no negative value (a histogram), else 1.0 (no power: on signed features
        ``sign(x) |x|^0.5`` only distorts the coefficients' scales; docs/benchmarks.md, the
        digits set). Fixed from then on, so the features stay version-independent. Give 0.5
        for the rule the Wikipedia figures were chosen with whatever the inputs.
    power_txt : float, default=1.0
        Text power map before L2 normalisation, ``> 0``.
    center : bool, default=True
        Subtract the working set's mean projection before the cosine.
    regroup : int, default=3
        Before each warm solve, Lloyd steps of the texts' k-means run from the previous
        groups (new pairs first join the nearest group), so that groups formed on the stream's
        first topic move to the topics that came since; ``>= 0``. ``0``: the previous groups
        are only carried over (the rule before it, under which a stream that opens on one
        topic keeps groups carved inside it). The paper, offline, starts every solve from
        k-means on the texts: that is the first solve here.

    Attributes
    ----------
    ua, ub : ndarray of shape (img_dim + 1, groups) and (txt_dim + 1, groups)
        The projections ``U_a`` and ``U_b`` (the last row for the constant feature).
    mean_a, mean_b : ndarray of shape (groups,)
        The working set's mean projections (zero with ``center=False``).
    y : ndarray of shape (window,)
        Each working-set pair's group (-1 until a solve places it).
    pairs, solves : int
        Pairs seen and solves so far.
    trace : list of dict
        The last solve's objective at its start and after each outer iteration.

    References
    ----------
    .. [1] Liang, Li, Cao, He and Wang, "Self-Paced Cross-Modal Subspace Matching", SIGIR 2016.

    Examples
    --------
    Unsupervised: the pairs' labels are never read; they only score the result.

    >>> from streamxm.learning.evaluation import retrieval_maps, split_of
    >>> from streamxm.tools.datasets import synthetic_pairs
    >>> pairs, rng = synthetic_pairs(90, 8, 5, n_classes=3, spread=0.3), np.random.default_rng(0)
    >>> m = SCSM(8, 5, groups=3, window=120, solve_first=90, power_img=1.0)
    >>> from streamxm.buffer.replay import ReplayBuffer
    >>> history = ReplayBuffer(200, 8, 5)
    >>> for p in pairs:
    ...     example = Example(p.img, p.txt, p.labels)
    ...     _ = history.add(example)
    ...     m.learn_one(example, history, rng, LearnStats())
    >>> round(min(retrieval_maps(m, split_of(pairs)).values()), 1)
    1.0
    """

    reads_labels = False
    checkpoint_defaults: ClassVar[dict[str, Any]] = {"regroup": 0}  # came later, off

    def __init__(
        self,
        img_dim: int,
        txt_dim: int,
        groups: int = 10,
        alpha: float = 0.3,
        gamma: float = 1.0,
        beta: float = 1e-4,
        r: int = 5,
        iterations: int = 5,
        growth: float = 1.2,
        window: int = 2500,
        solve_first: int = 64,
        solve_every: int = 256,
        power_img: float | Literal["auto"] = "auto",
        power_txt: float = 1.0,
        center: bool = True,
        regroup: int = 3,
    ) -> None:
        super().__init__(img_dim, txt_dim)
        require(
            locals(),
            groups=">= 2",
            r=">= 1",
            iterations=">= 0",
            alpha=">= 0",
            gamma=">= 0",
            beta="> 0",
            growth=">= 1",
            power_txt="> 0",
            regroup=">= 0",
        )
        if power_img != "auto":
            require({"power_img": power_img}, power_img="> 0")
        if window < groups:
            raise ValueError(f"window must be >= groups ({groups}), got {window}")
        self.groups, self.r = int(groups), int(r)
        self.alpha, self.gamma, self.beta = float(alpha), float(gamma), float(beta)
        self.iterations, self.growth = int(iterations), float(growth)
        self.window = int(window)
        self.solve_first, self.solve_every = solve_first, solve_every
        self.schedule = ResolveSchedule(solve_first, solve_every)
        self.power_img: float | Literal["auto"] = (
            "auto" if power_img == "auto" else float(power_img)
        )
        self.power_txt = float(power_txt)
        # The image power in use: the given one, or "auto"'s pick at the first pair.
        self.power_img_: float | None = None if power_img == "auto" else float(power_img)
        self.center = bool(center)
        self.regroup = int(regroup)
        # The working set, a ring: features with the constant appended, and each pair's group
        # (-1 until a solve has placed it).
        self.xa = np.zeros((self.window, img_dim + 1))
        self.xb = np.zeros((self.window, txt_dim + 1))
        self.y = np.full(self.window, -1, dtype=np.int64)
        self.pairs = 0
        self.ua = np.zeros((img_dim + 1, self.groups))
        self.ub = np.zeros((txt_dim + 1, self.groups))
        self.mean_a = np.zeros(self.groups)
        self.mean_b = np.zeros(self.groups)
        self.solves = 0
        self.trace: list[dict[str, float]] = []

    def _features(self, x: NDArray[np.floating], power: float) -> F64:
        return append_constant(power_normalize(np.atleast_2d(x), power))

    # -- learning ----------------------------------------------------------------------------
    def learn_one(
        self, pair: Example, history: History, rng: np.random.Generator, stats: LearnStats
    ) -> None:
        if self.solves:
            observe_triplet(self, dataclasses.replace(pair, labels=()), history, rng, stats)
        self._add(pair)
        if self.schedule.due(self.pairs):
            self.solve(rng)

    def fit(self, pairs: list[Example], rng: np.random.Generator, stats: LearnStats) -> None:
        """The offline protocol: the last ``window`` of ``pairs`` (all of them when they fit)
        as the working set, one solve."""
        for pair in pairs:
            self._add(pair)
        self.solve(rng)

    @property
    def image_power(self) -> float:
        """The image power map in use (``"auto"`` before its first pair: the Hellinger map)."""
        return 0.5 if self.power_img_ is None else self.power_img_

    def _add(self, pair: Example) -> None:
        if self.power_img_ is None:  # "auto": histograms keep the Hellinger map
            self.power_img_ = 0.5 if float(np.min(pair.img)) >= 0.0 else 1.0
        at = self.pairs % self.window
        self.xa[at] = self._features(pair.img, self.image_power)[0]
        self.xb[at] = self._features(pair.txt, self.power_txt)[0]
        self.y[at] = -1
        self.pairs += 1

    def _working_set(self) -> NDArray[np.intp]:
        """Ring positions of the working set, oldest first."""
        n = min(self.pairs, self.window)
        start = self.pairs % self.window if self.pairs > self.window else 0
        return np.asarray((start + np.arange(n)) % self.window)

    def solve(self, rng: np.random.Generator) -> None:
        """Re-run the alternation on the working set, warm-started, groups kept stable."""
        rows = self._working_set()
        n = len(rows)
        if n < max(self.groups, 2):
            return
        problem = Problem(
            self.xa[rows],
            self.xb[rows],
            self.groups,
            self.alpha / n,
            self.gamma * n,
            self.beta * n,
            self.r,
        )
        previous = self.y[rows].copy()
        warm = self.solves > 0
        problem.start(rng, init=previous if warm else None, regroup_steps=self.regroup)
        self.trace = [{"start": problem.objective()}]
        for _ in range(self.iterations):
            self.trace.append(problem.iterate(self.growth))
        y, perm = problem.y, np.arange(self.groups)
        if warm:
            y, perm = _match_groups(previous, y, self.groups)
        self.y[rows] = y
        self.ua, self.ub = problem.ua[:, perm], problem.ub[:, perm]
        za, zb = problem.projections()  # of the final U, kept by the problem
        self.mean_a = za.mean(axis=0)[perm] if self.center else np.zeros(self.groups)
        self.mean_b = zb.mean(axis=0)[perm] if self.center else np.zeros(self.groups)
        self.solves += 1

    # -- serving -------------------------------------------------------------------------------
    def _embed(self, f: F64, u: F64, mean: F64) -> NDArray[np.float32]:
        if not self.solves:
            return np.zeros((len(f), self.groups), dtype=np.float32)
        return power_normalize(f @ u - mean).astype(np.float32)

    def embed_images(self, x: NDArray[np.floating]) -> NDArray[np.float32]:
        return self._embed(self._features(x, self.image_power), self.ua, self.mean_a)

    def embed_texts(self, x: NDArray[np.floating]) -> NDArray[np.float32]:
        return self._embed(self._features(x, self.power_txt), self.ub, self.mean_b)

    def embedding(self) -> EmbeddingKind:
        return linear_heads(self)

    def linear_head(self, modality: str) -> LinearHead:
        """:meth:`_embed` as ``l2(x U + u_c - mean)`` (``u_c``: the constant feature's row)."""
        u, mean, power = (
            (self.ua, self.mean_a, self.image_power)
            if modality == "image"
            else (self.ub, self.mean_b, self.power_txt)
        )
        if not self.solves:  # zero embeddings until the first solve
            u, mean = np.zeros_like(u), np.zeros_like(mean)
        return LinearHead(power_features(power), u[:-1], u[-1] - mean, "l2")

    # -- the work counted (streamxm/models/work.py) ------------------------------------------
    def periodic_work(self) -> tuple[int, int]:
        """Solves come every ``solve_every`` pairs once the doubling ends and the window is
        full (a solve's size is the window's)."""
        start = max(self.window, self.schedule.steady_start())
        return self.schedule.next_due(start - 1), self.schedule.every

    def learning_work(self) -> Work:
        """Per pair, in the steady state (``n = window`` pairs in the working set, solves warm):

        ``W = W_triplet + W_add + W_solve / solve_every``

        - ``W_triplet``: :func:`~streamxm.models.base.observe_triplet`, the query's modality
          alternating, so half of ``E_a(1) + E_b(2)`` and half of ``E_b(1) + E_a(2)``
          (``E``: :meth:`embedding_work`), plus the two stored rows gathered (float32);
        - ``W_add``: both rows' features (:meth:`_features`) written into the ring;
        - ``W_solve``: :meth:`solve` on ``n`` pairs with ``T = iterations``: the working set
          copied for ``Problem`` (2 passes of ``n (d_a + d_b)``), its construction (the graphs
          and the fixed parts of Eq. 16), the warm start with ``min(solve_every, n)`` unplaced
          pairs and ``regroup`` Lloyd steps, the objective once and ``T`` outer iterations
          (:class:`~streamxm.models.scsm_solver.ProblemWork` has each term; the means reuse
          the problem's last projections). The k-means of the first solve is a one-off, not
          counted.
        """
        da, db = self.img_dim + 1, self.txt_dim + 1
        triplet = (
            self.embedding_work(1, "image")
            + self.embedding_work(2, "text")
            + self.embedding_work(1, "text")
            + self.embedding_work(2, "image")
        ) * 0.5
        gather = (
            elementwise(2 * (self.img_dim + self.txt_dim), itemsize=4, flops_per_item=0.0) * 0.5
        )
        add = (
            _feature_work(1, self.img_dim, self.image_power)
            + _feature_work(1, self.txt_dim, self.power_txt)
            + elementwise(da + db)
        )
        return triplet + gather + add + self._solve_work() * (1.0 / self.solve_every)

    def _solve_work(self) -> Work:
        """One warm :meth:`solve` on a full window (see :meth:`learning_work`)."""
        n = self.window
        sizes = ProblemWork(n, self.img_dim + 1, self.txt_dim + 1, self.groups, self.r)
        copy = elementwise(n * (sizes.da + sizes.db), flops_per_item=0.0)
        return (
            copy
            + sizes.construction()
            + sizes.start(min(self.solve_every, n), self.regroup)
            + sizes.objective()
            + sizes.iterate() * self.iterations
        )

    def embedding_work(self, rows: int, modality: str) -> Work:
        """:meth:`embed_images` / :meth:`embed_texts` on ``rows`` float32 vectors of ``d``:
        the features (:func:`_feature_work`), ``gemm(rows, c, d + 1)`` with ``U`` (float64),
        and the centring, normalisation and float32 cast of the ``rows x c`` result (6
        flops, 10 passes)."""
        dim, power = (
            (self.img_dim, self.image_power)
            if modality == "image"
            else (self.txt_dim, self.power_txt)
        )
        return (
            _feature_work(rows, dim, power)
            + gemm(rows, self.groups, dim + 1)
            + elementwise(rows * self.groups, flops_per_item=6.0, passes=10.0)
        )

    # -- state ---------------------------------------------------------------------------------
    def state(self) -> tuple[Arrays, dict[str, Any]]:
        meta = {"pairs": self.pairs, "solves": self.solves, "trace": self.trace}
        return attribute_arrays(self, _LEARNED), {**meta, "power_img": self.power_img_}

    def load_state(self, arrays: Arrays, meta: dict[str, Any]) -> None:
        restore_attribute_arrays(self, arrays, _LEARNED)
        self.pairs, self.solves = int(meta["pairs"]), int(meta["solves"])
        if meta.get("power_img") is not None:  # "auto"'s pick (checkpoints before it: given)
            self.power_img_ = float(meta["power_img"])
        self.trace = [{k: float(v) for k, v in t.items()} for t in meta["trace"]]


def _feature_work(rows: int, dim: int, power: float) -> Work:
    """:meth:`SCSM._features` on ``rows x dim`` float32 inputs, in float64: the upcast (4 bytes
    read, 8 written), for ``power != 1`` ``sign``, ``abs``, the power and their product (4
    flops, 9 passes), the norm (``x * x`` and its sum: 2 flops, 3 passes), the division (1
    flop, 2 passes) and ``append_constant``'s copy (2 passes): ``7 rows dim`` flops and
    ``4 + 8 * 17`` bytes per item (``3`` and ``4 + 8 * 8`` for ``power = 1``)."""
    items = rows * dim
    if power != 1.0:
        return Work(7.0 * items, (4.0 + 8.0 * 17.0) * items)
    return Work(3.0 * items, (4.0 + 8.0 * 8.0) * items)


def _match_groups(
    previous: NDArray[np.int64], y: NDArray[np.int64], groups: int
) -> tuple[NDArray[np.int64], NDArray[np.intp]]:
    """Relabel the new groups to the old ones they overlap most (Hungarian assignment on the
    pairs placed by both solves): the relabelled ``y`` and the permutation of ``U``'s columns
    (the new column for each old group) to match."""
    both = previous >= 0
    overlap = np.zeros((groups, groups))
    np.add.at(overlap, (previous[both], y[both]), 1.0)
    old_of_new = np.empty(groups, dtype=np.int64)
    rows, cols = linear_sum_assignment(-overlap)
    old_of_new[cols] = rows
    perm = np.argsort(old_of_new)  # new column for each old group
    return old_of_new[y], perm
