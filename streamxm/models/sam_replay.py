"""What SAM's steps learn from (:meth:`~streamxm.models.sam.SAM.learn_one`,
:meth:`~streamxm.models.sam.SAM.fit_epochs`).

On a stream each arriving pair waits in ``pending``; every ``step_every`` pairs one step is
taken on the pending pairs filled up to a mini-batch from a reservoir sample of the stream
(Algorithm R: uniform over every pair so far), which they then join. Offline, each epoch is a
shuffled pass over the training set in mini-batches.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import TYPE_CHECKING

import numpy as np
from numpy.typing import NDArray

from streamxm.buffer.replay import ReplayBuffer, label_tuples
from streamxm.models.array_types import Vectors
from streamxm.models.base import LearnStats
from streamxm.models.history import Example, History
from streamxm.models.sam_average import follow_step, match_live
from streamxm.models.sam_inputs import observe_scale, scale_arrivals

if TYPE_CHECKING:
    from streamxm.models.sam import SAM

__all__ = [
    "Batch",
    "Labels",
    "Vectors",
    "arrive",
    "epoch_batches",
    "fit_epochs",
    "keep",
    "learn_arrival",
    "rehearsal_batch",
    "reservoir_rows",
    "stacked",
    "stream_batch",
]

#: Each row's labels.
Labels = list[tuple[int, ...]]
#: A mini-batch: image rows, text rows, each row's labels and which rows are newly arrived.
Batch = tuple[Vectors, Vectors, Labels, NDArray[np.bool_]]


def stacked(pairs: list[Example]) -> tuple[Vectors, Vectors, Labels]:
    """The pairs' image rows, text rows and labels."""
    return (
        np.stack([p.img for p in pairs]),
        np.stack([p.txt for p in pairs]),
        [p.labels for p in pairs],
    )


def keep(model: SAM, pairs: list[Example], rng: np.random.Generator) -> None:
    """Reservoir sampling (Algorithm R) of ``pairs`` into ``model.reservoir`` (``replay``
    pairs): every pair offered so far (``reservoir_seen``) is in it with equal chance."""
    for pair in pairs:
        if model.reservoir.size < model.replay:
            model.reservoir.add(pair)
        else:
            j = int(rng.integers(model.reservoir_seen + 1))
            if j < model.replay:
                model.reservoir.put(j, pair)
        model.reservoir_seen += 1


def reservoir_rows(
    reservoir: ReplayBuffer, count: int, balanced: bool, rng: np.random.Generator
) -> tuple[Vectors, Vectors, Labels]:
    """Up to ``count`` rows of ``reservoir``, drawn without replacement: uniformly, or every
    class equally likely where ``balanced``
    (:meth:`~streamxm.buffer.replay.ReplayBuffer.balanced_mix`)."""
    mix = reservoir.balanced_mix(np.arange(reservoir.size)) if balanced else None
    size = min(count, reservoir.size)
    slots = rng.choice(reservoir.size, size=size, replace=False, p=mix)
    return reservoir.img[slots], reservoir.txt[slots], label_tuples(reservoir.labels[slots])


def stream_batch(
    fresh: list[Example],
    reservoir: ReplayBuffer,
    batch_size: int,
    balanced: bool,
    rng: np.random.Generator,
) -> Batch:
    """The ``fresh`` pairs filled up to ``batch_size`` rows from ``reservoir``
    (:func:`reservoir_rows`). The fresh pairs come first and are the new rows."""
    fill_img, fill_txt, fill_labels = reservoir_rows(
        reservoir, batch_size - len(fresh), balanced, rng
    )
    fresh_img, fresh_txt, fresh_labels = stacked(fresh)
    img = np.vstack([fresh_img, fill_img])
    txt = np.vstack([fresh_txt, fill_txt])
    new = np.zeros(len(img), dtype=bool)
    new[: len(fresh)] = True
    return img, txt, fresh_labels + fill_labels, new


