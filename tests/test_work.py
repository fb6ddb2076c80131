"""The work each model counts (streamxm/models/work.py) and the rolling evaluation's schedule
sized from it (streamxm/learning/schedule.py)."""

from __future__ import annotations

import numpy as np
import pytest

from streamxm.learning.schedule import REFERENCE_RATES, evaluation_interval
from streamxm.learning.stream_learner import StreamLearner
from streamxm.models import MODEL_NAMES, create_model
from streamxm.models.cmos import CMOS
from streamxm.models.cmos_updates import add_outer_products
from streamxm.models.work import Rates, Work, gemm, matvec, rank_update
from tests.conftest import class_stream


def test_work_adds_scales_and_takes_the_slower_of_arithmetic_and_traffic() -> None:
    product = gemm(2, 3, 4)
    assert product == Work(flops=48.0, bytes=8.0 * (8 + 12 + 6))
    assert matvec(5, 7, 4) == Work(70.0, 4.0 * (35 + 7 + 5), 70.0)
    assert rank_update(2, 3, 1) == gemm(2, 3, 1) + Work(6.0, 96.0)
    assert (product + product) == product * 2 == 2 * product
    rates = Rates(flops_per_s=10.0, bytes_per_s=100.0, flops32_per_s=40.0)
    assert Work(flops=50.0, bytes=100.0).seconds(rates) == 5.0
    assert Work(flops=40.0, bytes=100.0, flops32=40.0).seconds(rates) == 1.0
    assert Work(flops=1.0, bytes=1000.0).seconds(rates) == 10.0


