"""The kernel machinery of one CMOMKS modality: its input blocks, the landmark pool on which
kernels are centred and triplets projected, and the support points with their coefficients.

Used by :class:`streamxm.models.cmomks.CMOMKS`, one side for the images and one for the texts.
"""

from __future__ import annotations

import numpy as np
from numpy.typing import NDArray

from streamxm.models.array_types import F64
from streamxm.models.base import Arrays
from streamxm.models.work import Work, elementwise, gemm

__all__ = ["KernelSide"]


class KernelSide:
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
        self.landmarks, self.budget = landmarks, budget
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

    @classmethod
    def for_kernels(
        cls,
        dim: int,
        blocks: list[tuple[int, int] | None],
        gammas: list[float],
        power: float,
        landmarks: int,
        budget: int,
    ) -> KernelSide:
        """The side of kernel pairs whose kernel ``j`` reads ``blocks[j]`` (``None``: the whole
        vector) with bandwidth ``gammas[j]``: pairs on one block share its stored points."""
        full = [b or (0, dim) for b in blocks]
        distinct = sorted(set(full))
        return cls(
            dim,
            distinct,
            [distinct.index(b) for b in full],
            np.array(gammas),
            power,
            landmarks,
            budget,
        )

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

    def add_to_pool(self, x: NDArray[np.floating]) -> None:
        """Append one vector, prepared, to the landmark pool (not yet full)."""
        for b, part in enumerate(self.prep(x)):
            self.pool[b][self.pool_size] = part[0]
            self.pool_sq[b][self.pool_size] = np.einsum("ij,ij->i", part, part)[0]
        self.pool_size += 1

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

    def triplet_terms(
        self, parts: list[NDArray[np.float32]], used: int
    ) -> tuple[F64, F64, F64, F64]:
        """For two prepared rows: centred kernels to the pool (M, 2, P), support terms
        (M, 2, used), ``m`` of the rows (M, 2) and ``k(row0, row1)`` (M,)."""
        to_pool, m_x = self.centred_to_pool(parts)
        support = self.centred_to_support(parts, m_x, used)
        k01 = self.kernels([p[:1] for p in parts], [p[1:] for p in parts])[:, 0, 0]
        return to_pool, support, m_x, k01

    def same_pool(self, other: KernelSide) -> bool:
        """Whether ``other`` has this side's closed landmark pool (so its kernels centre alike)."""
        return (
            self.pool_size == other.pool_size
            and np.array_equal(self.c, other.c)
            and all(np.array_equal(a, b) for a, b in zip(self.pool, other.pool, strict=True))
        )

    def rewritten(self, before: KernelSide, used: int, used_before: int) -> NDArray[np.int64]:
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

    def pool_coordinates(self, slot: int) -> F64:
        """(M, P): this side's function of support triplet ``slot``, ``sum_c coef_c k~(., x_c)``,
        projected onto the pool span, as coordinates ``K~_PP^+ k~_P`` on the pool points."""
        parts = [s[slot] for s in self.support]  # the two points, prepared
        to_pool, _ = self.centred_to_pool(parts)  # (M, 2, P)
        combined = np.einsum("mcp,c->mp", to_pool, self.coef[slot])
        return np.asarray(np.einsum("mpq,mq->mp", self.pinv, combined))

    # -- state -------------------------------------------------------------------------------
    def state_arrays(self, prefix: str) -> Arrays:
        """What a checkpoint keeps, named ``prefix.*``: the coefficients, the support points'
        ``m`` and the points; the squared norms and the closed pool's constants are derived."""
        arrays: Arrays = {f"{prefix}.coef": self.coef, f"{prefix}.support_m": self.support_m}
        for b in range(len(self.blocks)):
            arrays[f"{prefix}.pool.{b}"] = self.pool[b]
            arrays[f"{prefix}.support.{b}"] = self.support[b]
        return arrays

    def load_state_arrays(self, arrays: Arrays, prefix: str, pool_size: int) -> None:
        """Restore :meth:`state_arrays` with ``pool_size`` pool points filled, and derive the
        rest."""
        self.coef = np.array(arrays[f"{prefix}.coef"], dtype=np.float32)
        self.support_m = np.array(arrays[f"{prefix}.support_m"], dtype=np.float64)
        for b in range(len(self.blocks)):
            self.pool[b] = np.array(arrays[f"{prefix}.pool.{b}"], dtype=np.float32)
            self.pool_sq[b] = np.einsum("ij,ij->i", self.pool[b], self.pool[b])
            self.support[b] = np.array(arrays[f"{prefix}.support.{b}"], dtype=np.float32)
            flat = self.support[b].reshape(-1, self.support[b].shape[2])
            self.support_sq[b] = np.einsum("ij,ij->i", flat, flat)
        self.pool_size = pool_size
        if self.pool_size >= self.landmarks:
            self.close_pool()  # derived: centring constants and the pool Gram inverse

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
