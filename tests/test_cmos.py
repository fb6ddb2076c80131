"""CMOS against a direct transcription of the paper's equations."""

from typing import Literal

import numpy as np
import pytest

from streamxm.learning.evaluation import retrieval_maps
from streamxm.learning.stream_learner import StreamLearner
from streamxm.models.base import LearnStats
from streamxm.models.cmos import CMOS
from streamxm.stream.messages import Pair, make_pair
from streamxm.tools.datasets import iter_pairs, load_dataset
from tests.conftest import SHARED_WIKI, class_stream


def transcription(
    triplets: list[tuple[str, np.ndarray, np.ndarray, np.ndarray]], dv: int, dt: int, C: float
) -> tuple[np.ndarray, list[float]]:
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
    model = CMOS(2, 2, C=0.05, normalize="none", center=False)
    stats = LearnStats()
    # W = 0: every score is 0, so the first triplet is a mistake (0 - 0 <= 0).
    model.update_image(np.array([1.0, 0]), np.array([1.0, 0]), np.array([0, 1.0]), stats)
    assert stats.mistakes["i2t"] == 1
    # Now s(v, t+) - s(v, t-) = 2 * tau > 0: not a mistake, loss 1 - 2C.
    model.update_image(np.array([1.0, 0]), np.array([1.0, 0]), np.array([0, 1.0]), stats)
    assert stats.mistakes["i2t"] == 1
    assert stats.loss["i2t"] == pytest.approx(1.0 + (1 - 2 * 0.05))


def _random_pairs(n: int, seed: int) -> list[Pair]:
    """``n`` pairs of uniform random 6-d images and 4-d texts, each with one of three labels."""
    rng = np.random.default_rng(seed)
    return [
        make_pair(str(i), rng.random(6), rng.random(4), labels=[int(rng.integers(3))])
        for i in range(n)
    ]


def test_learning_does_not_depend_on_batch_boundaries() -> None:
    pairs = _random_pairs(300, seed=3)
    one = StreamLearner("cmos", 6, 4, seed=7)
    one.learn(pairs)
    many = StreamLearner("cmos", 6, 4, seed=7)
    for i in range(0, 300, 17):
        many.learn(pairs[i : i + 17])
    assert np.array_equal(one.model.W, many.model.W)  # type: ignore[attr-defined]
    assert one.rolling_map() == many.rolling_map()


def test_state_round_trip_continues_identically() -> None:
    pairs = _random_pairs(200, seed=4)
    a = StreamLearner("cmos", 6, 4, seed=1)
    a.learn(pairs[:120])
    b = StreamLearner.from_state(*a.state())
    a.learn(pairs[120:])
    b.learn(pairs[120:])
    assert np.array_equal(a.model.W, b.model.W)  # type: ignore[attr-defined]
    assert a.stats.as_dict() == b.stats.as_dict()


def test_unlabelled_pairs_use_their_own_partner_as_positive() -> None:
    rng = np.random.default_rng(5)
    learner = StreamLearner("cmos", 5, 3, seed=0)
    learner.learn([make_pair(str(i), rng.random(5), rng.random(3)) for i in range(50)])
    assert learner.pairs_unlabelled == 50
    assert learner.stats.triplets["i2t"] > 0


@pytest.mark.skipif(not SHARED_WIKI.exists(), reason="../shared/datasets not present")
def test_one_pass_over_wikipedia_learns_something() -> None:
    ds = load_dataset(SHARED_WIKI)
    learner = StreamLearner("cmos", 128, 10)
    learner.learn(list(iter_pairs(ds, limit=600)))
    rm = learner.rolling_map()
    # Chance level on 10 classes is about 0.1; the rolling mAP must be clearly above it.
    assert rm["i2t"] is not None and rm["i2t"] > 0.18
    assert rm["t2i"] is not None and rm["t2i"] > 0.18


