"""``streamxm bench throughput``: pairs learned per second on one core, beside the machine's limit.

The learner is timed on synthetic pairs of the requested sizes through
:meth:`StreamLearner.learn`, the code the worker runs (replay buffer, triplet sampling,
updates), with the rolling evaluation off.

Beside every model's figure stands its *roofline*: the work the model counts per pair
(:meth:`~streamxm.models.opt_in.CountsWork.learning_work`: floating-point operations, the
float32 share of them, bytes of state moved; periodic solves spread over their period), the
time that work needs at this thread's rates measured in the same run (float64 and float32
GEMM, a streaming read of a matrix the size of the model's state), and the measured time's
ratio to it. The timed
pairs start once the model's periodic work is periodic (past its doubling re-solves, its
window or landmark pool: :meth:`~streamxm.models.opt_in.CountsWork.periodic_work`) and
span whole periods, so each re-solve is timed as often as the count spreads it.

For CMOS, the work per triplet that no implementation can avoid is one
matrix-vector product with ``W`` (the margin ``a^T W b``); the *limit* is the time BLAS takes for
those products, one per triplet, measured on the same ``W`` in the same run. The *baseline* is the
same pipeline with the paper's loop transcribed literally (``solver="paper"``). Everything runs
under a one-thread BLAS limit. Each figure is the median of ``repeats`` runs.

With ``order="class"`` the same pairs arrive one class at a time, as a topic burst does: the
models that draw from the buffer's memory and rehearse during a burst do more work per pair
then, and the figure is set beside the same stream in its own (mixed) order, timed in the same
run, repeat by repeat (each order has its own warm-up: the timed pairs are the same number, not
the same pairs).
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable
from typing import Any, NamedTuple

import numpy as np
from threadpoolctl import threadpool_limits

from streamxm.learning.schedule import EvalEvery, evaluation_interval
from streamxm.learning.stream_learner import StreamLearner
from streamxm.models import CrossModalModel, create_model, split_name
from streamxm.models.opt_in import counted
from streamxm.models.work import Rates
from streamxm.stream.messages import Pair
from streamxm.tools.datasets import stream_order, synthetic_pairs

__all__ = ["throughput"]


def _median_seconds(run: Callable[[], float], repeats: int) -> float:
    return statistics.median(run() for _ in range(repeats))


class _Timed(NamedTuple):
    seconds: float  # per timed pair
    learner: StreamLearner
    in_burst: int  # timed pairs that arrived in a burst
    evaluated: int  # timed pairs the rolling evaluation scored
    evaluation_seconds: float  # per timed pair, spent scoring them


def _time_learning(
    model: str,
    pairs: list[Pair],
    warmup: int,
    params: dict[str, Any],
    seed: int,
    eval_every: EvalEvery | None = None,
) -> _Timed:
    """Time ``pairs[warmup:]`` (the buffer fills during the warm-up); ``eval_every``: the
    rolling evaluation's schedule (None: off)."""
    img_dim, txt_dim = pairs[0].img.shape[0], pairs[0].txt.shape[0]
    learner = StreamLearner(
        model, img_dim, txt_dim, params, seed=seed, eval_every=eval_every or len(pairs) + 1
    )
    learner.learn(pairs[:warmup])
    learner.flush()
    in_burst, evaluated = learner.pairs_in_burst, learner.pairs_evaluated
    scoring = learner.evaluation_seconds
    start = time.perf_counter()
    for i in range(warmup, len(pairs), 256):
        learner.learn(pairs[i : i + 256])
    learner.flush()
    timed = len(pairs) - warmup
    seconds = (time.perf_counter() - start) / timed
    return _Timed(
        seconds,
        learner,
        learner.pairs_in_burst - in_burst,
        learner.pairs_evaluated - evaluated,
        (learner.evaluation_seconds - scoring) / timed,
    )


def _matvec_seconds(W: np.ndarray[Any, Any], calls: int, seed: int) -> float:
    """Seconds for one ``W @ x`` plus one ``y @ W`` (the two directions), BLAS."""
    rng = np.random.default_rng(seed)
    xs = rng.random((calls, W.shape[1]), dtype=np.float32).astype(W.dtype)
    ys = rng.random((calls, W.shape[0]), dtype=np.float32).astype(W.dtype)
    start = time.perf_counter()
    for x, y in zip(xs, ys, strict=True):
        W @ x
        y @ W
    return (time.perf_counter() - start) / calls


#: The rolling evaluation's gallery: the learner's default.
_EVAL_GALLERY = 200

