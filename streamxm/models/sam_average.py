"""SAM's served towers on a stream: an exponential moving average of the trained towers'
weights (Polyak averaging), which the embeddings read while the optimiser keeps stepping the
live weights (:class:`~streamxm.models.sam.SAM`'s ``ema``).

After each stream step the average moves towards the live weights by ``1 - decay_t``, with
``decay_t = min(ema, n / (n + 1))`` at the ``n``-th step (counting from 0): the plain mean of
the weights after each step until ``1 / (1 - ema)`` steps, an exponential moving average after
(:func:`step_decay`, :func:`follow_step`). Offline (``fit``) the trained weights serve, as the
paper's: the average is set to them after each epoch (:func:`match_live`). At ``ema = 0`` there
is no average and the live towers serve.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from streamxm.models.sam_tower import Tower
from streamxm.models.work import Work, elementwise

if TYPE_CHECKING:
    from streamxm.models.sam import SAM

__all__ = [
    "average_towers",
    "average_work",
    "copy_tower",
    "follow_step",
    "match_live",
    "new_averages",
    "served_towers",
    "step_decay",
]


def new_averages(model: SAM) -> tuple[Tower, Tower] | None:
    """``model``'s image and text averages, zero until the towers are drawn, on its device
    (``None`` at ``ema`` 0)."""
    if model.ema == 0:
        return None
    return (
        Tower(model.img_dim, model.hidden, model.dim, model.device_),
        Tower(model.txt_dim, model.hidden, model.dim, model.device_),
    )


def served_towers(model: SAM) -> tuple[Tower, Tower]:
    """The image and text towers ``model``'s embeddings read: the moving averages, or the live
    towers at ``ema`` 0."""
    return model.average or (model.img_tower, model.txt_tower)


def step_decay(ema: float, step: int) -> float:
    """The average's decay at the ``step``-th step (from 0): ``min(ema, step / (step + 1))``,
    the running mean of every step's weights until the exponential average weighs the older
    ones less.

    >>> step_decay(0.99, 0), step_decay(0.99, 3), step_decay(0.99, 1000)
    (0.0, 0.75, 0.99)
    """
    return min(ema, step / (step + 1.0))


def copy_tower(average: Tower, live: Tower) -> None:
    """``average``'s parameters set to ``live``'s."""
    with torch.no_grad():
        for a, p in zip(average.parameters(), live.parameters(), strict=True):
            a.copy_(p)


def average_towers(averages: tuple[Tower, Tower], live: tuple[Tower, Tower], decay: float) -> None:
    """Each average parameter ``a`` moved towards its live one ``w``: ``a <- decay a + (1 -
    decay) w`` (all the way at ``decay = 0``).

    >>> live, avg = (Tower(2, 3, 1), Tower(2, 3, 1)), (Tower(2, 3, 1), Tower(2, 3, 1))
    >>> _ = live[0].b2.data.fill_(1.0)
    >>> average_towers(avg, live, 0.25)
    >>> float(avg[0].b2[0]), float(avg[1].b2[0])
    (0.75, 0.0)
    """
    with torch.no_grad():
        for average, tower in zip(averages, live, strict=True):
            if decay == 0.0:
                copy_tower(average, tower)
                continue
            for a, p in zip(average.parameters(), tower.parameters(), strict=True):
                a.lerp_(p, 1.0 - decay)


def follow_step(model: SAM) -> None:
    """After ``model``'s ``steps``-th stream step, its averages (if any) move towards the live
    towers by ``1 - step_decay(ema, steps - 1)``."""
    if model.average is not None:
        live = (model.img_tower, model.txt_tower)
        average_towers(model.average, live, step_decay(model.ema, model.steps - 1))


def match_live(model: SAM) -> None:
    """``model``'s averages (if any) set to its live towers."""
    if model.average is not None:
        average_towers(model.average, (model.img_tower, model.txt_tower), 0.0)


def average_work(parameters: int) -> Work:
    """One step of the average over ``parameters`` float32 numbers: ``a + (1 - decay) (w -
    a)``, 3 flops, the average read and written and the weights read (12 B)."""
    return elementwise(parameters, 4, flops_per_item=3.0, passes=3.0)