@pytest.mark.parametrize(("dtype", "atol"), [("float32", 1e-5), ("float64", 1e-12)])
def test_blocked_solver_matches_the_paper_loop_over_2000_updates(dtype: str, atol: float) -> None:
    pairs = class_stream(205, 48, 24, seed=11, n_classes=5)
    runs = {}
    for solver in ("blocked", "paper"):
        learner = StreamLearner(
            "cmos", 48, 24, {"solver": solver, "dtype": dtype, "C": 1.0}, seed=3, eval_every=10_000
        )
        learner.model.tau_log = []  # type: ignore[attr-defined]
        learner.learn(pairs)
        learner.flush()
        runs[solver] = learner
    blocked, paper = runs["blocked"], runs["paper"]
    taus_b = np.array(blocked.model.tau_log)  # type: ignore[attr-defined]
    taus_p = np.array(paper.model.tau_log)  # type: ignore[attr-defined]
    assert len(taus_b) == len(taus_p) >= 2000
    np.testing.assert_allclose(taus_b, taus_p, rtol=0, atol=atol)
    np.testing.assert_array_equal(taus_b == 1.0, taus_p == 1.0)  # the same steps are clipped
    w_blocked, w_paper = blocked.model.W, paper.model.W  # type: ignore[attr-defined]
    np.testing.assert_allclose(w_blocked, w_paper, rtol=0, atol=atol)
    assert blocked.stats.as_dict()["mistakes"] == paper.stats.as_dict()["mistakes"]
    # All three kinds of step occur: passive, clipped at C, and the exact l / ||V||^2.
    assert (taus_b == 0).sum() > 0 and (taus_b == 1.0).sum() > 0
    assert ((taus_b > 0) & (taus_b < 1.0)).sum() > 0


def test_deferred_learning_does_not_depend_on_cuts_or_restarts() -> None:
    pairs = class_stream(400, 10, 6, seed=2, n_classes=5)
    one = StreamLearner("cmos", 10, 6, seed=5, eval_every=7)
    one.learn(pairs)
    cut = StreamLearner("cmos", 10, 6, seed=5, eval_every=7)
    for i in range(0, 250, 13):
        cut.learn(pairs[i : min(i + 13, 250)])
    assert cut.model._queued > 0  # type: ignore[attr-defined]  # state holds queued triplets
    restored = StreamLearner.from_state(*cut.state())
    restored.learn(pairs[250:])
    one.flush()
    restored.flush()
    assert np.array_equal(one.model.W, restored.model.W)  # type: ignore[attr-defined]
    assert one.stats.as_dict() == restored.stats.as_dict()
    assert one.rolling_map() == restored.rolling_map()


@pytest.mark.parametrize("noise", [0.0, 0.3])
def test_mistakes_stay_under_the_theorem_1_bound(noise: float) -> None:
    """Theorem 1: mistakes <= max(R, 1/C) (||U||_F^2 + 2C sum_t l_t(U)) for any U, with
    R = max_t ||V_t||_F^2. The stream is built so that a known U ranks every triplet with margin
    (noise 0), or most of them (noise 0.3: some triplets are flipped, so U pays a loss)."""
    rng = np.random.default_rng(0)
    dv, dt, C = 8, 6, 0.1
    U = rng.normal(size=(dv, dt))
    U *= 2.0 / np.linalg.norm(U)
    model = CMOS(dv, dt, C=C, normalize="none", center=False)
    stats = LearnStats()
    sq_norms, u_losses = [], []
    kept = 0
    while kept < 3000:
        is_text = kept % 2 == 1
        q = rng.normal(size=dt if is_text else dv)
        p, n = (
            (rng.normal(size=dv), rng.normal(size=dv))
            if is_text
            else (rng.normal(size=dt), rng.normal(size=dt))
        )
        left, right = (p - n, q) if is_text else (q, p - n)
        u_margin = float(left @ U @ right)
        if u_margin < 1.0:
            if rng.random() >= noise or u_margin < -1.0:
                continue  # keep the stream separable, except for the chosen noise
        elif rng.random() < noise / 3:
            p, n = n, p
            left, right = (p - n, q) if is_text else (q, p - n)
            u_margin = -u_margin
        u_losses.append(max(0.0, 1.0 - u_margin))
        sq_norms.append(float(left @ left) * float(right @ right))
        if is_text:
            model.update_text(q, p, n, stats, defer=True)
        else:
            model.update_image(q, p, n, stats, defer=True)
        kept += 1
    model.flush(stats)
    mistakes = stats.mistakes["i2t"] + stats.mistakes["t2i"]
    bound = max(max(sq_norms), 1 / C) * (np.sum(U * U) + 2 * C * sum(u_losses))
    assert (sum(u_losses) == 0) == (noise == 0)
    assert 0 < mistakes <= bound


