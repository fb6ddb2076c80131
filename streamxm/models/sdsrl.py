"""SDSRL: Nystroem kernel features and semantic projections learned by coordinate descent.

Jiang, Li, Li and Wang, "Learning Discriminative Representations for Semantic Cross Media
Retrieval" (SDSRL), Sec. 3 (Eq. 5), Algorithm 1 (MPL-CD) and its appendix.
"""

from __future__ import annotations

from typing import Any

import numpy as np
from numpy.typing import NDArray

from streamxm.buffer.replay import ReplayBuffer
from streamxm.models.base import (
    Arrays,
    LearnStats,
    MergeParts,
    observe_triplet,
    require,
)
from streamxm.models.classes import ClassIndex
from streamxm.models.heads import (
    LinearHead,
    RbfFeatures,
    power_features,
    rbf_kernel,
    squared_norms,
)
from streamxm.models.moments import ResolveSchedule, power_normalize, power_normalize_work
from streamxm.models.opt_in import CountsWork, MergesRanks
from streamxm.models.projections import mpl_cd, mpl_cd_work
from streamxm.models.work import Work, elementwise, gemm
from streamxm.stream.messages import Pair

__all__ = ["SDSRL", "NystroemMap", "rbf_kernel"]

F64 = NDArray[np.float64]


class NystroemMap:
    """Explicit features ``phi(x) = k(x, landmarks) U diag(w)^-1/2`` with ``K_mm = U diag(w) U'``,
    so that ``phi(x)'phi(y)`` approximates ``k(x, y)`` (exactly on the landmarks).

    Eigenvalues below ``floor`` times the largest are dropped: with ``sigma = 1`` on L2-normalised
    vectors the kernel is nearly linear and ``K_mm`` numerically singular, and dividing by those
    eigenvalues would only amplify rounding. The feature count is the number of eigenvalues kept.

    >>> rng = np.random.default_rng(0)
    >>> pts = rng.normal(size=(5, 3))
    >>> nm = NystroemMap(pts, gamma=0.5)
    >>> f = nm.features(pts)
    >>> bool(np.allclose(f @ f.T, rbf_kernel(pts, pts, 0.5)))
    True
    """

    def __init__(
        self,
        landmarks: NDArray[np.floating],
        gamma: float,
        floor: float = 1e-10,
        proj: F64 | None = None,
    ) -> None:
        self.landmarks = np.asarray(landmarks, dtype=np.float64)
        self.gamma = float(gamma)
        if proj is None:
            w, u = np.linalg.eigh(rbf_kernel(self.landmarks, self.landmarks, self.gamma))
            keep = w > floor * w.max()
            proj = u[:, keep] / np.sqrt(w[keep])
        self.proj = np.asarray(proj, dtype=np.float64)
        self.landmark_norms = squared_norms(self.landmarks)

    @property
    def dim(self) -> int:
        return int(self.proj.shape[1])

    def kernel(self, x: NDArray[np.floating]) -> F64:
        return rbf_kernel(np.atleast_2d(x), self.landmarks, self.gamma, self.landmark_norms)

    def features(self, x: NDArray[np.floating]) -> F64:
        return self.kernel(x) @ self.proj


