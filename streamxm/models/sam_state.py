"""SAM's state as arrays: its checkpoint (:meth:`~streamxm.models.sam.SAM.state`,
:meth:`~streamxm.models.sam.SAM.load_state`) and the parts several ranks merge
(:meth:`~streamxm.models.sam.SAM.merge_parts`, :meth:`~streamxm.models.sam.SAM.set_merged`).

The arrays are CPU numpy whatever the model's device: ``w.<tower>.<name>`` the towers'
parameters and ``momentum.<tower>.<name>`` their optimiser buffers, ``scaler_img.`` and
``scaler_txt.`` the standardisation's sums, ``cent_*`` the centroids, ``reservoir.`` and
``pending.`` the stored pairs, ``torch_rng`` the model's generator, and where ``ema`` is set
``avg.<tower>.<name>`` the towers' moving averages.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import numpy as np
import torch
from numpy.typing import NDArray

from streamxm.buffer.replay import ReplayBuffer
from streamxm.models.base import Arrays, MergeParts
from streamxm.models.history import Example
from streamxm.models.sam_inputs import on_device

if TYPE_CHECKING:
    from streamxm.models.sam import SAM

__all__ = ["load_state", "merge_parts", "model_state", "set_merged"]


def _cpu_copy(x: torch.Tensor) -> NDArray[Any]:
    """A new CPU numpy copy of a tensor on any device."""
    return x.detach().cpu().numpy().copy()


def _averages(model: SAM) -> list[tuple[str, torch.nn.Parameter]]:
    """The moving averages' parameters by checkpoint name (none at ``ema`` 0)."""
    if model.average is None:
        return []
    img, txt = model.average
    return [(f"avg.img.{n}", p) for n, p in img.named_parameters()] + [
        (f"avg.txt.{n}", p) for n, p in txt.named_parameters()
    ]


def model_state(model: SAM) -> tuple[Arrays, dict[str, Any]]:
    """The checkpoint of ``model``: its arrays and its metadata (JSON-serialisable)."""
    arrays: Arrays = {}
    for name, p in model._named_parameters():
        arrays[f"w.{name}"] = _cpu_copy(p)
        buf = model.optimizer.state.get(p, {}).get("momentum_buffer")
        if buf is not None:
            arrays[f"momentum.{name}"] = _cpu_copy(buf)
    arrays.update((name, _cpu_copy(p)) for name, p in _averages(model))
    arrays.update(model.img_scaler.state("scaler_img."))
    arrays.update(model.txt_scaler.state("scaler_txt."))
    arrays["cent_img"] = _cpu_copy(model.cent_img)
    arrays["cent_txt"] = _cpu_copy(model.cent_txt)
    arrays["cent_seen"] = _cpu_copy(model.cent_seen)
    arrays["torch_rng"] = model.generator.get_state().numpy().copy()
    reservoir_arrays, reservoir_meta = model.reservoir.state()
    arrays.update({f"reservoir.{k}": v for k, v in reservoir_arrays.items()})
    pending = ReplayBuffer(max(len(model.pending), 1), model.img_dim, model.txt_dim)
    for pair in model.pending:
        pending.add(pair)
    pending_arrays, _ = pending.state()
    arrays.update({f"pending.{k}": v for k, v in pending_arrays.items()})
    meta = {
        "initialised": model.initialised,
        "steps": model.steps,
        "clock": model.clock,
        "scale_img": model.scale_img,
        "scale_txt": model.scale_txt,
        "classes": model.classes.classes,
        "ignored_labels": model.classes.ignored_labels,
        "reservoir": reservoir_meta,
        "reservoir_seen": model.reservoir_seen,
        "pending": len(model.pending),
    }
    return arrays, meta