def test_burst_damping_leaves_a_mixed_stream_as_the_paper_learns_it() -> None:
    """Without a burst (a ring never full, or classes well mixed) the damped cap is never
    used: ``W`` is bit for bit the paper rule's."""
    pairs = _random_pairs(300, seed=6)
    runs = []
    for damping in (0.0, 0.5):
        learner = StreamLearner("cmos", 6, 4, {"burst_damping": damping}, seed=2)
        learner.learn(pairs)
        learner.flush()
        runs.append(learner.model.W)  # type: ignore[attr-defined]
    assert np.array_equal(runs[0], runs[1])


def test_a_checkpoint_without_burst_damping_restores_the_former_rule() -> None:
    """A checkpoint written before ``burst_damping`` (no parameter, no ``queued_cap``) restores
    with the damping off and its queued triplets at the cap ``C``."""
    pairs = class_stream(120, 6, 4, seed=8, n_classes=3)
    learner = StreamLearner("cmos", 6, 4, seed=4, eval_every=10**9)
    learner.learn(pairs)
    arrays, meta = learner.state()
    assert learner.model._queued > 0  # type: ignore[attr-defined]
    old_arrays = {k: v for k, v in arrays.items() if k != "model.queued_cap"}
    old_meta = {**meta, "params": {k: v for k, v in meta["params"].items() if k != "burst_damping"}}
    restored = StreamLearner.from_state(old_arrays, old_meta)
    model = restored.model
    assert model.burst_damping == 0.0  # type: ignore[attr-defined]
    queued = model._queued  # type: ignore[attr-defined]
    assert queued == learner.model._queued  # type: ignore[attr-defined]
    np.testing.assert_array_equal(model._cap[:queued], model.C)  # type: ignore[attr-defined]


@pytest.mark.parametrize("damping", [0.0, 0.5])
def test_queued_caps_survive_a_checkpoint(damping: float) -> None:
    """A class-ordered stream long enough to burst queues damped triplets beside replayed ones
    at ``C``; a restored learner continues identically."""
    pairs = sorted(_random_pairs(1400, seed=9), key=lambda p: p.labels[0])
    one = StreamLearner("cmos", 6, 4, {"burst_damping": damping}, seed=3, eval_every=10**9)
    one.learn(pairs)
    cut = StreamLearner("cmos", 6, 4, {"burst_damping": damping}, seed=3, eval_every=10**9)
    cut.learn(pairs[:1201])
    caps = set(cut.model._cap[: cut.model._queued].tolist())  # type: ignore[attr-defined]
    assert caps == ({0.1, 0.05} if damping else {0.1})
    restored = StreamLearner.from_state(*cut.state())
    restored.learn(pairs[1201:])
    one.flush()
    restored.flush()
    assert np.array_equal(one.model.W, restored.model.W)  # type: ignore[attr-defined]


def test_burst_damping_holds_text_to_image_when_topics_arrive_one_at_a_time() -> None:
    """Wikipedia one class at a time, the classes in a random order: a burst hands CMOS every
    triplet of one class in a row, nearly all clipped at ``C``, and the class last to arrive
    overwrites what the earlier ones wrote; damping the arriving pairs' steps in a burst keeps
    more of it (mean over three class orders; text to image is the direction that falls)."""
    ds = load_dataset("wiki")
    maps: dict[float, list[tuple[float, float]]] = {0.0: [], 0.5: []}
    for seed in (0, 1, 2):
        pairs = list(iter_pairs(ds, order="class-shuffled", seed=seed))
        for damping, runs in maps.items():
            params = {"burst_damping": damping}
            learner = StreamLearner("cmos", 128, 10, params, seed=seed, eval_every=10**9)
            learner.learn(pairs)
            m = retrieval_maps(learner.model, (ds.img_test, ds.txt_test, ds.y_test))
            runs.append((m["map_i2t"], m["map_t2i"]))
    paper, damped = np.mean(maps[0.0], axis=0), np.mean(maps[0.5], axis=0)
    assert damped[1] > paper[1] + 0.003, maps
    assert damped[0] > paper[0] - 0.002, maps


