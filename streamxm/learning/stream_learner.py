"""The learning loop shared by the worker and the benchmarks: replay buffer, RNG, test-then-train
rolling mAP, counters, and the whole state as arrays plus JSON.

The worker feeds it pairs read from Redis; ``streamxm bench quality --protocol stream`` feeds it
the training rows of a file. Both go through :meth:`StreamLearner.learn`, so the benchmark
measures the code the service runs. :class:`streamxm.Learner` wraps it for use in your own
process.
"""

from __future__ import annotations

import bisect
import time
from collections import deque
from collections.abc import Sequence
from typing import Any

import numpy as np
from numpy.typing import NDArray

from streamxm import defaults as D
from streamxm.buffer.replay import ReplayBuffer
from streamxm.faults import raise_point
from streamxm.learning.drift import DriftMonitor
from streamxm.learning.evaluation import average_precision
from streamxm.learning.schedule import EvalEvery, EvaluationSchedule
from streamxm.models import DIRECTIONS, CrossModalModel, LearnStats, create_model, model_class
from streamxm.models.heads import SlotFeatures
from streamxm.models.history import Example
from streamxm.stream.messages import Pair

__all__ = [
    "UPDATE_BUCKETS",
    "LearnFailed",
    "StreamLearner",
    "default_memory",
    "example_of",
    "model_from_state",
]

#: Upper bounds (seconds) of the per-pair update latency histogram.
UPDATE_BUCKETS = (1e-5, 3e-5, 1e-4, 3e-4, 1e-3, 3e-3, 1e-2, 3e-2, 0.1, 0.3, 1.0, float("inf"))


def _eval_every(value: Any) -> EvalEvery:
    return "auto" if value == "auto" else int(value)


def example_of(pair: Pair) -> Example:
    """The arrays a model learns from, of a pair in the wire format."""
    return Example(pair.img, pair.txt, pair.labels)


def default_memory(model: CrossModalModel, capacity: int) -> int:
    """Memory slots beside a ring of ``capacity`` recent pairs when none are asked for: the
    model's ``memory_share`` of the ring.

    >>> from streamxm.models import create_model
    >>> cmos, cca = create_model("cmos", 4, 3), create_model("cca", 4, 3)
    >>> default_memory(cmos, 500), default_memory(cca, 500)
    (1000, 0)
    """
    return int(capacity * model.memory_share)


class LearnFailed(RuntimeError):
    """Learning raised at the ``index``-th pair of a :meth:`StreamLearner.learn` call.

    The pairs before it were applied and the failing one may be half applied, so the learner's
    state is no longer that of any prefix of the stream: discard it and reload a checkpoint.
    The original exception is the ``__cause__``.
    """

    def __init__(self, index: int, pair_id: str, cause: BaseException) -> None:
        super().__init__(
            f"learning pair {pair_id!r} (#{index} of the batch) raised "
            f"{type(cause).__name__}: {cause}"
        )
        self.index = index
        self.pair_id = pair_id


