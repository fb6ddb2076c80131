"""The pairwise classifier's choices beyond the paper: ``lr``, ``pos_weight`` and ``lam``
picked by the first pair's inputs (``"auto"``), the bipartite variant's class positives and
the one-sided terms held at zero."""

from typing import Any

import numpy as np
import pytest

from streamxm.learning.stream_learner import StreamLearner
from streamxm.models.base import LearnStats
from streamxm.models.moments import power_normalize
from streamxm.models.pairwise import PairwiseLogistic
from streamxm.stream.messages import Pair, make_pair
from tests.conftest import class_stream


def _signed(pairs: list[Pair]) -> list[Pair]:
    """The pairs shifted to signed coefficients of different scales."""
    scale_i, scale_t = np.linspace(0.5, 4.0, len(pairs[0].img)), np.linspace(3.0, 0.2, 4)
    return [
        make_pair(p.id, (p.img - 1.0) * scale_i, (p.txt - 1.0) * scale_t[: len(p.txt)], p.labels)
        for p in pairs
    ]


def _learned(name: str, pairs: list[Pair], params: dict[str, Any]) -> PairwiseLogistic:
    learner = StreamLearner(name, 6, 4, params, seed=2, eval_every=10**9)
    learner.learn(pairs)
    assert isinstance(learner.model, PairwiseLogistic)
    return learner.model


@pytest.mark.parametrize(
    ("signed", "inputs", "lr", "pos_weight", "lam"),
    [(False, "histogram", 0.01, 10.0, 0.08), (True, "signed", 0.03, 1.0, 0.02)],
)
def test_auto_picks_the_rule_from_the_first_pair_and_equals_it_given(
    signed: bool, inputs: str, lr: float, pos_weight: float, lam: float
) -> None:
    """``"auto"`` reads the first pair: no negative value is the histogram rule
    (``lr=0.01, pos_weight=10, lam=0.08``), else the signed rule; either way the weights are
    bit for bit those of the same numbers given."""
    pairs = class_stream(200, 6, 4, seed=5)
    pairs = _signed(pairs) if signed else pairs
    auto = _learned("pairwise", pairs, {})
    given = _learned("pairwise", pairs, {"lr": lr, "pos_weight": pos_weight, "lam": lam})
    assert auto.inputs_ == inputs
    assert (auto.step_size, auto.positive_weight, auto.l2) == (lr, pos_weight, lam)
    assert np.array_equal(auto.W, given.W) and np.array_equal(auto.G, given.G)


def test_given_numbers_override_auto_and_invalid_ones_raise() -> None:
    model = _learned("pairwise", _signed(class_stream(80, 6, 4, seed=5)), {"lr": 0.02})
    assert model.inputs_ == "signed" and model.step_size == 0.02 and model.positive_weight == 1.0
    with pytest.raises(ValueError, match="lr must be > 0"):
        PairwiseLogistic(3, 2, lr=0.0)
    with pytest.raises(ValueError, match="pos_weight must be > 0"):
        PairwiseLogistic(3, 2, pos_weight=-1.0)
    with pytest.raises(ValueError, match="lam must be >= 0"):
        PairwiseLogistic(3, 2, lam=-0.1)
    assert PairwiseLogistic(3, 2, lam=0.0).l2 == 0.0


def test_the_pick_is_checkpointed_and_old_checkpoints_keep_their_numbers() -> None:
    """A restored learner keeps ``"auto"``'s pick and continues bit for bit; a checkpoint
    written before ``"auto"`` holds ``lr`` and ``pos_weight`` as numbers and no pick."""
    pairs = _signed(class_stream(300, 6, 4, seed=8))
    a = StreamLearner("pairwise", 6, 4, {"whiten_first": 16}, seed=1, eval_every=10**9)
    a.learn(pairs[:130])
    arrays, meta = a.state()
    b = StreamLearner.from_state(arrays, meta)
    assert b.model.inputs_ == "signed"  # type: ignore[attr-defined]
    a.learn(pairs[130:])
    b.learn(pairs[130:])
    assert np.array_equal(a.model.W, b.model.W)  # type: ignore[attr-defined]
    old_params = {**meta["params"], "lr": 0.01, "pos_weight": 10.0}
    restored = StreamLearner.from_state(arrays, {**meta, "params": old_params})
    assert (restored.model.step_size, restored.model.positive_weight) == (0.01, 10.0)  # type: ignore[attr-defined]