def test_memory_and_replays_hold_text_to_image_when_topics_arrive_one_at_a_time() -> None:
    """The same streams: the default memory of twice the ring with six replays a pair keeps more
    of both directions than a memory of the ring's size with two (the former defaults): a text
    query's negatives are images drawn from the memory during a burst, and a few dozen a class
    teach ``W`` those images rather than the class."""
    ds = load_dataset("wiki")
    maps: dict[str, list[tuple[float, float]]] = {"former": [], "default": []}
    for seed in (0, 1, 2):
        pairs = list(iter_pairs(ds, order="class-shuffled", seed=seed))
        for name, params, memory in (("former", {"replay": 2}, 500), ("default", {}, None)):
            learner = StreamLearner(
                "cmos", 128, 10, params, seed=seed, eval_every=10**9, buffer_memory=memory
            )
            assert learner.buffer.memory == (memory or 1000)
            learner.learn(pairs)
            m = retrieval_maps(learner.model, (ds.img_test, ds.txt_test, ds.y_test))
            runs = maps[name]
            runs.append((m["map_i2t"], m["map_t2i"]))
    former, default = np.mean(maps["former"], axis=0), np.mean(maps["default"], axis=0)
    assert default[1] > former[1] + 0.002, maps
    assert default[0] > former[0] - 0.002, maps


def _ema_transcription(
    triplets: list[tuple[str, np.ndarray, np.ndarray, np.ndarray]], dv: int, dt: int, beta: float
) -> tuple[np.ndarray, np.ndarray]:
    """The paper's sequential loop (C = 0.3) with ``A = beta A + (1 - beta) W`` after each
    triplet: the last iterate and its average."""
    W, A = np.zeros((dv, dt)), np.zeros((dv, dt))
    for kind, q, p, n in triplets:
        left, right = (q, p - n) if kind == "image" else (p - n, q)
        V = np.outer(left, right)
        loss = max(0.0, 1 - left @ W @ right)
        W = W + min(0.3, loss / np.sum(V * V)) * V
        A = beta * A + (1 - beta) * W
    return W, A


@pytest.mark.parametrize("solver", ["blocked", "paper"])
def test_the_average_is_the_sequential_loops_whatever_the_flushes(
    solver: Literal["blocked", "paper"],
) -> None:
    """``average`` serves the moving average of the iterates one triplet at a time, as the
    sequential loop gives it, through queues flushed at uneven points."""
    rng = np.random.default_rng(3)
    dv, dt = 9, 5
    model = CMOS(
        dv, dt, C=0.3, normalize="none", center=False, dtype="float64", solver=solver, average=4.0
    )
    assert model.triplets_per_pair == 10  # beta = 1 - 1 / 40
    stats = LearnStats()
    triplets = []
    for k in range(400):
        kind = "image" if rng.random() < 0.5 else "text"
        q, p, n = (rng.normal(size=d) for d in ((dv, dt, dt) if kind == "image" else (dt, dv, dv)))
        update = model.update_image if kind == "image" else model.update_text
        update(q, p, n, stats, defer=k % 7 != 0)
        triplets.append((kind, q, p, n))
    model.flush(stats)
    W, A = _ema_transcription(triplets, dv, dt, beta=1 - 1 / 40)
    np.testing.assert_allclose(model.W, W, rtol=0, atol=1e-10)
    assert model.W_avg is not None and model.served is model.W_avg
    np.testing.assert_allclose(model.W_avg, A, rtol=0, atol=1e-10)
    assert not np.allclose(model.W_avg, model.W, atol=1e-3)


def test_without_an_average_the_last_iterate_is_served() -> None:
    learner = StreamLearner("cmos", 6, 4, seed=1)
    learner.learn(_random_pairs(200, seed=2))
    model = learner.model
    assert isinstance(model, CMOS) and model.average == 0.0
    assert model.W_avg is None and model.served is model.W
    assert "model.W_avg" not in learner.state()[0]


