"""CMOS against a direct transcription of the paper's equations."""

import numpy as np
import pytest

from streamxm.datasets import iter_pairs, load_dataset
from streamxm.learner import Learner
from streamxm.messages import make_pair
from streamxm.models.base import LearnStats
from streamxm.models.cmos import CMOS
from tests.conftest import SHARED_WIKI


def transcription(triplets: list[tuple[str, np.ndarray, np.ndarray, np.ndarray]], dv: int,
                  dt: int, C: float) -> tuple[np.ndarray, list[float]]:
    """Eq. 6/7 as written: l = max(0, 1 - s(q,p) + s(q,n)), tau = min(C, l/||V||^2), W += tau V."""
    W = np.zeros((dv, dt))
    taus = []
    for kind, q, p, n in triplets:
        if kind == "image":
            V = np.outer(q, p - n)
            loss = max(0.0, 1 - q @ W @ p + q @ W @ n)
        else:
            V = np.outer(p - n, q)
            loss = max(0.0, 1 - p @ W @ q + n @ W @ q)
        tau = min(C, loss / np.sum(V * V))
        W = W + tau * V
        taus.append(tau)
    return W, taus


def test_updates_match_the_equations_on_random_data() -> None:
    rng = np.random.default_rng(1)
    dv, dt = 12, 7
    model = CMOS(dv, dt, C=0.3, normalize="none", center=False)
    triplets = []
    stats = LearnStats()
    for k in range(500):
        kind = "image" if k % 2 == 0 else "text"
        if kind == "image":
            q, p, n = rng.normal(size=dv), rng.normal(size=dt), rng.normal(size=dt)
            model.update_image(q, p, n, stats)
        else:
            q, p, n = rng.normal(size=dt), rng.normal(size=dv), rng.normal(size=dv)
            model.update_text(q, p, n, stats)
        triplets.append((kind, q, p, n))
    W, _ = transcription(triplets, dv, dt, C=0.3)
    np.testing.assert_allclose(model.W, W, rtol=0, atol=1e-6)
    assert stats.triplets == {"i2t": 250, "t2i": 250}
    assert 0 < stats.mistakes["i2t"] < 250


def test_mistake_means_positive_not_above_negative_before_update() -> None:
    model = CMOS(2, 2, normalize="none", center=False)
    stats = LearnStats()
    # W = 0: every score is 0, so the first triplet is a mistake (0 - 0 <= 0).
    model.update_image(np.array([1.0, 0]), np.array([1.0, 0]), np.array([0, 1.0]), stats)
    assert stats.mistakes["i2t"] == 1
    # Now s(v, t+) - s(v, t-) = 2 * tau > 0: not a mistake, loss 1 - 2C.
    model.update_image(np.array([1.0, 0]), np.array([1.0, 0]), np.array([0, 1.0]), stats)
    assert stats.mistakes["i2t"] == 1
    assert stats.loss["i2t"] == pytest.approx(1.0 + (1 - 2 * 0.05))


def test_learning_does_not_depend_on_batch_boundaries() -> None:
    rng = np.random.default_rng(3)
    pairs = [make_pair(str(i), rng.random(6), rng.random(4), labels=[int(rng.integers(3))])
             for i in range(300)]
    one = Learner("cmos", 6, 4, seed=7)
    one.learn(pairs)
    many = Learner("cmos", 6, 4, seed=7)
    for i in range(0, 300, 17):
        many.learn(pairs[i : i + 17])
    assert np.array_equal(one.model.W, many.model.W)  # type: ignore[attr-defined]
    assert one.rolling_map() == many.rolling_map()


def test_state_round_trip_continues_identically() -> None:
    rng = np.random.default_rng(4)
    pairs = [make_pair(str(i), rng.random(6), rng.random(4), labels=[int(rng.integers(3))])
             for i in range(200)]
    a = Learner("cmos", 6, 4, seed=1)
    a.learn(pairs[:120])
    b = Learner.from_state(*a.state())
    a.learn(pairs[120:])
    b.learn(pairs[120:])
    assert np.array_equal(a.model.W, b.model.W)  # type: ignore[attr-defined]
    assert a.stats.as_dict() == b.stats.as_dict()


def test_unlabelled_pairs_use_their_own_partner_as_positive() -> None:
    rng = np.random.default_rng(5)
    learner = Learner("cmos", 5, 3, seed=0)
    learner.learn([make_pair(str(i), rng.random(5), rng.random(3)) for i in range(50)])
    assert learner.pairs_unlabelled == 50
    assert learner.stats.triplets["i2t"] > 0


@pytest.mark.skipif(not SHARED_WIKI.exists(), reason="../shared/datasets not present")
def test_one_pass_over_wikipedia_learns_something() -> None:
    ds = load_dataset(SHARED_WIKI)
    learner = Learner("cmos", 128, 10)
    learner.learn(list(iter_pairs(ds, limit=600)))
    rm = learner.rolling_map()
    # Chance level on 10 classes is about 0.1; the rolling mAP must be clearly above it.
    assert rm["i2t"] is not None and rm["i2t"] > 0.18
    assert rm["t2i"] is not None and rm["t2i"] > 0.18
