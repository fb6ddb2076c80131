"""The rolling evaluation's schedule, sized from its cost.

An evaluated pair is scored against the newest ``gallery`` stored pairs in both directions
before the model learns it (:class:`~streamxm.learning.learner.StreamLearner`). For a model
that learns fast, scoring every pair would cost more than learning it (CMOS: two products with
the whole ``W`` against a share of one per pair). ``eval_every="auto"`` scores every ``N``-th
pair with

    N = ceil(evaluation_seconds / (share * learning_seconds)),

both from the work the model counts (:mod:`streamxm.models.work`) at fixed reference rates, so
the choice depends on the model's settings and sizes only: a learner and its restored copy
evaluate the same pairs, and the rolling mAP stays test-then-train on a fixed subsample of the
stream. The share is a bound on the estimate; ``streamxm bench throughput --eval-every auto``
measures the real one.
"""

from __future__ import annotations

import math
from typing import Literal

from streamxm import defaults
from streamxm.models import CrossModalModel
from streamxm.models.work import Rates

__all__ = ["REFERENCE_RATES", "EvalEvery", "evaluation_interval", "resolve_eval_every"]

#: An evaluation schedule as asked for: every N-th pair, or "auto".
EvalEvery = int | Literal["auto"]

REFERENCE_RATES = Rates(defaults.REFERENCE_FLOPS_PER_S, defaults.REFERENCE_BYTES_PER_S)


def evaluation_interval(model: CrossModalModel, gallery: int,
                        share: float = defaults.EVAL_SHARE) -> int:
    """Every how many pairs to evaluate so that evaluating costs about ``share`` of learning;
    1 for a model that does not count its work.

    >>> from streamxm.models import create_model
    >>> evaluation_interval(create_model("cmos", 4096, 1000), 200) > 1
    True
    """
    learning, evaluation = model.learning_work(), model.evaluation_work(gallery)
    if learning is None or evaluation is None:
        return 1
    ratio = evaluation.seconds(REFERENCE_RATES) / (share * learning.seconds(REFERENCE_RATES))
    return max(1, math.ceil(ratio))


def resolve_eval_every(eval_every: EvalEvery, model: CrossModalModel, gallery: int) -> int:
    """The schedule as a number of pairs; refuses anything but a positive int or ``"auto"``."""
    if eval_every == "auto":
        return evaluation_interval(model, gallery)
    if isinstance(eval_every, bool) or not isinstance(eval_every, int) or eval_every < 1:
        raise ValueError(f"eval_every must be a positive integer or 'auto', got {eval_every!r}")
    return eval_every
