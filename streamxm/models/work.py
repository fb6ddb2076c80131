"""The work an algorithm does, counted from its settings: floating-point operations and bytes
of memory traffic.

Each model counts what its update does per arriving pair
(:meth:`~streamxm.models.opt_in.CountsWork.learning_work`) and what embedding rows through it
costs (:meth:`~streamxm.models.opt_in.CountsWork.embedding_work`). Two things read the counts:
``streamxm bench throughput`` sets the measured time beside the *roofline* (the time the counted
work needs at the machine's measured rates), and the learner sizes its rolling evaluation's
schedule from the ratio of evaluation work to learning work
(:func:`streamxm.learning.schedule.evaluation_interval`), which must not depend on timings, so
that a learner and its restored copy evaluate the same pairs.

Counting rules: a multiply-add is two flops; ``bytes`` counts each operand of a product read once
and each output written once (the traffic a blocked BLAS call needs at least), so a product whose
operands stay in cache is charged its flops. LAPACK factorisations are charged their textbook
flop counts (Golub and Van Loan, *Matrix Computations*, 4th ed., tables 1.1.2, 5.5.1 and 8.6.1).
"""

from __future__ import annotations

from dataclasses import dataclass

__all__ = [
    "Rates",
    "Work",
    "cholesky",
    "eigh",
    "elementwise",
    "gemm",
    "gram_update",
    "matvec",
    "rank_update",
    "svd",
    "syrk",
    "triangular_inverse",
]


@dataclass(frozen=True)
class Rates:
    """A thread's rates: ``flops_per_s`` of a large float64 matrix product, ``bytes_per_s`` of
    a streaming read (a large matrix-vector product), ``flops32_per_s`` of a float32 product
    (twice the float64 rate where none is given: twice the lanes per vector)."""

    flops_per_s: float
    bytes_per_s: float
    flops32_per_s: float | None = None


@dataclass(frozen=True)
class Work:
    """``flops`` floating-point operations touching ``bytes`` of memory."""

    flops: float = 0.0
    bytes: float = 0.0
    #: The share of ``flops`` done in float32.
    flops32: float = 0.0

    def __add__(self, other: Work) -> Work:
        return Work(
            self.flops + other.flops, self.bytes + other.bytes, self.flops32 + other.flops32
        )

    def __mul__(self, times: float) -> Work:
        return Work(self.flops * times, self.bytes * times, self.flops32 * times)

    __rmul__ = __mul__

    def seconds(self, rates: Rates) -> float:
        """The roofline: the longer of the arithmetic at the GEMM rates and the traffic at the
        streaming rate (one bounds the other, so neither can be beaten)."""
        fast = rates.flops32_per_s or 2.0 * rates.flops_per_s
        arithmetic = (self.flops - self.flops32) / rates.flops_per_s + self.flops32 / fast
        return max(arithmetic, self.bytes / rates.bytes_per_s)

    def as_dict(self) -> dict[str, float]:
        return {
            "flops": round(self.flops),
            "flops_float32": round(self.flops32),
            "bytes": round(self.bytes),
        }


def gemm(m: int, n: int, k: int, itemsize: int = 8) -> Work:
    """``(m, k) @ (k, n)`` into a new ``(m, n)``; ``itemsize`` 4: in float32."""
    flops = 2.0 * m * n * k
    return Work(flops, float(itemsize) * (m * k + k * n + m * n), flops if itemsize == 4 else 0.0)


def matvec(m: int, n: int, itemsize: int = 8) -> Work:
    """An ``(m, n)`` matrix times a vector (either side)."""
    return gemm(m, 1, n, itemsize)


def syrk(n: int, inner: int, itemsize: int = 8) -> Work:
    """``A A'`` of an ``(n, inner)`` operand as numpy runs ``x @ x.T`` (BLAS ``syrk``): one
    triangle, ``n (n + 1) inner`` flops, the operand read, the triangle written, then mirrored
    (two passes of ``n^2`` in all)."""
    return Work(float(n * (n + 1) * inner), float(itemsize) * (n * inner + 2.0 * n * n))


def gram_update(n: int, inner: int, itemsize: int = 8) -> Work:
    """``C += A A'`` on ``C``'s lower triangle in place (BLAS ``syrk`` with ``beta = 1``) for an
    ``(n, inner)`` operand: ``n (n + 1) inner`` flops, the operand read, the triangle read and
    written."""
    return Work(float(n * (n + 1) * inner), float(itemsize) * (n * inner + n * (n + 1)))


def rank_update(m: int, n: int, k: int, itemsize: int = 8) -> Work:
    """``C += A @ B`` with ``C`` ``(m, n)`` and inner size ``k``: the product plus ``C`` read
    and written."""
    return gemm(m, n, k, itemsize) + elementwise(m * n, itemsize)


def elementwise(
    n: float, itemsize: int = 8, flops_per_item: float = 1.0, passes: float = 2.0
) -> Work:
    """``n`` items, each read or written ``passes`` times in all, ``flops_per_item`` each."""
    flops = flops_per_item * n
    return Work(flops, passes * itemsize * n, flops if itemsize == 4 else 0.0)


def cholesky(n: int, itemsize: int = 8) -> Work:
    """``n^3 / 3`` flops over an ``(n, n)`` matrix read and written."""
    return Work(n**3 / 3.0, 2.0 * itemsize * n * n)


def triangular_inverse(n: int, itemsize: int = 8) -> Work:
    """``n^3 / 3`` flops (``trtri``)."""
    return Work(n**3 / 3.0, 2.0 * itemsize * n * n)


def eigh(n: int, itemsize: int = 8) -> Work:
    """Symmetric eigenvalues and eigenvectors: ``9 n^3`` flops."""
    return Work(9.0 * n**3, 2.0 * itemsize * n * n)


def svd(m: int, n: int, itemsize: int = 8) -> Work:
    """Thin SVD of an ``(m, n)`` matrix with both singular bases: ``4 m n^2 + 8 n^3`` flops on
    its smaller side ``n`` (Golub and Van Loan's R-SVD with thin ``U``, Chan's variant)."""
    m, n = max(m, n), min(m, n)
    return Work(4.0 * m * n * n + 8.0 * n**3, 2.0 * itemsize * (m * n + n * n))
