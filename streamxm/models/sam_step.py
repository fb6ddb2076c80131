"""SAM's SGD step on a mini-batch (:func:`train_step`) and its pieces beside the margins
(:meth:`~streamxm.models.sam.SAM.margins`): the categories of the mini-batch and its negatives,
the class centroids, Eq. 5's loss and its gradient, the statistics of the triplets and the
optimiser's descent, run with subnormal numbers flushed to zero.

The gradients are the chain rule written out: :func:`score_gradient` with respect to the scores,
then :meth:`~streamxm.models.sam_tower.Tower.set_gradients` through each tower.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from typing import TYPE_CHECKING

import numpy as np
import torch
from torch import Tensor, nn

from streamxm.models.base import LearnStats
from streamxm.models.classes import ClassIndex
from streamxm.models.optim import nesterov_step
from streamxm.models.sam_inputs import observe_scale, on_device, prepare_rows
from streamxm.models.sam_replay import Batch, Labels
from streamxm.models.sam_tower import step_multipliers

if TYPE_CHECKING:
    from streamxm.models.sam import SAM

__all__ = [
    "batch_loss",
    "category_matrix",
    "descend",
    "negatives_of",
    "record",
    "score_gradient",
    "subnormals_flushed",
    "train_step",
    "update_centroids",
    "uses_compiled_descent",
]


@contextmanager
def subnormals_flushed() -> Iterator[None]:
    """This thread's floating-point unit flushes subnormal results and inputs to zero (x86
    FTZ/DAZ, ``torch.set_flush_denormal``) inside the block, and stops after it.

    Where the hinges go quiet (every margin met, as on well-separated classes), gradients are
    exactly zero and the momentum decays geometrically into subnormal numbers, whose arithmetic
    runs much slower on x86. Values that small move no weight. The mode is per thread, so other
    threads (the API's embedding) keep IEEE arithmetic; a caller that had it on finds it off
    afterwards.
    """
    flushing = torch.set_flush_denormal(True)  # False where the CPU has no such mode
    try:
        yield
    finally:
        if flushing:
            torch.set_flush_denormal(False)


def category_matrix(labels: Labels, classes: ClassIndex, device: torch.device) -> Tensor:
    """(b, classes) 0/1: the known classes of each item (filled on the CPU, then moved)."""
    y = np.zeros((len(labels), len(classes)), dtype=np.float32)
    rows: list[int] = []
    cols: list[int] = []
    for i, item in enumerate(labels):
        found = classes.columns(item, arriving=False)
        rows += [i] * len(found)
        cols += found
    y[rows, cols] = 1.0  # one assignment: indexing a tensor per item is slow
    return torch.from_numpy(y).to(device)


def negatives_of(y: Tensor) -> Tensor:
    """(b, b): whether item ``n`` is a negative of anchor ``a``, from the items' categories
    ``y``: a labelled anchor's are the labelled items sharing none of its labels, an unlabelled
    anchor's all other items."""
    labelled = y.sum(dim=1) > 0
    unshared = (y @ y.T) == 0
    negatives = unshared.logical_and_(labelled[None, :]).logical_or_(~labelled[:, None])
    return negatives.fill_diagonal_(False)


def update_centroids(
    centroids: tuple[Tensor, Tensor],
    seen: Tensor,
    y: Tensor,
    projections: tuple[Tensor, Tensor],
    rate: float,
) -> tuple[Tensor, Tensor, Tensor]:
    """The image and text ``centroids`` (one row a class; ``seen``: which have had a member)
    moved towards the means of the mini-batch's ``projections`` per class of ``y``: by
    ``rate``, or all the way on a class's first visit. Rows are added for classes new to them
    (the returned tensors); the rows of the classes present are updated in place."""
    cent_img, cent_txt = centroids
    grow = y.shape[1] - cent_img.shape[0]
    if grow > 0:
        zeros = torch.zeros(grow, cent_img.shape[1], device=cent_img.device)
        cent_img = torch.cat([cent_img, zeros])
        cent_txt = torch.cat([cent_txt, zeros])
        seen = torch.cat([seen, torch.zeros(grow, dtype=torch.bool, device=seen.device)])
    counts = y.sum(dim=0)
    present = counts > 0
    weight = torch.where(seen, rate, 1.0)[present, None]
    for cent, z in zip((cent_img, cent_txt), projections, strict=True):
        means = (y.T @ z)[present] / counts[present, None]
        cent[present] = (1.0 - weight) * cent[present] + weight * means
    seen |= present
    return cent_img, cent_txt, seen


def batch_loss(s: Tensor, margins: Tensor, negatives: Tensor) -> tuple[Tensor, Tensor]:
    """Eq. 5 over a mini-batch: per anchor, the hinge summed over its negatives, both directions.

    ``s[i, j]`` is the similarity of image ``i`` and text ``j`` (pair ``i``'s partner is text
    ``i``), ``margins[a, n]`` the margin of anchor ``a`` against negative ``n`` and
    ``negatives[a, n]`` whether ``n`` is a negative of ``a``. Returns the hinge terms of the
    image anchors (against texts) and of the text anchors (against images), each (b, b), zero
    off the negatives; the loss is their sum divided by the batch size (the mean over anchors
    of the per-anchor sum: the plain sum diverges at the paper's learning rate).
    """
    pos = torch.diagonal(s)[:, None]
    mask = negatives.to(s.dtype)
    i2t = torch.relu(margins - pos + s) * mask
    t2i = torch.relu(margins - pos + s.T) * mask
    return i2t, t2i


def score_gradient(i2t: Tensor, t2i: Tensor) -> Tensor:
    """The gradient of :func:`batch_loss`'s loss ``(sum(i2t) + sum(t2i)) / b`` with respect to
    the scores ``s``: with ``A = [i2t > 0]`` and ``B = [t2i > 0]`` (the active hinges, zero off
    the negatives), ``(A + B^T - diag(rowsum(A) + rowsum(B))) / b``; a hinge at exactly zero
    passes no gradient, as ``relu``'s.

    >>> score_gradient(torch.tensor([[0.0, 0.2], [0.0, 0.0]]), torch.zeros(2, 2))
    tensor([[-0.5000,  0.5000],
            [ 0.0000,  0.0000]])
    """
    active_i2t = (i2t > 0).to(i2t.dtype)
    active_t2i = (t2i > 0).to(t2i.dtype)
    grad = active_i2t + active_t2i.T
    grad.diagonal().sub_(active_i2t.sum(dim=1) + active_t2i.sum(dim=1))
    return grad.div_(i2t.shape[0])


def record(
    s: Tensor, i2t: Tensor, t2i: Tensor, negatives: Tensor, new: Tensor, stats: LearnStats
) -> None:
    """The triplets of the new anchors into ``stats``: their rows of the scores ``s``, hinges
    and negatives."""
    pos = torch.diagonal(s)[new, None]
    rows = negatives[new]
    for direction, scores, hinge in (("i2t", s[new], i2t[new]), ("t2i", s.T[new], t2i[new])):
        stats.triplets[direction] += int(rows.sum())
        stats.mistakes[direction] += int(((pos - scores <= 0) & rows).sum())
        stats.loss[direction] += float(hinge[rows].sum())
        stats.updates[direction] += int(((hinge > 0) & rows).sum())


def uses_compiled_descent(device: torch.device, momentum: float) -> bool:
    """Whether :func:`descend` takes the compiled pass: on the CPU, with momentum."""
    return device.type == "cpu" and momentum > 0


def descend(
    optimizer: torch.optim.SGD,
    parameters: list[nn.Parameter],
    lr: float,
    momentum: float,
    device: torch.device,
) -> None:
    """The optimiser's step at learning rate ``lr``: on the CPU with momentum
    (:func:`uses_compiled_descent`), one compiled pass per parameter
    (:func:`~streamxm.models.optim.nesterov_step`, torch's rule) over the momentum buffers the
    torch optimiser holds (so its state is the checkpoint's); elsewhere the torch optimiser
    itself."""
    if not uses_compiled_descent(device, momentum):
        for group in optimizer.param_groups:
            group["lr"] = lr
        optimizer.step()
        return
    for p in parameters:
        state = optimizer.state[p]
        if "momentum_buffer" not in state:  # torch's first step: the buffer is the gradient
            state["momentum_buffer"] = torch.zeros_like(p, memory_format=torch.contiguous_format)
        assert p.grad is not None
        nesterov_step(
            p.detach().numpy(), state["momentum_buffer"].numpy(), p.grad.numpy(), lr, momentum
        )


def train_step(model: SAM, batch: Batch, stats: LearnStats, epoch: int) -> float:
    """:meth:`~streamxm.models.sam.SAM.step` of ``model``: one SGD step on a mini-batch, its
    loss returned, with subnormal numbers flushed to zero (:func:`subnormals_flushed`).

    Per tower, the inputs prepared and a training pass with this step's dropout; the centroids
    move towards the batch's class means and the ``f_ms`` normalisers take in its distances
    before the margins are computed; the new anchors' triplets enter ``stats``; the learning
    rate decays with the step count and the clock advances by ``rows / epoch``.
    """
    img, txt, labels, new = batch
    with subnormals_flushed():
        b = len(img)
        y = model._category_matrix(labels)
        negatives = negatives_of(y)
        xi = prepare_rows(img, model.img_scaler, model.power_img, model.device_)
        xt = prepare_rows(txt, model.txt_scaler, model.power_txt, model.device_)
        # each tower's dropout multipliers, drawn from the model's generator in turn
        shape = (b, model.hidden)
        dropout = (model.dropout, model.generator, model._device_generator, model.device_)
        with torch.no_grad():
            img_pass = model.img_tower.train_forward(xi, step_multipliers(shape, *dropout))
            txt_pass = model.txt_tower.train_forward(xt, step_multipliers(shape, *dropout))
            zi, zt = img_pass.z, txt_pass.z
            model._update_centroids(y, zi, zt)
            distances = model._distances(img, txt)
            observe_scale(model, *distances)
            margins = model.margins(*distances, y)
            s = zi @ zt.T
            i2t, t2i = batch_loss(s, margins, negatives)
            loss = float(i2t.sum() + t2i.sum()) / b
            new_rows = on_device(np.asarray(new, dtype=np.bool_), model.device_)
            record(s, i2t, t2i, negatives, new_rows, stats)
            grad_s = score_gradient(i2t, t2i)
            model.img_tower.set_gradients(img_pass, grad_s @ zt)
            model.txt_tower.set_gradients(txt_pass, grad_s.T @ zi)
        lr = model.lr / (1.0 + model.decay * model.steps)
        descend(model.optimizer, model._parameters(), lr, model.momentum, model.device_)
        model.steps += 1
        model.clock += b / epoch
        return loss
