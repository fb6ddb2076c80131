"""CMOMKS's support eviction: the class-balanced rule, and the paper's ring one parameter away."""

import numpy as np

from streamxm.learning.stream_learner import StreamLearner
from streamxm.models.base import LearnStats
from streamxm.models.cmomks import CMOMKS
from streamxm.stream.messages import make_pair
from tests.conftest import assert_same_scores, class_stream

KERNELS = [{"img_gamma": 0.5, "txt_gamma": 0.5}, {"img_gamma": 4.0, "txt_gamma": 2.0}]
#: The paper's pool, the stream's first pairs: no class capped.
PAPERS_POOL = {"pool_class_cap": 1.0, "pool_burst_cap": 1.0}


def _closed_model(balanced: bool) -> CMOMKS:
    """A model of budget 6 whose landmark pool is closed, with a margin every triplet misses."""
    model = CMOMKS(6, 4, kernels=KERNELS, landmarks=8, budget=6, margin=1e3)
    model.balanced_support = balanced
    rng = np.random.default_rng(0)
    for _ in range(8):
        model.img_side.add_to_pool(rng.random(6))
        model.txt_side.add_to_pool(rng.random(4))
    model.img_side.close_pool()
    model.txt_side.close_pool()
    return model


def _store(model: CMOMKS, groups: list[int], seed: int = 1) -> list[int]:
    """Learn one random triplet per group; return the slot each was stored at."""
    rng = np.random.default_rng(seed)
    slots = []
    for i, group in enumerate(groups):
        size = model.support_size
        img, txt = rng.random((2, 6)).astype(np.float32), rng.random((2, 4)).astype(np.float32)
        model.learn_triplet(img, txt, i % 2 == 1, LearnStats(), group=group)
        assert model.support_size == min(size + 1, model.budget)  # every triplet steps
        slots.append((model.head - 1) % model.budget)
    return slots


def test_a_full_support_evicts_the_oldest_triplet_of_its_largest_class() -> None:
    model = _closed_model(balanced=True)
    assert _store(model, [0, 0, 0, 1, 1, 2]) == [0, 1, 2, 3, 4, 5]  # fills in order
    # Class 0 holds the most (3): its oldest, slot 0, goes; then 0, 1 and 3 (the arriving triplet
    # counted) hold two each: the oldest of theirs, slot 1 (class 0); then 3 would hold three:
    # its own oldest, slot 0; then 1 would: its oldest, slot 3.
    A, tau = model.A.copy(), model.tau.copy()
    coords = [side.pool_coordinates(0) for side in (model.img_side, model.txt_side)]
    assert _store(model, [3], seed=2) == [0]
    projected = tau[:, 0, None, None] * coords[0][:, :, None] * coords[1][:, None, :]
    np.testing.assert_allclose(model.A, A + projected, rtol=1e-12)  # the evicted one, projected
    assert _store(model, [3, 3, 1], seed=3) == [1, 0, 3]
    assert model.slot_group.tolist() == [3, 3, 0, 1, 1, 2]
    assert model.projected == 4


def test_the_papers_rule_evicts_the_oldest_whatever_its_class() -> None:
    model = _closed_model(balanced=False)
    assert _store(model, [0, 0, 0, 1, 1, 2, 3, 3, 3]) == [0, 1, 2, 3, 4, 5, 0, 1, 2]


def test_an_unlabelled_stream_is_learned_alike_by_both_rules() -> None:
    pairs = [make_pair(p.id, p.img, p.txt, []) for p in class_stream(300, 6, 4, seed=5)]
    models = []
    for balanced in (True, False):
        params = {"kernels": KERNELS, "landmarks": 20, "budget": 30, "balanced_support": balanced}
        learner = StreamLearner("cmomks", 6, 4, params, seed=0)
        learner.learn(pairs)
        models.append(learner.model)
    assert isinstance(models[0], CMOMKS) and isinstance(models[1], CMOMKS)
    assert models[0].projected > 0
    assert_same_scores(models[0], models[1], 6, 4)
    assert np.array_equal(models[0].A, models[1].A)