def load_state(model: SAM, arrays: Arrays, meta: dict[str, Any]) -> None:
    """Restore ``model`` from :func:`model_state`'s arrays and metadata. The learning rate is
    not among them: a function of the step count, it is set before every step."""
    with torch.no_grad():
        for name, p in model._named_parameters():
            p.copy_(torch.from_numpy(np.asarray(arrays[f"w.{name}"], dtype=np.float32)))
            if f"momentum.{name}" in arrays:
                model.optimizer.state[p]["momentum_buffer"] = on_device(
                    np.array(arrays[f"momentum.{name}"], dtype=np.float32), model.device_
                )
        for name, p in _averages(model):
            p.copy_(torch.from_numpy(np.asarray(arrays[name], dtype=np.float32)))
    model.img_scaler.load_state(arrays, "scaler_img.")
    model.txt_scaler.load_state(arrays, "scaler_txt.")
    model.cent_img = on_device(np.array(arrays["cent_img"], dtype=np.float32), model.device_)
    model.cent_txt = on_device(np.array(arrays["cent_txt"], dtype=np.float32), model.device_)
    model.cent_seen = on_device(np.array(arrays["cent_seen"], dtype=np.bool_), model.device_)
    model.generator.set_state(torch.from_numpy(np.array(arrays["torch_rng"], dtype=np.uint8)))
    model.reservoir = ReplayBuffer.from_state(
        {k[10:]: v for k, v in arrays.items() if k.startswith("reservoir.")}, meta["reservoir"]
    )
    model.reservoir_seen = int(meta["reservoir_seen"])
    model.pending = [
        Example(
            np.array(arrays["pending.img"][i], dtype=np.float32),
            np.array(arrays["pending.txt"][i], dtype=np.float32),
            tuple(int(x) for x in arrays["pending.labels"][i] if x >= 0),
        )
        for i in range(int(meta["pending"]))
    ]
    model.initialised = bool(meta["initialised"])
    model.steps, model.clock = int(meta["steps"]), float(meta["clock"])
    model.scale_img, model.scale_txt = float(meta["scale_img"]), float(meta["scale_txt"])
    model.classes.restore(meta["classes"], meta["ignored_labels"])


def merge_parts(model: SAM) -> MergeParts | None:
    """What the ranks merge: the towers' weights, momentum buffers and moving averages
    averaged, the changes
    of the standardisation's sums and of the counters added, the largest ``f_ms`` normalisers,
    each class's centroids averaged over the ranks that have seen it (their totals and the
    count of such ranks); ``None`` before the first step."""
    if not model.steps:
        return None
    parts: MergeParts = {}
    for name, p in model._named_parameters():
        # Views of the live tensors on the CPU (copies from another device): the merge
        # reads them, and set_merged writes the result back.
        parts[f"w.{name}"] = ("mean", p.detach().cpu().numpy())
        parts[f"momentum.{name}"] = (
            "mean",
            model.optimizer.state[p]["momentum_buffer"].cpu().numpy(),
        )
    for name, p in _averages(model):
        parts[name] = ("mean", p.detach().cpu().numpy())
    for key, scaler in (("img", model.img_scaler), ("txt", model.txt_scaler)):
        parts.update({k: ("sum", np.asarray(v)) for k, v in scaler.state(f"scaler_{key}.").items()})
    parts["scales"] = ("max", np.array([model.scale_img, model.scale_txt]))
    grow = max(len(model.classes) - model.cent_img.shape[0], 0)
    seen = torch.cat([model.cent_seen.cpu(), torch.zeros(grow, dtype=torch.bool)])
    weight = seen.numpy().astype(np.float32)
    for key, cent in (("cent_img", model.cent_img), ("cent_txt", model.cent_txt)):
        full = torch.cat([cent.cpu(), torch.zeros(grow, model.dim)]).numpy()
        parts[key] = ("total", full * weight[:, None])
    parts["cent_seen"] = ("total", weight)
    parts["steps"] = ("sum", np.asarray(model.steps))
    parts["clock"] = ("sum", np.asarray(model.clock))
    parts["ignored_labels"] = ("sum", np.asarray(model.classes.ignored_labels))
    return parts


def set_merged(model: SAM, merged: Arrays) -> None:
    """Take on the merge of every rank's :func:`merge_parts`."""
    with torch.no_grad():
        for name, p in model._named_parameters():
            p.copy_(torch.from_numpy(np.asarray(merged[f"w.{name}"], dtype=np.float32)))
            model.optimizer.state[p]["momentum_buffer"].copy_(
                torch.from_numpy(np.asarray(merged[f"momentum.{name}"], dtype=np.float32))
            )
        for name, p in _averages(model):
            p.copy_(torch.from_numpy(np.asarray(merged[name], dtype=np.float32)))
    model.img_scaler.load_state(merged, "scaler_img.")
    model.txt_scaler.load_state(merged, "scaler_txt.")
    model.scale_img, model.scale_txt = (float(x) for x in merged["scales"])
    holders = np.asarray(merged["cent_seen"], dtype=np.float32)
    means = [
        np.asarray(merged[key], dtype=np.float32) / np.maximum(holders, 1.0)[:, None]
        for key in ("cent_img", "cent_txt")
    ]
    model.cent_img, model.cent_txt = (on_device(mean, model.device_) for mean in means)
    model.cent_seen = on_device(holders > 0, model.device_)
    model.steps, model.clock = int(merged["steps"]), float(merged["clock"])
    model.classes.ignored_labels = int(merged["ignored_labels"])
