"""Running first and second moments of a stream, and the ridge whitening built from them.

One piece of arithmetic serves the models that need covariance statistics: CCA solves its
eigenproblem from them, the pairwise family whitens its inputs with them.
"""

from __future__ import annotations

from typing import Any

import numpy as np
from numpy.typing import NDArray
from scipy.linalg import cholesky as _potrf
from scipy.linalg import eigh, lapack
from scipy.linalg.blas import dgemm, dsyrk

from streamxm.models.work import Work, cholesky, elementwise, gemm, gram_update

__all__ = [
    "FeatureScaler",
    "ResolveSchedule",
    "RunningMoments",
    "append_constant",
    "covariance_work",
    "fold_work",
    "power_normalize",
    "power_normalize_work",
    "ridge_cholesky",
    "ridge_cholesky_work",
    "ridge_whitener",
    "top_singular",
]

Arrays = dict[str, NDArray[Any]]


def power_normalize(x: NDArray[np.floating], power: float = 1.0) -> NDArray[np.float64]:
    """Rows mapped ``x -> sign(x) |x|^power`` and then L2-normalised (a zero row stays zero).

    ``power=0.5`` on histograms is the Hellinger map.

    >>> power_normalize(np.array([[4.0, 0.0], [0.0, 0.0]]), 0.5)
    array([[1., 0.],
           [0., 0.]])
    """
    out = np.asarray(x, dtype=np.float64)
    if power != 1.0:
        out = np.sign(out) * np.abs(out) ** power
    norms = np.linalg.norm(out, axis=-1, keepdims=True)
    return np.asarray(out / np.where(norms == 0, 1.0, norms))


def power_normalize_work(items: int, power: float) -> Work:
    """The work of :func:`power_normalize` on ``items`` float32 values: the float64 copy (read
    4, write 8 bytes), at ``power != 1`` the sign, the absolute value, the power and their
    product (9 passes, 4 flops), the squares, their row sums and the division (5 passes, 3
    flops)."""
    mapped = power != 1.0
    return elementwise(items, flops_per_item=3.0 + 4.0 * mapped, passes=6.5 + 9.0 * mapped)


def append_constant(z: NDArray[np.floating]) -> NDArray[np.float64]:
    """Rows with a constant 1 appended: an intercept for linear models on normalised inputs.

    >>> append_constant(np.array([[0.5, 2.0]]))
    array([[0.5, 2. , 1. ]])
    """
    z = np.atleast_2d(np.asarray(z, dtype=np.float64))
    return np.hstack([z, np.ones((z.shape[0], 1))])


def ridge_cholesky(
    cov: NDArray[np.float64], ridge: float, overwrite: bool = False
) -> NDArray[np.float64]:
    """The lower Cholesky factor ``L`` of ``cov + r I``, ``r = ridge * trace(cov) / d``: the
    whitener of :func:`ridge_whitener` is ``L^-1``, which a caller that only applies it can
    use through triangular solves instead.

    Only the lower triangle of ``cov`` is read (:meth:`RunningMoments.cov_xx` with
    ``full=False`` leaves the upper one unset). ``overwrite=True`` factors ``cov`` in place
    (Fortran order makes it truly in place): at 4096-d each copy is 134 MB of page faults.

    >>> ridge_cholesky(np.diag([4.0, 1.0]), ridge=0.0).round(6)
    array([[2., 0.],
           [0., 1.]])
    """
    d = cov.shape[0]
    r = ridge * float(np.trace(cov)) / d
    reg = cov if overwrite else cov.copy(order="K")
    # A tiny absolute floor keeps the factorisation defined on a constant stream; added on the
    # diagonal alone, the same numbers as adding ``(r + floor) I``.
    reg.flat[:: d + 1] += r + 1e-12
    # scipy's potrf: the same factor as numpy's, bit for bit, in three quarters of the time.
    return np.asarray(_potrf(reg, lower=True, check_finite=False, overwrite_a=True))


def ridge_cholesky_work(d: int) -> Work:
    """:func:`ridge_cholesky` in place: the trace and the diagonal (``d``), the factor
    (``d^3 / 3``, :func:`~streamxm.models.work.cholesky`)."""
    return elementwise(d, passes=3.0) + cholesky(d)