def test_a_checkpoint_from_before_restores_the_papers_rule_and_continues_identically() -> None:
    """A checkpoint without the slots' classes, the waiting triplets' classes and the new
    parameters (as written before them) learns on as the paper's rule does, bit for bit."""
    pairs = sorted(class_stream(400, 6, 4, seed=6, n_classes=5), key=lambda p: p.labels[0])
    params = {
        "kernels": KERNELS,
        "landmarks": 20,
        "budget": 30,
        "balanced_support": False,
        "burst_damping": 0.0,
    }
    kwargs = {"seed": 1, "buffer_capacity": 80, "buffer_memory": 40}
    paper = StreamLearner("cmomks", 6, 4, params, **kwargs)
    paper.learn(pairs[:150])
    arrays, meta = paper.state()
    new = ("model.slot_group", "model.slot_written", "model.waiting.group")
    arrays = {k: v for k, v in arrays.items() if k not in new}
    meta["params"] = {
        k: v for k, v in meta["params"].items() if k not in ("balanced_support", "burst_damping")
    }
    before = StreamLearner.from_state(arrays, meta)
    assert isinstance(before.model, CMOMKS)
    assert not before.model.balanced_support and before.model.burst_damping == 0.0
    paper.learn(pairs[150:])
    before.learn(pairs[150:])
    assert isinstance(paper.model, CMOMKS) and paper.model.projected > 0
    assert_same_scores(before.model, paper.model, 6, 4)
    assert np.array_equal(before.model.A, paper.model.A)
    assert before.stats.as_dict() == paper.stats.as_dict()


def test_the_balanced_rule_keeps_every_class_in_a_class_ordered_support() -> None:
    pairs = sorted(class_stream(400, 6, 4, seed=6, n_classes=5), key=lambda p: p.labels[0])
    held = {}
    for balanced in (True, False):
        params = {"kernels": KERNELS, "landmarks": 20, "budget": 30, "balanced_support": balanced}
        learner = StreamLearner("cmomks", 6, 4, params, seed=1, buffer_capacity=80)
        learner.learn(pairs)
        assert isinstance(learner.model, CMOMKS)
        held[balanced] = np.bincount(learner.model.slot_group, minlength=5)
        # A round trip keeps the slots' classes and ages.
        again = StreamLearner.from_state(*learner.state()).model
        assert isinstance(again, CMOMKS)
        assert np.array_equal(again.slot_group, learner.model.slot_group)
        assert np.array_equal(again.slot_written, learner.model.slot_written)
    # Balanced: six slots a class; the ring: mostly the last class (rehearsal adds the others).
    assert held[True].tolist() == [6, 6, 6, 6, 6]
    assert held[False][4] > 2 * 6, held[False]


def test_the_pool_takes_one_pair_in_pool_skip_plus_one_and_closes_when_full() -> None:
    pairs = class_stream(100, 6, 4, seed=2)
    params = {"kernels": KERNELS, "landmarks": 10, "pool_skip": 2, **PAPERS_POOL}
    learner = StreamLearner("cmomks", 6, 4, params, seed=0)
    learner.learn(pairs[:27])
    model = learner.model
    assert isinstance(model, CMOMKS) and model.img_side.pool_size == 9 and model._waiting
    learner.learn(pairs[27:28])  # the 28th pair is the 10th pool point
    assert model.pool_full and not model._waiting
    for side, rows in (
        (model.img_side, [p.img for p in pairs]),
        (model.txt_side, [p.txt for p in pairs]),
    ):
        assert np.array_equal(side.pool[0], side.prep(np.stack(rows[0:28:3]))[0])


def test_a_pool_filled_while_no_triplet_waits_is_closed() -> None:
    """A stream opening with one class draws no triplet (no negative) while the pool fills; the
    pair that fills it closes it all the same (centring constants and the pool Gram's inverse)."""
    pairs = sorted(class_stream(200, 6, 4, seed=6), key=lambda p: p.labels[0])
    assert len({p.labels[0] for p in pairs[:10]}) == 1
    params = {"kernels": KERNELS, "landmarks": 10, "pool_skip": 0, **PAPERS_POOL}
    learner = StreamLearner("cmomks", 6, 4, params)
    learner.learn(pairs[:10])
    model = learner.model
    assert isinstance(model, CMOMKS) and model.pool_full and not model._waiting
    assert np.all(model.img_side.c > 0) and np.any(model.txt_side.pinv != 0)
    # So it learns on as a restored copy does (a restore derives the closed pool's constants).
    restored = StreamLearner.from_state(*learner.state())
    learner.learn(pairs[10:])
    restored.learn(pairs[10:])
    assert_same_scores(restored.model, learner.model, 6, 4)


def test_a_class_holding_its_cap_of_the_pool_passes_it_by() -> None:
    """In class order the capped pool holds ``ceil(0.25 * 10) = 3`` points of each of the first
    classes (their first pairs), not the first class alone; the paper's rule is the cap 1."""
    pairs = sorted(class_stream(40, 6, 4, seed=6), key=lambda p: p.labels[0])
    held = {}
    for cap in (0.25, 1.0):
        params = {"kernels": KERNELS, "landmarks": 10, **PAPERS_POOL, "pool_class_cap": cap}
        learner = StreamLearner("cmomks", 6, 4, params, seed=0)
        learner.learn(pairs)
        model = learner.model
        assert isinstance(model, CMOMKS) and model.pool_full
        held[cap] = np.bincount(model.pool_group, minlength=4).tolist()
        if cap < 1.0:
            firsts = [
                i
                for c in range(4)
                for i in [j for j, p in enumerate(pairs) if p.labels[0] == c][:3]
            ]
            rows = np.stack([pairs[i].img for i in firsts[:10]])
            assert np.array_equal(model.img_side.pool[0], model.img_side.prep(rows)[0])
    first_ten = np.bincount([p.labels[0] for p in pairs[:10]], minlength=4).tolist()
    assert held[0.25] == [3, 3, 3, 1] and held[1.0] == first_ten == [8, 2, 0, 0]