def test_the_average_is_what_the_model_serves_and_scores() -> None:
    pairs = class_stream(300, 10, 6, seed=5, n_classes=4)
    learner = StreamLearner("cmos", 10, 6, {"average": 5.0}, seed=2, eval_every=3)
    learner.learn(pairs)
    learner.flush()  # as every read does first
    model = learner.model
    assert isinstance(model, CMOS) and model.W_avg is not None
    imgs, txts = np.stack([p.img for p in pairs[:7]]), np.stack([p.txt for p in pairs[:9]])
    want = model.map_images(imgs) @ model.W_avg.astype(np.float64) @ model.map_texts(txts).T
    np.testing.assert_allclose(model.similarity(imgs, txts), want, rtol=1e-6, atol=1e-7)
    inner = model.embed_images(imgs).astype(np.float64) @ model.embed_texts(txts).T
    np.testing.assert_allclose(inner, want, rtol=1e-4, atol=1e-5)
    kind = model.embedding()
    assert kind.fixed
    moved, constant = kind.moved("text", imgs)  # type: ignore[attr-defined]
    units = txts / np.linalg.norm(txts, axis=1, keepdims=True)
    np.testing.assert_allclose(moved @ units.T + constant[:, None], want, rtol=1e-6, atol=1e-7)
    last = model.map_images(imgs) @ model.W.astype(np.float64) @ model.map_texts(txts).T
    assert not np.allclose(last, want, rtol=1e-3)
    assert learner.rolling_map()["i2t"] is not None


def test_averaged_learning_does_not_depend_on_cuts_or_restarts() -> None:
    """A checkpoint keeps the average and the queued triplets' decays: cut into calls and
    restored halfway, a learner ends bit for bit as one that learned the stream in one go."""
    pairs = class_stream(400, 10, 6, seed=2, n_classes=5)
    params = {"average": 8.0}
    one = StreamLearner("cmos", 10, 6, params, seed=5, eval_every=7)
    one.learn(pairs)
    cut = StreamLearner("cmos", 10, 6, params, seed=5, eval_every=7)
    for i in range(0, 250, 13):
        cut.learn(pairs[i : min(i + 13, 250)])
    assert cut.model._queued > 0  # type: ignore[attr-defined]
    restored = StreamLearner.from_state(*cut.state())
    restored.learn(pairs[250:])
    one.flush()
    restored.flush()
    for name in ("W", "W_avg"):
        assert np.array_equal(getattr(one.model, name), getattr(restored.model, name)), name
    assert one.stats.as_dict() == restored.stats.as_dict()
    assert one.rolling_map() == restored.rolling_map()


def test_a_checkpoint_without_average_restores_the_last_iterate_rule() -> None:
    learner = StreamLearner("cmos", 6, 4, seed=4)
    learner.learn(class_stream(120, 6, 4, seed=8, n_classes=3))
    arrays, meta = learner.state()
    old_meta = {**meta, "params": {k: v for k, v in meta["params"].items() if k != "average"}}
    restored = StreamLearner.from_state(arrays, old_meta)
    assert isinstance(restored.model, CMOS)
    assert restored.model.average == 0.0 and restored.model.W_avg is None


class _Mirror:
    """A rank group of two whose other rank learned exactly what this one did."""

    world = 2

    def sum_ints(self, values: list[int]) -> list[int]:
        return [2 * v for v in values]

    def all_reduce_(self, flat: np.ndarray, op: str = "sum") -> None:
        if op == "sum":
            flat *= 2


def test_ranks_mix_the_average_as_they_mix_w() -> None:
    """Merged across ranks, the average moves from the round's start by the mixed changes of
    the ranks, as ``W`` does."""
    from streamxm.learning.rounds import RankMerge

    pairs = class_stream(300, 10, 6, seed=6, n_classes=4)
    learner = StreamLearner("cmos", 10, 6, {"average": 6.0}, seed=1)
    learner.learn(pairs[:100])
    merge = RankMerge(_Mirror())  # type: ignore[arg-type]
    merge.reset(learner)
    model = learner.model
    assert isinstance(model, CMOS) and model.W_avg is not None
    base = {"W": model.W.copy(), "W_avg": model.W_avg.copy()}
    learner.learn(pairs[100:200])
    learner.flush()
    ends = {"W": model.W.copy(), "W_avg": model.W_avg.copy()}
    merge.merge(learner, 100)
    for name, start in base.items():
        want = start + np.sqrt(2.0) * (ends[name] - start)
        np.testing.assert_allclose(getattr(model, name), want, rtol=1e-5, atol=1e-6)
    learner.learn(pairs[200:])  # and learning goes on from the merged iterate
    assert not np.array_equal(model.W_avg, base["W_avg"])
