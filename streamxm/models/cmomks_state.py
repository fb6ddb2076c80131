"""CMOMKS's checkpoint as arrays (:meth:`~streamxm.models.cmomks.CMOMKS.state`,
:meth:`~streamxm.models.cmomks.CMOMKS.load_state`).

The arrays: ``tau``, ``A``, ``log_theta`` and ``kernel_mistakes``; per side (``img.``, ``txt.``)
what :meth:`~streamxm.models.cmomks_support.KernelSide.state_arrays` keeps; and ``waiting.*``,
the triplets drawn before the landmark pool filled, when there are any.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import numpy as np

from streamxm.models.base import Arrays
from streamxm.models.cmomks_learning import Triplet
from streamxm.models.state_arrays import ArrayAttributes, attribute_arrays, restore_attribute_arrays

if TYPE_CHECKING:
    from streamxm.models.cmomks import CMOMKS

__all__ = ["load_state", "model_state"]

#: The model's own learned arrays (the sides keep theirs).
_LEARNED: ArrayAttributes = {
    **dict.fromkeys(("tau", "A", "log_theta"), np.float64),
    "kernel_mistakes": np.int64,
}


def model_state(model: CMOMKS) -> tuple[Arrays, dict[str, Any]]:
    """The checkpoint of ``model``: its arrays and its metadata (JSON-serialisable)."""
    arrays = attribute_arrays(model, _LEARNED)
    for name, side in (("img", model.img_side), ("txt", model.txt_side)):
        arrays.update(side.state_arrays(name))
    arrays.update(_waiting_arrays(model._waiting))
    return arrays, {
        "support_size": model.support_size,
        "head": model.head,
        "n_triplets": model.n_triplets,
        "projected": model.projected,
        "vote_mistakes": model.vote_mistakes,
        "pool_size": model.img_side.pool_size,
    }


def load_state(model: CMOMKS, arrays: Arrays, meta: dict[str, Any]) -> None:
    """Restore :func:`model_state` into ``model`` (built with the same settings)."""
    restore_attribute_arrays(model, arrays, _LEARNED)
    for name, side in (("img", model.img_side), ("txt", model.txt_side)):
        side.load_state_arrays(arrays, name, int(meta["pool_size"]))
    model.support_size, model.head = int(meta["support_size"]), int(meta["head"])
    model.n_triplets, model.projected = int(meta["n_triplets"]), int(meta["projected"])
    model.vote_mistakes = int(meta["vote_mistakes"])
    model._waiting = _waiting_from(arrays)


def _waiting_arrays(waiting: list[Triplet]) -> Arrays:
    """The triplets waiting for the pool to fill, as a checkpoint keeps them (none: nothing)."""
    if not waiting:
        return {}
    return {
        "waiting.img": np.stack([w[0] for w in waiting]),
        "waiting.txt": np.stack([w[1] for w in waiting]),
        "waiting.is_text": np.array([w[2] for w in waiting]),
    }


def _waiting_from(arrays: Arrays) -> list[Triplet]:
    """The waiting triplets of :func:`_waiting_arrays`."""
    if "waiting.is_text" not in arrays:
        return []
    return [
        (arrays["waiting.img"][i], arrays["waiting.txt"][i], bool(flag))
        for i, flag in enumerate(arrays["waiting.is_text"])
    ]