def rehearsal_batch(reservoir: ReplayBuffer, batch_size: int, rng: np.random.Generator) -> Batch:
    """Up to ``batch_size`` rows of ``reservoir``, every class equally likely
    (:func:`reservoir_rows`); none is new."""
    img, txt, labels = reservoir_rows(reservoir, batch_size, True, rng)
    return img, txt, labels, np.zeros(len(img), dtype=bool)


def epoch_batches(
    training: tuple[Vectors, Vectors, Labels], batch_size: int, rng: np.random.Generator
) -> Iterator[Batch]:
    """One epoch's mini-batches of a training set (:func:`stacked`): a random permutation of
    its rows in runs of ``batch_size``, every row new, a last run of a single row left out (it
    has no negatives)."""
    img, txt, labels = training
    order = rng.permutation(len(img))
    for at in range(0, len(order), batch_size):
        rows = order[at : at + batch_size]
        if len(rows) >= 2:
            yield img[rows], txt[rows], [labels[i] for i in rows], np.ones(len(rows), dtype=bool)


def arrive(model: SAM, pairs: list[Example], scale_all: bool = False) -> None:
    """Count the pairs' classes; their rows join the standardisation's statistics up to
    ``scale_pairs`` rows in all (every row with ``scale_all``: the offline training set, or a
    pair that arrives during a burst with ``burst_scale``)."""
    limit = None if scale_all else model.scale_pairs
    powers = (model.power_img, model.power_txt)
    scale_arrivals(pairs, model.img_scaler, model.txt_scaler, powers, limit)
    for p in pairs:
        model.classes.columns(p.labels)


def learn_arrival(
    model: SAM, pair: Example, history: History, rng: np.random.Generator, stats: LearnStats
) -> None:
    """:meth:`~streamxm.models.sam.SAM.learn_one`: ``pair`` is counted in (into the
    standardisation past ``scale_pairs`` too, where ``burst_scale`` is set and ``history`` sees a
    burst) and waits; at the
    ``step_every``-th waiting pair, one step on them filled up from the reservoir
    (class-balanced where ``balance`` is set and ``history`` sees a burst of few classes),
    which they then join; during a burst, ``rehearse`` more steps on class-balanced mini-batches
    of the reservoir alone (:func:`rehearsal_batch`); the towers' moving averages (``ema``)
    follow every step."""
    model._start(rng)
    model.on_stream = True
    burst = history.bursty()
    arrive(model, [pair], scale_all=model.burst_scale and burst)
    model.pending.append(pair)
    if len(model.pending) < model.step_every:
        return
    fresh, model.pending = model.pending, []
    balanced = model.balance and burst
    img, txt, labels, new = stream_batch(fresh, model.reservoir, model.batch_size, balanced, rng)
    stepped = len(img) >= 2
    if stepped:
        model.step(img, txt, labels, new, stats, model.epoch_pairs)
        follow_step(model)
    keep(model, fresh, rng)
    if not (stepped and burst and model.reservoir.size >= 2):
        return
    for _ in range(model.rehearse):
        model.step(
            *rehearsal_batch(model.reservoir, model.batch_size, rng), stats, model.epoch_pairs
        )
        follow_step(model)


def fit_epochs(
    model: SAM, pairs: list[Example], rng: np.random.Generator, stats: LearnStats
) -> Iterator[int]:
    """:meth:`~streamxm.models.sam.SAM.fit_epochs`: the training set counted in (its
    standardisation and the ``f_ms`` normalisers from up to 4,096 sampled rows) and offered to
    the reservoir, so that a stream can continue from the fitted model; then ``epochs`` passes
    over it, yielding the number done after each, the towers' averages (``ema``) set to the
    trained weights after each (offline the trained weights serve, as the paper's)."""
    model._start(rng)
    model.on_stream = False
    arrive(model, pairs, scale_all=True)
    img, txt, labels = stacked(pairs)
    sample = rng.choice(len(pairs), size=min(len(pairs), 4096), replace=False)
    observe_scale(model, *model._distances(img[sample], txt[sample]))
    keep(model, pairs, rng)
    for epoch in range(model.epochs):
        for batch in epoch_batches((img, txt, labels), model.batch_size, rng):
            model.step(*batch, stats, len(pairs))
        match_live(model)
        yield epoch + 1