#: The smallest and largest matrix the streaming read is timed on (bytes): 16 MB is
#: :func:`_machine_rates`' reference, which a large last-level cache holds; 1 GB is past any.
_READ_BYTES = (16 << 20, 1 << 30)


def _read_rate(nbytes: int, seed: int, repeats: int) -> float:
    """Bytes per second of a streaming read (``W @ x`` and ``y @ W``, float32, 1,024 columns)
    over a matrix of ``nbytes`` (clipped to :data:`_READ_BYTES`)."""
    nbytes = min(max(nbytes, _READ_BYTES[0]), _READ_BYTES[1])
    W = np.random.default_rng(seed).random((nbytes // 4096, 1024), dtype=np.float32)
    calls = max(2, min(20, (64 << 20) // W.nbytes * 4))
    return W.nbytes / (_median_seconds(lambda: _matvec_seconds(W, calls, seed), repeats) / 2)


def _machine_rates(seed: int, repeats: int, state_bytes: int) -> tuple[Rates, float]:
    """This thread's rates, each the median of ``repeats``: float64 and float32 GEMM
    (``512 x 1024`` by ``1024 x 1024``) and a streaming read over a matrix the size of the
    model's state (``state_bytes``), which sets the roofline's memory rate; and apart the
    read rate over 16 MB, a size the last-level cache may hold.

    A model whose state outgrows the cache streams it from memory at every pass, slower than
    a cached matrix is read, so the cached rate would set a roof no model of that size can
    reach; one whose state fits is read at the cached rate, as its roof says."""
    rng = np.random.default_rng(seed)

    def gemm_rate(dtype: type[np.floating[Any]]) -> float:
        a, b = rng.random((512, 1024)).astype(dtype), rng.random((1024, 1024)).astype(dtype)
        a @ b  # warm

        def once() -> float:
            start = time.perf_counter()
            a @ b
            return time.perf_counter() - start

        return 2.0 * 512 * 1024 * 1024 / _median_seconds(once, repeats * 3)

    rates = Rates(
        flops_per_s=gemm_rate(np.float64),
        bytes_per_s=_read_rate(state_bytes, seed, repeats),
        flops32_per_s=gemm_rate(np.float32),
    )
    return rates, _read_rate(_READ_BYTES[0], seed, repeats)


def _state_bytes(model: Any) -> int:
    """The bytes of the arrays a model checkpoints: its state's size in memory."""
    arrays, _ = model.state()
    return int(sum(np.asarray(a).nbytes for a in arrays.values()))


def _roofline(timed: _Timed, pairs: int, rates: Rates) -> dict[str, Any]:
    """The model's counted work per pair (its evaluation's share over the ``pairs`` timed
    included, with the kept features of the pairs stored between two evaluations), the time
    it needs at ``rates`` and the measured time's ratio to it."""
    counting = counted(timed.learner.model)
    if counting is None:
        return {}
    work = counting.learning_work()
    evaluation = counting.evaluation_work(timed.learner.eval_gallery)
    if work is None or evaluation is None:
        return {}
    if timed.evaluated:  # each evaluation also computes the kept features of the new pairs
        stale = min(round(pairs / timed.evaluated), timed.learner.eval_gallery)
        evaluation = evaluation + counting.kept_feature_work(stale)
    work = work + evaluation * (timed.evaluated / pairs)
    per_pair = timed.seconds
    roof = work.seconds(rates)
    arithmetic = work.seconds(Rates(rates.flops_per_s, float("inf"), rates.flops32_per_s))
    return {
        "work_per_pair": work.as_dict(),
        "roofline_pairs_per_s": round(1 / roof, 1),
        "roofline_bound": "arithmetic" if arithmetic >= roof else "memory",
        "ratio_to_roofline": round(roof / per_pair, 3),
    }


def throughput(
    model: str = "cmos",
    img_dim: int = 4096,
    txt_dim: int = 1000,
    pairs: int = 2000,
    baseline_pairs: int = 200,
    warmup: int | None = None,
    repeats: int = 3,
    params: dict[str, Any] | None = None,
    seed: int = 0,
    order: str = "file",
    eval_every: EvalEvery | None = None,
) -> dict[str, Any]:
    """Measure the learner, the BLAS limit and (for CMOS) the literal baseline; return JSON.

    ``eval_every``: time the learner with the worker's rolling evaluation scoring every
    ``eval_every``-th pair (``"auto"``, the service's default: sized from the counted work;
    ``pairs`` then spans at least two intervals), and beside it, in the same repeat, the
    same stream with the evaluation off (``learning_only_pairs_per_s``); and
    ``evaluation_share``, the share of the learner's time spent scoring, timed inside the same
    run (the median over repeats; two runs' difference would carry the machine's drift
    between them).

    For CMOS the default is ``triplets_per_pair=2`` (one triplet per direction, so the limit is
    two matrix-vector products per pair) and, in file order, ``replay=0`` (a
    replayed query would be a third; CMOS replays only in bursts anyway); pass ``params`` to
    change them. The buffer is the model's default: its
    memory of the whole history is drawn from during bursts of few classes only, and the
    benchmark's stream has none.
    The untimed warm-up fills the replay buffer (100 pairs; with another ``order``, its whole
    ring of 500, the learner's default, so that a burst draws from the memory), for CMOMKS its
    landmark pool and support budget, and for a model with periodic work the pairs until it
    is periodic; ``pairs`` is rounded up to whole periods. So the figure is the steady state.
    With another ``order`` (``class``: :func:`~streamxm.tools.datasets.stream_order`) the
    pairs arrive in it, and the same stream in its own order is timed beside it in each
    repeat, after its own warm-up of as many pairs (``file_order_pairs_per_s``, ``slowdown``:
    the ratio of the medians); ``timed_pairs_in_burst`` counts the timed pairs that arrived
    in a burst.
    """
    base, _ = split_name(model)
    params = _with_cmos_defaults(base, params, order)
    probe = create_model(model, img_dim, txt_dim, params)
    pairs, warmup = _timed_span(probe, base, pairs, warmup, order, eval_every)
    data = synthetic_pairs(warmup + pairs, img_dim, txt_dim, seed=seed)
    ordered = [data[i] for i in stream_order(np.array([p.labels[0] for p in data]), order, seed)]
    result: dict[str, Any] = {
        "model": model,
        "img_dim": img_dim,
        "txt_dim": txt_dim,
        "pairs": pairs,
        "warmup_pairs": warmup,
        "repeats": repeats,
        "threads": 1,
        "order": order,
        "eval_every": eval_every,
    }
    with threadpool_limits(limits=1):
        timed = _time_repeats(
            model, data, ordered, warmup, params, seed, order, eval_every, repeats
        )
        learner = timed.learned[-1].learner
        machine, rates = _machine_figures(learner, seed, repeats)
        result.update(_learner_figures(timed, pairs, machine, rates))
        result.update(_timed_beside(timed))
        if base == "cmos":
            base_data = ordered[: warmup + baseline_pairs]  # the same stream, paper loop
            result.update(
                _cmos_limit(
                    model, learner, base_data, warmup, params, seed, repeats, timed.per_pair
                )
            )
    return result


def _with_cmos_defaults(base: str, params: dict[str, Any] | None, order: str) -> dict[str, Any]:
    """``params`` with CMOS's benchmark defaults (:func:`throughput`) where they are unset."""
    params = dict(params or {})
    if base == "cmos":
        params.setdefault("triplets_per_pair", 2)
        if order == "file":  # no burst: replay=0 is the default's work; in bursts it is not
            params.setdefault("replay", 0)
    return params


def _timed_span(
    probe: CrossModalModel,
    base: str,
    pairs: int,
    warmup: int | None,
    order: str,
    eval_every: EvalEvery | None,
) -> tuple[int, int]:
    """The timed pairs (whole periods of the model's periodic work; with the evaluation, at
    least two of its intervals) and the untimed warm-up before them (:func:`throughput`)."""
    counting = counted(probe)
    start, period = counting.periodic_work() if counting is not None else (0, 1)
    if eval_every is not None:  # at least two evaluations timed: their share is measured
        interval = evaluation_interval(probe, _EVAL_GALLERY) if eval_every == "auto" else eval_every
        pairs = max(pairs, 2 * interval)
    pairs = -(-pairs // period) * period  # whole periods: each periodic solve timed once
    if warmup is None:
        warmup = 100 if order == "file" else 500
        if base == "cmomks":
            settings = probe.params()
            warmup += settings["landmarks"] + -(
                -settings["budget"] // settings["triplets_per_pair"]
            )
        if start > warmup:  # steady: the doubling solves and the model's own fill are past
            warmup = start
    return pairs, warmup


class _Repeats(NamedTuple):
    per_pair: float  # the median seconds per pair of the learner as asked
    learned: list[_Timed]  # each repeat's learner as asked
    file_order: list[float]  # per pair, the same stream in its own order (another order)
    learning_only: list[float]  # per pair, the evaluation off (with the evaluation)


def _time_repeats(
    model: str,
    data: list[Pair],
    ordered: list[Pair],
    warmup: int,
    params: dict[str, Any],
    seed: int,
    order: str,
    eval_every: EvalEvery | None,
    repeats: int,
) -> _Repeats:
    """Each repeat times the learner on ``ordered`` (``data`` in ``order``) and, in the same
    repeat, its references: ``data`` in its own order when ``order`` is another, the
    evaluation off when it is on."""
    learned: list[_Timed] = []
    file_order: list[float] = []
    learning_only: list[float] = []

    def run_learner() -> float:
        if order != "file":  # the reference, in the same repeat
            file_order.append(_time_learning(model, data, warmup, params, seed, eval_every)[0])
        if eval_every:
            learning_only.append(_time_learning(model, ordered, warmup, params, seed)[0])
        timed = _time_learning(model, ordered, warmup, params, seed, eval_every)
        learned.append(timed)
        return timed.seconds

    per_pair = _median_seconds(run_learner, repeats)
    return _Repeats(per_pair, learned, file_order, learning_only)


def _machine_figures(
    learner: StreamLearner, seed: int, repeats: int
) -> tuple[dict[str, Any], Rates]:
    """The machine's rates (:func:`_machine_rates`) as the JSON reports them, and as rates."""
    state_bytes = _state_bytes(learner.model)
    rates, cached_read = _machine_rates(seed, repeats, state_bytes)
    return {
        "gemm_float64_flops_per_s": round(rates.flops_per_s),
        "gemm_float32_flops_per_s": round(rates.flops32_per_s or 0),
        "read_bytes_per_s": round(rates.bytes_per_s),
        "read_bytes_per_s_16mb": round(cached_read),
        "state_bytes": state_bytes,
    }, rates


def _learner_figures(
    timed: _Repeats, pairs: int, machine: dict[str, Any], rates: Rates
) -> dict[str, Any]:
    """The learner's figures: its rate (the median repeat's), the last repeat's counts, the
    ``machine`` it ran on and its roofline at the machine's ``rates``."""
    last = timed.learned[-1]
    return {
        "params": last.learner.model.params(),
        "pairs_per_s": round(1 / timed.per_pair, 1),
        "seconds_per_pair": timed.per_pair,
        "timed_pairs_in_burst": last.in_burst,
        "evaluated_every": (round(pairs / last.evaluated, 1) if last.evaluated else None),
        "machine": machine,
        **_roofline(last._replace(seconds=timed.per_pair), pairs, rates),
    }


def _timed_beside(timed: _Repeats) -> dict[str, Any]:
    """The references timed beside the learner: learning alone (its evaluation's share of the
    time) and the same stream in its own order (the slowdown of the order asked)."""
    figures: dict[str, Any] = {}
    if timed.learning_only:
        alone = statistics.median(timed.learning_only)
        share = statistics.median(t.evaluation_seconds / t.seconds for t in timed.learned)
        figures.update(
            learning_only_pairs_per_s=round(1 / alone, 1), evaluation_share=round(share, 3)
        )
    if timed.file_order:
        reference = statistics.median(timed.file_order)
        figures.update(
            file_order_pairs_per_s=round(1 / reference, 1),
            slowdown=round(timed.per_pair / reference, 2),
        )
    return figures


def _cmos_limit(
    model: str,
    learner: StreamLearner,
    base_data: list[Pair],
    warmup: int,
    params: dict[str, Any],
    seed: int,
    repeats: int,
    per_pair: float,
) -> dict[str, Any]:
    """CMOS's learner beside its limit (BLAS matrix-vector products with its own ``W``, one per
    triplet) and beside the paper's loop on ``base_data`` (the same stream, shorter)."""
    triplets = sum(learner.stats.triplets.values()) / learner.pairs_seen
    W = learner.model.W  # type: ignore[attr-defined]
    matvec = _median_seconds(lambda: _matvec_seconds(W, 200, seed), repeats)
    # One product per triplet; a pair of directions is one W @ x plus one y @ W.
    limit_per_pair = matvec / 2 * triplets
    paper_params = {**params, "solver": "paper"}
    baseline = _median_seconds(
        lambda: _time_learning(model, base_data, warmup, paper_params, seed)[0], repeats
    )
    return {
        "triplets_per_pair": round(triplets, 3),
        "limit_pairs_per_s": round(1 / limit_per_pair, 1),
        "ratio_to_limit": round(limit_per_pair / per_pair, 3),
        "baseline_pairs_per_s": round(1 / baseline, 1),
        "baseline_ratio_to_limit": round(limit_per_pair / baseline, 3),
        "speedup_over_baseline": round(baseline / per_pair, 2),
    }
