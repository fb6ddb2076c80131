"""CMOMKS: kernelised PA steps, Hedge, the Theorem 2 bound, the budget, state and the worker."""

import time

import numpy as np
import pytest
import redis

from streamxm.config import Settings
from streamxm.learning.stream_learner import StreamLearner
from streamxm.models.base import LearnStats
from streamxm.models.cmomks import CMOMKS
from streamxm.service import build_worker, open_store
from streamxm.stream.keys import Keys
from streamxm.stream.messages import make_pair
from streamxm.stream.producer import StreamProducer
from tests.conftest import assert_same_scores, class_stream, two_versions

KERNELS = [{"img_gamma": 0.5, "txt_gamma": 0.5}, {"img_gamma": 4.0, "txt_gamma": 2.0}]


def _model_with_pool(dv: int = 6, dt: int = 4, **params: object) -> CMOMKS:
    model = CMOMKS(dv, dt, kernels=KERNELS, landmarks=8, **params)  # type: ignore[arg-type]
    learner = StreamLearner("cmomks", dv, dt, model.params(), seed=0)
    learner.learn(class_stream(30, dv, dt, seed=1))
    assert isinstance(learner.model, CMOMKS) and learner.model.pool_full
    return learner.model


@pytest.mark.parametrize("is_text", [False, True])
def test_each_kernel_pair_takes_its_own_pa_step(is_text: bool) -> None:
    """PA moves the margin by exactly tau ||V||^2, and to the margin itself when tau < C: checks
    the dual step and ||V||^2 = k~(q,q)(k(p,p) - 2k(p,n) + k(n,n)) through kernel values."""
    model = _model_with_pool(C=1e6)
    rng = np.random.default_rng(5)
    q, p, n = (
        (rng.random(4), rng.random(6), rng.random(6))
        if is_text
        else (rng.random(6), rng.random(4), rng.random(4))
    )
    img_rows = np.vstack([p, n]) if is_text else np.vstack([q, q])
    txt_rows = np.vstack([q, q]) if is_text else np.vstack([p, n])

    def margins() -> np.ndarray:
        s = model.kernel_scores(img_rows, txt_rows)
        return s[:, 0, 0] - (s[:, 1, 0] if is_text else s[:, 0, 1])

    before = margins()
    support = model.support_size
    model.learn_triplet(
        img_rows.astype(np.float32), txt_rows.astype(np.float32), is_text, LearnStats()
    )
    after = margins()
    slot = (model.head - 1) % model.budget
    tau = model.tau[:, slot]
    assert model.support_size == min(support + 1, model.budget)
    loss = np.maximum(0, 1 - before)
    assert np.all(tau > 0) and np.all(tau < 1e6)  # no clipping with this C
    np.testing.assert_allclose(after, 1.0, atol=1e-4)  # unclipped PA lands on the margin
    np.testing.assert_allclose(tau, loss / ((after - before) / tau), rtol=1e-4)


def test_hedge_weights_are_beta_to_the_mistakes() -> None:
    learner = StreamLearner(
        "cmomks", 6, 4, {"kernels": KERNELS, "landmarks": 8, "beta": 0.9}, seed=0
    )
    learner.learn(class_stream(120, 6, 4, seed=2))
    model = learner.model
    assert isinstance(model, CMOMKS)
    expected = 0.9 ** model.kernel_mistakes.astype(float)
    np.testing.assert_allclose(model.theta, expected / expected.sum(), rtol=1e-9)
    assert model.kernel_mistakes.min() > 0


def test_theorem_2_bound_on_a_testclass_stream() -> None:
    """Mistakes of the Hedge-weighted vote stay under the bound in terms of the best single
    kernel pair: (ln(1/beta) min_j M_j + ln m) / ln(2/(1+beta)) <= 2 (...) / (1 - beta)."""
    kernels = [{"img_gamma": g, "txt_gamma": g} for g in (0.05, 1.0, 20.0)]
    beta = 0.95
    learner = StreamLearner(
        "cmomks",
        6,
        4,
        {"kernels": kernels, "landmarks": 10, "beta": beta, "budget": 200, "triplets_per_pair": 2},
        seed=0,
    )
    learner.learn(class_stream(600, 6, 4, seed=3))
    model = learner.model
    assert isinstance(model, CMOMKS)
    best, m = int(model.kernel_mistakes.min()), len(kernels)
    tight = (np.log(1 / beta) * best + np.log(m)) / np.log(2 / (1 + beta))
    paper = 2 * (np.log(1 / beta) * best + np.log(m)) / (1 - beta)
    assert 0 < model.vote_mistakes <= tight <= paper
    assert len(set(model.kernel_mistakes.tolist())) > 1  # the pairs really differ


def _rss_bytes() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * 4096


