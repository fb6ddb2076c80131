"""CMOS: online asymmetric bilinear similarity learned by Passive-Aggressive updates.

Wu, Wang and Huang, "Online Asymmetric Similarity Learning for Cross-Modal Retrieval", CVPR 2017.

The step sizes, their merge into ``W`` and the triplets a pair queues are in
:mod:`streamxm.models.cmos_updates`, the checkpoint and the ranks' merge in
:mod:`streamxm.models.cmos_state`, the work counted in :mod:`streamxm.models.cmos_work`.
"""

from __future__ import annotations

from typing import Any, ClassVar, Literal

import numpy as np
from numpy.typing import NDArray

from streamxm.models import cmos_state, cmos_work
from streamxm.models.base import Arrays, LearnStats, MergeParts, require
from streamxm.models.cmos_average import decay, move_average
from streamxm.models.cmos_updates import (
    Queued,
    add_outer_products,
    blocked_steps,
    paper_steps,
    queue_pair,
)
from streamxm.models.embedding import EmbeddingKind, fixed_space_or_towers
from streamxm.models.heads import SlotFeatures
from streamxm.models.history import Example, History
from streamxm.models.opt_in import CountsWork, MergesRanks
from streamxm.models.work import Work

__all__ = ["CMOS"]


class CMOS(CountsWork, MergesRanks, name="cmos"):
    """Bilinear similarity ``s(v, t) = phi(v)^T W psi(t)`` learned online by PA-I updates.

    An image triplet ``(v, t+, t-)`` with loss ``l = max(0, margin - s(v, t+) + s(v, t-))``
    takes the step ``W += tau V``, ``V = v (t+ - t-)^T``, ``tau = min(C, l / ||V||_F^2)``
    (Eq. 6); a text triplet ``(t, v+, v-)`` the mirror, ``V = (v+ - v-) t^T`` (Eq. 7). ``phi``
    and ``psi`` L2-normalise and centre the inputs. Queued triplets are solved in blocks, with
    the same steps as the sequential loop.

    See ``docs/design.md``, section "cmos", for the method and the streaming choices.

    Parameters
    ----------
    img_dim, txt_dim : int
        Input sizes.
    C : float, default=0.1
        PA-I aggressiveness, ``> 0``; chosen on the Wikipedia stream (``docs/benchmarks.md``).
    margin : float, default=1.0
        Hinge margin, ``> 0`` (paper: 1).
    triplets_per_pair : int, default=10
        Triplets drawn per arriving pair, ``>= 1``.
    normalize : {"l2", "none"}, default="l2"
        Input normalisation, before the centring.
    center : bool, default=True
        Centre inputs by the running means of the (normalised) vectors seen.
    dtype : {"float32", "float64"}, default="float32"
        Dtype of ``W`` (the block solve runs in float64).
    flush_every : int, default=128
        Queued triplets that trigger a flush, ``>= 1`` (larger: fewer, bigger matrix products).
    solver : {"blocked", "paper"}, default="blocked"
        ``"blocked"`` solves the queue at once; ``"paper"`` is Eq. 6/7 transcribed literally,
        one triplet at a time with ``V`` formed explicitly (the baseline of
        ``streamxm bench throughput`` and the oracle of the tests).
    replay : int, default=6
        Extra triplets per pair, during a burst, whose query is a pair of the history's memory,
        ``>= 0`` (0: the paper's rule; nothing is replayed outside a burst or without a memory).
        Chosen with the memory's size (``memory_share``) on some seeds of the stream orders and
        checked on others (``docs/benchmarks.md``, "Stream orders").
    burst_damping : float, default=0.5
        During a burst, the arriving pair's triplets step with the cap ``C (1 - burst_damping)``
        (its replayed ones keep ``C``), in ``[0, 1)`` (0: the paper's rule). A burst hands the
        model hundreds of triplets of one class in a row, nearly all clipped at the cap (PA-I's
        margin of 1 is rarely met), so the class that arrives last writes the most recent and
        largest share of ``W`` over the directions it shares with the others; the smaller steps
        keep what the earlier classes wrote. Outside a burst nothing changes.
    average : float, default=0.0
        Horizon, in pairs, of the exponential moving average of the iterates that the model
        serves, ``>= 0``: after each triplet ``A = beta A + (1 - beta) W`` with
        ``beta = 1 - 1 / (average * triplets_per_pair)`` (:mod:`.cmos_average`); the learner
        keeps stepping from its last iterate ``W``. 0: ``A`` is ``W`` (the paper's rule).

    Attributes
    ----------
    W : ndarray of shape (img_dim, txt_dim)
        The bilinear map, in ``dtype``: the last iterate.
    W_avg : ndarray of shape (img_dim, txt_dim) or None
        The average ``A`` served and scored in place of ``W`` (``None`` when ``average`` is 0).
    img_sum, txt_sum : ndarray of shape (img_dim,) and (txt_dim,)
        Sums of the normalised inputs seen; divided by ``n_seen``, the centring means.
    n_seen : int
        Pairs learned.
    n_triplets : int
        Triplets drawn so far; its parity picks the direction of the next one.

    References
    ----------
    .. [1] Wu, Wang and Huang, "Online Asymmetric Similarity Learning for Cross-Modal
       Retrieval", CVPR 2017.

    Examples
    --------
    >>> import numpy as np
    >>> m = CMOS(3, 2, normalize="none", center=False)
    >>> stats = LearnStats()
    >>> m.update_image(np.array([1., 0, 0]), np.array([1., 0]), np.array([0., 1]), stats)
    >>> m.W
    array([[ 0.1, -0.1],
           [ 0. ,  0. ],
           [ 0. ,  0. ]], dtype=float32)
    >>> stats.mistakes["i2t"], stats.loss["i2t"]
    (1, 1.0)
    """

    # Twice the ring: in a burst a text query's negatives are images from it, and a few dozen a
    # class let W learn those images rather than the class (text->image falls).
    memory_share = 2.0
    # replay, burst_damping and average came later: a checkpoint without them restores them off
    checkpoint_defaults: ClassVar[dict[str, Any]] = {
        "replay": 0,
        "burst_damping": 0.0,
        "average": 0.0,
    }

    def __init__(
        self,
        img_dim: int,
        txt_dim: int,
        C: float = 0.1,
        margin: float = 1.0,
        triplets_per_pair: int = 10,
        normalize: Literal["l2", "none"] = "l2",
        center: bool = True,
        dtype: Literal["float32", "float64"] = "float32",
        flush_every: int = 128,
        solver: Literal["blocked", "paper"] = "blocked",
        replay: int = 6,
        burst_damping: float = 0.5,
        average: float = 0.0,
    ) -> None:
        super().__init__(img_dim, txt_dim)
        require(
            locals(),
            C="> 0",
            margin="> 0",
            triplets_per_pair=">= 1",
            flush_every=">= 1",
            replay=">= 0",
            burst_damping="in [0, 1)",
            average=">= 0",
        )
        if normalize not in ("l2", "none"):
            raise ValueError(f"normalize must be 'l2' or 'none', got {normalize!r}")
        if solver not in ("blocked", "paper"):
            raise ValueError(f"solver must be 'blocked' or 'paper', got {solver!r}")
        if dtype not in ("float32", "float64"):
            raise ValueError(f"dtype must be 'float32' or 'float64', got {dtype!r}")
        self.C = float(C)
        self.margin = float(margin)
        self.triplets_per_pair = int(triplets_per_pair)
        self.normalize = normalize
        self.center = bool(center)
        self.dtype = dtype
        self.flush_every = int(flush_every)
        self.solver = solver
        self.replay = int(replay)
        self.burst_damping = float(burst_damping)
        self.average = float(average)
        self._beta = decay(self.average, self.triplets_per_pair)  # per triplet
        #: When a list, every flush appends the step sizes it took, in order (for tests).
        self.tau_log: list[float] | None = None
        self.W = np.zeros((img_dim, txt_dim), dtype=dtype)
        self.W_avg = self.W.copy() if self.average > 0 else None
        self.img_sum = np.zeros(img_dim, dtype=np.float64)
        self.txt_sum = np.zeros(txt_dim, dtype=np.float64)
        self.n_seen = 0
        self.n_triplets = 0  # its parity picks the direction of the next triplet
        # The queue of triplets not yet applied: V_k = left[k] right[k]^T.
        capacity = self.flush_every + self.triplets_per_pair + self.replay
        self._left = np.zeros((capacity, img_dim), dtype=dtype)
        self._right = np.zeros((capacity, txt_dim), dtype=dtype)
        self._is_text = np.zeros(capacity, dtype=bool)
        self._cap = np.zeros(capacity, dtype=np.float64)  # each queued triplet's PA cap
        self._decay = np.zeros(capacity, dtype=np.float64)  # and its average's beta
        self._queued = 0
        self._stats = LearnStats()  # where reads record a flush; update points it at its own

    # -- input map -------------------------------------------------------------------------
    def _norm(self, x: NDArray[np.floating]) -> NDArray[np.float64]:
        x = np.asarray(x, dtype=np.float64)
        if self.normalize == "l2":
            norms = np.linalg.norm(x, axis=-1, keepdims=True)
            x = x / np.where(norms > 0, norms, 1.0)
        return np.asarray(x, dtype=np.float64)

    def _mean(self, total: NDArray[np.float64]) -> NDArray[np.float64]:
        if not self.center or self.n_seen == 0:
            return np.zeros_like(total)
        return total / self.n_seen

    def map_images(self, x: NDArray[np.floating]) -> NDArray[np.float64]:
        """``phi``: the input map applied to image vectors."""
        return self._norm(x) - self._mean(self.img_sum)

    def map_texts(self, x: NDArray[np.floating]) -> NDArray[np.float64]:
        """``psi``: the input map applied to text vectors."""
        return self._norm(x) - self._mean(self.txt_sum)

    # -- the PA updates (Eq. 6 and 7; streamxm/models/cmos_updates.py) ---------------------
    def _enqueue(
        self,
        left: NDArray[np.floating],
        right: NDArray[np.floating],
        is_text: bool,
        cap: float | None = None,
    ) -> None:
        """Queue ``V = left right^T``, stepping with the PA cap ``cap`` (default ``C``)."""
        k = self._queued
        self._left[k] = left
        self._right[k] = right
        self._is_text[k] = is_text
        self._cap[k] = self.C if cap is None else cap
        self._decay[k] = self._beta
        self._queued += 1

    def _submit(
        self,
        left: NDArray[np.floating],
        right: NDArray[np.floating],
        is_text: bool,
        stats: LearnStats,
        defer: bool,
    ) -> None:
        if self._queued >= self.flush_every:
            self.flush(stats)
        self._enqueue(left, right, is_text)
        if not defer:
            self.flush(stats)

    def update_image(
        self,
        v: NDArray[np.floating],
        t_pos: NDArray[np.floating],
        t_neg: NDArray[np.floating],
        stats: LearnStats,
        defer: bool = False,
    ) -> None:
        """Image-query triplet ``(v, t+, t-)`` on mapped vectors: ``V = v (t+ - t-)^T``.

        Applied now, or with ``defer=True`` queued for the next flush (its effect is the same).
        """
        self._submit(v, np.asarray(t_pos, np.float64) - t_neg, False, stats, defer)

    def update_text(
        self,
        t: NDArray[np.floating],
        v_pos: NDArray[np.floating],
        v_neg: NDArray[np.floating],
        stats: LearnStats,
        defer: bool = False,
    ) -> None:
        """Text-query triplet ``(t, v+, v-)`` on mapped vectors: ``V = (v+ - v-) t^T`` (see
        :meth:`update_image`)."""
        self._submit(np.asarray(v_pos, np.float64) - v_neg, t, True, stats, defer)

    def flush(self, stats: LearnStats) -> None:
        """Solve the queued triplets in order, exactly as the sequential PA loop, and merge their
        rank-one updates into ``W`` as one matrix product."""
        n = self._queued
        if n == 0:
            return
        self._queued = 0
        queue = Queued(self._left[:n], self._right[:n], self._is_text[:n])
        caps = self._cap[:n]
        before = self.W.copy() if self.W_avg is not None else self.W
        if self.solver == "paper":
            tau = paper_steps(self.W, queue, self.margin, caps, stats)
        else:
            tau = blocked_steps(self.W, queue, self.margin, caps, stats)
            if tau.any():
                add_outer_products(self.W, queue.left, tau, queue.right)  # W += A^T diag(tau) B
        if self.W_avg is not None:
            move_average(self.W_avg, before, queue.left, tau, queue.right, self._decay[:n])
        if self.tau_log is not None:
            self.tau_log.extend(tau.tolist())

    def learn_one(
        self, pair: Example, history: History, rng: np.random.Generator, stats: LearnStats
    ) -> None:
        queue_pair(self, pair, history, rng, stats)

    # -- serving ---------------------------------------------------------------------------
    @property
    def served(self) -> NDArray[Any]:
        """The map served and scored: the average ``W_avg``, or ``W`` without one."""
        return self.W if self.W_avg is None else self.W_avg

    def embed_images(self, x: NDArray[np.floating]) -> NDArray[np.float32]:
        self.flush(self._stats)
        return np.asarray(self.map_images(x) @ self.served, dtype=np.float32)

    def embed_texts(self, x: NDArray[np.floating]) -> NDArray[np.float32]:
        return self.map_texts(x).astype(np.float32)

    def similarity(
        self, imgs: NDArray[np.floating], txts: NDArray[np.floating]
    ) -> NDArray[np.float64]:
        self.flush(self._stats)
        a, b = self.map_images(np.atleast_2d(imgs)), self.map_texts(np.atleast_2d(txts))
        # Multiply W into the smaller side: one query against many costs one matvec.
        if len(a) <= len(b):
            return np.asarray((a @ self.served) @ b.T)
        return np.asarray(a @ (self.served @ b.T))

    def evaluation_scores(
        self, pair: Example, history: History, rows: NDArray[np.intp], kept: SlotFeatures
    ) -> tuple[NDArray[np.float64], NDArray[np.float64]]:
        """``W`` multiplied into the arriving pair's side, once per direction, in ``W``'s dtype
        (a float64 operand would copy ``W`` at every call); the stored rows enter through the
        norms the history keeps: ``psi(t) . q = (t . q) / ||t|| - mean . q``."""
        self.flush(self._stats)
        W = self.served
        image_query = (self.map_images(pair.img).astype(W.dtype) @ W).astype(np.float64)
        text_query = (W @ self.map_texts(pair.txt).astype(W.dtype)).astype(np.float64)
        i2t = _stored_scores(self, history.txt, history.txt_norm, rows, image_query, self.txt_sum)
        t2i = _stored_scores(self, history.img, history.img_norm, rows, text_query, self.img_sum)
        return (
            np.concatenate([[self.map_texts(pair.txt) @ image_query], i2t]),
            np.concatenate([[self.map_images(pair.img) @ text_query], t2i]),
        )

    # -- the work counted (streamxm/models/work.py) ----------------------------------------
    def learning_work(self) -> Work:
        """Per pair, ``triplets_per_pair / flush_every`` of a flush of ``flush_every`` triplets
        (:func:`.cmos_work.flush_work`)."""
        flush = cmos_work.flush_work(self, self.flush_every)
        return flush * (self.triplets_per_pair / self.flush_every)

    def embedding_work(self, rows: int, modality: str) -> Work:
        """Images: the map and ``phi(x) W``; texts: the map only."""
        return cmos_work.embedding_work(self, rows, modality)

    def evaluation_work(self, gallery: int) -> Work:
        """The flush an evaluation forces, the query products and the stored rows' scores
        (:func:`.cmos_work.evaluation_work`)."""
        return cmos_work.evaluation_work(self, gallery)

    def embedding(self) -> EmbeddingKind:
        return fixed_space_or_towers(self)

    @property
    def fixed_space(self) -> bool:
        # phi(x) = unit(x) - mean: bilinear in the unit rows, the mean folding into a constant.
        return self.normalize == "l2"

    def queries_for_texts(
        self, imgs: NDArray[np.floating]
    ) -> tuple[NDArray[np.float64], NDArray[np.float64]]:
        self.flush(self._stats)
        q = self.map_images(np.atleast_2d(imgs)) @ self.served.astype(np.float64)
        return q, -(q @ self._mean(self.txt_sum))

    def queries_for_images(
        self, txts: NDArray[np.floating]
    ) -> tuple[NDArray[np.float64], NDArray[np.float64]]:
        self.flush(self._stats)
        q = self.map_texts(np.atleast_2d(txts)) @ self.served.T.astype(np.float64)
        return q, -(q @ self._mean(self.img_sum))

    # -- state (streamxm/models/cmos_state.py) ---------------------------------------------
    def merge_parts(self) -> MergeParts:
        return cmos_state.merge_parts(self)

    def set_merged(self, merged: Arrays) -> None:
        cmos_state.set_merged(self, merged)

    def state(self) -> tuple[Arrays, dict[str, Any]]:
        return cmos_state.model_state(self)

    def load_state(self, arrays: Arrays, meta: dict[str, Any]) -> None:
        cmos_state.load_state(self, arrays, meta)


def _stored_scores(
    model: CMOS,
    stored: NDArray[np.float32],
    norms: NDArray[np.float32],
    rows: NDArray[np.intp],
    query: NDArray[np.float64],
    total: NDArray[np.float64],
) -> NDArray[np.float64]:
    """The stored ``rows``' scores against a moved ``query``: ``(x . q) / ||x|| - mean . q``,
    ``mean`` the centring mean of the sums ``total``."""
    raw = np.asarray(stored[rows] @ query.astype(np.float32), dtype=np.float64)
    if model.normalize == "l2":
        raw /= np.where(norms[rows] > 0, norms[rows], 1.0)
    return raw - float(model._mean(total) @ query)
