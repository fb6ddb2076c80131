"""CMOS's state as arrays: its checkpoint (:meth:`~streamxm.models.cmos.CMOS.state`,
:meth:`~streamxm.models.cmos.CMOS.load_state`) and the parts several ranks merge
(:meth:`~streamxm.models.cmos.CMOS.merge_parts`, :meth:`~streamxm.models.cmos.CMOS.set_merged`).

The arrays: ``W``, the centring sums ``img_sum`` and ``txt_sum``, and in a checkpoint the
triplets still queued, ``queued_left``, ``queued_right``, ``queued_is_text`` and their PA caps
``queued_cap`` (absent in a checkpoint written before the caps could differ: all ``C``); with
an average served, also ``W_avg`` and the queued triplets' decays ``queued_decay``.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import numpy as np

from streamxm.models.base import Arrays, MergeParts

if TYPE_CHECKING:
    from streamxm.models.cmos import CMOS

__all__ = ["load_state", "merge_parts", "model_state", "set_merged"]


def merge_parts(model: CMOS) -> MergeParts:
    """``W`` and its average ``W_avg`` mixed across ranks; the centring sums and the counts
    summed."""
    parts: MergeParts = {
        "W": ("mix", model.W),
        "img_sum": ("sum", model.img_sum),
        "txt_sum": ("sum", model.txt_sum),
        "n_seen": ("sum", np.asarray(model.n_seen)),
        "n_triplets": ("sum", np.asarray(model.n_triplets)),
    }
    if model.W_avg is not None:
        parts["W_avg"] = ("mix", model.W_avg)
    return parts


def set_merged(model: CMOS, merged: Arrays) -> None:
    """Take the merged parts of :func:`merge_parts` (the queue must be empty)."""
    if model._queued:
        raise RuntimeError("merge with triplets still queued: flush first")
    model.W = np.asarray(merged["W"], dtype=model.dtype)
    if model.W_avg is not None:
        model.W_avg = np.array(merged["W_avg"], dtype=model.dtype)
    model.img_sum = np.array(merged["img_sum"], dtype=np.float64)
    model.txt_sum = np.array(merged["txt_sum"], dtype=np.float64)
    model.n_seen, model.n_triplets = int(merged["n_seen"]), int(merged["n_triplets"])


def model_state(model: CMOS) -> tuple[Arrays, dict[str, Any]]:
    """The checkpoint of ``model``: its arrays and its metadata (JSON-serialisable)."""
    n = model._queued
    arrays = {
        "W": model.W,
        "img_sum": model.img_sum,
        "txt_sum": model.txt_sum,
        "queued_left": model._left[:n],
        "queued_right": model._right[:n],
        "queued_is_text": model._is_text[:n],
        "queued_cap": model._cap[:n],
    }
    if model.W_avg is not None:
        arrays.update(W_avg=model.W_avg, queued_decay=model._decay[:n])
    return arrays, {"n_seen": model.n_seen, "n_triplets": model.n_triplets}


def load_state(model: CMOS, arrays: Arrays, meta: dict[str, Any]) -> None:
    """Restore :func:`model_state` into ``model`` (built with the same settings)."""
    model.W = np.array(arrays["W"], dtype=model.dtype)
    model.img_sum = np.array(arrays["img_sum"], dtype=np.float64)
    model.txt_sum = np.array(arrays["txt_sum"], dtype=np.float64)
    model.n_seen, model.n_triplets = int(meta["n_seen"]), int(meta["n_triplets"])
    n = len(arrays.get("queued_is_text", ()))
    model._left[:n] = arrays["queued_left"]
    model._right[:n] = arrays["queued_right"]
    model._is_text[:n] = arrays["queued_is_text"]
    model._cap[:n] = arrays.get("queued_cap", model.C)  # absent: written when all were C
    if model.W_avg is not None:
        model.W_avg = np.array(arrays["W_avg"], dtype=model.dtype)
        model._decay[:n] = arrays["queued_decay"]
    model._queued = n