def top_singular(
    m: NDArray[np.float64], k: int
) -> tuple[NDArray[np.float64], NDArray[np.float64], NDArray[np.float64]]:
    """``(U_k, s_k, V_k)``: the ``k`` largest singular values of ``m``, descending, and their
    left and right vectors as columns.

    Only ``k`` pairs are computed: the eigenpairs of the Gram matrix of ``m``'s smaller side
    (``A'A`` with ``A`` the tall orientation of ``m``, LAPACK ``syevr`` for the top ``k``),
    ``s = sqrt(lambda)`` and the other side ``A v / s``; a full SVD of a 4096 x 1000 matrix
    computes all 1000 triplets for the ten a model keeps. Squaring the matrix costs accuracy
    only on the small singular values, which are not kept. A zero singular value leaves its
    vector on the long side zero. Each vector on the short side has its largest entry
    positive (a sign an SVD leaves arbitrary).

    >>> u, s, v = top_singular(np.diag([3.0, 1.0, 2.0]), 2)
    >>> s.round(6), np.abs(u).round(6)[:, 0], np.abs(v).round(6)[:, 1]
    (array([3., 2.]), array([1., 0., 0.]), array([0., 0., 1.]))
    """
    tall = m.shape[0] >= m.shape[1]
    a = m if tall else m.T
    gram = a.T @ a
    n = gram.shape[0]
    k = min(k, n)
    values, short = eigh(gram, subset_by_index=[n - k, n - 1], driver="evr", check_finite=False)
    values, short = values[::-1], short[:, ::-1]
    # A canonical sign (scikit-learn's svd_flip rule): each vector's largest entry positive,
    # so two learners whose statistics differ by rounding keep the same orientation.
    peaks = short[np.argmax(np.abs(short), axis=0), np.arange(short.shape[1])]
    short = short * np.where(peaks < 0, -1.0, 1.0)
    s = np.sqrt(np.clip(values, 0.0, None))
    long = (a @ short) / np.where(s > 0, s, 1.0)
    long[:, s == 0] = 0.0
    return (long, s, short) if tall else (short, s, long)


def ridge_whitener(
    cov: NDArray[np.float64], ridge: float, overwrite: bool = False
) -> NDArray[np.float64]:
    """``K`` with ``K (cov + r I) K^T = I``, ``r = ridge * trace(cov) / d`` (ridge relative to
    the mean eigenvalue, so it does not depend on the scale of the features).

    ``K`` is the inverse of the Cholesky factor: it differs from the symmetric ``(cov + r I)^-1/2``
    by a rotation only, which neither a cosine nor an L2 penalty on a bilinear matrix can see, and
    costs one factorisation instead of an eigendecomposition (d = 4096 stays cheap). Reads and
    ``overwrite`` as in :func:`ridge_cholesky`.

    >>> k = ridge_whitener(np.diag([4.0, 1.0]), ridge=0.0)
    >>> np.round(k @ np.diag([4.0, 1.0]) @ k.T, 12)
    array([[1., 0.],
           [0., 1.]])
    """
    chol = ridge_cholesky(cov, ridge, overwrite=overwrite)
    # The triangular inverse (LAPACK trtri): an eighth of the work of a general solve against
    # the identity, the same matrix to rounding.
    inverse, info = lapack.dtrtri(chol, lower=1)
    if info:
        raise np.linalg.LinAlgError(f"singular Cholesky factor (trtri info {info})")
    return np.asarray(inverse)  # lower triangular: numpy's factor has zeros above, kept