def test_a_pool_cap_no_class_reaches_changes_nothing() -> None:
    """A well-mixed stream whose classes each hold fewer than the cap's points of the first
    ``landmarks`` pairs fills the pool with them, as the paper's rule does, and learns alike."""
    pairs = class_stream(300, 6, 4, seed=3)
    assert max(np.bincount([p.labels[0] for p in pairs[:12]])) <= 6
    learners = []
    for cap in (0.5, 1.0):
        params = {"kernels": KERNELS, "landmarks": 12, "budget": 20, **PAPERS_POOL}
        params["pool_class_cap"] = cap
        learners.append(StreamLearner("cmomks", 6, 4, params, seed=0))
        learners[-1].learn(pairs)
    capped, paper = (learner.model for learner in learners)
    assert isinstance(capped, CMOMKS) and isinstance(paper, CMOMKS)
    assert np.array_equal(capped.A, paper.A) and np.array_equal(capped.tau, paper.tau)
    # A checkpoint from before the parameter restores the paper's rule.
    arrays, meta = learners[0].state()
    meta["params"] = {k: v for k, v in meta["params"].items() if k != "pool_class_cap"}
    before = StreamLearner.from_state(arrays, meta)
    assert isinstance(before.model, CMOMKS) and before.model.pool_class_cap == 1.0


def test_a_burst_caps_the_pool_tighter_and_a_stream_of_few_classes_lifts_the_caps() -> None:
    """In class order, the classes arriving in a burst hold at most the burst cap's points
    (``ceil(0.25 * 40) = 10``), the first at most the plain cap's (20); a stream of two classes,
    which the plain cap of 0.2 cannot fill a pool with, passes ``landmarks`` offered pairs by in
    a row and then fills it from the next ones, and a restored copy continues alike."""
    pairs = sorted(class_stream(160, 6, 4, seed=6), key=lambda p: p.labels[0])
    params = {"kernels": KERNELS, "landmarks": 40, "pool_class_cap": 0.5, "pool_burst_cap": 0.25}
    learner = StreamLearner("cmomks", 6, 4, params, seed=0)
    learner.learn(pairs)
    model = learner.model
    assert isinstance(model, CMOMKS) and model.pool_full and model.pool_passed < 40
    held = np.bincount(model.pool_group, minlength=4)
    assert held[0] == 20 and held.min() <= 10 and held.max() <= 20, held
    two = [p for p in class_stream(300, 6, 4, seed=7) if p.labels[0] < 2]
    params = {"kernels": KERNELS, "landmarks": 10, "pool_class_cap": 0.2}
    learner = StreamLearner("cmomks", 6, 4, params, seed=0)
    learner.learn(two[:8])
    model = learner.model
    assert isinstance(model, CMOMKS) and model.img_side.pool_size == 4 and not model.pool_full
    restored = StreamLearner.from_state(*learner.state())
    learner.learn(two[15:])
    restored.learn(two[15:])
    assert model.pool_full and model.pool_passed == 10
    assert np.bincount(model.pool_group, minlength=2).tolist() != [5, 5]  # not capped to 2 each
    assert_same_scores(restored.model, model, 6, 4)


def test_classes_that_each_break_the_run_still_lift_the_caps_in_all() -> None:
    """One pool point a class (``ceil(0.05 * 20)``) and runs of 14 pairs: every new class breaks
    the run of pairs passed by before it reaches 20, so the caps lift at 60 passed in all, in
    the fifth class, and the pairs from there on fill the pool."""
    rng = np.random.default_rng(0)
    pairs = [
        make_pair(f"{c}-{i}", rng.random(6) + c, rng.random(4) + c, labels=[c])
        for c in range(8)
        for i in range(14)
    ]
    params = {"kernels": KERNELS, "landmarks": 20, "pool_class_cap": 0.05, "pool_burst_cap": 1.0}
    learner = StreamLearner("cmomks", 6, 4, params, seed=0)
    learner.learn(pairs[: 4 * 14])
    model = learner.model
    assert isinstance(model, CMOMKS) and model.img_side.pool_size == 4
    assert model.pool_passed_all == 52 and model.pool_passed == 13
    learner.learn(pairs[4 * 14 :])
    assert model.pool_full and model.pool_passed_all == 60 and model.pool_passed < 20
    assert np.bincount(model.pool_group).tolist() == [1, 1, 1, 1, 7, 9]
