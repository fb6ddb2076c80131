"""The online optimiser the mini-batch models share."""

from __future__ import annotations

from typing import Any

import numpy as np
from numpy.typing import NDArray

__all__ = ["adagrad_step"]


def adagrad_step(w: NDArray[Any], sq_sum: NDArray[Any], grad: NDArray[Any], lr: float,
                 lam: float) -> None:
    """In place: ``g = grad + lam w``, ``sq_sum += g^2``, ``w -= lr g / (sqrt(sq_sum) + 1e-8)``.

    AdaGrad on a loss plus ``lam / 2 ||w||^2``; its per-coordinate ``1 / sqrt(t)`` decay needs no
    schedule tied to a stream length, which a stream does not have.

    >>> w, s = np.array([1.0]), np.zeros(1)
    >>> adagrad_step(w, s, np.array([3.0]), lr=0.5, lam=1.0)
    >>> w, s
    (array([0.5]), array([16.]))
    """
    g = grad + lam * w
    sq_sum += g * g
    w -= lr * g / (np.sqrt(sq_sum) + 1e-8)