class RunningMoments:
    """Counts, sums and co-moment sums of paired vectors ``(x, y)``, in float64.

    Float64 because covariances are differences of large sums; the matrices are small
    (``d x d``) next to what they summarise. ``cross=False`` skips ``sum x y^T`` for models that
    never need it. Rows added one at a time wait in a block of up to :attr:`BLOCK` and are
    folded into the sums by one matrix product when it is full or when anything reads the
    moments: a rank-one update of a 4096 x 4096 sum per pair streams 134 MB through memory, a
    block of 64 does that once for 64 pairs. The fold adds into the sums in place
    (BLAS ``syrk`` and ``gemm`` with ``beta = 1``), so no ``d x d`` temporary is allocated; the
    symmetric sums keep their **lower triangle** only (Fortran order, the other triangle unset),
    half the work of a full product. The pending rows are part of :meth:`state`, so a restored
    stream folds at the same pairs, bit for bit.

    >>> m = RunningMoments(2, 1)
    >>> m.add(np.array([[1.0, 0.0], [3.0, 2.0]]), np.array([[1.0], [3.0]]))
    >>> m.mean_x(), m.cov_xy()
    (array([2., 1.]), array([[1.],
           [1.]]))
    >>> m.cov_xx()
    array([[1., 1.],
           [1., 1.]])
    """

    BLOCK = 64

    def __init__(self, dx: int, dy: int, cross: bool = True) -> None:
        self.n = 0
        self.sum_x = np.zeros(dx)
        self.sum_y = np.zeros(dy)
        self.sxx = np.zeros((dx, dx), order="F")
        self.syy = np.zeros((dy, dy), order="F")
        self.sxy = np.zeros((dx, dy) if cross else (0, 0), order="F")
        self._pending: list[tuple[NDArray[np.float64], NDArray[np.float64]]] = []
        self._pending_rows = 0
        self._scratch: dict[str, NDArray[np.float64]] = {}  # derived, never saved

    def add(self, x: NDArray[np.floating], y: NDArray[np.floating]) -> None:
        """Add rows ``x`` (n, dx) and ``y`` (n, dy) (copied: a caller may reuse its arrays)."""
        rows_x = np.atleast_2d(np.array(x, dtype=np.float64))
        rows_y = np.atleast_2d(np.array(y, dtype=np.float64))
        self.n += rows_x.shape[0]
        self._pending.append((rows_x, rows_y))
        self._pending_rows += rows_x.shape[0]
        if self._pending_rows >= self.BLOCK:
            self.fold()

    def fold(self) -> None:
        """Add the pending rows to the sums (reads do this themselves)."""
        if not self._pending:
            return
        x = np.vstack([p[0] for p in self._pending])
        y = np.vstack([p[1] for p in self._pending])
        self._pending, self._pending_rows = [], 0
        self.sum_x += x.sum(axis=0)
        self.sum_y += y.sum(axis=0)
        # ``x.T`` is the Fortran-order (d, B) view BLAS takes without a copy.
        self.sxx = _add_gram(self.sxx, x.T)
        self.syy = _add_gram(self.syy, y.T)
        if self.sxy.size:
            self.sxy = np.asarray(
                dgemm(1.0, x.T, y.T, beta=1.0, c=self.sxy, trans_b=1, overwrite_c=1)
            )

    def mean_x(self) -> NDArray[np.float64]:
        self.fold()
        return self.sum_x / max(self.n, 1)

    def mean_y(self) -> NDArray[np.float64]:
        self.fold()
        return self.sum_y / max(self.n, 1)

    def _cov(
        self,
        s: NDArray[np.float64],
        a: NDArray[np.float64],
        b: NDArray[np.float64],
        reuse: str | None,
        lower: bool = False,
    ) -> NDArray[np.float64]:
        """``s / n - (a / n)(b / n)^T`` in Fortran order, a block of columns at a time (no
        ``d x d`` temporary; the same numbers entry by entry); ``lower`` computes the lower
        triangle's blocks only. ``reuse`` names a scratch matrix these moments keep and
        overwrite at the next call with that name: at 4096-d a new one is 134 MB of page
        faults, as long as the arithmetic."""
        n = max(self.n, 1)
        out = self._scratch.get(reuse) if reuse else None
        if out is None or out.shape != s.shape:
            out = np.empty(s.shape, order="F")
            if reuse:
                self._scratch[reuse] = out
        mean_a, mean_b = a / n, b / n
        for j in range(0, out.shape[1], _COLUMNS):
            top, cols = (j if lower else 0), slice(j, j + _COLUMNS)
            block = out[top:, cols]
            np.divide(s[top:, cols], n, out=block)
            block -= np.outer(mean_a[top:], mean_b[cols])
        return out

    def cov_xx(self, full: bool = True, reuse: bool = False) -> NDArray[np.float64]:
        """The covariance of ``x``. ``full=False`` leaves the upper triangle unset (what
        :func:`ridge_cholesky` reads is the lower one), a ``d x d`` mirror the fewer;
        ``reuse=True`` returns a scratch matrix the next ``reuse`` call overwrites (a caller
        that factors it and is done with it before then)."""
        self.fold()
        return _symmetric(
            self._cov(self.sxx, self.sum_x, self.sum_x, "xx" if reuse else None, lower=True), full
        )

    def cov_yy(self, full: bool = True, reuse: bool = False) -> NDArray[np.float64]:
        """The covariance of ``y``; ``full`` and ``reuse`` as in :meth:`cov_xx`."""
        self.fold()
        return _symmetric(
            self._cov(self.syy, self.sum_y, self.sum_y, "yy" if reuse else None, lower=True), full
        )

    def cov_xy(self, reuse: bool = False) -> NDArray[np.float64]:
        """The cross-covariance; ``reuse`` as in :meth:`cov_xx`."""
        if not self.sxy.size:
            raise ValueError("these moments were kept without the cross term")
        self.fold()
        return self._cov(self.sxy, self.sum_x, self.sum_y, "xy" if reuse else None)

    def sums(self, prefix: str) -> Arrays:
        """The count and sums with every pending row folded in: what ranks add up (the
        symmetric sums' lower triangles: the sum of two is the sum's)."""
        self.fold()
        return self._sums(prefix)

    def _sums(self, prefix: str) -> Arrays:
        return {
            f"{prefix}sum_x": self.sum_x,
            f"{prefix}sum_y": self.sum_y,
            f"{prefix}sxx": self.sxx,
            f"{prefix}syy": self.syy,
            f"{prefix}sxy": self.sxy,
            f"{prefix}n": np.asarray(self.n, dtype=np.int64),
        }

    def state(self, prefix: str) -> Arrays:
        """The sums and, apart, the pending rows (saving folds nothing: a checkpoint does not
        change when the sums take their rows)."""
        pending_x = [p[0] for p in self._pending] or [np.zeros((0, len(self.sum_x)))]
        pending_y = [p[1] for p in self._pending] or [np.zeros((0, len(self.sum_y)))]
        return {
            **self._sums(prefix),
            f"{prefix}pending_x": np.vstack(pending_x),
            f"{prefix}pending_y": np.vstack(pending_y),
        }

    def load_state(self, arrays: Arrays, prefix: str) -> None:
        """From :meth:`state` or :meth:`sums` (checkpoints from before the block have no
        pending rows; those that kept both triangles load as they are: only the lower one is
        read)."""
        self.n = int(arrays[f"{prefix}n"])
        self.sum_x = np.array(arrays[f"{prefix}sum_x"], dtype=np.float64)
        self.sum_y = np.array(arrays[f"{prefix}sum_y"], dtype=np.float64)
        for key in ("sxx", "syy", "sxy"):
            setattr(self, key, np.array(arrays[f"{prefix}{key}"], dtype=np.float64, order="F"))
        self._pending, self._pending_rows = [], 0
        if f"{prefix}pending_x" in arrays and len(arrays[f"{prefix}pending_x"]):
            self._pending = [
                (
                    np.array(arrays[f"{prefix}pending_x"], dtype=np.float64),
                    np.array(arrays[f"{prefix}pending_y"], dtype=np.float64),
                )
            ]
            self._pending_rows = len(self._pending[0][0])


