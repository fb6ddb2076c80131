"""The rows a server's index keeps for :class:`~streamxm.models.cmomks.CMOMKS`, carried from one
version to the next: only the columns of the support slots written since are recomputed
(:func:`index_update`).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import numpy as np
from numpy.typing import NDArray

from streamxm.models.base import CrossModalModel
from streamxm.models.embedding import IndexUpdate

if TYPE_CHECKING:
    from streamxm.models.cmomks import CMOMKS

__all__ = ["index_update"]


def index_update(model: CMOMKS, earlier: CrossModalModel, modality: str) -> IndexUpdate | None:
    """:meth:`~streamxm.models.cmomks.CMOMKS.index_update`: kept rows with the columns of the
    support slots written since ``earlier`` recomputed (the pool means read from the kept rows);
    ``None`` unless ``earlier`` is an earlier version of ``model`` (same settings, the same
    closed pool, no larger support)."""
    if not (
        isinstance(earlier, type(model))
        and model.pool_full
        and earlier.pool_full
        and model._settings() == earlier._settings()
        and earlier.support_size <= model.support_size
    ):
        return None
    side = model.img_side if modality == "image" else model.txt_side
    before = earlier.img_side if modality == "image" else earlier.txt_side
    if not side.same_pool(before):
        return None
    slots = side.rewritten(before, model.support_size, earlier.support_size)
    m, width = len(model.kernels), model.landmarks + model.budget
    columns = (np.arange(m)[:, None] * width + model.landmarks + slots[None, :]).ravel()

    def update(kept: NDArray[np.float32], x: NDArray[np.floating]) -> NDArray[np.float32]:
        if kept.shape[1] != model._index_width():
            raise ValueError(
                f"kept rows are {kept.shape[1]} wide, not cmomks's {model._index_width()}"
            )
        out = np.array(kept, dtype=np.float32)
        if len(slots):
            m_x = kept[:, -m:].T.astype(np.float64)
            values = side.centred_to_slots(side.prep(x), m_x, slots, np.float32)
            out[:, columns] = values.transpose(1, 0, 2).reshape(len(out), -1)
        return out

    return update