def test_class_positives_is_its_docstring_and_off_is_the_former_rule() -> None:
    """With labels that agree, the loss is the mean of ``log(1 + exp(-(s(p) - s(n))))`` over
    every (agreeing, disagreeing) couple, the positive among the agreeing, and the gradient is
    its derivative; without one, and with ``class_positives=False``, it is Eq. 4.7's."""
    rng = np.random.default_rng(1)
    on = PairwiseLogistic(3, 2, variant="bipartite", negatives=4)
    off = PairwiseLogistic(3, 2, variant="bipartite", negatives=4, class_positives=False)
    on.W = off.W = rng.normal(size=on.W.shape).astype(np.float32)
    fx = rng.normal(size=(5, 4)).astype(np.float32)
    fy = rng.normal(size=(5, 3)).astype(np.float32)
    agree = np.array([False, True, False, True])
    formed = [(fx[0], fy[1]), (fx[2], fy[0]), (fx[0], fy[3]), (fx[4], fy[0])]

    def direct(w: np.ndarray) -> float:
        s = lambda a, b: float(a @ w @ b)  # noqa: E731
        above = [s(fx[0], fy[0])] + [s(a, b) for (a, b), g in zip(formed, agree, strict=True) if g]
        below = [s(a, b) for (a, b), g in zip(formed, agree, strict=True) if not g]
        return float(np.mean([np.log1p(np.exp(-(p - n))) for p in above for n in below]))

    w0 = on.W.astype(np.float64)
    loss, left, right, _ = on.loss_and_factors(fx, fy, agree)
    assert loss == pytest.approx(direct(w0), rel=1e-5)
    eps, numeric = 1e-4, np.zeros_like(w0)
    for idx in np.ndindex(*w0.shape):
        e = np.zeros_like(w0)
        e[idx] = eps
        numeric[idx] = (direct(w0 + e) - direct(w0 - e)) / (2 * eps)
    np.testing.assert_allclose(left.T @ right, numeric, rtol=1e-3, atol=1e-5)
    none = np.zeros(4, dtype=bool)
    pairs = zip(on.loss_and_factors(fx, fy, none), off.loss_and_factors(fx, fy, none), strict=True)
    for got, want in pairs:
        assert np.array_equal(got, want)  # no agreeing partner: Eq. 4.7 bit for bit


def test_class_positives_off_restores_the_former_rule_from_old_checkpoints() -> None:
    """Unlabelled, the two settings learn the same weights bit for bit; a checkpoint without
    the key restores with ``class_positives=False``, the rule it was written under."""
    pairs = class_stream(200, 6, 4, seed=3)
    stripped = [make_pair(p.id, p.img, p.txt) for p in pairs]
    on = _learned("pairwise:bipartite", stripped, {})
    off = _learned("pairwise:bipartite", stripped, {"class_positives": False})
    assert np.array_equal(on.W, off.W)
    assert not np.array_equal(
        _learned("pairwise:bipartite", pairs, {}).W,
        _learned("pairwise:bipartite", pairs, {"class_positives": False}).W,
    )
    learner = StreamLearner("pairwise:bipartite", 6, 4, seed=4, eval_every=10**9)
    learner.learn(pairs[:60])
    arrays, meta = learner.state()
    params = {k: v for k, v in meta["params"].items() if k != "class_positives"}
    restored = StreamLearner.from_state(arrays, {**meta, "params": params})
    assert restored.model.class_positives is False  # type: ignore[attr-defined]