def fold_work(dx: int, dy: int, rows: int, cross: bool = True) -> Work:
    """One :meth:`RunningMoments.fold` of ``B`` pending rows: the rows stacked and summed
    (``B (d_x + d_y)``, five passes); ``S_xx += X'X`` and ``S_yy += Y'Y`` on their lower
    triangles in place (:func:`~streamxm.models.work.gram_update`); with ``cross``,
    ``S_xy += X'Y`` in place (``2 d_x d_y B`` flops, ``S_xy`` read and written)."""
    work = elementwise(rows * (dx + dy), passes=5.0) + gram_update(dx, rows) + gram_update(dy, rows)
    if cross:
        work += gemm(dx, dy, rows) + elementwise(dx * dy, flops_per_item=0.0)
    return work


def covariance_work(entries: int) -> Work:
    """A covariance of ``entries`` numbers from its sums (:meth:`RunningMoments._cov`): the
    sum divided into a new matrix (2 passes), each block of the outer product of the means
    written and subtracted (4 passes): 3 flops, 6 passes an entry."""
    return elementwise(entries, flops_per_item=3.0, passes=6.0)


#: Columns of a covariance computed at once (:meth:`RunningMoments._cov`): 2 MB of outer
#: product at 4096-d.
_COLUMNS = 64


def _add_gram(total: NDArray[np.float64], rows_t: NDArray[np.float64]) -> NDArray[np.float64]:
    """``total += rows_t rows_t^T`` on the lower triangle, in place when ``total`` is Fortran
    order (BLAS ``dsyrk``, ``beta = 1``)."""
    if not rows_t.shape[1]:
        return total
    return np.asarray(dsyrk(1.0, rows_t, beta=1.0, c=total, lower=1, overwrite_c=1))


def _symmetric(lower: NDArray[np.float64], full: bool) -> NDArray[np.float64]:
    """``lower``'s lower triangle mirrored onto its upper one (in place) when ``full``, a
    block of rows at a time."""
    if not full:
        return lower
    d = lower.shape[0]
    for i in range(0, d, _COLUMNS):
        end = min(i + _COLUMNS, d)
        lower[i:end, end:] = lower[end:, i:end].T
        block = lower[i:end, i:end]
        above = np.triu_indices(end - i, 1)
        block[above] = block.T[above]
    return lower