class SDSRL(CountsWork, MergesRanks, name="sdsrl", shared_space=True, batch_fit=True):
    """Semantic projections of Nystroem features: ``s(x, y) = phi(x)' A B' psi(y)``.

    ``phi`` and ``psi`` are Nystroem maps of RBF kernels on landmarks drawn from the stream;
    ``A`` and ``B`` minimise ``||M_I - AA'||^2 + ||M_T - BB'||^2 + ||M_C - AB'||^2`` (Eq. 5, by
    MPL-CD) for targets built from the label similarity ``S = L L'``, re-solved on a schedule
    from running statistics (``Phi'Phi``, ``Psi'Psi``, ``Phi'L``, ``Psi'L``). Images and texts
    share the space and are compared by inner product.

    See ``docs/design.md``, section "sdsrl", for the method and the streaming choices.

    Parameters
    ----------
    img_dim, txt_dim : int
        Input sizes.
    q : int, default=10
        Dimension of the shared space, ``>= 1``.
    mu : float, default=7e-4
        Ridge of the closed forms, per pair, ``> 0`` (``mu n`` is the paper's ``mu``;
        ``mu=5e-4`` is about the paper's setting); chosen on the Wikipedia stream
        (``docs/benchmarks.md``).
    m_img : int, default=1000
        Image landmarks, ``>= 1``.
    m_txt : int or None, default=None
        Text landmarks, ``>= 1``; ``None`` takes ``min(2 txt_dim, 1000)`` (20 for 10-d texts,
        as the paper).
    sigma_img, sigma_txt : float, default=1.0
        RBF widths ``exp(-sigma ||x - y||^2)``, ``> 0``.
    power_img : float, default=0.5
        Image power map before L2 normalisation, ``> 0`` (0.5: the Hellinger map).
    power_txt : float, default=1.0
        Text power map before L2 normalisation, ``> 0``.
    landmark_pool : int, default=1000
        Pairs kept before the landmarks freeze, ``>= 1``.
    solve_first : int, default=32
        First re-solve (pairs); the gaps double from it up to ``solve_every``, ``>= 1``.
    solve_every : int, default=256
        Pairs between re-solves once the doubling ends, ``>= 1``.
    outer : int, default=10
        MPL-CD outer loops, ``>= 1``.
    inner : int, default=3
        MPL-CD sweeps per sub-problem in a loop, ``>= 1``.
    tol : float, default=1e-4
        MPL-CD stops when the loss falls by less than ``tol`` (relative) in a loop, ``>= 0``.
    forget : float, default=1.0
        Exponential forgetting factor per pair, in ``(0, 1]`` (1 keeps everything).
    batch : int, default=64
        Pairs buffered before they are folded into the statistics, ``>= 1``.
    max_classes : int, default=1000
        Most classes tracked (labels beyond are ignored and counted).

    Attributes
    ----------
    a, b : ndarray of shape (m1, q) and (m2, q)
        The projections ``A`` and ``B`` of the Nystroem features.
    w_img, w_txt : ndarray
        What queries use, from the last solve: the Nystroem projections times ``A`` and ``B``,
        so that an embedding is ``k(x, landmarks) w``.
    map_img, map_txt : NystroemMap or None
        The Nystroem maps of the statistics (provisional until ``frozen``).
    frozen : bool
        Whether the landmarks are frozen.
    gram_img, gram_txt, lab_img, lab_txt : ndarray
        The statistics ``Phi'Phi``, ``Psi'Psi``, ``Phi'L`` and ``Psi'L``.
    weight : float
        The (forgetting-weighted) pair count of the statistics.
    pairs, unlabelled, solves : int
        Pairs seen, the unlabelled ones among them, and solves so far.

    References
    ----------
    .. [1] Jiang, Li, Li and Wang, "Learning Discriminative Representations for Semantic Cross
       Media Retrieval" (SDSRL), Sec. 3 (Eq. 5), Algorithm 1 (MPL-CD) and its appendix.

    Examples
    --------
    A batch fit on three topics, then every direction's mAP among the pairs (images and texts
    share the space, so same-modality directions are reported too):

    >>> from streamxm.learning.evaluation import retrieval_maps, split_of
    >>> from streamxm.tools.datasets import synthetic_pairs
    >>> pairs = synthetic_pairs(90, 8, 5, n_classes=3, spread=0.3)
    >>> m = SDSRL(8, 5, q=3, m_img=40, landmark_pool=60, power_img=1.0)
    >>> m.fit(pairs, np.random.default_rng(0), LearnStats())
    >>> sorted(d for d, v in retrieval_maps(m, split_of(pairs)).items() if v > 0.95)
    ['map_i2i', 'map_i2t', 'map_t2i', 'map_t2t']
    """

    def __init__(
        self,
        img_dim: int,
        txt_dim: int,
        q: int = 10,
        mu: float = 7e-4,
        m_img: int = 1000,
        m_txt: int | None = None,
        sigma_img: float = 1.0,
        sigma_txt: float = 1.0,
        power_img: float = 0.5,
        power_txt: float = 1.0,
        landmark_pool: int = 1000,
        solve_first: int = 32,
        solve_every: int = 256,
        outer: int = 10,
        inner: int = 3,
        tol: float = 1e-4,
        forget: float = 1.0,
        batch: int = 64,
        max_classes: int = 1000,
    ) -> None:
        super().__init__(img_dim, txt_dim)
        m_txt = min(2 * txt_dim, 1000) if m_txt is None else m_txt
        require(
            locals(),
            q=">= 1",
            mu="> 0",
            m_img=">= 1",
            m_txt=">= 1",
            landmark_pool=">= 1",
            sigma_img="> 0",
            sigma_txt="> 0",
            power_img="> 0",
            power_txt="> 0",
            forget="in (0, 1]",
            batch=">= 1",
            outer=">= 1",
            inner=">= 1",
            tol=">= 0",
        )
        self.q, self.mu = int(q), float(mu)
        self.m_img, self.m_txt = int(m_img), int(m_txt)
        self.sigma_img, self.sigma_txt = float(sigma_img), float(sigma_txt)
        self.power_img, self.power_txt = float(power_img), float(power_txt)
        self.landmark_pool = int(landmark_pool)
        self.solve_first, self.solve_every = solve_first, solve_every
        self.schedule = ResolveSchedule(solve_first, solve_every)
        self.outer, self.inner, self.tol = int(outer), int(inner), float(tol)
        self.forget = float(forget)
        self.batch = int(batch)
        self.max_classes = max_classes
        self.class_index = ClassIndex(max_classes)
        # Pairs not yet folded into the statistics: the landmark pool, then a batch.
        self.pending_img: list[NDArray[np.float64]] = []
        self.pending_txt: list[NDArray[np.float64]] = []
        self.pending_cols: list[list[int]] = []
        self.frozen = False
        self.map_img: NystroemMap | None = None
        self.map_txt: NystroemMap | None = None
        self.gram_img = self.gram_txt = np.zeros((0, 0))
        self.lab_img = self.lab_txt = np.zeros((0, 0))
        self.weight = 0.0  # the (forgetting-weighted) pair count of the statistics
        self.a = np.zeros((0, self.q))
        self.b = np.zeros((0, self.q))
        # What queries use, replaced together at the end of each solve: the maps of that solve
        # (the statistics' maps may have moved on, before the landmarks freeze) and the
        # Nystroem projections times A and B.
        self.serve_img: NystroemMap | None = None
        self.serve_txt: NystroemMap | None = None
        self._feature_maps: dict[str, tuple[NystroemMap, RbfFeatures]] = {}  # derived
        self.w_img = np.zeros((0, self.q))
        self.w_txt = np.zeros((0, self.q))
        self.pairs = 0
        self.unlabelled = 0
        self.solves = 0
        self.cd_losses: list[float] = []

    @property
    def ignored_labels(self) -> int:
        return self.class_index.ignored_labels

    # -- learning ----------------------------------------------------------------------------
    def update(
        self,
        pair: Pair,
        slot: int,
        buffer: ReplayBuffer,
        rng: np.random.Generator,
        stats: LearnStats,
    ) -> None:
        if self.serve_img is not None:
            observe_triplet(self, pair, slot, buffer, rng, stats)
        self._add(pair)
        if not self.frozen and self.pairs >= self.landmark_pool:
            self._freeze(rng, len(self.pending_img))
        elif self.frozen and len(self.pending_img) >= self.batch:
            self._fold()
        if self.schedule.due(self.pairs):
            self.solve(rng)

    def fit(self, pairs: list[Pair], rng: np.random.Generator, stats: LearnStats) -> None:
        """The offline protocol: landmarks drawn from all of ``pairs``, one solve on all of them
        (added to whatever the model has learned; on a fresh model, the paper's batch method)."""
        for pair in pairs:
            self._add(pair)
        if not self.frozen:
            self._freeze(rng, len(self.pending_img))
        self.solve(rng)

    def _add(self, pair: Pair) -> None:
        self.pending_img.append(power_normalize(pair.img, self.power_img))
        self.pending_txt.append(power_normalize(pair.txt, self.power_txt))
        self.pending_cols.append(self.class_index.columns(pair.labels))
        self.pairs += 1
        self.unlabelled += not pair.labels

    def _draw_maps(self, rng: np.random.Generator, pool: int) -> tuple[NystroemMap, NystroemMap]:
        imgs = np.asarray(self.pending_img[:pool])
        txts = np.asarray(self.pending_txt[:pool])
        pick_img = np.sort(rng.choice(pool, size=min(self.m_img, pool), replace=False))
        pick_txt = np.sort(rng.choice(pool, size=min(self.m_txt, pool), replace=False))
        return (
            NystroemMap(imgs[pick_img], self.sigma_img),
            NystroemMap(txts[pick_txt], self.sigma_txt),
        )

    def _freeze(self, rng: np.random.Generator, pool: int) -> None:
        self.map_img, self.map_txt = self._draw_maps(rng, pool)
        self.frozen = True
        self._reset_statistics()
        self._fold()

    def _reset_statistics(self) -> None:
        assert self.map_img is not None and self.map_txt is not None
        self.gram_img = np.zeros((self.map_img.dim, self.map_img.dim))
        self.gram_txt = np.zeros((self.map_txt.dim, self.map_txt.dim))
        self.lab_img = np.zeros((self.map_img.dim, 0))
        self.lab_txt = np.zeros((self.map_txt.dim, 0))
        self.weight = 0.0
        self.a = np.zeros((0, self.q))
        self.b = np.zeros((0, self.q))

    def _fold(self) -> None:
        """Add the pending pairs to the statistics and drop them."""
        self._accumulate(self.pending_img, self.pending_txt, self.pending_cols)
        self.pending_img, self.pending_txt, self.pending_cols = [], [], []

    def _accumulate(self, imgs: list[F64], txts: list[F64], label_cols: list[list[int]]) -> None:
        """Add pairs to the statistics, in arrival order (for the forgetting)."""
        if not imgs:
            return
        assert self.map_img is not None and self.map_txt is not None
        phi = self.map_img.features(np.asarray(imgs))
        psi = self.map_txt.features(np.asarray(txts))
        labels = np.zeros((len(label_cols), len(self.class_index)))
        for row, cols in enumerate(label_cols):
            labels[row, cols] = 1.0
        n = len(phi)
        w = self.forget ** np.arange(n - 1, -1, -1, dtype=np.float64)
        decay = self.forget**n
        grow = labels.shape[1] - self.lab_img.shape[1]
        self.lab_img = np.hstack([self.lab_img, np.zeros((self.lab_img.shape[0], grow))])
        self.lab_txt = np.hstack([self.lab_txt, np.zeros((self.lab_txt.shape[0], grow))])
        self.gram_img = decay * self.gram_img + (phi * w[:, None]).T @ phi
        self.gram_txt = decay * self.gram_txt + (psi * w[:, None]).T @ psi
        self.lab_img = decay * self.lab_img + (phi * w[:, None]).T @ labels
        self.lab_txt = decay * self.lab_txt + (psi * w[:, None]).T @ labels
        self.weight = decay * self.weight + float(w.sum())

    def targets(self) -> tuple[F64, F64]:
        """``G = (Phi'Phi + mu n I)^-1 Phi'L`` and ``H`` likewise: ``M_I = GG'``, ``M_T = HH'``,
        ``M_C = GH'`` (Eq. 5 with ``S = LL'``)."""
        ridge = self.mu * self.weight
        g = np.linalg.solve(self.gram_img + ridge * np.eye(len(self.gram_img)), self.lab_img)
        h = np.linalg.solve(self.gram_txt + ridge * np.eye(len(self.gram_txt)), self.lab_txt)
        return np.asarray(g, dtype=np.float64), np.asarray(h, dtype=np.float64)

    def solve(self, rng: np.random.Generator) -> None:
        """Re-solve ``A`` and ``B`` from the statistics so far."""
        if not self.frozen:
            # Provisional landmarks from the pool: the statistics are rebuilt around them.
            if len(self.pending_img) < 2:
                return
            self.map_img, self.map_txt = self._draw_maps(rng, len(self.pending_img))
            self._reset_statistics()
            self._accumulate(self.pending_img, self.pending_txt, self.pending_cols)
        else:
            self._fold()
        g, h = self.targets()
        if g.shape[1] == 0 or not np.any(g) or not np.any(h):
            return  # no labelled pair yet: nothing to project onto
        a, b = self.a, self.b
        if a.shape != (len(g), self.q) or b.shape != (len(h), self.q):
            a = _small_random(rng, g, self.q)
            b = _small_random(rng, h, self.q)
        result = mpl_cd(g, h, a, b, rng, self.outer, self.inner, self.tol)
        self.a, self.b, self.cd_losses = result.a, result.b, result.losses
        self.solves += 1
        self._publish()

    def _publish(self) -> None:
        assert self.map_img is not None and self.map_txt is not None
        self.serve_img, self.serve_txt = self.map_img, self.map_txt
        self.w_img = self.map_img.proj @ self.a
        self.w_txt = self.map_txt.proj @ self.b

    # -- several ranks ---------------------------------------------------------------------------
    def register_labels(self, labels: list[tuple[int, ...]]) -> None:
        for item in labels:
            self.class_index.columns(item, arriving=False)

    def merge_parts(self) -> MergeParts | None:
        if not self.frozen or self.forget != 1.0:
            return None
        self._fold()
        grow = len(self.class_index) - self.lab_img.shape[1]
        if grow:  # classes registered for this round that no folded pair carried yet
            self.lab_img = np.hstack([self.lab_img, np.zeros((self.lab_img.shape[0], grow))])
            self.lab_txt = np.hstack([self.lab_txt, np.zeros((self.lab_txt.shape[0], grow))])
        parts: MergeParts = {
            k: ("sum", getattr(self, k)) for k in ("gram_img", "gram_txt", "lab_img", "lab_txt")
        }
        for key in ("weight", "pairs", "unlabelled"):
            parts[key] = ("sum", np.asarray(getattr(self, key)))
        parts["ignored_labels"] = ("sum", np.asarray(self.class_index.ignored_labels))
        return parts

    def set_merged(self, merged: Arrays) -> None:
        for key in ("gram_img", "gram_txt", "lab_img", "lab_txt"):
            setattr(self, key, np.array(merged[key], dtype=np.float64))
        self.weight = float(merged["weight"])
        self.pairs, self.unlabelled = int(merged["pairs"]), int(merged["unlabelled"])
        self.class_index.ignored_labels = int(merged["ignored_labels"])

    def after_merge(self, pairs_before: int, pairs_after: int, rng: np.random.Generator) -> None:
        if self.schedule.crossed(pairs_before, pairs_after):
            self.solve(rng)

    # -- serving -------------------------------------------------------------------------------
    def _embed(
        self, x: NDArray[np.floating], nm: NystroemMap | None, power: float, w: F64
    ) -> NDArray[np.float32]:
        x = np.atleast_2d(x)
        if nm is None:
            return np.zeros((len(x), self.q), dtype=np.float32)
        return np.asarray(nm.kernel(power_normalize(x, power)) @ w, dtype=np.float32)

    def embed_images(self, x: NDArray[np.floating]) -> NDArray[np.float32]:
        return self._embed(x, self.serve_img, self.power_img, self.w_img)

    def embed_texts(self, x: NDArray[np.floating]) -> NDArray[np.float32]:
        return self._embed(x, self.serve_txt, self.power_txt, self.w_txt)

    def linear_head(self, modality: str) -> LinearHead | None:
        """:meth:`_embed` as ``k(x, landmarks) W``: the kernel rows are the features, the same
        for every version once the landmarks freeze; ``None`` before the first solve."""
        nm, power, w = (
            (self.serve_img, self.power_img, self.w_img)
            if modality == "image"
            else (self.serve_txt, self.power_txt, self.w_txt)
        )
        if nm is None:
            return None
        # One map per landmark set: its key digests the landmarks (a large array), and the
        # rolling evaluation asks for the head at every evaluated pair.
        made = self._feature_maps.get(modality)
        if made is None or made[0] is not nm:
            made = (nm, RbfFeatures(power_features(power), nm.landmarks, nm.gamma))
            self._feature_maps[modality] = made
        return LinearHead(made[1], w, None, "none")

    # -- the work counted (streamxm/models/work.py) ----------------------------------------
    def periodic_work(self) -> tuple[int, int]:
        """Solves come every ``solve_every`` pairs once the doubling ends and the landmark
        pool is full (the landmarks freeze then)."""
        start = max(self.landmark_pool, self.schedule.steady_start())
        return self.schedule.next_due(start - 1), self.schedule.every

    def _steady_sizes(self) -> tuple[int, int, int]:
        """``(m1, m2, c)`` of the steady state: the landmarks drawn from the full pool,
        ``m1 = min(m_img, landmark_pool)`` and ``m2 = min(m_txt, landmark_pool)`` (also the
        feature counts, at their most: the eigenvalue floor may drop some, a property of the
        data), and ``c`` the class columns seen so far (at least one: they grow with the
        stream's classes)."""
        return (
            min(self.m_img, self.landmark_pool),
            min(self.m_txt, self.landmark_pool),
            max(1, len(self.class_index)),
        )

    def learning_work(self) -> Work:
        """Per pair in the steady state (landmarks frozen, solved once), float64, with
        ``d_v, d_t`` the input sizes, ``(m1, m2, c)`` = :meth:`_steady_sizes`, ``B = batch`` and
        ``n = solve_every``:

        ``T + N(1, d_v) + N(1, d_t) + F / B + R / n``

        - ``T = (E_v(1) + E_t(2) + E_t(1) + E_v(2)) / 2``: the scored triplet
          (:func:`~streamxm.models.base.observe_triplet`, directions alternating), ``E`` the
          :meth:`embedding_work`;
        - ``N(r, d)``: the arriving vectors power-normalised (:func:`power_normalize_work`);
        - ``F``: a fold of ``B`` pending pairs (:func:`_fold_work`);
        - ``R``: a re-solve (:func:`_solve_work`).
        """
        m1, m2, c = self._steady_sizes()
        triplet = 0.5 * (
            self.embedding_work(1, "image")
            + self.embedding_work(2, "text")
            + self.embedding_work(1, "text")
            + self.embedding_work(2, "image")
        )
        fold = _fold_work(self.batch, ((self.img_dim, m1), (self.txt_dim, m2)), c)
        solve = _solve_work(m1, m2, c, self.q, self.outer, self.inner)
        return (
            triplet
            + power_normalize_work(self.img_dim, self.power_img)
            + power_normalize_work(self.txt_dim, self.power_txt)
            + fold * (1.0 / self.batch)
            + solve * (1.0 / self.solve_every)
        )

    def embedding_work(self, rows: int, modality: str) -> Work:
        """:meth:`_embed` on ``r`` rows of size ``d`` against the ``m`` steady-state landmarks
        (:meth:`_steady_sizes`): ``N(r, d)`` (:func:`power_normalize_work`), the kernel rows
        ``K(r, m, d)`` (:func:`_rbf_work`) and their product with ``W`` (``2 r m q``)."""
        dim, m, power = self._side(modality)
        return (
            power_normalize_work(rows * dim, power)
            + _rbf_work(rows, m, dim)
            + gemm(rows, self.q, m)
            + elementwise(rows * self.q, itemsize=4, flops_per_item=0.0)
        )

    def evaluation_work(self, gallery: int) -> Work:
        """The base class's count (the query's kept-feature map, the ``g + 1`` stored and
        arriving features times ``W``: ``2 (g + 1) m q``, the scores: ``2 (g + 1) q``) for the
        steady-state heads (:meth:`_steady_features`), so it is the same before the first solve
        (no head yet) and while the provisional landmarks grow."""
        total = Work()
        for modality in ("image", "text"):
            dim, m, _ = self._side(modality)
            total += (
                self._steady_features(modality).work(1, dim)
                + gemm(gallery + 1, self.q, m)
                + gemm(1, gallery + 1, self.q)
            )
        return total

    def kept_feature_work(self, rows: int) -> Work:
        """The base class's count for the steady-state heads (:meth:`_steady_features`)."""
        total = Work()
        for modality in ("image", "text"):
            dim = self._side(modality)[0]
            total += elementwise(
                rows * dim, 4, flops_per_item=3.0, passes=3.0
            ) + self._steady_features(modality).work(rows, dim)
        return total

    def _steady_features(self, modality: str) -> RbfFeatures:
        """A shape-only stand-in for a steady-state head's feature map: the
        :class:`~streamxm.models.heads.RbfFeatures` over the ``m`` landmarks of
        :meth:`_steady_sizes` (the count reads their number, not their values)."""
        _, m, power = self._side(modality)
        gamma = self.sigma_img if modality == "image" else self.sigma_txt
        return RbfFeatures(power_features(power), np.empty((m, 0)), gamma)

    def _side(self, modality: str) -> tuple[int, int, float]:
        """``(input size, steady-state landmarks, power)`` of ``modality``."""
        m1, m2, _ = self._steady_sizes()
        if modality == "image":
            return self.img_dim, m1, self.power_img
        if modality == "text":
            return self.txt_dim, m2, self.power_txt
        raise ValueError(f"modality must be 'image' or 'text', got {modality!r}")

    # -- state ---------------------------------------------------------------------------------
    def state(self) -> tuple[Arrays, dict[str, Any]]:
        arrays: Arrays = {
            "gram_img": self.gram_img,
            "gram_txt": self.gram_txt,
            "lab_img": self.lab_img,
            "lab_txt": self.lab_txt,
            "a": self.a,
            "b": self.b,
            "pending_img": np.asarray(self.pending_img).reshape(-1, self.img_dim),
            "pending_txt": np.asarray(self.pending_txt).reshape(-1, self.txt_dim),
            "classes": np.asarray(self.class_index.classes, dtype=np.int64),
        }
        for key, nm in (("img", self.map_img), ("txt", self.map_txt)):
            if nm is not None:
                arrays[f"landmarks_{key}"] = nm.landmarks
                arrays[f"proj_{key}"] = nm.proj
        serve_apart = self.serve_img is not None and self.serve_img is not self.map_img
        if serve_apart:
            for key, nm in (("img", self.serve_img), ("txt", self.serve_txt)):
                assert nm is not None
                arrays[f"serve_landmarks_{key}"] = nm.landmarks
                arrays[f"serve_proj_{key}"] = nm.proj
        if self.serve_img is not None:
            arrays["w_img"], arrays["w_txt"] = self.w_img, self.w_txt
        meta = {
            "frozen": self.frozen,
            "weight": self.weight,
            "pairs": self.pairs,
            "unlabelled": self.unlabelled,
            "solves": self.solves,
            "pending_cols": self.pending_cols,
            "cd_losses": self.cd_losses,
            "ignored_labels": self.class_index.ignored_labels,
            "serve_apart": serve_apart,
        }
        return arrays, meta

    def load_state(self, arrays: Arrays, meta: dict[str, Any]) -> None:
        for key in ("gram_img", "gram_txt", "lab_img", "lab_txt", "a", "b"):
            setattr(self, key, np.array(arrays[key], dtype=np.float64))
        self.pending_img = list(np.array(arrays["pending_img"], dtype=np.float64))
        self.pending_txt = list(np.array(arrays["pending_txt"], dtype=np.float64))
        self.pending_cols = [[int(c) for c in cols] for cols in meta["pending_cols"]]
        self.class_index.restore([int(c) for c in arrays["classes"]], meta["ignored_labels"])
        self.map_img = self.map_txt = None
        if "landmarks_img" in arrays:
            self.map_img = NystroemMap(
                arrays["landmarks_img"], self.sigma_img, proj=arrays["proj_img"]
            )
            self.map_txt = NystroemMap(
                arrays["landmarks_txt"], self.sigma_txt, proj=arrays["proj_txt"]
            )
        self.frozen = bool(meta["frozen"])
        self.weight = float(meta["weight"])
        self.pairs, self.unlabelled = int(meta["pairs"]), int(meta["unlabelled"])
        self.solves = int(meta["solves"])
        self.cd_losses = [float(x) for x in meta["cd_losses"]]
        self.serve_img, self.serve_txt = self.map_img, self.map_txt
        if meta["serve_apart"]:
            self.serve_img = NystroemMap(
                arrays["serve_landmarks_img"], self.sigma_img, proj=arrays["serve_proj_img"]
            )
            self.serve_txt = NystroemMap(
                arrays["serve_landmarks_txt"], self.sigma_txt, proj=arrays["serve_proj_txt"]
            )
        if "w_img" in arrays:
            self.w_img = np.array(arrays["w_img"], dtype=np.float64)
            self.w_txt = np.array(arrays["w_txt"], dtype=np.float64)
        else:
            self.serve_img = self.serve_txt = None


