"""CMOS's served map: an exponential moving average of its iterates ``W_k``, one per triplet.

After triplet ``k`` the average moves ``A_k = beta_k A_{k-1} + (1 - beta_k) W_k``. The queue's
``n`` triplets enter at a flush in closed form, from ``W`` before the flush and the steps
``tau_j V_j`` solved there: with ``S_j = beta_j ... beta_{n-1}``,

    A_n = S_0 A_0 + (1 - S_0) W_0 + sum_j tau_j (1 - S_j) V_j,

one more rank-``n`` product of the size of ``W``'s merge. The average is therefore the one the
sequential loop gives, however the queue is cut into flushes. ``beta_k = 0`` makes the average
the last iterate.
"""

from __future__ import annotations

from typing import Any

import numpy as np
from numpy.typing import NDArray

from streamxm.models.cmos_updates import add_outer_products

__all__ = ["decay", "move_average"]


def decay(horizon_pairs: float, triplets_per_pair: int) -> float:
    """``beta`` per triplet of an average over about ``horizon_pairs`` pairs of
    ``triplets_per_pair`` triplets each (``1 - 1 / horizon`` in triplets; 0 for a horizon of at
    most one triplet: the last iterate)."""
    horizon = horizon_pairs * triplets_per_pair
    return 1.0 - 1.0 / horizon if horizon > 1.0 else 0.0


def move_average(
    average: NDArray[Any],
    before: NDArray[Any],
    left: NDArray[Any],
    tau: NDArray[np.float64],
    right: NDArray[Any],
    betas: NDArray[np.float64],
) -> None:
    """Move ``average`` in place over a flush's triplets ``V_j = left[j] right[j]^T`` with steps
    ``tau`` and decays ``betas``, ``before`` the map before the flush (module docstring)."""
    suffix = np.cumprod(betas[::-1])[::-1]  # S_j = beta_j ... beta_{n-1}
    whole = float(suffix[0])
    if whole == 0.0 and not suffix.any():  # every decay 0: the last iterate
        average[...] = before
    else:
        average *= average.dtype.type(whole)
        average += average.dtype.type(1.0 - whole) * before
    weights = tau * (1.0 - suffix)
    if weights.any():
        add_outer_products(average, left, weights, right)
