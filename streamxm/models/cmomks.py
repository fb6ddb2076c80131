"""CMOMKS: multiple kernel pairs, each learned by kernelised PA, combined by Hedge weights.

Wu, Wang and Huang, "Online Asymmetric Similarity Learning for Cross-Modal Retrieval", CVPR 2017,
Sec. 3.4.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, ClassVar

import numpy as np
from numpy.typing import NDArray

from streamxm.buffer.replay import ReplayBuffer, TripletSampler
from streamxm.models.base import Arrays, CrossModalModel, IndexUpdate, LearnStats, require
from streamxm.models.opt_in import CountsWork
from streamxm.models.work import Work, elementwise, gemm, matvec
from streamxm.stream.messages import Pair

__all__ = ["CMOMKS", "KernelPair", "default_kernels"]

F64 = NDArray[np.float64]


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


def default_kernels() -> list[dict[str, Any]]:
    """Gaussian kernel pairs at three image bandwidths (2, 4, 8) with text bandwidths 2, 4, 4."""
    return [KernelPair(gv, gt).to_json() for gv, gt in ((2.0, 2.0), (4.0, 4.0), (8.0, 4.0))]


class _Side:
    """Kernel machinery of one modality: its blocks, landmark pool and support points.

    Points are stored per distinct block, already mapped and normalised. ``k~`` is the kernel
    centred on the landmark pool: ``k~(x, y) = k(x, y) - m(x) - m(y) + c`` with
    ``m(x) = mean_r k(x, r)`` and ``c = mean_{r, r'} k(r, r')``.
    """

    def __init__(
        self,
        dim: int,
        blocks: list[tuple[int, int]],
        block_of: list[int],
        gammas: F64,
        power: float,
        landmarks: int,
        budget: int,
    ) -> None:
        self.blocks, self.block_of, self.gammas, self.power = blocks, block_of, gammas, power
        self.landmarks = landmarks
        widths = [stop - start for start, stop in blocks]
        m = len(block_of)
        self.pool = [np.zeros((landmarks, w), dtype=np.float32) for w in widths]
        self.pool_size = 0
        self.support = [np.zeros((budget, 2, w), dtype=np.float32) for w in widths]
        # Squared norms of the stored points: 1, or 0 for a zero vector.
        self.pool_sq = [np.zeros(landmarks, dtype=np.float32) for _ in widths]
        self.support_sq = [np.zeros(budget * 2, dtype=np.float32) for _ in widths]
        self.coef = np.zeros((budget, 2), dtype=np.float32)
        self.support_m = np.zeros((m, budget, 2), dtype=np.float64)  # m(x) of support points
        self.c = np.zeros(m, dtype=np.float64)
        self.pool_m = np.zeros((m, landmarks), dtype=np.float64)  # m(r) of the pool points
        self.pinv = np.zeros((m, landmarks, landmarks), dtype=np.float64)  # of centred pool Gram

    def prep(self, x: NDArray[np.floating]) -> list[NDArray[np.float32]]:
        """Per block: the rows of ``x`` mapped by the power and L2-normalised."""
        out = []
        x = np.atleast_2d(np.asarray(x, dtype=np.float32))
        for start, stop in self.blocks:
            part = x[:, start:stop]
            if self.power != 1.0:
                part = np.sign(part) * np.abs(part) ** self.power
            norms = np.linalg.norm(part, axis=1, keepdims=True)
            out.append((part / np.where(norms > 0, norms, 1.0)).astype(np.float32))
        return out

    def kernels(
        self,
        parts: list[NDArray[np.float32]],
        points: list[NDArray[np.float32]],
        points_sq: list[NDArray[np.float32]] | None = None,
        dtype: type[np.floating] = np.float64,
    ) -> F64:
        """(M, n, p): raw kernel values between prepared rows and prepared points (whose squared
        norms may be given, to spare a pass over large stored arrays), in ``dtype`` (learning:
        float64; a server's index rows: float32, whose exponentials cost less)."""
        dists = []
        for b, (part, pts) in enumerate(zip(parts, points, strict=True)):
            pts_sq = np.einsum("ij,ij->i", pts, pts) if points_sq is None else points_sq[b]
            # The stored points on the left: BLAS streams them once (a few rows against many
            # points); with the rows on the left it packs the points first, which is slower.
            d = np.einsum("ij,ij->i", part, part)[:, None] + pts_sq[None, :] - 2 * (pts @ part.T).T
            dists.append(np.maximum(d, 0.0, dtype=dtype))
        out = np.empty((len(self.block_of), *dists[0].shape), dtype=dtype)
        for j, (b, g) in enumerate(zip(self.block_of, self.gammas, strict=True)):
            np.exp(np.multiply(dists[b], -g, out=out[j]), out=out[j])  # in place: n x p is large
        return out

    def pool_points(self) -> list[NDArray[np.float32]]:
        return [p[: self.pool_size] for p in self.pool]

    def centred_to_pool(
        self, parts: list[NDArray[np.float32]], dtype: type[np.floating] = np.float64
    ) -> tuple[F64, F64]:
        """``k~(x, r)`` for every pool point ``r``, (M, n, P), and ``m(x)``, (M, n)."""
        k = self.kernels(
            parts, self.pool_points(), [q[: self.pool_size] for q in self.pool_sq], dtype
        )
        m_x = k.mean(axis=2, dtype=np.float64)
        k -= (self.pool_m - self.c[:, None]).astype(dtype)[:, None, :]
        k -= m_x[:, :, None].astype(dtype)
        return k, m_x

    def close_pool(self) -> None:
        k = self.kernels(self.pool_points(), self.pool_points())
        self.pool_m = k.mean(axis=2)
        self.c = k.mean(axis=(1, 2))
        n = self.pool_size
        for j in range(len(self.block_of)):
            centred = k[j] - self.pool_m[j][:, None] - self.pool_m[j][None]
            centred += self.c[j]
            self.pinv[j, :n, :n] = np.linalg.pinv(centred, rcond=1e-6, hermitian=True)

    def centred_to_support(self, parts: list[NDArray[np.float32]], m_x: F64, used: int) -> F64:
        """``sum_c coef_kc k~(x, x_kc)`` for every support triplet ``k``: (M, n, used)."""
        return self.centred_to_slots(parts, m_x, slice(0, used))

    def centred_to_slots(
        self,
        parts: list[NDArray[np.float32]],
        m_x: F64,
        slots: slice | NDArray[np.int64],
        dtype: type[np.floating] = np.float64,
    ) -> F64:
        """:meth:`centred_to_support` for the support triplets in ``slots`` only (a slice of
        slots from 0 reads the stored points in place), the kernels in ``dtype``."""
        count = len(range(len(self.coef))[slots]) if isinstance(slots, slice) else len(slots)
        if count == 0:
            return np.zeros((len(self.block_of), len(parts[0]), 0))
        pts = [s[slots].reshape(count * 2, s.shape[2]) for s in self.support]
        if isinstance(slots, slice):
            pts_sq = [q[: count * 2] for q in self.support_sq]
        else:
            pts_sq = [q.reshape(-1, 2)[slots].ravel() for q in self.support_sq]
        k = self.kernels(parts, pts, pts_sq, dtype).reshape(
            len(self.block_of), len(parts[0]), count, 2
        )
        # The centring summed over each triplet's points: sum_c coef_c (k_c - m(x) - m(x_c) + c)
        # = sum_c coef_c k_c - (m(x) - c) sum_c coef_c - sum_c coef_c m(x_c), so only one pass
        # reads the (M, n, slots, 2) kernels.
        coef = self.coef[slots].astype(np.float64)
        weight = coef.sum(axis=1)
        offset = np.einsum("mkc,kc->mk", self.support_m[:, slots], coef)
        summed = np.einsum("mnkc,kc->mnk", k, coef.astype(dtype))
        summed -= ((m_x - self.c[:, None])[:, :, None] * weight).astype(dtype)
        summed -= offset[:, None, :].astype(dtype)
        return np.asarray(summed)

    def same_pool(self, other: _Side) -> bool:
        """Whether ``other`` has this side's closed landmark pool (so its kernels centre alike)."""
        return (
            self.pool_size == other.pool_size
            and np.array_equal(self.c, other.c)
            and all(np.array_equal(a, b) for a, b in zip(self.pool, other.pool, strict=True))
        )

    def rewritten(self, before: _Side, used: int, used_before: int) -> NDArray[np.int64]:
        """The support slots below ``used`` whose triplet is not ``before``'s (written since, or
        not filled there)."""
        same = np.arange(used) < used_before
        for mine, theirs in zip(self.support, before.support, strict=True):
            same &= (mine[:used] == theirs[:used]).all(axis=(1, 2))
        same &= (self.coef[:used] == before.coef[:used]).all(axis=1)
        same &= (self.support_m[:, :used] == before.support_m[:, :used]).all(axis=(0, 2))
        return np.flatnonzero(~same).astype(np.int64)

    def put(
        self, slot: int, parts: list[NDArray[np.float32]], m_x: F64, coef: tuple[float, float]
    ) -> None:
        """Store a support triplet's two prepared points and their ``m`` at ``slot``."""
        for b, part in enumerate(parts):
            self.support[b][slot] = part
            self.support_sq[b][2 * slot : 2 * slot + 2] = np.einsum("ij,ij->i", part, part)
        self.support_m[:, slot] = m_x
        self.coef[slot] = coef

    # -- the work counted (streamxm/models/work.py) -------------------------------------------
    def prep_work(self, rows: int) -> Work:
        """:meth:`prep` of ``rows`` rows, per block of width ``w`` (float32): the power map
        ``sign(x) * |x|^power`` (``4 n w`` flops, 9 passes) unless ``power = 1``, then the norms,
        the division and the float32 copy (``3 n w`` flops, 5 passes)."""
        total = Work()
        for start, stop in self.blocks:
            items = rows * (stop - start)
            if self.power != 1.0:
                total += elementwise(items, 4, flops_per_item=4.0, passes=9.0)
            total += elementwise(items, 4, flops_per_item=3.0, passes=5.0)
        return total

    def kernels_work(self, rows: int, points: int, norms_given: bool = True) -> Work:
        """:meth:`kernels` of ``rows`` prepared rows against ``points`` prepared points: per
        block of width ``w`` the float32 product ``gemm(n, p, w)`` (the points read once),
        ``2 x`` and the rows' squared norms (``3 n w``), the points' norms when not given
        (``2 p w``), the distances ``|x|^2 + |y|^2 - 2 x.y`` clipped into float64 (``3 n p``
        flops, 7 float32 passes); per kernel pair ``exp(-gamma d)`` in place (``2 M n p`` flops,
        ``exp`` counted as one, 4 float64 passes)."""
        total = Work()
        for start, stop in self.blocks:
            width = stop - start
            total += (
                gemm(rows, points, width, 4)
                + elementwise(rows * width, 4, flops_per_item=3.0, passes=3.0)
                + elementwise(rows * points, 4, flops_per_item=3.0, passes=7.0)
            )
            if not norms_given:
                total += elementwise(points * width, 4, flops_per_item=2.0, passes=1.0)
        return total + elementwise(
            len(self.block_of) * rows * points, 8, flops_per_item=2.0, passes=4.0
        )

    def pool_work(self, rows: int) -> Work:
        """:meth:`centred_to_pool` of ``rows`` rows: the kernels to the ``P`` pool points, their
        mean ``m(x)`` and the centring ``k - m(x) - m(r) + c`` (``4 M n P`` flops, 7 float64
        passes)."""
        items = len(self.block_of) * rows * self.landmarks
        return self.kernels_work(rows, self.landmarks) + elementwise(
            items, 8, flops_per_item=4.0, passes=7.0
        )

    def support_work(self, rows: int, used: int) -> Work:
        """:meth:`centred_to_support` of ``rows`` rows against ``used`` support triplets: the
        kernels to their ``2 used`` points, the centring (``3`` flops, 6 passes an item) and
        the sum over each triplet's two points with its coefficients (``2`` flops, 1 pass), all
        over ``M n 2 used`` float64 items."""
        return self.kernels_work(rows, 2 * used) + elementwise(
            len(self.block_of) * rows * 2 * used, 8, flops_per_item=5.0, passes=7.0
        )


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
    triplets_per_pair : int, default=10
        Triplets drawn per arriving pair, ``>= 1``.
    power : float, default=0.5
        Elementwise power applied before normalising, ``> 0`` (0.5: Hellinger; 1: none).
    rehearse : int, default=10
        During a burst of few classes, triplets whose query is a remembered pair, per arriving
        pair, ``>= 0``.

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
    projected : int
        Triplets projected into ``A`` so far.

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
    checkpoint_defaults: ClassVar[dict[str, Any]] = {"rehearse": 0}  # came later, off

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
    ) -> None:
        super().__init__(img_dim, txt_dim)
        specs = [KernelPair.from_json(k) for k in (kernels or default_kernels())]
        if not specs:
            raise ValueError("kernels must name at least one kernel pair")
        require(
            locals(),
            C="> 0",
            margin="> 0",
            beta="in (0, 1)",
            power="> 0",
            budget=">= 1",
            landmarks=">= 2",
            triplets_per_pair=">= 1",
            rehearse=">= 0",
        )
        for k in specs:
            for block, dim in ((k.img_block, img_dim), (k.txt_block, txt_dim)):
                if block is not None and not 0 <= block[0] < block[1] <= dim:
                    raise ValueError(f"kernel block {block} outside [0, {dim})")
            if k.img_gamma <= 0 or k.txt_gamma <= 0:
                raise ValueError("kernel gammas must be > 0")
        self.kernels = specs
        self.C, self.margin, self.beta, self.power = float(C), float(margin), float(beta), power
        self.budget, self.landmarks = int(budget), int(landmarks)
        self.triplets_per_pair = int(triplets_per_pair)
        self.rehearse = int(rehearse)
        self.img_side = self._side(
            img_dim, [k.img_block for k in specs], [k.img_gamma for k in specs]
        )
        self.txt_side = self._side(
            txt_dim, [k.txt_block for k in specs], [k.txt_gamma for k in specs]
        )
        m = len(specs)
        self.tau = np.zeros((m, budget), dtype=np.float64)
        self.A = np.zeros((m, landmarks, landmarks), dtype=np.float64)  # projected triplets
        self.log_theta = np.zeros(m, dtype=np.float64)
        self.kernel_mistakes = np.zeros(m, dtype=np.int64)
        self.vote_mistakes = 0
        self.support_size = 0
        self.head = 0  # ring slot of the next support triplet
        self.n_triplets = 0
        self.projected = 0
        # Triplets that arrived before the pool was full: image rows, text rows, is_text.
        self._waiting: list[tuple[NDArray[np.float32], NDArray[np.float32], bool]] = []

    def _side(self, dim: int, blocks: list[tuple[int, int] | None], gammas: list[float]) -> _Side:
        full = [b or (0, dim) for b in blocks]
        distinct = sorted(set(full))
        return _Side(
            dim,
            distinct,
            [distinct.index(b) for b in full],
            np.array(gammas),
            self.power,
            self.landmarks,
            self.budget,
        )

    @property
    def theta(self) -> F64:
        """Hedge weights, normalised to sum to 1."""
        w = np.exp(self.log_theta - self.log_theta.max())
        return np.asarray(w / w.sum())

    @property
    def pool_full(self) -> bool:
        return self.img_side.pool_size >= self.landmarks

    # -- kernel features ---------------------------------------------------------------------
    def _features(self, side: _Side, x: NDArray[np.floating]) -> tuple[F64, F64]:
        """Per kernel pair: centred kernels to the pool (M, n, P) and the support terms
        (M, n, used) of the rows of ``x``."""
        parts = side.prep(x)
        to_pool, m_x = side.centred_to_pool(parts)
        return to_pool, side.centred_to_support(parts, m_x, self.support_size)

    def _image_terms(self, x: NDArray[np.floating]) -> F64:
        """(M, n, P + used): the image side of ``s_j`` so that ``s_j = image . text``."""
        to_pool, support = self._features(self.img_side, x)
        projected = np.matmul(to_pool, self.A)
        return np.concatenate([projected, support * self.tau[:, None, : self.support_size]], 2)

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

    # -- learning ----------------------------------------------------------------------------
    def _side_terms(
        self, side: _Side, parts: list[NDArray[np.float32]]
    ) -> tuple[F64, F64, F64, F64]:
        """For two prepared rows: centred kernels to the pool (M, 2, P), support terms
        (M, 2, used), ``m`` of the rows (M, 2) and ``k(row0, row1)`` (M,)."""
        to_pool, m_x = side.centred_to_pool(parts)
        support = side.centred_to_support(parts, m_x, self.support_size)
        k01 = side.kernels([p[:1] for p in parts], [p[1:] for p in parts])[:, 0, 0]
        return to_pool, support, m_x, k01

    def learn_triplet(
        self,
        img_rows: NDArray[np.float32],
        txt_rows: NDArray[np.float32],
        is_text: bool,
        stats: LearnStats,
    ) -> None:
        """``img_rows``/``txt_rows``: (2, d) each; an image triplet has its query twice in
        ``img_rows`` and ``(t+, t-)`` in ``txt_rows``, a text triplet the mirror."""
        img_parts, txt_parts = self.img_side.prep(img_rows), self.txt_side.prep(txt_rows)
        i_pool, i_sup, i_m, i_k01 = self._side_terms(self.img_side, img_parts)
        t_pool, t_sup, t_m, t_k01 = self._side_terms(self.txt_side, txt_parts)
        used = self.support_size
        img_terms = np.concatenate(
            [np.matmul(i_pool, self.A), i_sup * self.tau[:, None, :used]], axis=2
        )
        s = np.einsum("mik,mjk->mij", img_terms, np.concatenate([t_pool, t_sup], axis=2))
        # Gaussian: k(x, x) = 1, so k(p,p) - 2k(p,n) + k(n,n) = 2 - 2k(p,n); the query term is
        # the centred k~(q, q) = 1 - 2 m(q) + c.
        if is_text:
            diff = s[:, 0, 0] - s[:, 1, 0]  # s(v+, t) - s(v-, t)
            sq_norm = (1.0 - 2.0 * t_m[:, 0] + self.txt_side.c) * (2.0 - 2.0 * i_k01)
        else:
            diff = s[:, 0, 0] - s[:, 0, 1]  # s(v, t+) - s(v, t-)
            sq_norm = (1.0 - 2.0 * i_m[:, 0] + self.img_side.c) * (2.0 - 2.0 * t_k01)
        theta = self.theta
        loss = np.maximum(0.0, self.margin - diff)
        ok = (loss > 0) & (sq_norm > 1e-12)
        new_tau = np.where(ok, np.minimum(self.C, loss / np.where(ok, sq_norm, 1.0)), 0.0)
        wrong = diff <= 0.0
        # The Hedge-weighted vote of the pairs (Theorem 2 bounds its mistakes).
        self.vote_mistakes += int(theta @ wrong >= 0.5)
        self.kernel_mistakes += wrong
        self.log_theta += np.log(self.beta) * wrong
        self.log_theta -= self.log_theta.max()
        stats.add(
            "t2i" if is_text else "i2t",
            float(theta @ diff) <= 0.0,
            float(theta @ loss),
            bool(new_tau.any()),
        )
        if new_tau.any():
            slot = self.head
            if self.support_size == self.budget:
                self._project(slot)
            self.img_side.put(slot, img_parts, i_m, (1.0, -1.0) if is_text else (1.0, 0.0))
            self.txt_side.put(slot, txt_parts, t_m, (1.0, 0.0) if is_text else (1.0, -1.0))
            self.tau[:, slot] = new_tau
            self.head = (self.head + 1) % self.budget
            self.support_size = min(self.support_size + 1, self.budget)

    def _project(self, slot: int) -> None:
        """Merge support triplet ``slot`` into ``A``: each side's function, projected onto the
        pool span, has coordinates ``K~_PP^+ k~_P(a)``."""
        coords = []
        for side in (self.img_side, self.txt_side):
            parts = [s[slot] for s in side.support]  # the two points, prepared
            to_pool, _ = side.centred_to_pool(parts)  # (M, 2, P)
            combined = np.einsum("mcp,c->mp", to_pool, side.coef[slot])
            coords.append(np.einsum("mpq,mq->mp", side.pinv, combined))
        self.A += self.tau[:, slot, None, None] * coords[0][:, :, None] * coords[1][:, None, :]
        self.projected += 1

    def update(
        self,
        pair: Pair,
        slot: int,
        buffer: ReplayBuffer,
        rng: np.random.Generator,
        stats: LearnStats,
    ) -> None:
        if not self.pool_full:
            for side, x in ((self.img_side, pair.img), (self.txt_side, pair.txt)):
                for b, part in enumerate(side.prep(x)):
                    side.pool[b][side.pool_size] = part[0]
                    side.pool_sq[b][side.pool_size] = np.einsum("ij,ij->i", part, part)[0]
                side.pool_size += 1
        queries = [(slot, pair.labels, self.triplets_per_pair, stats)]
        # A burst: rehearse the rest (once learning has started: waiting triplets are counted).
        if self.rehearse and self.pool_full and buffer.drawable() > buffer.recent:
            for q in rng.integers(buffer.recent, buffer.recent + buffer.stored, size=self.rehearse):
                labels = buffer.labels_at(int(q))
                queries.append((int(q), labels, 1, LearnStats()))
        for qslot, qlabels, count, qstats in queries:
            sampler = TripletSampler(buffer, qslot, qlabels)
            for is_text, pos, neg in sampler.directed(rng, count, self.n_triplets):
                if is_text:
                    triplet = (
                        np.vstack([buffer.img[pos], buffer.img[neg]]),
                        np.vstack([buffer.txt[qslot], buffer.txt[qslot]]),
                        True,
                    )
                else:
                    triplet = (
                        np.vstack([buffer.img[qslot], buffer.img[qslot]]),
                        np.vstack([buffer.txt[pos], buffer.txt[neg]]),
                        False,
                    )
                self.n_triplets += 1
                if self.pool_full and not self._waiting:
                    self.learn_triplet(*triplet, qstats)
                else:
                    self._waiting.append(triplet)
        if self.pool_full and self._waiting:
            self.img_side.close_pool()
            self.txt_side.close_pool()
            waiting, self._waiting = self._waiting, []
            for triplet in waiting:
                self.learn_triplet(*triplet, stats)

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
        (the pool means read from the kept rows); ``None`` unless ``earlier`` is an earlier
        version of this model (same settings, the same closed pool, no larger support)."""
        if not (
            isinstance(earlier, CMOMKS)
            and self.pool_full
            and earlier.pool_full
            and self._settings() == earlier._settings()
            and earlier.support_size <= self.support_size
        ):
            return None
        side = self.img_side if modality == "image" else self.txt_side
        before = earlier.img_side if modality == "image" else earlier.txt_side
        if not side.same_pool(before):
            return None
        slots = side.rewritten(before, self.support_size, earlier.support_size)
        m, width = len(self.kernels), self.landmarks + self.budget
        columns = (np.arange(m)[:, None] * width + self.landmarks + slots[None, :]).ravel()

        def update(kept: NDArray[np.float32], x: NDArray[np.floating]) -> NDArray[np.float32]:
            if kept.shape[1] != self._index_width():
                raise ValueError(
                    f"kept rows are {kept.shape[1]} wide, not cmomks's {self._index_width()}"
                )
            out = np.array(kept, dtype=np.float32)
            if len(slots):
                m_x = kept[:, -m:].T.astype(np.float64)
                values = side.centred_to_slots(side.prep(x), m_x, slots, np.float32)
                out[:, columns] = values.transpose(1, 0, 2).reshape(len(out), -1)
            return out

        return update

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
        """Per pair, ``triplets_per_pair`` times :meth:`_triplet_work`: the steady state has the
        pool closed and the support full, and outside bursts no triplets are rehearsed. Every
        triplet is counted as updating (a triplet skips the support only when all ``M`` kernel
        pairs already meet the margin, which the margin-1 hinge on centred kernel scores rarely
        does), so each one also projects the oldest support triplet into ``A``."""
        return self._triplet_work() * self.triplets_per_pair

    def _triplet_work(self) -> Work:
        """:meth:`learn_triplet` with ``M`` kernel pairs, ``P = landmarks``, ``U = budget``
        support triplets, two rows a side (the query twice on its side, both counted). Per side:
        ``prep`` of the two rows, their centred
        kernels to the pool (``gemm(2, P, w)``) and to the ``2U`` support points
        (``gemm(2, 2U, w)``), ``k(row0, row1)``; the scores ``M gemm(2, P, P)`` (through ``A``,
        float64) and ``M gemm(2, 2, P + U)``, the products with ``tau`` and the concatenations
        (``M 2 (P + U)`` items); then :meth:`_project_work` and the two ``put`` copies."""
        m, p, u = len(self.kernels), self.landmarks, self.budget
        total = Work()
        for side in (self.img_side, self.txt_side):
            width = sum(stop - start for start, stop in side.blocks)
            total += (
                side.prep_work(2)
                + side.pool_work(2)
                + side.support_work(2, u)
                + side.kernels_work(1, 1, norms_given=False)
                + elementwise(2 * width, 4, flops_per_item=2.0, passes=3.0)
            )  # put
        total += (
            gemm(2, p, p) * m
            + gemm(2, 2, p + u) * m
            + elementwise(m * 2 * u, 8, flops_per_item=1.0, passes=2.0)
            + elementwise(m * 2 * (p + u), 8, flops_per_item=0.0, passes=4.0)
        )
        return total + self._project_work()

    def _project_work(self) -> Work:
        """:meth:`_project` of the support triplet leaving: per side the two stored points'
        centred kernels to the pool again (``gemm(2, P, w)``), their sum with the coefficients
        (``2 M 2 P``) and the coordinates ``K~_PP^+ k~`` (``M matvec(P, P)``, float64); then
        ``A += tau c_v c_t^T`` through a full ``(M, P, P)`` temporary (``2 M P^2`` flops: the
        temporary written and read, ``A`` read and written)."""
        m, p = len(self.kernels), self.landmarks
        total = Work()
        for side in (self.img_side, self.txt_side):
            total += (
                side.pool_work(2)
                + elementwise(m * 2 * p, 8, flops_per_item=2.0, passes=1.0)
                + matvec(p, p) * m
            )
        return total + elementwise(m * p * p, 8, flops_per_item=2.0, passes=4.0)

    def embedding_work(self, rows: int, modality: str) -> Work:
        """:meth:`embed_images` / :meth:`embed_texts` of ``n`` rows at a full support: ``prep``,
        the centred kernels to the pool (``gemm(n, P, w)``) and to the ``2U`` support points
        (``gemm(n, 2U, w)``, float32); images add ``M gemm(n, P, P)`` through ``A`` (float64)
        and the products with ``tau`` (``M n U``) and ``theta`` (``M n (P + U)``); both
        concatenate (``M n (P + U)`` float64 copied) and flatten into float32 (read 8, zeroed
        and written 4 bytes an item)."""
        m, p, u = len(self.kernels), self.landmarks, self.budget
        side = self.img_side if modality == "image" else self.txt_side
        terms = m * rows * (p + u)
        total = (
            side.prep_work(rows)
            + side.pool_work(rows)
            + side.support_work(rows, u)
            + elementwise(terms, 8, flops_per_item=0.0, passes=2.0)
            + elementwise(terms, 4, flops_per_item=0.0, passes=4.0)
        )
        if modality == "image":
            total += (
                gemm(rows, p, p) * m
                + elementwise(m * rows * u, 8, flops_per_item=1.0, passes=2.0)
                + elementwise(terms, 8, flops_per_item=1.0, passes=2.0)
            )
        return total

    # -- state -------------------------------------------------------------------------------
    def state(self) -> tuple[Arrays, dict[str, Any]]:
        arrays: Arrays = {
            "tau": self.tau,
            "A": self.A,
            "log_theta": self.log_theta,
            "kernel_mistakes": self.kernel_mistakes,
        }
        for name, side in (("img", self.img_side), ("txt", self.txt_side)):
            arrays[f"{name}.coef"] = side.coef
            arrays[f"{name}.support_m"] = side.support_m
            for b in range(len(side.blocks)):
                arrays[f"{name}.pool.{b}"] = side.pool[b]
                arrays[f"{name}.support.{b}"] = side.support[b]
        if self._waiting:
            arrays["waiting.img"] = np.stack([w[0] for w in self._waiting])
            arrays["waiting.txt"] = np.stack([w[1] for w in self._waiting])
            arrays["waiting.is_text"] = np.array([w[2] for w in self._waiting])
        return arrays, {
            "support_size": self.support_size,
            "head": self.head,
            "n_triplets": self.n_triplets,
            "projected": self.projected,
            "vote_mistakes": self.vote_mistakes,
            "pool_size": self.img_side.pool_size,
        }

    def load_state(self, arrays: Arrays, meta: dict[str, Any]) -> None:
        self.tau = np.array(arrays["tau"], dtype=np.float64)
        self.A = np.array(arrays["A"], dtype=np.float64)
        self.log_theta = np.array(arrays["log_theta"], dtype=np.float64)
        self.kernel_mistakes = np.array(arrays["kernel_mistakes"], dtype=np.int64)
        for name, side in (("img", self.img_side), ("txt", self.txt_side)):
            side.coef = np.array(arrays[f"{name}.coef"], dtype=np.float32)
            side.support_m = np.array(arrays[f"{name}.support_m"], dtype=np.float64)
            for b in range(len(side.blocks)):
                side.pool[b] = np.array(arrays[f"{name}.pool.{b}"], dtype=np.float32)
                side.pool_sq[b] = np.einsum("ij,ij->i", side.pool[b], side.pool[b])
                side.support[b] = np.array(arrays[f"{name}.support.{b}"], dtype=np.float32)
                flat = side.support[b].reshape(-1, side.support[b].shape[2])
                side.support_sq[b] = np.einsum("ij,ij->i", flat, flat)
            side.pool_size = int(meta["pool_size"])
            if side.pool_size >= self.landmarks:
                side.close_pool()  # derived: centring constants and the pool Gram inverse
        self.support_size, self.head = int(meta["support_size"]), int(meta["head"])
        self.n_triplets, self.projected = int(meta["n_triplets"]), int(meta["projected"])
        self.vote_mistakes = int(meta["vote_mistakes"])
        self._waiting = []
        if "waiting.is_text" in arrays:
            self._waiting = [
                (arrays["waiting.img"][i], arrays["waiting.txt"][i], bool(flag))
                for i, flag in enumerate(arrays["waiting.is_text"])
            ]
