"""SDSRL's state as arrays: its checkpoint (:meth:`~streamxm.models.sdsrl.SDSRL.state`,
:meth:`~streamxm.models.sdsrl.SDSRL.load_state`).

The arrays are the statistics (``gram_img``, ``gram_txt``, ``lab_img``, ``lab_txt``), the
projections ``a`` and ``b``, the pending pairs, the class values, the landmarks' class counts,
the maps (``landmarks_*`` and ``proj_*``, and ``serve_``-prefixed ones when queries use other
maps) and the published ``w_img``, ``w_txt``.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import numpy as np

from streamxm.models.base import Arrays
from streamxm.models.sdsrl_landmarks import STATISTICS, map_arrays, restore_maps

if TYPE_CHECKING:
    from streamxm.models.sdsrl import SDSRL

__all__ = ["load_state", "model_state"]


def model_state(model: SDSRL) -> tuple[Arrays, dict[str, Any]]:
    """The checkpoint of ``model``: its arrays and its metadata (JSON-serialisable)."""
    arrays: Arrays = {key: getattr(model, key) for key in (*STATISTICS, "a", "b")}
    arrays["pending_img"] = np.asarray(model.pending_img).reshape(-1, model.img_dim)
    arrays["pending_txt"] = np.asarray(model.pending_txt).reshape(-1, model.txt_dim)
    arrays["classes"] = np.asarray(model.class_index.classes, dtype=np.int64)
    arrays["landmark_classes_img"] = model.landmark_classes_img
    arrays["landmark_classes_txt"] = model.landmark_classes_txt
    arrays.update(map_arrays("", model.map_img, model.map_txt))
    serve_apart = model.serve_img is not None and model.serve_img is not model.map_img
    if serve_apart:
        arrays.update(map_arrays("serve_", model.serve_img, model.serve_txt))
    if model.serve_img is not None:
        arrays["w_img"], arrays["w_txt"] = model.w_img, model.w_txt
    meta = {
        "frozen": model.frozen,
        "weight": model.weight,
        "pairs": model.pairs,
        "unlabelled": model.unlabelled,
        "solves": model.solves,
        "pending_cols": model.pending_cols,
        "cd_losses": model.cd_losses,
        "ignored_labels": model.class_index.ignored_labels,
        "serve_apart": serve_apart,
        "grown_classes": model.grown_classes,
    }
    return arrays, meta


def load_state(model: SDSRL, arrays: Arrays, meta: dict[str, Any]) -> None:
    """Restore ``model`` from :func:`model_state`'s arrays and metadata."""
    for key in (*STATISTICS, "a", "b"):
        setattr(model, key, np.array(arrays[key], dtype=np.float64))
    model.pending_img = list(np.array(arrays["pending_img"], dtype=np.float64))
    model.pending_txt = list(np.array(arrays["pending_txt"], dtype=np.float64))
    model.pending_cols = [[int(c) for c in cols] for cols in meta["pending_cols"]]
    model.class_index.restore([int(c) for c in arrays["classes"]], meta["ignored_labels"])
    for side in ("img", "txt"):  # came with grow_landmarks: none in older checkpoints
        counts = arrays.get(f"landmark_classes_{side}", np.zeros(0))
        setattr(model, f"landmark_classes_{side}", np.array(counts, dtype=np.int64))
    model.map_img = model.map_txt = None
    if "landmarks_img" in arrays:
        model.map_img, model.map_txt = restore_maps(arrays, "", model.sigma_img, model.sigma_txt)
    model.frozen = bool(meta["frozen"])
    model.weight = float(meta["weight"])
    model.pairs, model.unlabelled = int(meta["pairs"]), int(meta["unlabelled"])
    model.solves = int(meta["solves"])
    # came with ranks that grow: none in older checkpoints (their classes owe growth)
    model.grown_classes = int(meta.get("grown_classes", 0))
    model.cd_losses = [float(x) for x in meta["cd_losses"]]
    model.serve_img, model.serve_txt = model.map_img, model.map_txt
    if meta["serve_apart"]:
        model.serve_img, model.serve_txt = restore_maps(
            arrays, "serve_", model.sigma_img, model.sigma_txt
        )
    if "w_img" in arrays:
        model.w_img = np.array(arrays["w_img"], dtype=np.float64)
        model.w_txt = np.array(arrays["w_txt"], dtype=np.float64)
    else:
        model.serve_img = model.serve_txt = None