@pytest.mark.long
def test_budget_keeps_memory_and_time_flat_over_100000_pairs() -> None:
    pairs = class_stream(2000, 8, 4, seed=4)
    learner = StreamLearner(
        "cmomks",
        8,
        4,
        {"kernels": KERNELS, "landmarks": 10, "budget": 100, "triplets_per_pair": 1},
        seed=0,
        eval_every=10**9,
    )
    learner.learn(pairs[:300])  # the pool and the budget fill
    model = learner.model
    assert isinstance(model, CMOMKS) and model.support_size == 100

    def state_bytes() -> int:
        arrays, _ = learner.state()
        return sum(a.nbytes for a in arrays.values())

    times, rss, state = [], [], []
    for block in range(1, 51):
        start = time.perf_counter()
        learner.learn([make_pair(f"{block}-{p.id}", p.img, p.txt, list(p.labels)) for p in pairs])
        times.append((time.perf_counter() - start) / len(pairs))
        rss.append(_rss_bytes())
        state.append(state_bytes())
    assert learner.pairs_seen >= 100_000
    assert model.support_size == 100 and model.projected > 50_000
    # Memory: the learned state has one size however long the stream, and the process does
    # not grow (100k pairs leaking even 100 bytes each would add 10 MB).
    assert len(set(state)) == 1
    assert rss[-1] - rss[0] < 8 * 1024 * 1024, rss
    # Time per pair: the late blocks cost what the early ones did (median ratio, generous).
    assert np.median(times[-10:]) < 2.0 * np.median(times[:10])


def test_state_round_trip_continues_identically_even_before_the_pool_is_full() -> None:
    pairs = class_stream(200, 6, 4, seed=6)
    params = {"kernels": KERNELS, "landmarks": 50, "budget": 40}
    a = StreamLearner("cmomks", 6, 4, params, seed=1, eval_every=3)
    a.learn(pairs[:30])
    assert not a.model.pool_full  # type: ignore[attr-defined]  # triplets are waiting
    b = StreamLearner.from_state(*a.state())
    a.learn(pairs[30:])
    b.learn(pairs[30:])
    probe_i, probe_t = assert_same_scores(a.model, b.model, 6, 4)
    assert a.stats.as_dict() == b.stats.as_dict()
    emb = a.model.embed_images(probe_i) @ a.model.embed_texts(probe_t).T
    np.testing.assert_allclose(emb, a.model.similarity(probe_i, probe_t), rtol=1e-4, atol=1e-6)


def test_a_new_version_recomputes_only_its_rewritten_support_slots_of_the_index_rows() -> None:
    """``index_update`` (the server's next index from the previous version's) equals the
    new version's own ``index_rows``, with the columns of the slots not written since copied;
    a model whose pool is not the earlier one's recomputes all of them."""
    pairs = class_stream(300, 6, 4, seed=3)
    params = {"kernels": KERNELS, "landmarks": 20, "budget": 60, "triplets_per_pair": 2}
    earlier, later = two_versions("cmomks", pairs, params, 100, 10)
    assert isinstance(earlier, CMOMKS) and isinstance(later, CMOMKS)
    gallery = {
        "image": np.stack([p.img for p in pairs[150:]]),
        "text": np.stack([p.txt for p in pairs[150:]]),
    }
    for modality, side, before in (
        ("image", later.img_side, earlier.img_side),
        ("text", later.txt_side, earlier.txt_side),
    ):
        written = side.rewritten(before, later.support_size, earlier.support_size)
        assert 0 < len(written) < later.budget  # some slots, not all: a partial recompute
        kept = earlier.index_rows(modality, gallery[modality])
        update = later.index_update(earlier, modality)
        assert update is not None
        since = update(kept, gallery[modality])
        np.testing.assert_allclose(
            since, later.index_rows(modality, gallery[modality]), rtol=1e-5, atol=1e-6
        )
        other_pool = StreamLearner("cmomks", 6, 4, params, seed=0)
        other_pool.learn(pairs[200:])
        assert other_pool.model.index_update(earlier, modality) is None


def test_the_worker_learns_cmomks_and_resumes_from_its_checkpoint(
    r: redis.Redis, settings: Settings
) -> None:
    pairs = class_stream(300, 6, 4, seed=7)
    params = {"kernels": KERNELS, "landmarks": 100, "budget": 60}  # the pool: one pair in two
    client = StreamProducer(r, settings.namespace)
    client.push_pairs(pairs[:150])
    build_worker(settings, r, "cmomks", params).run(until_idle=True)  # stops before the pool fills
    client.push_pairs(pairs[150:])
    worker = build_worker(settings, r, "cmomks", params)
    worker.run(until_idle=True)
    ckpt = open_store(settings, r).load_latest("cmomks")
    assert ckpt is not None
    restored = StreamLearner.from_state(ckpt.arrays, ckpt.meta)
    reference = StreamLearner("cmomks", 6, 4, params, seed=settings.seed)
    reference.learn(pairs)
    assert restored.pairs_seen == 300
    assert_same_scores(restored.model, reference.model, 6, 4)
    stats = r.hgetall(Keys(settings.namespace).stats("cmomks"))
    assert int(stats[b"pairs_processed"]) == 300 and int(stats[b"mistakes_i2t"]) > 0
