"""SDSRL: Nystroem kernel features and semantic projections learned by coordinate descent.

Jiang, Li, Li and Wang, "Learning Discriminative Representations for Semantic Cross Media
Retrieval" (SDSRL), Sec. 3 (Eq. 5), Algorithm 1 (MPL-CD) and its appendix.
"""

from __future__ import annotations

from typing import Any, ClassVar

import numpy as np
from numpy.typing import NDArray

from streamxm.models import sdsrl_state
from streamxm.models.array_types import F64
from streamxm.models.base import (
    Arrays,
    LearnStats,
    MergeParts,
    observe_triplet,
    require,
)
from streamxm.models.classes import ClassIndex
from streamxm.models.embedding import EmbeddingKind, linear_heads
from streamxm.models.heads import LinearHead, RbfFeatures, power_features, rbf_kernel
from streamxm.models.history import Example, History
from streamxm.models.moments import ResolveSchedule, power_normalize
from streamxm.models.opt_in import MergesRanks
from streamxm.models.projections import mpl_cd
from streamxm.models.sdsrl_landmarks import STATISTICS, LandmarkStatistics, NystroemMap
from streamxm.models.sdsrl_work import SDSRLWork

__all__ = ["SDSRL", "NystroemMap", "rbf_kernel"]


class SDSRL(
    LandmarkStatistics, SDSRLWork, MergesRanks, name="sdsrl", shared_space=True, batch_fit=True
):
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
    grow_landmarks : float, default=0.5
        ``>= 0``. Above 0, after the freeze each side owes every class seen
        ``ceil(grow_landmarks m / C)`` landmarks (``m`` its landmarks at the freeze, ``C`` the
        classes so far), taken from the class's next pending pairs, the statistics re-based
        onto the grown set (``LandmarkStatistics._grow``). 0.5 keeps the file-order figure
        and holds it in streams of one class or topic at a time (``docs/benchmarks.md``);
        ``grow_landmarks=0`` is the paper's rule, the landmarks drawn once and frozen. A
        distributed learner's split rounds hold the landmarks; rank 0 learns the round after
        a class new to them alone, growing (:meth:`merge_parts`). The narrative is in
        ``docs/design.md``.

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
    grown_classes : int
        The class columns known at the last growth over pending pairs (those after are owed
        growth).

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

    # grow_landmarks came later: a checkpoint without it restores the frozen landmarks
    checkpoint_defaults: ClassVar[dict[str, Any]] = {"grow_landmarks": 0.0}

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
        grow_landmarks: float = 0.5,
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
            grow_landmarks=">= 0",
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
        self.grow_landmarks = float(grow_landmarks)
        self.batch = int(batch)
        self.max_classes = max_classes
        self.class_index = ClassIndex(max_classes)
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
        self.solves = 0
        self.cd_losses: list[float] = []

    @property
    def ignored_labels(self) -> int:
        return self.class_index.ignored_labels

    # -- learning ----------------------------------------------------------------------------
    def learn_one(
        self, pair: Example, history: History, rng: np.random.Generator, stats: LearnStats
    ) -> None:
        if self.serve_img is not None:
            observe_triplet(self, pair, history, rng, stats)
        self._add(pair)
        if not self.frozen and self.pairs >= self.landmark_pool:
            self._freeze(rng)
        elif self.frozen and len(self.pending_img) >= self.batch:
            self._fold()
        if self.schedule.due(self.pairs):
            self.solve(rng)

    def fit(self, pairs: list[Example], rng: np.random.Generator, stats: LearnStats) -> None:
        """The offline protocol: landmarks drawn from all of ``pairs``, one solve on all of them
        (added to whatever the model has learned; on a fresh model, the paper's batch method)."""
        for pair in pairs:
            self._add(pair)
        if not self.frozen:
            self._freeze(rng)
        self.solve(rng)

    def solve(self, rng: np.random.Generator) -> None:
        """Re-solve ``A`` and ``B`` from the statistics so far."""
        if not self.frozen:
            # Provisional landmarks from the pool: the statistics are rebuilt around them.
            if len(self.pending_img) < 2:
                return
            self._redraw(rng)
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
        """The round's classes numbered alike on every rank; the round is split, so the
        landmarks hold still until :meth:`after_merge` (every rank's set stays the same; a
        class new to them is owed growth, :attr:`owes_growth`)."""
        self.hold_growth = True
        for item in labels:
            self.class_index.columns(item, arriving=False)

    def merge_parts(self) -> MergeParts | None:
        """The summed statistics and counters; ``None`` before the freeze, with ``forget < 1``,
        and while growth is owed with no pair pending outside a split round: rank 0 then learns
        the next round alone, growing landmarks for the owed classes from its pairs (a fold
        here grows from the pairs pending)."""
        if not self.frozen or self.forget != 1.0:
            return None
        if self.owes_growth and not self.hold_growth and not self.pending_img:
            return None
        self._fold()
        # Columns for the classes registered for this round that no folded pair carried yet.
        self._widen_labels(len(self.class_index))
        parts: MergeParts = {k: ("sum", getattr(self, k)) for k in STATISTICS}
        for key in ("weight", "pairs", "unlabelled"):
            parts[key] = ("sum", np.asarray(getattr(self, key)))
        parts["ignored_labels"] = ("sum", np.asarray(self.class_index.ignored_labels))
        return parts

    def set_merged(self, merged: Arrays) -> None:
        for key in STATISTICS:
            setattr(self, key, np.array(merged[key], dtype=np.float64))
        self.weight = float(merged["weight"])
        self.pairs, self.unlabelled = int(merged["pairs"]), int(merged["unlabelled"])
        self.class_index.ignored_labels = int(merged["ignored_labels"])

    def after_merge(self, pairs_before: int, pairs_after: int, rng: np.random.Generator) -> None:
        if self.schedule.crossed(pairs_before, pairs_after):
            self.solve(rng)
        self.hold_growth = False  # the split round is over

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

    def embedding(self) -> EmbeddingKind:
        return linear_heads(self)

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

    # -- state ---------------------------------------------------------------------------------
    def state(self) -> tuple[Arrays, dict[str, Any]]:
        return sdsrl_state.model_state(self)

    def load_state(self, arrays: Arrays, meta: dict[str, Any]) -> None:
        sdsrl_state.load_state(self, arrays, meta)


def _small_random(rng: np.random.Generator, target: F64, q: int) -> F64:
    """A start for the descent at a tenth of the target's entry scale (``0`` is stationary)."""
    scale = 0.1 * float(np.linalg.norm(target)) / np.sqrt(target.size)
    return rng.normal(scale=scale, size=(len(target), q))