def _small_random(rng: np.random.Generator, target: F64, q: int) -> F64:
    """A start for the descent at a tenth of the target's entry scale (``0`` is stationary)."""
    scale = 0.1 * float(np.linalg.norm(target)) / np.sqrt(target.size)
    return rng.normal(scale=scale, size=(len(target), q))


def _rbf_work(rows: int, m: int, dim: int) -> Work:
    """:func:`~streamxm.models.heads.rbf_kernel` of ``r`` rows against ``m`` landmarks of
    size ``d`` (float64) whose squared norms are kept: the rows' squared norms and ``2 x``
    (3 flops, three passes over ``r d``), the product ``(2 x) L'`` (``2 r m d``) and, over the
    ``r x m`` result, the norms added, ``max(., 0)``, ``-gamma .`` and ``exp`` (24 flops, ten
    passes an entry)."""
    return (
        elementwise(rows * dim, flops_per_item=3.0, passes=3.0)
        + gemm(rows, m, dim)
        + elementwise(rows * m, flops_per_item=24.0, passes=10.0)
    )


def _fold_work(batch: int, sides: tuple[tuple[int, int], ...], classes: int) -> Work:
    """:meth:`SDSRL._accumulate` of ``B`` pending pairs, per side ``(d, m)`` (``m`` landmarks
    and features) with ``c`` class columns:

    - the pending rows stacked (two passes over ``B d``), their kernel rows ``K(B, m, d)``
      (:func:`_rbf_work`) times the Nystroem projection (``2 B m^2``);
    - ``Phi'Phi`` as ``(Phi w)' Phi`` (``2 m^2 B``: a ``gemm``, the weighted copy is another
      operand) and ``Phi'L`` (``2 m c B``), ``Phi w`` formed for each (three passes over
      ``B m``), each sum decayed and added (2 flops, five passes an entry);
    - ``Phi'L`` copied by ``hstack`` even when no class is new (two passes over ``m c``);

    plus the ``B x c`` label matrix written.
    """
    work = elementwise(batch * classes, flops_per_item=0.0, passes=1.0)
    for dim, m in sides:
        work += (
            elementwise(batch * dim, flops_per_item=0.0)
            + _rbf_work(batch, m, dim)
            + gemm(batch, m, m)
            + 2 * elementwise(batch * m, passes=3.0)
            + gemm(m, m, batch)
            + gemm(m, classes, batch)
            + elementwise(m * m + m * classes, flops_per_item=2.0, passes=5.0)
            + elementwise(m * classes, flops_per_item=0.0)
        )
    return work


