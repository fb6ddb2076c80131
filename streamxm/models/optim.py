"""The online optimiser the mini-batch models share."""

from __future__ import annotations

from typing import Any

import numpy as np
from numpy.typing import NDArray

from streamxm.models.array_types import F32
from streamxm.models.compiled import njit
from streamxm.models.work import Work, elementwise

__all__ = [
    "adagrad_outer_step",
    "adagrad_outer_work",
    "adagrad_step",
    "adagrad_work",
    "nesterov_step",
    "nesterov_work",
]


def adagrad_step(
    w: NDArray[Any], sq_sum: NDArray[Any], grad: NDArray[Any], lr: float, lam: float
) -> None:
    """In place: ``g = grad + lam w``, ``sq_sum += g^2``, ``w -= lr g / (sqrt(sq_sum) + 1e-8)``
    (``w`` and ``sq_sum`` of one dtype).

    AdaGrad on a loss plus ``lam / 2 ||w||^2``; its per-coordinate ``1 / sqrt(t)`` decay needs no
    schedule tied to a stream length, which a stream does not have.

    The gradient of the l2 term makes every coordinate move at every step, so the step is one
    pass over ``w``, ``sq_sum`` and ``grad``: a compiled loop (numba) when the three are
    contiguous arrays of one dtype (every caller's case), the same operations in the same
    order as numpy's whole-array form, so bit for bit its result, in one pass instead of ten.

    >>> w, s = np.array([1.0]), np.zeros(1)
    >>> adagrad_step(w, s, np.array([3.0]), lr=0.5, lam=1.0)
    >>> w, s
    (array([0.5]), array([16.]))
    """
    kind = w.dtype.type
    if (
        w.dtype == sq_sum.dtype == grad.dtype
        and w.dtype in (np.float32, np.float64)
        and w.shape == sq_sum.shape == grad.shape
        and all(a.flags.c_contiguous for a in (w, sq_sum, grad))
    ):
        _adagrad_pass(
            w.reshape(-1), sq_sum.reshape(-1), grad.reshape(-1), kind(lr), kind(lam), kind(1e-8)
        )
        return
    _adagrad_arrays(w, sq_sum, grad, lr, lam)


@njit(error_model="numpy", boundscheck=False)
def _adagrad_pass(
    w: NDArray[Any], sq_sum: NDArray[Any], grad: NDArray[Any], lr: Any, lam: Any, eps: Any
) -> None:  # pragma: no cover - compiled
    for i in range(w.size):
        g = w[i] * lam + grad[i]
        total = sq_sum[i] + g * g
        sq_sum[i] = total
        w[i] -= (g * lr) / (np.sqrt(total) + eps)


def adagrad_outer_step(w: F32, sq_sum: F32, left: F32, right: F32, lr: float, lam: float) -> None:
    """:func:`adagrad_step` on a gradient of rank ``r``, ``grad = left^T right`` (``left``
    ``(r, m)``, ``right`` ``(r, n)``, ``w`` ``(m, n)``), the gradient formed inside the pass.

    A mini-batch of ``r`` pairs gives such a gradient (a sum of ``r`` outer products); formed
    row by row in the compiled loop, the ``m x n`` gradient is never written and read back
    (at 4097 x 1001 float32, 32 of the step's 96 MB of memory traffic). Each entry sums its
    ``r`` products in order, then takes the step in :func:`adagrad_step`'s order.

    >>> w, s = np.ones((1, 2), np.float32), np.zeros((1, 2), np.float32)
    >>> adagrad_outer_step(w, s, np.array([[1.0], [2.0]], np.float32),
    ...                    np.array([[1.0, 0.0], [1.0, 0.0]], np.float32), lr=0.5, lam=1.0)
    >>> w, s
    (array([[0.5, 0.5]], dtype=float32), array([[16.,  1.]], dtype=float32))
    """
    if not (w.dtype == sq_sum.dtype == left.dtype == right.dtype == np.float32):
        raise TypeError("adagrad_outer_step takes float32 arrays")
    if w.shape != sq_sum.shape or left.shape[1:] != w.shape[:1] or right.shape[1:] != w.shape[1:]:
        raise ValueError(
            f"shapes do not match: w {w.shape}, sq_sum {sq_sum.shape}, "
            f"left {left.shape}, right {right.shape}"
        )
    if not (w.flags.c_contiguous and sq_sum.flags.c_contiguous):
        raise ValueError("w and sq_sum must be C-contiguous (updated in place)")
    kind = np.float32
    _adagrad_outer_pass(
        w,
        sq_sum,
        np.ascontiguousarray(left.T),
        np.ascontiguousarray(right),
        kind(lr),
        kind(lam),
        kind(1e-8),
    )