def test_cross_only_is_the_former_step_then_the_projection() -> None:
    """A step with ``cross_only`` is the former step (``cross_only=False``) with the one-sided
    terms set back to zero; learned, only the intercept and the cross terms move; on by
    default, and a checkpoint without the key restores with it off (the rule it was written
    under)."""
    rng = np.random.default_rng(3)
    on = PairwiseLogistic(3, 2, negatives=4, cross_only=True)
    off = PairwiseLogistic(3, 2, negatives=4, cross_only=False)
    fx = rng.normal(size=(5, 4)).astype(np.float32)
    fy = rng.normal(size=(5, 3)).astype(np.float32)
    fx[:, -1] = fy[:, -1] = 1.0
    agree = np.array([False, True, False, False])
    stats = LearnStats()
    on.step(fx, fy, agree, stats)
    off.step(fx, fy, agree, stats)
    assert np.any(off.W[-1, :-1] != 0) and np.any(off.W[:-1, -1] != 0)
    projected = off.W.copy()
    projected[-1, :-1] = projected[:-1, -1] = 0.0
    assert np.array_equal(on.W, projected) and np.array_equal(on.G, off.G)
    assert PairwiseLogistic(3, 2, variant="bipartite").cross_only
    assert PairwiseLogistic(3, 2).cross_only
    learned = _learned("pairwise:bipartite", class_stream(120, 6, 4, seed=5), {"cross_only": True})
    assert not learned.W[-1, :-1].any() and not learned.W[:-1, -1].any()
    assert learned.W[-1, -1] != 0 and learned.W[:-1, :-1].any()
    learner = StreamLearner("pairwise", 6, 4, seed=4, eval_every=10**9)
    learner.learn(class_stream(60, 6, 4, seed=5))
    arrays, meta = learner.state()
    params = {k: v for k, v in meta["params"].items() if k != "cross_only"}
    restored = StreamLearner.from_state(arrays, {**meta, "params": params})
    assert restored.model.cross_only is False  # type: ignore[attr-defined]


def _last_refresh(model: PairwiseLogistic, pairs: list[Pair]) -> int:
    """The pair count at the whitener's last refresh: the prefix whose mean its mean is."""
    rows = power_normalize(np.stack([p.img for p in pairs]), model.power)
    means = np.cumsum(rows, axis=0) / np.arange(1, len(rows) + 1)[:, None]
    found = [n + 1 for n in range(len(rows)) if np.allclose(means[n], model.mean_x, atol=1e-12)]
    assert len(found) == 1
    return found[0]


def test_burst_whiten_every_refreshes_more_often_only_in_a_burst() -> None:
    """A mixed stream never bursts: ``burst_whiten_every`` leaves it bit for bit as without it.
    A class-ordered one bursts, and its whitener was last refreshed on the finer schedule
    (16, 32, then every 50) instead of the coarse one's 256; 0 is the coarse schedule alone,
    and a checkpoint without the key restores with 0."""
    base = {"whiten_first": 16, "whiten_every": 200}

    def learned(pairs: list[Pair], every: int) -> tuple[PairwiseLogistic, int]:
        params = {**base, "burst_whiten_every": every}
        learner = StreamLearner("pairwise", 6, 4, params, buffer_capacity=40, seed=2)
        learner.learn(pairs)
        assert isinstance(learner.model, PairwiseLogistic)
        return learner.model, learner.pairs_in_burst

    mixed = class_stream(400, 6, 4, seed=3)
    (on, bursts_on), (off, bursts_off) = learned(mixed, 50), learned(mixed, 0)
    assert bursts_on == bursts_off == 0 and np.array_equal(on.W, off.W)
    ordered = sorted(mixed, key=lambda p: p.labels[0])
    (on, bursts_on), (off, _) = learned(ordered, 50), learned(ordered, 0)
    assert bursts_on > 0
    assert _last_refresh(off, ordered) == 256
    assert _last_refresh(on, ordered) in range(264, 401, 50)
    learner = StreamLearner("pairwise", 6, 4, seed=4, eval_every=10**9)
    learner.learn(mixed[:60])
    arrays, meta = learner.state()
    params = {k: v for k, v in meta["params"].items() if k != "burst_whiten_every"}
    restored = StreamLearner.from_state(arrays, {**meta, "params": params})
    assert restored.model.burst_whiten_every == 0  # type: ignore[attr-defined]
    with pytest.raises(ValueError, match="burst_whiten_every must be >= 0"):
        PairwiseLogistic(3, 2, burst_whiten_every=-1)
