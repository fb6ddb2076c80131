"""SAM's inputs: the rows a tower reads and the input-space distances of ``f_ms``.

A tower reads its modality's vectors power-mapped and L2-normalised (when the modality's
``power`` is set), then standardised by the running moments of the pairs seen
(:class:`~streamxm.models.moments.FeatureScaler`), float32 on the model's device. ``f_ms``
(Eq. 9) reads the Euclidean distances between the vectors as sent.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import numpy as np
import torch
from numpy.typing import NDArray
from torch import Tensor

from streamxm.models.history import Example
from streamxm.models.moments import FeatureScaler, power_normalize
from streamxm.models.sam_tower import Tower

if TYPE_CHECKING:
    from streamxm.models.sam import SAM

__all__ = [
    "EMBED_ROWS",
    "embed_rows",
    "input_distances",
    "mapped_rows",
    "observe_scale",
    "on_device",
    "pairwise_distances",
    "prepare_rows",
    "scale_arrivals",
]

EMBED_ROWS = 4096  # rows per forward pass when embedding: bounds the hidden activations


def on_device(x: NDArray[Any], device: torch.device) -> Tensor:
    """A numpy array as a tensor on ``device`` (shared memory on the CPU)."""
    return torch.from_numpy(np.ascontiguousarray(x)).to(device)


def mapped_rows(x: NDArray[np.floating], power: float | None) -> NDArray[np.floating]:
    """Inputs before standardisation: as sent, or power-mapped and L2-normalised."""
    return x if power is None else power_normalize(x, power)


def observe_scale(model: SAM, dist_img: Tensor, dist_txt: Tensor) -> None:
    """Raise ``model``'s ``f_ms`` normalisers to the largest of these distances."""
    model.scale_img = max(model.scale_img, float(dist_img.max()))
    model.scale_txt = max(model.scale_txt, float(dist_txt.max()))


def scale_arrivals(
    pairs: list[Example],
    img_scaler: FeatureScaler,
    txt_scaler: FeatureScaler,
    powers: tuple[float | None, float | None],
    limit: int | None,
) -> None:
    """The pairs' rows join the standardisation's statistics (``img_scaler``, ``txt_scaler``,
    after the image and text ``powers``' maps), up to ``limit`` rows in all (``None``: every
    row)."""
    room = len(pairs)
    if limit is not None:
        room = max(0, min(room, limit - img_scaler.n))
    if room:
        scaled = pairs[:room]
        img_scaler.add(mapped_rows(np.stack([p.img for p in scaled]), powers[0]))
        txt_scaler.add(mapped_rows(np.stack([p.txt for p in scaled]), powers[1]))


def prepare_rows(
    x: NDArray[np.floating], scaler: FeatureScaler, power: float | None, device: torch.device
) -> Tensor:
    """A tower's input rows, float32 on ``device``: power-mapped and L2-normalised when
    ``power`` is set (:func:`~streamxm.models.moments.power_normalize`'s map), then
    standardised by ``scaler``'s running moments (computed in float64, applied in float32)."""
    rows = on_device(np.asarray(x, dtype=np.float32), device)  # shares the caller's memory
    if power is not None:
        mapped = rows.abs() if power == 1.0 else rows.abs().pow_(power)
        rows = mapped.mul_(rows.sign())
        norms = torch.linalg.vector_norm(rows, dim=1, keepdim=True)
        rows.div_(norms.masked_fill_(norms == 0, 1.0))
    mean, std = (on_device(v.astype(np.float32), device) for v in scaler.standardisation())
    return (rows - mean).div_(std)


def embed_rows(
    x: NDArray[np.floating],
    tower: Tower,
    scaler: FeatureScaler,
    power: float | None,
    device: torch.device,
) -> NDArray[np.float32]:
    """``tower``'s inference pass over the rows of ``x`` (2-d) prepared by
    :func:`prepare_rows`, :data:`EMBED_ROWS` rows at a time, as float32 CPU rows."""
    width = tower.b2.shape[0]  # the tower's output size
    out = np.empty((len(x), width), dtype=np.float32)
    with torch.no_grad():
        for at in range(0, len(x), EMBED_ROWS):
            chunk = prepare_rows(x[at : at + EMBED_ROWS], scaler, power, device)
            out[at : at + EMBED_ROWS] = tower(chunk).cpu().numpy()
    return out


def pairwise_distances(x: Tensor) -> Tensor:
    """Euclidean distances between the rows of ``x``, from their Gram matrix: ``d_ij^2 =
    |x_i|^2 + |x_j|^2 - 2 x_i . x_j``, clipped at 0 (the product path ``torch.cdist`` takes for
    more than 25 rows, without its padded copies of the operands; the diagonal is exactly 0).

    >>> pairwise_distances(torch.tensor([[0.0, 0.0], [3.0, 4.0]]))
    tensor([[0., 5.],
            [5., 0.]])
    """
    gram = x @ x.T
    norms = gram.diagonal().clone()
    return gram.mul_(-2.0).add_(norms[:, None]).add_(norms[None, :]).clamp_min_(0.0).sqrt_()


def input_distances(
    img: NDArray[np.floating], txt: NDArray[np.floating], device: torch.device
) -> tuple[Tensor, Tensor]:
    """Euclidean distances between the rows, per modality, on the vectors as sent."""
    ti = on_device(np.asarray(img, dtype=np.float32), device)
    tt = on_device(np.asarray(txt, dtype=np.float32), device)
    return pairwise_distances(ti), pairwise_distances(tt)
