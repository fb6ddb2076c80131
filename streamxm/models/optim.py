"""The online optimiser the mini-batch models share."""

from __future__ import annotations

from typing import Any

import numba
import numpy as np
from numpy.typing import NDArray

__all__ = ["adagrad_step"]


def adagrad_step(w: NDArray[Any], sq_sum: NDArray[Any], grad: NDArray[Any], lr: float,
                 lam: float) -> None:
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
    if (w.dtype == sq_sum.dtype == grad.dtype and w.dtype in (np.float32, np.float64)
            and w.shape == sq_sum.shape == grad.shape
            and all(a.flags.c_contiguous for a in (w, sq_sum, grad))):
        _adagrad_pass(w.reshape(-1), sq_sum.reshape(-1), grad.reshape(-1), kind(lr), kind(lam),
                      kind(1e-8))
        return
    _adagrad_arrays(w, sq_sum, grad, lr, lam)


@numba.njit(cache=True, error_model="numpy", boundscheck=False)
def _adagrad_pass(w: NDArray[Any], sq_sum: NDArray[Any], grad: NDArray[Any], lr: Any, lam: Any,
                  eps: Any) -> None:  # pragma: no cover - compiled
    for i in range(w.size):
        g = w[i] * lam + grad[i]
        total = sq_sum[i] + g * g
        sq_sum[i] = total
        w[i] -= (g * lr) / (np.sqrt(total) + eps)


def _adagrad_arrays(w: NDArray[Any], sq_sum: NDArray[Any], grad: NDArray[Any], lr: float,
                    lam: float) -> None:
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