class FeatureScaler:
    """Per-feature running mean and variance of a stream; :meth:`transform` standardises.

    Only the diagonal is kept (``d`` numbers, not ``d x d``), so 4096-d inputs cost nothing.
    Sums are float64; the output is float32. The variance gets a floor of ``1e-6`` times the
    mean variance (plus ``1e-12``), so a feature constant so far does not divide by zero and a
    stream's first pairs (variance 0) map to 0 rather than infinity.

    >>> s = FeatureScaler(2)
    >>> s.add(np.array([[1.0, 5.0], [3.0, 5.0]]))
    >>> np.round(s.transform(np.array([[2.0, 5.0], [3.0, 5.0]])), 4)
    array([[0., 0.],
           [1., 0.]], dtype=float32)
    """

    def __init__(self, dim: int) -> None:
        self.n = 0
        self.sum = np.zeros(dim)
        self.sum_sq = np.zeros(dim)

    def add(self, x: NDArray[np.floating]) -> None:
        """Add rows ``x`` (n, dim)."""
        x = np.atleast_2d(np.asarray(x, dtype=np.float64))
        self.n += x.shape[0]
        self.sum += x.sum(axis=0)
        self.sum_sq += np.einsum("ij,ij->j", x, x)

    def standardisation(self) -> tuple[NDArray[np.float64], NDArray[np.float64]]:
        """The mean and standard deviation (its variance floored) that :meth:`transform`
        applies: ``z = (x - mean) / std``."""
        n = max(self.n, 1)
        mean = self.sum / n
        var = np.maximum(self.sum_sq / n - mean * mean, 0.0)
        var += 1e-6 * float(var.mean()) + 1e-12
        return mean, np.sqrt(var)

    def transform(self, x: NDArray[np.floating]) -> NDArray[np.float32]:
        mean, std = self.standardisation()
        z = (np.atleast_2d(np.asarray(x, dtype=np.float64)) - mean) / std
        return z.astype(np.float32)

    def state(self, prefix: str) -> Arrays:
        return {
            f"{prefix}sum": self.sum,
            f"{prefix}sum_sq": self.sum_sq,
            f"{prefix}n": np.asarray(self.n, dtype=np.int64),
        }

    def load_state(self, arrays: Arrays, prefix: str) -> None:
        self.n = int(arrays[f"{prefix}n"])
        self.sum = np.array(arrays[f"{prefix}sum"], dtype=np.float64)
        self.sum_sq = np.array(arrays[f"{prefix}sum_sq"], dtype=np.float64)


class ResolveSchedule:
    """When a model re-solves from its statistics: at pair counts that double from ``first``
    (early in a stream the statistics change fast) until the gap reaches ``every``, then every
    ``every`` pairs. A schedule by pair count does not depend on how the stream was cut.

    >>> s = ResolveSchedule(first=4, every=10)
    >>> [n for n in range(1, 40) if s.due(n)]
    [4, 8, 16, 26, 36]
    """

    def __init__(self, first: int, every: int) -> None:
        if first < 1 or every < 1:
            raise ValueError("first and every must be >= 1")
        self.first = first
        self.every = every

    def next_due(self, pairs: int) -> int:
        """The first count after ``pairs`` at which a re-solve is due.

        >>> s = ResolveSchedule(first=4, every=10)
        >>> [s.next_due(n) for n in (0, 4, 15, 16, 17, 36)]
        [4, 8, 16, 26, 26, 46]
        """
        n = self.first
        while n < self.every:
            if n > pairs:
                return n
            n *= 2
        if n > pairs:
            return n
        return n + ((pairs - n) // self.every + 1) * self.every

    def steady_start(self) -> int:
        """The first re-solve from which they come every ``every`` pairs.

        >>> ResolveSchedule(first=4, every=10).steady_start()
        16
        """
        n = self.first
        while n < self.every:
            n *= 2
        return n

    def crossed(self, before: int, after: int) -> bool:
        """Whether a re-solve fell due at a count in ``(before, after]`` (a distributed round
        jumps over counts one learner would have stopped at)."""
        return self.next_due(before) <= after

    def due(self, pairs: int) -> bool:
        n = self.first
        while n < pairs and n < self.every:
            n *= 2
        if n >= pairs:
            return n == pairs
        return (pairs - n) % self.every == 0