class StreamLearner:
    """A model plus everything needed to keep learning it from a stream.

    Every pair's triplets feed a :class:`~streamxm.learning.drift.DriftMonitor` (ADWIN on the
    per-pair mistake rate), which counts rises in the mistake rate.

    Rolling mAP is test-then-train: every ``eval_every``-th pair, before the model learns from it,
    the pair's image is ranked against the texts of the last ``eval_gallery`` buffered pairs plus
    its own text (and its text against their images). Relevant items share a label with the query
    (for an unlabelled query: its own partner). The AP of each such query enters a window of the
    last ``rolling_window`` queries per direction; the rolling mAP is their mean. The schedule is
    by pair index, so it does not depend on how the stream was cut into batches.

    Parameters
    ----------
    model
        Model name, e.g. ``"cmos"``.
    img_dim, txt_dim
        Input sizes.
    params
        Model constructor parameters.
    buffer_capacity
        Pairs in the replay buffer's ring of the most recent pairs.
    buffer_memory
        Slots of the class-balanced memory of the whole history beside the ring
        (:class:`~streamxm.buffer.replay.ReplayBuffer`), which the models draw from during a
        burst of few classes only; 0: the ring alone; ``None`` (default): the model's own
        share of the ring (:attr:`~streamxm.models.base.CrossModalModel.memory_share`).
        ``docs/benchmarks.md`` ("Stream order") measures what it buys.
    seed
        Seed of the learner's RNG (triplet sampling); its state is checkpointed.
    eval_every
        Evaluate every N-th pair; ``"auto"`` (the default, the service's): after each evaluated
        pair, the next one is N pairs on, N sized from the model's counted work so that
        evaluating costs about :data:`~streamxm.defaults.EVAL_SHARE` of learning
        (:class:`~streamxm.learning.schedule.EvaluationSchedule`).
    eval_gallery
        Stored pairs each evaluated pair is ranked against.
    rolling_window
        Evaluated pairs per direction behind the rolling mAP.

    Examples
    --------
    >>> import numpy as np
    >>> from streamxm.stream.messages import make_pair
    >>> rng = np.random.default_rng(0)
    >>> learner = StreamLearner("cmos", img_dim=4, txt_dim=3)
    >>> pairs = [make_pair(str(i), rng.random(4), rng.random(3), labels=[i % 2]) for i in range(20)]
    >>> report = learner.learn(pairs)
    >>> learner.pairs_seen, report["pairs"]
    (20, 20)
    """

    def __init__(
        self,
        model: str,
        img_dim: int,
        txt_dim: int,
        params: dict[str, Any] | None = None,
        buffer_capacity: int = 500,
        seed: int = 0,
        buffer_memory: int | None = None,
        eval_every: EvalEvery = D.EVAL_EVERY,
        eval_gallery: int = 200,
        rolling_window: int = 500,
        max_labels: int = 64,
    ) -> None:
        self.model_name = model
        self.model: CrossModalModel = create_model(model, img_dim, txt_dim, params)
        if buffer_memory is None:
            buffer_memory = default_memory(self.model, buffer_capacity)
        self.buffer = ReplayBuffer(
            buffer_capacity + buffer_memory,
            img_dim,
            txt_dim,
            max_labels,
            memory=buffer_memory,
            seed=seed,
        )
        self.rng = np.random.default_rng(seed)
        self.seed = seed
        self.eval_gallery = eval_gallery
        self.schedule = EvaluationSchedule(eval_every, eval_gallery)
        self.pairs_evaluated = 0
        self.rolling_window = rolling_window
        self.stats = LearnStats()
        self.pairs_seen = 0
        self.pairs_unlabelled = 0
        self.pairs_in_burst = 0  # arrived while the buffer said the stream was bursty
        self.update_seconds = 0.0
        self.evaluation_seconds = 0.0  # of update_seconds: scoring before learning (derived)
        self.update_hist = [0] * len(UPDATE_BUCKETS)
        self.rolling_ap: dict[str, deque[float]] = {
            d: deque(maxlen=rolling_window) for d in DIRECTIONS
        }
        self.drift = DriftMonitor()
        self._eval_features = SlotFeatures()  # the evaluated stored pairs' features (derived)

    @property
    def eval_every(self) -> EvalEvery:
        return self.schedule.every

    @property
    def img_dim(self) -> int:
        return self.model.img_dim

    @property
    def txt_dim(self) -> int:
        return self.model.txt_dim

    def rolling_map(self) -> dict[str, float | None]:
        return {d: (float(np.mean(q)) if q else None) for d, q in self.rolling_ap.items()}

    def flush(self) -> None:
        """Apply whatever learning the model has deferred (see :meth:`CrossModalModel.flush`)."""
        self.model.flush(self.stats)

    def _evaluate_before_learning(self, pair: Example) -> None:
        self.flush()  # deferred learning: the learner's time, not the evaluation's
        start = time.perf_counter()
        self._score(pair)
        self.pairs_evaluated += 1
        self.schedule.scored(self.pairs_seen, self.model)
        self.evaluation_seconds += time.perf_counter() - start

    def _score(self, pair: Example) -> None:
        # The newest pairs of the ring: the memory holds copies of some of them.
        order = self.buffer.order()[self.buffer.stored :][-self.eval_gallery :]
        relevant = np.zeros(len(order) + 1, dtype=bool)
        relevant[0] = True
        if pair.labels:
            stored = self.buffer.labels[order]
            relevant[1:] = np.isin(stored, np.asarray(pair.labels)).any(axis=1)
        i2t, t2i = self.model.evaluation_scores(pair, self.buffer, order, self._eval_features)
        # Cross-check of the definition: see average_precision (ties keep gallery order).
        ap = average_precision(np.vstack([i2t, t2i]), np.vstack([relevant, relevant]))
        self.rolling_ap["i2t"].append(float(ap[0]))
        self.rolling_ap["t2i"].append(float(ap[1]))

    def learn(self, pairs: Sequence[Pair]) -> dict[str, Any]:
        """Test-then-train on each pair in order; return counts for this call.

        Raises :class:`LearnFailed` (the cause chained) if learning a pair raises.
        """
        before = LearnStats.from_dict(self.stats.as_dict())
        for index, pair in enumerate(pairs):
            if pair.img.shape[0] != self.img_dim or pair.txt.shape[0] != self.txt_dim:
                raise ValueError(f"pair {pair.id!r} has dimensions other than the learner's")
            start = time.perf_counter()
            example = example_of(pair)
            try:
                raise_point("learn", pair.id)
                if self.schedule.due(self.pairs_seen) and len(self.buffer) > 0:
                    self._evaluate_before_learning(example)
                self.buffer.add(example)
                self.pairs_in_burst += self.buffer.bursty()
                self.model.learn_one(example, self.buffer, self.rng, self.stats)
            except Exception as exc:  # any bug or MemoryError: the caller must know where
                raise LearnFailed(index, pair.id, exc) from exc
            self.drift.follow(
                sum(self.stats.mistakes.values()),
                sum(self.stats.triplets.values()),
                self.pairs_seen,
            )
            self.pairs_seen += 1
            self.pairs_unlabelled += not pair.labels
            elapsed = time.perf_counter() - start
            self.update_seconds += elapsed
            self.update_hist[bisect.bisect_left(UPDATE_BUCKETS, elapsed)] += 1
        return {
            "pairs": len(pairs),
            "triplets": {d: self.stats.triplets[d] - before.triplets[d] for d in DIRECTIONS},
            "mistakes": {d: self.stats.mistakes[d] - before.mistakes[d] for d in DIRECTIONS},
            "loss": {d: self.stats.loss[d] - before.loss[d] for d in DIRECTIONS},
        }

    def fit(self, pairs: Sequence[Pair]) -> None:
        """Batch training for models with a batch fit (the ``offline`` protocol); the pairs also
        fill the replay buffer, as a stream of them would."""
        examples = [example_of(pair) for pair in pairs]
        for example in examples:
            self.buffer.add(example)
        self.model.fit(examples, self.rng, self.stats)
        self.pairs_seen += len(pairs)
        self.pairs_unlabelled += sum(not p.labels for p in pairs)

    # -- state -------------------------------------------------------------------------------
    def state(self) -> tuple[dict[str, NDArray[Any]], dict[str, Any]]:
        model_arrays, model_meta = self.model.state()
        buffer_arrays, buffer_meta = self.buffer.state()
        arrays: dict[str, NDArray[Any]] = {f"model.{k}": v for k, v in model_arrays.items()}
        arrays.update({f"buffer.{k}": v for k, v in buffer_arrays.items()})
        for d in DIRECTIONS:
            arrays[f"rolling_ap.{d}"] = np.asarray(self.rolling_ap[d], dtype=np.float64)
        meta = {
            "model": self.model_name,
            "img_dim": self.img_dim,
            "txt_dim": self.txt_dim,
            "params": self.model.params(),
            "model_meta": model_meta,
            "buffer_meta": buffer_meta,
            "seed": self.seed,
            "rng": self.rng.bit_generator.state,
            "eval_every": self.schedule.every,
            "next_evaluation": self.schedule.next_at,
            "pairs_evaluated": self.pairs_evaluated,
            "eval_gallery": self.eval_gallery,
            "rolling_window": self.rolling_window,
            "stats": self.stats.as_dict(),
            "pairs_seen": self.pairs_seen,
            "pairs_unlabelled": self.pairs_unlabelled,
            "pairs_in_burst": self.pairs_in_burst,
            "update_seconds": self.update_seconds,
            "update_hist": self.update_hist,
            "drift": self.drift.state(),
        }
        return arrays, meta

    @classmethod
    def from_state(cls, arrays: dict[str, NDArray[Any]], meta: dict[str, Any]) -> StreamLearner:
        buffer_arrays = {k[7:]: v for k, v in arrays.items() if k.startswith("buffer.")}
        params = _checkpoint_params(meta)
        memory = int(meta["buffer_meta"].get("memory", 0))
        learner = cls(
            meta["model"],
            int(meta["img_dim"]),
            int(meta["txt_dim"]),
            params,
            buffer_capacity=int(meta["buffer_meta"]["capacity"]) - memory,
            seed=int(meta["seed"]),
            buffer_memory=memory,
            eval_every=_eval_every(meta["eval_every"]),
            eval_gallery=int(meta["eval_gallery"]),
            rolling_window=int(meta["rolling_window"]),
            max_labels=buffer_arrays["labels"].shape[1],
        )
        _load_model_state(learner.model, arrays, meta)
        learner.buffer = ReplayBuffer.from_state(buffer_arrays, meta["buffer_meta"])
        learner.rng.bit_generator.state = meta["rng"]
        for d in DIRECTIONS:
            learner.rolling_ap[d].extend(float(x) for x in arrays[f"rolling_ap.{d}"])
        learner.stats = LearnStats.from_dict(meta["stats"])
        learner.pairs_seen = int(meta["pairs_seen"])
        learner.pairs_unlabelled = int(meta["pairs_unlabelled"])
        learner.pairs_in_burst = int(meta.get("pairs_in_burst", 0))  # absent: written before
        learner.schedule.next_at = int(meta.get("next_evaluation", 0))
        learner.pairs_evaluated = int(meta.get("pairs_evaluated", 0))
        learner.update_seconds = float(meta["update_seconds"])
        learner.update_hist = [int(x) for x in meta["update_hist"]]
        if "drift" in meta:  # checkpoints written before drift detection have none
            learner.drift = DriftMonitor.from_state(meta["drift"])
        return learner


def _checkpoint_params(meta: dict[str, Any]) -> dict[str, Any]:
    """A checkpoint's model parameters, with the defaults of parameters added since it was
    written (their earlier behaviour)."""
    return {**model_class(meta["model"]).checkpoint_defaults, **meta["params"]}


def _load_model_state(
    model: CrossModalModel, arrays: dict[str, NDArray[Any]], meta: dict[str, Any]
) -> None:
    model.load_state(
        {k[6:]: v for k, v in arrays.items() if k.startswith("model.")}, meta["model_meta"]
    )


def model_from_state(arrays: dict[str, NDArray[Any]], meta: dict[str, Any]) -> CrossModalModel:
    """The model of a learner checkpoint with its deferred learning applied, ready to score:
    what :meth:`StreamLearner.from_state` followed by :meth:`StreamLearner.flush` holds as its
    ``model``, without the replay buffer, random generator and statistics around it."""
    model = create_model(
        meta["model"], int(meta["img_dim"]), int(meta["txt_dim"]), _checkpoint_params(meta)
    )
    _load_model_state(model, arrays, meta)
    model.flush(LearnStats.from_dict(meta["stats"]))
    return model
