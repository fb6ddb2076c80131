"""The online optimiser the mini-batch models share."""

from __future__ import annotations

from typing import Any

import numpy as np
from numpy.typing import NDArray

__all__ = ["adagrad_step"]


def adagrad_step(w: NDArray[Any], sq_sum: NDArray[Any], grad: NDArray[Any], lr: float,
                 lam: float) -> None:
    """In place: ``g = grad + lam w``, ``sq_sum += g^2``, ``w -= lr g / (sqrt(sq_sum) + 1e-8)``
    (``w`` and ``sq_sum`` of one dtype).

    AdaGrad on a loss plus ``lam / 2 ||w||^2``; its per-coordinate ``1 / sqrt(t)`` decay needs no
    schedule tied to a stream length, which a stream does not have.

    >>> w, s = np.array([1.0]), np.zeros(1)
    >>> adagrad_step(w, s, np.array([3.0]), lr=0.5, lam=1.0)
    >>> w, s
    (array([0.5]), array([16.]))
    """
    # The formula's operations in its order, in two scratch arrays instead of five temporaries:
    # bit for bit the formula when all three share a dtype (every caller's case), at half the
    # memory traffic on a 4M-entry W. A gradient of another dtype is cast to ``w``'s.
    lr, lam = float(lr), float(lam)  # Python floats: a numpy float64 would promote float32 w
    g = np.multiply(w, lam)
    g += grad
    step = np.multiply(g, g)
    sq_sum += step
    np.sqrt(sq_sum, out=step)
    step += 1e-8
    np.divide(np.multiply(g, lr, out=g), step, out=step)
    w -= step
