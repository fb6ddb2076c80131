"""What a model may opt into beyond the contract of :class:`~streamxm.models.base.CrossModalModel`:
each an abstract subclass a model also inherits, checked with ``isinstance`` where it is used.

- :class:`CountsWork`: the model counts its work (floating-point operations, bytes), so the
  rolling evaluation is sized to a share of the learning (``STREAMXM_EVAL_EVERY=auto``) and
  ``streamxm bench throughput`` sets it beside its roofline. A model without it is evaluated
  at every pair and benchmarked without a roofline.
- :class:`MergesRanks`: several ranks can learn the model together
  (``streamxm worker --world-size N``, :mod:`streamxm.learning.rounds`). A model without it
  learns on rank 0 alone, which sends its state to the others after each round.
"""

from __future__ import annotations

from abc import abstractmethod
from typing import ClassVar

import numpy as np

from streamxm.models.base import Arrays, CrossModalModel, MergeParts
from streamxm.models.moments import ResolveSchedule
from streamxm.models.work import Work, elementwise, gemm

__all__ = ["CountsWork", "MergesRanks", "counted", "mergeable"]


class CountsWork(CrossModalModel):
    """A model that counts the work of its algorithm (:mod:`streamxm.models.work`)."""

    def learning_work(self) -> Work | None:
        """The work of :meth:`update` per arriving pair at this model's settings, in the steady
        state (buffer, budgets and landmark sets full, outside bursts), periodic work (a solve
        every ``n`` pairs) spread over its period; ``None``: not counted."""
        return None

    def periodic_work(self) -> tuple[int, int]:
        """``(start, period)``: once ``start`` pairs are learned, the periodic work that
        :meth:`learning_work` spreads over its period (a re-solve, a refresh) falls once in
        every ``period`` pairs, so timing ``k period`` pairs from there times it exactly ``k``
        times. The default reads a :class:`~streamxm.models.moments.ResolveSchedule` named
        ``schedule``; ``(0, 1)`` for a model with none."""
        schedule = getattr(self, "schedule", None)
        if isinstance(schedule, ResolveSchedule):
            return schedule.steady_start(), schedule.every
        return 0, 1

    def embedding_work(self, rows: int, modality: str) -> Work | None:
        """The work of embedding ``rows`` raw vectors of ``modality`` (``"image"`` or
        ``"text"``) through the model in the steady state; ``None``: not counted."""
        return None

    def evaluation_work(self, gallery: int) -> Work | None:
        """The work of :meth:`evaluation_scores` against ``gallery`` stored pairs whose kept
        features are current (those gone stale since the last evaluation are
        :meth:`kept_feature_work`); ``None``: not counted."""
        total = Work()
        for modality, dim in (("image", self.img_dim), ("text", self.txt_dim)):
            head = self.embedding().head(modality)
            if head is not None:
                width, k = head.weight.shape
                query = head.features.work(1, dim) if head.features is not None else Work()
                # Read in place when the rows are a run of slots (the ring's newest pairs),
                # gathered otherwise; charged the gather either way, an upper bound.
                kept = elementwise(gallery * width, 4, flops_per_item=0.0)
                total += (
                    query
                    + gemm(1, k, width)
                    + kept
                    + gemm(gallery, k, width, 4)
                    + gemm(1, gallery + 1, k)
                )
                continue
            embedding = self.embedding_work(gallery + 2, modality)
            if embedding is None:
                return None
            total += embedding
        return total

    def kept_feature_work(self, rows: int) -> Work:
        """The work of computing ``rows`` stored pairs' kept features (both sides, one batch:
        :class:`~streamxm.models.heads.SlotFeatures`) for :meth:`evaluation_scores`: their unit
        rows (3 passes) and the heads' feature maps. Nothing for a model that scores without
        kept features."""
        total = Work()
        for modality, dim in (("image", self.img_dim), ("text", self.txt_dim)):
            head = self.embedding().head(modality)
            if head is None:
                return Work()
            total += elementwise(rows * dim, 4, flops_per_item=3.0, passes=3.0)
            if head.features is not None:
                total += head.features.work(rows, dim)
        return total


class MergesRanks(CrossModalModel):
    """A model whose ranks merge after each round (:data:`~streamxm.models.base.MergeParts`)."""

    #: Most pairs a rank learns between two merges (``None``: a whole read of
    #: ``STREAMXM_READ_BATCH`` pairs a rank), for models whose ranks drift apart too far in a
    #: longer round.
    merge_every: ClassVar[int | None] = None

    def merge_parts(self) -> MergeParts | None:
        """What the ranks of a distributed learner combine after each round (see
        :data:`MergeParts`), or ``None`` while the model cannot be split: then rank 0 learns
        the whole round alone and sends its state to the others before they split again.

        Called after :meth:`flush`. The default is ``None``: a model learns on one rank only
        until it says how its ranks merge.
        """
        return None

    @abstractmethod
    def set_merged(self, merged: Arrays) -> None:
        """Take the merged arrays (same names as :meth:`merge_parts`)."""

    def after_merge(self, pairs_before: int, pairs_after: int, rng: np.random.Generator) -> None:
        """Work due once the merged model has seen ``pairs_after`` pairs (it had seen
        ``pairs_before`` at the previous merge): e.g. a re-solve whose schedule point the round
        crossed. The default has nothing to do."""
        return None

    def register_labels(self, labels: list[tuple[int, ...]]) -> None:
        """Give the labels of a whole round in stream order before a rank learns its share, so
        per-class columns are numbered alike on every rank (and as one learner would number
        them). The default keeps no per-class state."""
        return None


def counted(model: CrossModalModel) -> CountsWork | None:
    """``model`` if it counts its work, else None."""
    return model if isinstance(model, CountsWork) else None


def mergeable(model: CrossModalModel) -> MergesRanks | None:
    """``model`` if its ranks can merge, else None."""
    return model if isinstance(model, MergesRanks) else None
