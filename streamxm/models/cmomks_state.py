"""CMOMKS's checkpoint as arrays (:meth:`~streamxm.models.cmomks.CMOMKS.state`,
:meth:`~streamxm.models.cmomks.CMOMKS.load_state`).

The arrays: ``tau``, ``A``, ``log_theta``, ``kernel_mistakes``, the support slots' classes and
ages (``slot_group``, ``slot_written``) and the pool points' classes (``pool_group``); per side
(``img.``, ``txt.``) what :meth:`~streamxm.models.cmomks_support.KernelSide.state_arrays` keeps;
and ``waiting.*``, the triplets drawn before the landmark pool filled, when there are any.
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
#: The support slots' classes and ages, which a checkpoint from before them lacks.
_SLOTS: ArrayAttributes = dict.fromkeys(("slot_group", "slot_written"), np.int64)
#: The pool points' classes, which a checkpoint from before them lacks (read as unlabelled).
_POOL: ArrayAttributes = {"pool_group": np.int64}


def model_state(model: CMOMKS) -> tuple[Arrays, dict[str, Any]]:
    """The checkpoint of ``model``: its arrays and its metadata (JSON-serialisable)."""
    arrays = attribute_arrays(model, {**_LEARNED, **_SLOTS, **_POOL})
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
        "pairs_offered": model.pairs_offered,
        "pool_passed": model.pool_passed,
        "pool_passed_all": model.pool_passed_all,
        "pool_rebuilds": model.pool_rebuilds,
    }


def load_state(model: CMOMKS, arrays: Arrays, meta: dict[str, Any]) -> None:
    """Restore :func:`model_state` into ``model`` (built with the same settings)."""
    restore_attribute_arrays(model, arrays, _LEARNED)
    for name, side in (("img", model.img_side), ("txt", model.txt_side)):
        side.load_state_arrays(arrays, name, int(meta["pool_size"]))
    model.support_size, model.head = int(meta["support_size"]), int(meta["head"])
    model.n_triplets, model.projected = int(meta["n_triplets"]), int(meta["projected"])
    model.vote_mistakes = int(meta["vote_mistakes"])
    model.pairs_offered = int(meta.get("pairs_offered", 0))  # from before: pool_skip 0, unread
    model.pool_passed = int(meta.get("pool_passed", 0))  # from before: no cap, unread
    model.pool_passed_all = int(meta.get("pool_passed_all", 0))
    model._waiting = _waiting_from(arrays)
    model.pool_rebuilds = int(meta.get("pool_rebuilds", 0))
    if "pool_group" in arrays:
        restore_attribute_arrays(model, arrays, _POOL)
    else:
        model.pool_group = np.full(model.landmarks, -1, dtype=np.int64)
    if "slot_group" in arrays:
        restore_attribute_arrays(model, arrays, _SLOTS)
    else:  # from before: unlabelled, aged in ring order (the oldest at ``head`` once full)
        model.slot_group = np.full(model.budget, -1, dtype=np.int64)
        ring = (np.arange(model.budget) - model.head) % model.budget
        full = model.support_size == model.budget
        model.slot_written = ring + model.projected if full else np.arange(model.budget)


def _waiting_arrays(waiting: list[Triplet]) -> Arrays:
    """The triplets waiting for the pool to fill, as a checkpoint keeps them (none: nothing)."""
    if not waiting:
        return {}
    return {
        "waiting.img": np.stack([w[0] for w in waiting]),
        "waiting.txt": np.stack([w[1] for w in waiting]),
        "waiting.is_text": np.array([w[2] for w in waiting]),
        "waiting.group": np.array([w[3] for w in waiting], dtype=np.int64),
    }


def _waiting_from(arrays: Arrays) -> list[Triplet]:
    """The waiting triplets of :func:`_waiting_arrays` (from before their classes: -1)."""
    if "waiting.is_text" not in arrays:
        return []
    flags = arrays["waiting.is_text"]
    groups = arrays.get("waiting.group", np.full(len(flags), -1, dtype=np.int64))
    return [
        (arrays["waiting.img"][i], arrays["waiting.txt"][i], bool(flag), int(groups[i]))
        for i, flag in enumerate(flags)
    ]
