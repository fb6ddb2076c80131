"""The rolling evaluation's schedule, sized from its cost.

An evaluated pair is scored against the newest ``gallery`` stored pairs in both directions
before the model learns it (:class:`~streamxm.learning.stream_learner.StreamLearner`). For a model
that learns fast, scoring every pair would cost more than learning it (CMOS: two products with
the whole ``W`` against a share of one per pair). ``eval_every="auto"`` scores every ``N``-th
pair with

    N = ceil(evaluation_seconds / (share * learning_seconds)),

the evaluation's seconds including the kept features of the stored pairs it has not seen
(:func:`evaluation_interval`), both from the work the model counts
(:mod:`streamxm.models.work`) at fixed reference rates, so the choice depends on the model's
settings, sizes and state only: a learner and its restored copy evaluate the same pairs, and
the rolling mAP stays test-then-train on a fixed subsample of the stream. The share is a
bound on the estimate; ``streamxm bench throughput --eval-every auto`` measures the real one.
"""

from __future__ import annotations

from typing import Literal

from streamxm import defaults
from streamxm.models import CrossModalModel
from streamxm.models.opt_in import counted
from streamxm.models.work import Rates

__all__ = ["REFERENCE_RATES", "EvalEvery", "EvaluationSchedule", "evaluation_interval"]

#: An evaluation schedule as asked for: every N-th pair, or "auto".
EvalEvery = int | Literal["auto"]

REFERENCE_RATES = Rates(defaults.REFERENCE_FLOPS_PER_S, defaults.REFERENCE_BYTES_PER_S)


def evaluation_interval(
    model: CrossModalModel, gallery: int, share: float = defaults.EVAL_SHARE
) -> int:
    """Every how many pairs to evaluate so that evaluating costs about ``share`` of learning;
    1 for a model that does not count its work.

    An evaluation every ``N`` pairs costs ``E + F(min(N, g))``: the scoring ``E``
    (:meth:`~streamxm.models.opt_in.CountsWork.evaluation_work`) and the kept features of
    the gallery's pairs stored since the last one, at most the whole gallery ``g``
    (:meth:`~streamxm.models.opt_in.CountsWork.kept_feature_work`). The interval is the
    least ``N`` with ``(E + F(min(N, g))) / N <= share * L``, ``L`` the learning work per
    pair; the left side falls as ``N`` grows, so a doubling and a bisection find it.

    >>> from streamxm.models import create_model
    >>> evaluation_interval(create_model("cmos", 4096, 1000), 200) > 1
    True
    """
    counting = counted(model)
    if counting is None:
        return 1
    learning, evaluation = counting.learning_work(), counting.evaluation_work(gallery)
    if learning is None or evaluation is None:
        return 1
    budget = share * learning.seconds(REFERENCE_RATES)
    scoring = evaluation.seconds(REFERENCE_RATES)

    def affordable(n: int) -> bool:
        kept = counting.kept_feature_work(min(n, gallery)).seconds(REFERENCE_RATES)
        return scoring + kept <= n * budget

    high = 1
    while not affordable(high) and high < _LONGEST_INTERVAL:
        high *= 2
    low = high // 2  # not affordable (or 0)
    while high - low > 1:
        middle = (low + high) // 2
        low, high = (low, middle) if affordable(middle) else (middle, high)
    return high


#: The longest interval :func:`evaluation_interval` returns (a model whose evaluation costs
#: more is still scored now and then).
_LONGEST_INTERVAL = 1 << 20


class EvaluationSchedule:
    """Which pairs the rolling evaluation scores: every ``every``-th by pair index (``0, N,
    2N, ...``), or with ``"auto"`` the next pair once :func:`evaluation_interval` pairs have
    passed since the last evaluated one, the interval computed from the model as it is then
    (its counts follow its classes and supports as they grow). Both depend on the stream and
    the model's state only; ``next_at`` is kept in checkpoints."""

    def __init__(self, every: EvalEvery, gallery: int, next_at: int = 0) -> None:
        if every != "auto" and (isinstance(every, bool) or not isinstance(every, int) or every < 1):
            raise ValueError(f"eval_every must be a positive integer or 'auto', got {every!r}")
        self.every: EvalEvery = every
        self.gallery = gallery
        self.next_at = next_at

    def due(self, pairs_seen: int) -> bool:
        """Whether the pair arriving after ``pairs_seen`` pairs is scored."""
        if self.every == "auto":
            return pairs_seen >= self.next_at
        return pairs_seen % self.every == 0

    def scored(self, pairs_seen: int, model: CrossModalModel) -> None:
        """The pair arriving after ``pairs_seen`` pairs was scored: schedule the next one."""
        if self.every == "auto":
            self.next_at = pairs_seen + evaluation_interval(model, self.gallery)