@pytest.mark.parametrize("model", MODEL_NAMES)
@pytest.mark.parametrize("dims", [(4096, 1000), (512, 512)])
def test_every_model_counts_its_learning_and_evaluation_work(
    model: str, dims: tuple[int, int]
) -> None:
    m = create_model(model, *dims)
    learning, evaluation = m.learning_work(), m.evaluation_work(200)
    assert learning is not None and evaluation is not None
    for work in (learning, evaluation):
        assert work.flops > 0 and work.bytes > 0 and 0 <= work.flops32 <= work.flops
    # Larger inputs cost more to learn from and to score.
    small = create_model(model, dims[0] // 4, dims[1] // 4)
    assert small.learning_work().flops < learning.flops  # type: ignore[union-attr]
    assert small.evaluation_work(200).flops < evaluation.flops  # type: ignore[union-attr]
    assert evaluation_interval(m, 200) >= 1


def test_cmos_counts_a_flush_per_flush_every_triplets() -> None:
    m = CMOS(300, 200, triplets_per_pair=4, flush_every=64)
    flush = (
        gemm(64, 200, 300, 4) + gemm(64, 64, 300) + gemm(64, 64, 200) + rank_update(300, 200, 64, 4)
    )
    assert m.learning_work() == flush * (4 / 64)


def test_auto_counts_the_kept_features_of_the_pairs_stored_between_evaluations() -> None:
    """sdsrl's kept features (a kernel row a stored pair) cost more than the evaluation's share
    of a pair's learning: evaluating every pair would spend them on every pair, so the
    interval passes the gallery, whose features are then computed once an evaluation. The
    interval is the least that keeps the share."""
    model = create_model("sdsrl", 4096, 1000)
    learning = model.learning_work().seconds(REFERENCE_RATES)  # type: ignore[union-attr]
    scoring = model.evaluation_work(200).seconds(REFERENCE_RATES)  # type: ignore[union-attr]

    def share(n: int) -> float:
        kept = model.kept_feature_work(min(n, 200)).seconds(REFERENCE_RATES)
        return (scoring + kept) / (n * learning)

    assert model.kept_feature_work(1).seconds(REFERENCE_RATES) > 0.05 * learning
    interval = evaluation_interval(model, 200)
    assert interval > 200
    assert share(interval) <= 0.05 < share(interval - 1)


def test_auto_evaluates_a_subsample_sized_from_the_counted_work() -> None:
    """``eval_every="auto"``: after each scored pair the next is the interval of the counted
    work on; a learner restored half-way scores the same pairs with the same results."""
    model = create_model("cmos", 64, 32)
    interval = evaluation_interval(model, 200)
    ratio = model.evaluation_work(200).seconds(REFERENCE_RATES) / (  # type: ignore[union-attr]
        0.05 * model.learning_work().seconds(REFERENCE_RATES)
    )  # type: ignore[union-attr]
    assert interval == int(np.ceil(ratio)) and interval > 1
    assert evaluation_interval(model, 200, share=1.0) < interval
    pairs = class_stream(5 * interval + 2, 64, 32, seed=0)
    whole = StreamLearner("cmos", 64, 32, eval_every="auto")
    whole.learn(pairs)
    # Pair 0 finds the buffer empty; then pairs 1, 1 + N, ..., 1 + 5N.
    assert whole.pairs_evaluated == len(whole.rolling_ap["i2t"]) == 6
    half = StreamLearner("cmos", 64, 32, eval_every="auto")
    half.learn(pairs[: 2 * interval])
    restored = StreamLearner.from_state(*half.state())
    restored.learn(pairs[2 * interval :])
    assert restored.eval_every == "auto" and restored.pairs_evaluated == 6
    assert list(restored.rolling_ap["i2t"]) == list(whole.rolling_ap["i2t"])


@pytest.mark.parametrize("bad", [0, -3, "sometimes", 2.5, True])
def test_a_bad_schedule_is_refused(bad: object) -> None:
    with pytest.raises(ValueError, match="eval_every must be"):
        StreamLearner("cmos", 8, 4, eval_every=bad)  # type: ignore[arg-type]


def test_the_in_place_merge_is_the_product_plus_the_add_bit_for_bit() -> None:
    rng = np.random.default_rng(0)
    m = CMOS(300, 200)
    m.W[:] = rng.standard_normal(m.W.shape).astype(np.float32)
    left = rng.standard_normal((20, 300)).astype(np.float32)
    right = rng.standard_normal((20, 200)).astype(np.float32)
    tau = rng.random(20)
    expected = m.W + (left.T * tau.astype(np.float32)) @ right
    add_outer_products(m.W, left, tau, right)  # CMOS's merge of a flush into W
    assert np.array_equal(m.W, expected)


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
def test_the_compiled_adagrad_pass_is_the_whole_array_form_bit_for_bit(dtype: type) -> None:
    from streamxm.models.optim import _adagrad_arrays, adagrad_step

    rng = np.random.default_rng(0)
    w = rng.standard_normal((37, 11)).astype(dtype)
    sq = rng.random((37, 11)).astype(dtype)
    grad = rng.standard_normal((37, 11)).astype(dtype)
    w2, sq2 = w.copy(), sq.copy()
    for _ in range(3):
        adagrad_step(w, sq, grad, 0.05, 1e-3)
        _adagrad_arrays(w2, sq2, grad, 0.05, 1e-3)
    assert np.array_equal(w, w2) and np.array_equal(sq, sq2)
    # A gradient of another dtype takes the whole-array path, cast as numpy casts it.
    w3, sq3 = w.copy(), sq.copy()
    adagrad_step(w3, sq3, grad.astype(np.float16), 0.05, 1e-3)
    _adagrad_arrays(w, sq, grad.astype(np.float16), 0.05, 1e-3)
    assert np.array_equal(w3, w)


def test_the_outer_adagrad_step_is_the_dense_step_on_left_t_right() -> None:
    """The gradient formed inside the pass is ``left^T right``: the same step as the dense
    one to float32 rounding (the sums run in another order than BLAS's), and a bad shape or
    dtype is refused rather than read out of bounds."""
    from streamxm.models.optim import adagrad_outer_step, adagrad_step

    rng = np.random.default_rng(1)
    w = rng.standard_normal((41, 23)).astype(np.float32)
    sq = rng.random((41, 23)).astype(np.float32)
    left = rng.standard_normal((11, 41)).astype(np.float32)
    right = rng.standard_normal((11, 23)).astype(np.float32)
    w2, sq2 = w.copy(), sq.copy()
    for _ in range(3):
        adagrad_outer_step(w, sq, left, right, 0.05, 1e-3)
        adagrad_step(w2, sq2, left.T @ right, 0.05, 1e-3)
    np.testing.assert_allclose(w, w2, rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(sq, sq2, rtol=1e-5)
    adagrad_outer_step(w, sq, left[:0], right[:0], 0.05, 1e-3)  # rank 0: the l2 step alone
    adagrad_step(w2, sq2, np.zeros_like(w2), 0.05, 1e-3)
    np.testing.assert_allclose(w, w2, rtol=1e-5, atol=1e-6)
    with pytest.raises(ValueError, match="shapes"):
        adagrad_outer_step(w, sq, left[:, :40], right, 0.05, 1e-3)
    with pytest.raises(TypeError, match="float32"):
        adagrad_outer_step(w, sq, left.astype(np.float64), right, 0.05, 1e-3)


def test_timing_whole_periods_from_the_start_times_each_periodic_solve_once() -> None:
    """``periodic_work``: from ``start`` on, every ``period`` pairs hold exactly one re-solve
    (cca), so a benchmark timing whole periods times what ``learning_work`` spreads."""
    learner = StreamLearner("cca", 12, 6, {"solve_first": 8, "solve_every": 20}, eval_every=10**9)
    start, period = learner.model.periodic_work()
    assert (start, period) == (32, 20)
    pairs = class_stream(start + 3 * period, 12, 6, seed=0)
    learner.learn(pairs[:start])
    solves = learner.model.solves  # type: ignore[attr-defined]
    for k in range(3):
        learner.learn(pairs[start + k * period : start + (k + 1) * period])
        assert learner.model.solves == solves + k + 1  # type: ignore[attr-defined]
    windowed = create_model("scsm", 12, 6, {"window": 100, "solve_first": 8, "solve_every": 30})
    start, period = windowed.periodic_work()
    assert start >= 100 and period == 30 and (start - 32) % 30 == 0