@njit(error_model="numpy", boundscheck=False)
def _adagrad_outer_pass(
    w: NDArray[Any],
    sq_sum: NDArray[Any],
    left_t: NDArray[Any],
    right: NDArray[Any],
    lr: Any,
    lam: Any,
    eps: Any,
) -> None:  # pragma: no cover - compiled
    rank, n = right.shape
    row = np.empty(n, dtype=w.dtype)
    for i in range(w.shape[0]):
        row[:] = 0
        for t in range(rank):
            a = left_t[i, t]
            for j in range(n):
                row[j] += a * right[t, j]
        for j in range(n):
            g = w[i, j] * lam + row[j]
            total = sq_sum[i, j] + g * g
            sq_sum[i, j] = total
            w[i, j] -= (g * lr) / (np.sqrt(total) + eps)


def _adagrad_arrays(
    w: NDArray[Any], sq_sum: NDArray[Any], grad: NDArray[Any], lr: float, lam: float
) -> None:
    """The whole-array form, for any other dtype mix (a gradient of another dtype is cast to
    ``w``'s)."""
    lr, lam = float(lr), float(lam)  # Python floats: a numpy float64 would promote float32 w
    g = np.multiply(w, lam)
    g += grad
    step = np.multiply(g, g)
    sq_sum += step
    np.sqrt(sq_sum, out=step)
    step += 1e-8
    np.divide(np.multiply(g, lr, out=g), step, out=step)
    w -= step


def adagrad_work(items: int, itemsize: int) -> Work:
    """:func:`adagrad_step` over ``n`` items, one compiled pass: ``w``, ``G`` and the gradient
    read, ``w`` and ``G`` written (5 passes), 8 flops an item (``lam w + grad``, its square
    added, the square root, ``+ eps``, ``lr g``, the division, the subtraction)."""
    return elementwise(items, itemsize, flops_per_item=8.0, passes=5.0)


def adagrad_outer_work(items: int, rank: int, itemsize: int = 4) -> Work:
    """:func:`adagrad_outer_step` over ``n`` items with a rank-``r`` gradient: ``w`` and ``G``
    read and written (4 passes), ``2 r`` flops an item forming the gradient and the 8 of
    :func:`adagrad_work`."""
    return elementwise(items, itemsize, flops_per_item=8.0 + 2.0 * rank, passes=4.0)


def nesterov_step(w: F32, buf: F32, grad: F32, lr: float, momentum: float) -> None:
    """In place, SGD with Nesterov momentum as torch's ``SGD(nesterov=True)`` takes it:
    ``buf = momentum buf + grad``, ``w -= lr (grad + momentum buf)`` (float32 arrays of one
    shape, C-contiguous).

    One compiled pass over the three arrays (torch's single-tensor path makes four), each
    item's operations in torch's order; a fused multiply-add may round the last place
    differently. A momentum below float32's smallest normal number (about 1.2e-38) is stored as
    0: under zero gradients (a hinge loss with no active term) the buffer decays geometrically
    into subnormal numbers, on which x86 arithmetic runs about a hundred times slower, and a
    step of that size leaves every weight unchanged anyway.

    >>> w, buf = np.ones(2, np.float32), np.array([1.0, 0.0], np.float32)
    >>> nesterov_step(w, buf, np.array([1.0, 2.0], np.float32), lr=0.5, momentum=0.5)
    >>> w, buf
    (array([ 0.125, -0.5  ], dtype=float32), array([1.5, 2. ], dtype=float32))
    """
    arrays = (w, buf, grad)
    if not all(a.dtype == np.float32 and a.flags.c_contiguous for a in arrays):
        raise TypeError("nesterov_step takes C-contiguous float32 arrays")
    if not w.shape == buf.shape == grad.shape:
        raise ValueError(f"shapes do not match: w {w.shape}, buf {buf.shape}, grad {grad.shape}")
    _nesterov_pass(
        w.reshape(-1), buf.reshape(-1), grad.reshape(-1), np.float32(lr), np.float32(momentum)
    )


@njit(error_model="numpy", boundscheck=False)
def _nesterov_pass(
    w: NDArray[Any], buf: NDArray[Any], grad: NDArray[Any], lr: Any, momentum: Any
) -> None:  # pragma: no cover - compiled
    smallest = np.float32(np.finfo(np.float32).tiny)
    for i in range(w.size):
        g = grad[i]
        b = buf[i] * momentum + g
        b = b if abs(b) >= smallest else np.float32(0.0)  # no subnormal state (see above)
        buf[i] = b
        w[i] -= (g + b * momentum) * lr


def nesterov_work(items: int) -> Work:
    """:func:`nesterov_step` over ``n`` float32 items: ``w``, ``buf`` and the gradient read,
    ``w`` and ``buf`` written (5 passes), 5 flops an item."""
    return elementwise(items, 4, flops_per_item=5.0, passes=5.0)