def _solve_work(m1: int, m2: int, classes: int, q: int, outer: int, inner: int) -> Work:
    """:meth:`SDSRL.solve` once the landmarks are frozen (its fold is charged with the
    others, per pair):

    - the targets ``G = (Phi'Phi + mu n I)^-1 Phi'L`` and ``H``: ``eye``, its scaling and the
      sum (2 flops, six passes over ``m^2``), then ``gesv``: the LU factors (``2 m^3 / 3``)
      and ``c`` right-hand sides (``2 m^2 c``), the matrix and right-hand sides copied in and
      out (three passes over ``m^2 + m c``), and ``any(G)`` (one pass over ``m c``);
    - MPL-CD (:func:`~streamxm.models.projections.mpl_cd_work`, to its ``outer`` loops);
    - the published ``W = U diag(w)^-1/2 A``: ``2 m^2 q`` per side.
    """
    work = mpl_cd_work(m1, m2, classes, q, outer, inner)
    for m in (m1, m2):
        lu = Work(2.0 * m**3 / 3.0 + 2.0 * m * m * classes, 0.0)
        work += (
            elementwise(m * m, flops_per_item=2.0, passes=6.0)
            + lu
            + elementwise(m * m + m * classes, flops_per_item=0.0, passes=3.0)
            + elementwise(m * classes, flops_per_item=0.0, passes=1.0)
            + gemm(m, q, m)
        )
    return work
