"""CMOMKS: multiple kernel pairs, each learned by kernelised PA, combined by Hedge weights.

Wu, Wang and Huang, "Online Asymmetric Similarity Learning for Cross-Modal Retrieval", CVPR 2017,
Sec. 3.4.

The kernel machinery of one modality is in :mod:`streamxm.models.cmomks_support`, the learning
step in :mod:`streamxm.models.cmomks_learning`, the checkpoint in
:mod:`streamxm.models.cmomks_state`, the work counted in :mod:`streamxm.models.cmomks_work` and the
index rows carried between versions in :mod:`streamxm.models.cmomks_index`.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, ClassVar

import numpy as np
from numpy.typing import NDArray

from streamxm.models import cmomks_index, cmomks_state, cmomks_work
from streamxm.models.array_types import F64
from streamxm.models.base import Arrays, CrossModalModel, LearnStats, require
from streamxm.models.cmomks_learning import Triplet, image_terms, learn_pair, triplet_step
from streamxm.models.cmomks_support import KernelSide
from streamxm.models.embedding import EmbeddingKind, IndexUpdate, KernelTerms
from streamxm.models.history import Example, History
from streamxm.models.opt_in import CountsWork
from streamxm.models.work import Work

__all__ = ["CMOMKS", "KernelPair", "default_kernels"]


@dataclass(frozen=True)
class KernelPair:
    """One kernel pair ``(k^v, k^t)``: Gaussian kernels ``exp(-gamma ||x - y||^2)`` on the
    ``[start, stop)`` block of each vector (``None`` = the whole vector), after the block is
    mapped elementwise by ``sign(x) |x|^power`` and L2-normalised."""

    img_gamma: float
    txt_gamma: float
    img_block: tuple[int, int] | None = None
    txt_block: tuple[int, int] | None = None

    @classmethod
    def from_json(cls, spec: dict[str, Any]) -> KernelPair:
        def block(value: Any) -> tuple[int, int] | None:
            return None if value is None else (int(value[0]), int(value[1]))

        return cls(
            float(spec["img_gamma"]),
            float(spec["txt_gamma"]),
            block(spec.get("img_block")),
            block(spec.get("txt_block")),
        )

    def to_json(self) -> dict[str, Any]:
        return {
            "img_gamma": self.img_gamma,
            "txt_gamma": self.txt_gamma,
            "img_block": list(self.img_block) if self.img_block else None,
            "txt_block": list(self.txt_block) if self.txt_block else None,
        }

    def check(self, img_dim: int, txt_dim: int) -> None:
        """Raise ``ValueError`` unless both blocks lie inside their inputs and both gammas are
        ``> 0``."""
        for block, dim in ((self.img_block, img_dim), (self.txt_block, txt_dim)):
            if block is not None and not 0 <= block[0] < block[1] <= dim:
                raise ValueError(f"kernel block {block} outside [0, {dim})")
        if self.img_gamma <= 0 or self.txt_gamma <= 0:
            raise ValueError("kernel gammas must be > 0")


def default_kernels() -> list[dict[str, Any]]:
    """Gaussian kernel pairs at three image bandwidths (2, 4, 8) with text bandwidths 2, 4, 4."""
    return [KernelPair(gv, gt).to_json() for gv, gt in ((2.0, 2.0), (4.0, 4.0), (8.0, 4.0))]


#: The constructor's rules (:func:`~streamxm.models.base.require`).
_RULES = {
    "C": "> 0",
    "margin": "> 0",
    "beta": "in (0, 1)",
    "power": "> 0",
    "budget": ">= 1",
    "landmarks": ">= 2",
    "triplets_per_pair": ">= 1",
    "rehearse": ">= 0",
    "burst_damping": "in [0, 1)",
    "pool_skip": ">= 0",
    "rebuild_pool": ">= 0",
    "pool_class_cap": "in (0, 1]",
    "pool_burst_cap": "in (0, 1]",
}
#: Parameters that came later, off: a checkpoint without them restores with the former rules.
_CAME_LATER: dict[str, Any] = {
    "rehearse": 0,
    "balanced_support": False,
    "burst_damping": 0.0,
    "pool_skip": 0,
    "rebuild_pool": 0,
    "pool_class_cap": 1.0,
    "pool_burst_cap": 1.0,
}


class CMOMKS(CountsWork, name="cmomks"):
    """Cross-modal online multiple kernel similarity: Hedge-weighted kernelised CMOS scores.

    Kernel pair ``j`` scores ``s_j(v, t) = sum_k tau_jk <phi_j(v), a_k> <b_k, psi_j(t)>`` over
    the support triplets ``k``, each ``tau_jk`` a PA-I step (Eq. 6/7 through kernel
    evaluations); the model is ``f = sum_j theta_j s_j / sum_j theta_j``, with ``theta_j``
    multiplied by ``beta`` at each of pair ``j``'s mistakes (Hedge). The kernels are centred on
    a landmark pool, and triplets beyond the budget are projected onto it.

    See ``docs/design.md``, section "cmomks", for the method and the streaming choices.

    Parameters
    ----------
    img_dim, txt_dim : int
        Input sizes.
    kernels : list of dict or None, default=None
        Kernel pairs as JSON dicts (:class:`KernelPair` fields), at least one, gammas ``> 0``;
        ``None``: :func:`default_kernels`.
    C : float, default=0.5
        PA-I aggressiveness, ``> 0``; chosen on the Wikipedia stream (``docs/benchmarks.md``).
    margin : float, default=1.0
        Hinge margin, ``> 0``.
    beta : float, default=0.998
        Hedge discount, in ``(0, 1)`` (the paper's default).
    budget : int, default=1000
        Support triplets kept exactly, ``>= 1``.
    landmarks : int, default=500
        Size of the landmark pool (centring and projection of what leaves the support), ``>= 2``.
    pool_skip : int, default=0
        Pairs passed over between two pool points while the pool fills, ``>= 0`` (the pool
        spans the first ``(pool_skip + 1) landmarks`` pairs); 0: the paper's first
        ``landmarks`` pairs.
    pool_class_cap : float, default=0.2
        The share of the pool one class may take while it fills, in ``(0, 1]``: a pair whose
        class (its first label) holds ``ceil(pool_class_cap landmarks)`` pool points passes
        it by (:func:`.cmomks_learning.joins_pool`), until ``landmarks`` offered pairs in a
        row, or three times as many in all, have been passed by, which lifts the caps for good
        (a stream of fewer classes than the caps allow for fills its pool all the same); 1: the
        paper's rule, every pair joins.
    pool_burst_cap : float, default=0.1
        The same share while the history sees a burst of few classes, in ``(0, 1]`` (the
        smaller of the two holds then); 1: no other cap in a burst.
    rebuild_pool : int, default=0
        Pairs of a class with no landmark that the memory must hold for the pool to be rebuilt
        class-balanced from the memory, ``A`` re-based onto it
        (:func:`.cmomks_pool.rebuild_slots`, :func:`.cmomks_pool.rebuild`), ``>= 0``; 0: the
        paper's pool, frozen once full.
    triplets_per_pair : int, default=10
        Triplets drawn per arriving pair, ``>= 1``.
    power : float, default=0.5
        Elementwise power applied before normalising, ``> 0`` (0.5: Hellinger; 1: none).
    rehearse : int, default=10
        During a burst of few classes, triplets whose query is a remembered pair, per arriving
        pair, ``>= 0``.
    balanced_support : bool, default=False
        A full support's new triplet replaces the oldest triplet of the class (its query's
        first label) holding the most (:func:`.cmomks_learning.evicted_slot`); ``False``: the
        paper's oldest support triplet (a ring). Either is projected onto the pool.
    burst_damping : float, default=0.0
        During a burst the arriving pair's triplets step at most ``C (1 - burst_damping)``,
        in ``[0, 1)``; 0: the paper's ``C``.

    Attributes
    ----------
    tau : ndarray of shape (n_kernels, budget)
        The support triplets' PA coefficients, per kernel pair.
    A : ndarray of shape (n_kernels, landmarks, landmarks)
        The triplets that left the support, projected onto the landmark pool, per kernel pair.
    theta : ndarray of shape (n_kernels,)
        Hedge weights, normalised to sum to 1 (kept as ``log_theta``).
    kernel_mistakes : ndarray of shape (n_kernels,)
        Each kernel pair's own mistakes.
    vote_mistakes : int
        Mistakes of the Hedge-weighted vote, the quantity Hedge's analysis bounds.
    support_size : int
        Support triplets held, at most ``budget``.
    slot_group, slot_written : ndarray of shape (budget,)
        Each support slot's class (-1: unlabelled) and how many triplets the support had
        taken before it (its age).
    projected : int
        Triplets projected into ``A`` so far.
    pool_group : ndarray of shape (landmarks,)
        Each pool point's class (-1: unlabelled); ``pool_rebuilds``: the pool's rebuilds.

    References
    ----------
    .. [1] Wu, Wang and Huang, "Online Asymmetric Similarity Learning for Cross-Modal
       Retrieval", CVPR 2017, Sec. 3.4.

    Examples
    --------
    >>> import numpy as np
    >>> from streamxm.learning.stream_learner import StreamLearner
    >>> from streamxm.stream.messages import make_pair
    >>> rng = np.random.default_rng(0)
    >>> learner = StreamLearner("cmomks", 6, 4, {"budget": 50, "landmarks": 20})
    >>> _ = learner.learn([make_pair(str(i), rng.random(6), rng.random(4), labels=[i % 3])
    ...                    for i in range(100)])
    >>> model = learner.model
    >>> model.support_size, model.embed_images(rng.random((2, 6))).shape
    (50, (2, 210))
    """

    memory_share = 1.0
    checkpoint_defaults: ClassVar[dict[str, Any]] = _CAME_LATER

    def __init__(
        self,
        img_dim: int,
        txt_dim: int,
        kernels: list[dict[str, Any]] | None = None,
        C: float = 0.5,
        margin: float = 1.0,
        beta: float = 0.998,
        budget: int = 1000,
        landmarks: int = 500,
        triplets_per_pair: int = 10,
        power: float = 0.5,
        rehearse: int = 10,
        balanced_support: bool = False,
        burst_damping: float = 0.0,
        pool_skip: int = 0,
        rebuild_pool: int = 0,
        pool_class_cap: float = 0.2,
        pool_burst_cap: float = 0.1,
    ) -> None:
        super().__init__(img_dim, txt_dim)
        specs = [KernelPair.from_json(k) for k in (kernels or default_kernels())]
        if not specs:
            raise ValueError("kernels must name at least one kernel pair")
        require(locals(), **_RULES)
        for k in specs:
            k.check(img_dim, txt_dim)
        self.kernels = specs
        self.C, self.margin, self.beta, self.power = float(C), float(margin), float(beta), power
        self.budget, self.landmarks = int(budget), int(landmarks)
        self.triplets_per_pair = int(triplets_per_pair)
        self.rehearse = int(rehearse)
        self.balanced_support = bool(balanced_support)
        self.burst_damping = float(burst_damping)
        self.pool_skip, self.rebuild_pool = int(pool_skip), int(rebuild_pool)
        self.pool_class_cap, self.pool_burst_cap = float(pool_class_cap), float(pool_burst_cap)
        self.pairs_offered = 0  # pairs learned from (one in pool_skip + 1 joins the pool)
        self.pool_passed = 0  # offered pairs passed by in a row for a cap (joins_pool)
        self.pool_passed_all = 0  # and in all
        sizes = (self.power, self.landmarks, self.budget)
        self.img_side = KernelSide.for_kernels(
            img_dim, [k.img_block for k in specs], [k.img_gamma for k in specs], *sizes
        )
        self.txt_side = KernelSide.for_kernels(
            txt_dim, [k.txt_block for k in specs], [k.txt_gamma for k in specs], *sizes
        )
        m = len(specs)
        self.tau = np.zeros((m, budget), dtype=np.float64)
        self.A = np.zeros((m, landmarks, landmarks), dtype=np.float64)  # projected triplets
        self.log_theta = np.zeros(m, dtype=np.float64)
        self.kernel_mistakes = np.zeros(m, dtype=np.int64)
        self.vote_mistakes = 0
        self.support_size = 0
        self.head = 0  # the slot after the last support triplet written (the ring's next)
        self.slot_group = np.full(budget, -1, dtype=np.int64)  # class of each support triplet
        self.slot_written = np.zeros(budget, dtype=np.int64)  # support writes before it
        self.n_triplets = 0
        self.projected = 0
        self.pool_group = np.full(landmarks, -1, dtype=np.int64)  # class of each pool point
        self.pool_rebuilds = 0
        # Triplets that arrived before the pool was full: image rows, text rows, is_text, class.
        self._waiting: list[Triplet] = []

    @property
    def theta(self) -> F64:
        """Hedge weights, normalised to sum to 1."""
        w = np.exp(self.log_theta - self.log_theta.max())
        return np.asarray(w / w.sum())

    @property
    def pool_full(self) -> bool:
        return self.img_side.pool_size >= self.landmarks

    # -- kernel features ---------------------------------------------------------------------
    def _features(self, side: KernelSide, x: NDArray[np.floating]) -> tuple[F64, F64]:
        """Per kernel pair: centred kernels to the pool (M, n, P) and the support terms
        (M, n, used) of the rows of ``x``."""
        parts = side.prep(x)
        to_pool, m_x = side.centred_to_pool(parts)
        return to_pool, side.centred_to_support(parts, m_x, self.support_size)

    def _image_terms(self, x: NDArray[np.floating]) -> F64:
        """(M, n, P + used): the image side of ``s_j`` so that ``s_j = image . text``."""
        to_pool, support = self._features(self.img_side, x)
        return image_terms(to_pool, support, self.A, self.tau[:, : self.support_size])

    def _text_terms(self, x: NDArray[np.floating]) -> F64:
        to_pool, support = self._features(self.txt_side, x)
        return np.concatenate([to_pool, support], axis=2)

    def kernel_scores(self, imgs: NDArray[np.floating], txts: NDArray[np.floating]) -> F64:
        """(M, n_imgs, n_txts): every kernel pair's own similarity ``s_j``."""
        if not self.pool_full:
            return np.zeros((len(self.kernels), len(np.atleast_2d(imgs)), len(np.atleast_2d(txts))))
        return np.asarray(
            np.einsum("mik,mjk->mij", self._image_terms(imgs), self._text_terms(txts))
        )

    # -- learning (streamxm/models/cmomks_learning.py) ---------------------------------------
    def learn_triplet(
        self,
        img_rows: NDArray[np.float32],
        txt_rows: NDArray[np.float32],
        is_text: bool,
        stats: LearnStats,
        group: int = -1,
        cap: float | None = None,
    ) -> None:
        """``img_rows``/``txt_rows``: (2, d) each; an image triplet has its query twice in
        ``img_rows`` and ``(t+, t-)`` in ``txt_rows``, a text triplet the mirror; ``group``: its
        class, the query's first label (-1: unlabelled)
        (:func:`~streamxm.models.cmomks_learning.triplet_step`)."""
        triplet_step(self, img_rows, txt_rows, is_text, stats, group, cap)

    def learn_one(
        self, pair: Example, history: History, rng: np.random.Generator, stats: LearnStats
    ) -> None:
        learn_pair(self, pair, history, rng, stats)

    # -- serving -----------------------------------------------------------------------------
    def embed_images(self, x: NDArray[np.floating]) -> NDArray[np.float32]:
        if not self.pool_full:
            return self._flat(np.zeros((len(self.kernels), len(np.atleast_2d(x)), 0)))
        return self._flat(self._image_terms(x) * self.theta[:, None, None])

    def embed_texts(self, x: NDArray[np.floating]) -> NDArray[np.float32]:
        if not self.pool_full:
            return self._flat(np.zeros((len(self.kernels), len(np.atleast_2d(x)), 0)))
        return self._flat(self._text_terms(x))

    def _flat(self, terms: F64) -> NDArray[np.float32]:
        """(M, n, width) -> (n, M * (landmarks + budget)), zero-padded: one width always."""
        m, n, width = terms.shape
        out = np.zeros((n, m, self.landmarks + self.budget), dtype=np.float32)
        out[:, :, :width] = terms.transpose(1, 0, 2)
        return out.reshape(n, -1)

    def similarity(
        self, imgs: NDArray[np.floating], txts: NDArray[np.floating]
    ) -> NDArray[np.float64]:
        return np.asarray(np.einsum("m,mij->ij", self.theta, self.kernel_scores(imgs, txts)))

    def embedding(self) -> EmbeddingKind:
        return KernelTerms(
            self.embed_images,
            self.embed_texts,
            self.similarity,
            self.shared_space,
            index_rows=self.index_rows,
            index_query=self.index_query,
            update=lambda earlier, modality: self.index_update(earlier.source, modality),
            source=self,
        )

    # -- the rows a server's index keeps ---------------------------------------------------
    def index_rows(self, modality: str, x: NDArray[np.floating]) -> NDArray[np.float32]:
        """Per kernel pair ``[k~_P(x), sum_c coef_kc k~(x, x_kc)]`` (the centred kernels to the
        pool and to each support triplet: they change only where a support slot is written,
        never with ``A``, ``tau`` or ``theta``, which :meth:`index_query` carries), then the
        ``M`` pool means ``m_j(x)``, which the query weighs 0: kept so that a later version
        recomputes its rewritten slots' columns without the pool's kernels
        (:meth:`index_update`)."""
        m, rows = len(self.kernels), len(np.atleast_2d(x))
        if not self.pool_full:
            return self._index_flat(np.zeros((m, rows, 0)), np.zeros((m, rows)))
        side = self.img_side if modality == "image" else self.txt_side
        parts = side.prep(x)
        to_pool, m_x = side.centred_to_pool(parts, np.float32)
        support = side.centred_to_slots(parts, m_x, slice(0, self.support_size), np.float32)
        return self._index_flat(np.concatenate([to_pool, support], axis=2), m_x)

    def index_query(self, modality: str, x: NDArray[np.floating]) -> NDArray[np.float32]:
        """An image query as :meth:`embed_images`; a text query ``theta_j [A_j k~_P(t),
        tau_jk <b_k, psi_j(t)>]`` (``A`` applied from the text side); both with ``M`` zeros
        for the rows' pool means."""
        m, rows = len(self.kernels), len(np.atleast_2d(x))
        if not self.pool_full:
            return self._index_flat(np.zeros((m, rows, 0)), np.zeros((m, rows)))
        if modality == "image":
            terms = self._image_terms(x)
        else:
            to_pool, support = self._features(self.txt_side, x)
            terms = np.concatenate(
                [
                    np.matmul(to_pool, self.A.transpose(0, 2, 1)),
                    support * self.tau[:, None, : self.support_size],
                ],
                axis=2,
            )
        return self._index_flat(terms * self.theta[:, None, None], np.zeros((m, rows)))

    def index_update(self, earlier: CrossModalModel, modality: str) -> IndexUpdate | None:
        """Kept rows with the columns of the support slots written since ``earlier`` recomputed
        (:func:`.cmomks_index.index_update`)."""
        return cmomks_index.index_update(self, earlier, modality)

    def _settings(self) -> tuple[object, ...]:
        """What two versions share when one's index rows can be the other's."""
        return (tuple(self.kernels), self.landmarks, self.budget, self.power)

    def _index_width(self) -> int:
        return len(self.kernels) * (self.landmarks + self.budget + 1)

    def _index_flat(self, terms: F64, m_x: F64) -> NDArray[np.float32]:
        """:meth:`_flat` of ``terms`` followed by the ``M`` columns of ``m_x`` (M, n)."""
        return np.hstack([self._flat(terms), m_x.T.astype(np.float32)])

    # -- the work counted (streamxm/models/work.py) ------------------------------------------
    def learning_work(self) -> Work:
        """Per pair, ``triplets_per_pair`` times :func:`.cmomks_work.triplet_work`: the steady
        state has the pool closed and the support full, and outside bursts no triplets are
        rehearsed. Every triplet is counted as updating (a triplet skips the support only when
        all ``M`` kernel pairs already meet the margin, which the margin-1 hinge on centred
        kernel scores rarely does), so each one also projects a support triplet into ``A``
        (choosing it, ``O(budget)``, and the pool's rare rebuilds are not counted)."""
        return cmomks_work.triplet_work(self.img_side, self.txt_side) * self.triplets_per_pair

    def embedding_work(self, rows: int, modality: str) -> Work:
        """:meth:`embed_images` / :meth:`embed_texts` of ``n`` rows at a full support
        (:func:`.cmomks_work.embedding_work`)."""
        side = self.img_side if modality == "image" else self.txt_side
        return cmomks_work.embedding_work(side, rows, modality == "image")

    # -- state (streamxm/models/cmomks_state.py) ---------------------------------------------
    def state(self) -> tuple[Arrays, dict[str, Any]]:
        return cmomks_state.model_state(self)

    def load_state(self, arrays: Arrays, meta: dict[str, Any]) -> None:
        cmomks_state.load_state(self, arrays, meta)
