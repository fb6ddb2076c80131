"""SDSRL: streamed statistics, MPL-CD, the closed-form oracle, state, and the shared-space API."""

import copy
import math
import threading

import httpx
import numpy as np
import pytest
import redis
from scipy.optimize import minimize

from streamxm.config import Settings
from streamxm.learning.stream_learner import StreamLearner
from streamxm.models import create_model
from streamxm.models.base import LearnStats
from streamxm.models.moments import power_normalize
from streamxm.models.projections import dense_targets, mpl_cd, projection_loss
from streamxm.models.sdsrl import SDSRL, NystroemMap, rbf_kernel
from streamxm.service import build_worker
from streamxm.stream.messages import Pair, make_pair
from streamxm.stream.producer import StreamProducer
from streamxm.tools.bench import quality
from streamxm.worker.ranks import RankFollower, RankZeroWorker
from tests.conftest import (
    SHARED_WIKI,
    ApiServer,
    assert_same_scores,
    class_stream,
    wait_for,
    whole_and_cut,
)


def mixed_stream(n: int, seed: int) -> list[Pair]:
    """Single-label, multi-label and unlabelled pairs (labels from 5 classes)."""
    rng = np.random.default_rng(seed)
    pairs = []
    for i in range(n):
        kind = i % 4
        labels = (
            []
            if kind == 3
            else [int(rng.integers(5))]
            if kind < 2
            else sorted({int(x) for x in rng.integers(5, size=2)})
        )
        pairs.append(make_pair(str(i), rng.random(6), rng.random(4), labels=labels))
    return pairs


def paper_similarity(la: np.ndarray, lb: np.ndarray) -> np.ndarray:
    """S(a, b) = sum_j 2 L_a^j L_b^j / (L_a^j + L_b^j), a term 0 when both are 0 (the paper)."""
    num = 2 * la[:, None, :] * lb[None, :, :]
    den = la[:, None, :] + lb[None, :, :]
    return np.where(den > 0, num / np.where(den > 0, den, 1), 0).sum(axis=2)


# -- statistics ------------------------------------------------------------------------------
@pytest.mark.parametrize("forget", [1.0, 0.97])
def test_streamed_statistics_equal_the_batch_matrices(forget: float) -> None:
    pairs = mixed_stream(150, seed=0)
    model = SDSRL(
        6,
        4,
        q=3,
        m_img=12,
        m_txt=5,
        landmark_pool=40,
        batch=7,
        forget=forget,
        power_img=1.0,
        solve_first=10**6,
        solve_every=10**6,
        grow_landmarks=0.0,  # the paper's frozen landmarks: every pair's features on one map
    )
    learner = StreamLearner("sdsrl", 6, 4)
    learner.model = model
    learner.learn(pairs)
    model.solve(learner.rng)  # folds the pending batch
    assert model.frozen and model.unlabelled == sum(not p.labels for p in pairs)
    assert model.map_img is not None and model.map_txt is not None
    phi = model.map_img.features(power_normalize(np.stack([p.img for p in pairs]), 1.0))
    psi = model.map_txt.features(power_normalize(np.stack([p.txt for p in pairs]), 1.0))
    labels = np.zeros((len(pairs), 5))
    for row, p in enumerate(pairs):
        labels[row, [model.class_index.index[c] for c in p.labels]] = 1
    # Forgetting weighs pair t by forget^(n-1-t): the statistics are weighted batch sums.
    w = forget ** np.arange(len(pairs) - 1, -1, -1)
    np.testing.assert_allclose(model.gram_img, (phi * w[:, None]).T @ phi, rtol=1e-10)
    np.testing.assert_allclose(model.gram_txt, (psi * w[:, None]).T @ psi, rtol=1e-10)
    assert model.weight == pytest.approx(w.sum())
    # The paper's M matrices, built densely from the n x n similarity, equal the low-rank form.
    s = paper_similarity(labels, labels) * np.sqrt(w)[:, None] * np.sqrt(w)[None, :]
    sw_phi, sw_psi = phi * np.sqrt(w)[:, None], psi * np.sqrt(w)[:, None]
    ridge = model.mu * w.sum()
    p_img = np.linalg.inv(sw_phi.T @ sw_phi + ridge * np.eye(phi.shape[1]))
    p_txt = np.linalg.inv(sw_psi.T @ sw_psi + ridge * np.eye(psi.shape[1]))
    m_i = p_img @ sw_phi.T @ s @ sw_phi @ p_img
    m_t = p_txt @ sw_psi.T @ s @ sw_psi @ p_txt
    m_c = p_img @ sw_phi.T @ s @ sw_psi @ p_txt
    for dense, low in zip((m_i, m_t, m_c), dense_targets(*model.targets()), strict=True):
        np.testing.assert_allclose(low, dense, rtol=1e-6, atol=1e-9 * np.abs(dense).max())


def test_nystroem_features_reproduce_the_kernel_on_landmarks() -> None:
    rng = np.random.default_rng(3)
    pts = power_normalize(rng.random((30, 5)))
    nm = NystroemMap(pts[:10], gamma=1.0)
    f = nm.features(pts[:10])
    np.testing.assert_allclose(f @ f.T, rbf_kernel(pts[:10], pts[:10], 1.0), atol=1e-6)
    k = rbf_kernel(pts, pts, 1.0)
    errors = []
    for m in (5, 10, 25):
        f = NystroemMap(pts[:m], gamma=1.0).features(pts)
        errors.append(np.abs(f @ f.T - k).mean())
    assert errors[0] > errors[1] > errors[2] and errors[1] < 0.02  # more landmarks, closer


# -- MPL-CD ------------------------------------------------------------------------------------
def test_coordinate_descent_lowers_the_loss_monotonically() -> None:
    rng = np.random.default_rng(0)
    g, h = rng.normal(size=(40, 6)), rng.normal(size=(15, 6))
    res = mpl_cd(
        g,
        h,
        0.01 * rng.normal(size=(40, 3)),
        0.01 * rng.normal(size=(15, 3)),
        rng,
        outer=30,
        inner=1,
        tol=0.0,
    )
    losses = np.array(res.losses)
    assert np.all(np.diff(losses) <= 1e-9 * losses[0]), losses
    assert losses[-1] < 0.5 * losses[0]
    assert res.losses[-1] == pytest.approx(projection_loss(res.a, res.b, g, h))


def test_coordinate_descent_matches_a_dense_solver() -> None:
    """q below the rank of the targets (no exact factorisation): MPL-CD reaches the optimum
    that a quasi-Newton method finds on the dense m x m objective, from several starts."""
    rng = np.random.default_rng(1)
    g, h = rng.normal(size=(12, 4)), rng.normal(size=(7, 4))
    m_i, m_t, m_c = dense_targets(g, h)
    q = 2

    def dense(z: np.ndarray) -> tuple[float, np.ndarray]:
        a, b = z[: 12 * q].reshape(12, q), z[12 * q :].reshape(7, q)
        ri, rt, rc = a @ a.T - m_i, b @ b.T - m_t, a @ b.T - m_c
        loss = np.sum(ri**2) + np.sum(rt**2) + np.sum(rc**2)
        ga = 4 * ri @ a + 2 * rc @ b
        gb = 4 * rt @ b + 2 * rc.T @ a
        return float(loss), np.concatenate([ga.ravel(), gb.ravel()])

    best = min(
        (
            minimize(
                dense,
                rng.normal(size=19 * q),
                jac=True,
                method="L-BFGS-B",
                options={"maxiter": 5000, "gtol": 1e-10},
            )
            for _ in range(5)
        ),
        key=lambda r: r.fun,
    )
    res = mpl_cd(
        g,
        h,
        0.1 * rng.normal(size=(12, q)),
        0.1 * rng.normal(size=(7, q)),
        rng,
        outer=300,
        inner=2,
        tol=1e-12,
    )
    assert res.losses[-1] == pytest.approx(best.fun, rel=1e-5)
    a, b = best.x[: 12 * q].reshape(12, q), best.x[12 * q :].reshape(7, q)
    # Products are what the model uses (A, B are defined up to a rotation).
    np.testing.assert_allclose(res.a @ res.b.T, a @ b.T, atol=1e-3 * np.abs(a @ b.T).max())


def test_single_label_solution_is_the_closed_form_oracle() -> None:
    """With single labels S = YY', so A A' = G G' exactly when q >= classes (PAPER-NOTES)."""
    pairs = class_stream(200, 6, 4, seed=2, n_classes=4)
    model = SDSRL(
        6, 4, q=4, m_img=30, m_txt=8, landmark_pool=100, outer=200, tol=1e-12, power_img=1.0
    )
    model.fit(pairs, np.random.default_rng(0), LearnStats())
    g, h = model.targets()
    np.testing.assert_allclose(model.a @ model.a.T, g @ g.T, atol=1e-4 * np.abs(g @ g.T).max())
    np.testing.assert_allclose(model.a @ model.b.T, g @ h.T, atol=1e-4 * np.abs(g @ h.T).max())
    assert model.cd_losses[-1] < 1e-8 * model.cd_losses[0]


# -- streaming ---------------------------------------------------------------------------------
def test_unlabelled_pairs_feed_only_the_grams_and_are_counted() -> None:
    pairs = class_stream(120, 6, 4, seed=4)
    bare = [make_pair(f"u{i}", p.img, p.txt) for i, p in enumerate(pairs[:40])]
    a = SDSRL(6, 4, q=4, m_img=20, m_txt=8, landmark_pool=60)
    b = SDSRL(6, 4, q=4, m_img=20, m_txt=8, landmark_pool=60)
    a.fit(pairs, np.random.default_rng(0), LearnStats())
    b.fit(pairs, np.random.default_rng(0), LearnStats())
    b.fit(bare, np.random.default_rng(1), LearnStats())  # same landmarks: they are frozen
    assert b.unlabelled == 40 and a.unlabelled == 0
    assert not np.allclose(a.gram_img, b.gram_img)
    assert b.weight == a.weight + 40
    assert b.map_img is not None
    extra = b.map_img.features(power_normalize(np.stack([p.img for p in bare]), b.power_img))
    np.testing.assert_allclose(b.gram_img, a.gram_img + extra.T @ extra, rtol=1e-9)
    np.testing.assert_allclose(b.lab_img, a.lab_img, rtol=1e-12)


def test_serves_before_landmarks_freeze_and_learns_classes() -> None:
    pairs = class_stream(400, 8, 5, seed=5)
    learner = StreamLearner(
        "sdsrl",
        8,
        5,
        {"q": 4, "m_img": 100, "landmark_pool": 200, "solve_first": 16, "solve_every": 64},
        seed=0,
    )
    learner.learn(pairs[:50])
    model = learner.model
    assert isinstance(model, SDSRL) and not model.frozen and model.solves >= 2
    learner.learn(pairs[50:])
    assert model.frozen and not model.pending_img[:0] and model.solves >= 6
    assert model.map_img is not None and len(model.map_img.landmarks) == 100
    test = class_stream(200, 8, 5, seed=6)
    scores = model.similarity(np.stack([p.img for p in test]), np.stack([p.txt for p in test]))
    same = np.array([[p.labels == t.labels for t in test] for p in test])
    assert scores[same].mean() > scores[~same].mean() + 0.2 * scores.std()
    assert sum(learner.stats.triplets.values()) > 300  # mistakes are observed once serving


@pytest.mark.parametrize("cut", [30, 150, 333])
def test_checkpoint_round_trip_continues_identically(cut: int) -> None:
    """Cut before the landmarks freeze, right after, and mid-batch."""
    pairs = mixed_stream(400, seed=7)
    params = {
        "q": 3,
        "m_img": 50,
        "m_txt": 6,
        "landmark_pool": 120,
        "batch": 16,
        "solve_first": 8,
        "solve_every": 50,
    }
    whole, first = whole_and_cut("sdsrl", 6, 4, params, pairs, cut, seed=3)
    resumed = StreamLearner.from_state(*first.state())
    resumed.learn(pairs[cut:])
    assert_same_scores(resumed.model, whole.model, 6, 4)
    assert resumed.stats.as_dict() == whole.stats.as_dict()


def test_one_pass_on_wikipedia_is_within_two_percent_of_offline() -> None:
    if not SHARED_WIKI.exists():
        pytest.skip(f"{SHARED_WIKI} not present")
    offline = quality(SHARED_WIKI, "sdsrl", protocol="offline")
    stream = quality(SHARED_WIKI, "sdsrl", protocol="stream")
    assert offline["map_i2t"] >= 0.31 and offline["map_t2i"] >= 0.235
    for key in ("map_i2t", "map_t2i"):
        assert stream[key] >= 0.98 * offline[key], (key, stream[key], offline[key])
    assert offline["map_t2t"] > offline["map_i2i"] > 0.1  # text topics cluster by class


# -- the API -----------------------------------------------------------------------------------
def test_same_modality_search_needs_a_shared_space(r: redis.Redis, settings: Settings) -> None:
    pairs = class_stream(300, 8, 5, seed=10)
    StreamProducer(r, settings.namespace).push_pairs(pairs)
    for name, params in (("sdsrl", {"m_img": 100, "landmark_pool": 100, "q": 4}), ("cmos", {})):
        worker = build_worker(settings, r, name, params=params)
        worker.run(threading.Event(), until_idle=True)  # commits a checkpoint when it stops
    with ApiServer(settings) as api, httpx.Client(base_url=api.url, timeout=30) as http:
        wait_for(
            lambda: (
                len(http.get("/v1/models").json()["models"]) == 2
                and all(m["gallery_items"] == 300 for m in http.get("/v1/models").json()["models"])
            ),
            30,
            "both models and the gallery",
        )
        query = {
            "model": "sdsrl",
            "modality": "image",
            "target": "image",
            "vector": pairs[0].img.tolist(),
            "k": 20,
        }
        reply = http.post("/v1/search", json=query)
        assert reply.status_code == 200, reply.text
        body = reply.json()
        assert body["target"] == "image"
        by_id = {p.id: p for p in pairs}
        hits = [by_id[h["id"]] for h in body["results"]]
        scores = [h["score"] for h in body["results"]]
        assert scores == sorted(scores, reverse=True)
        assert sum(h.labels == pairs[0].labels for h in hits) >= 15
        text_query = {
            **query,
            "modality": "text",
            "target": "text",
            "vector": pairs[0].txt.tolist(),
        }
        assert http.post("/v1/search", json=text_query).json()["target"] == "text"
        model = create_model("sdsrl", 8, 5, {"m_img": 100, "landmark_pool": 100, "q": 4})
        assert model.shared_space
        refused = http.post("/v1/search", json={**query, "model": "cmos"})
        assert refused.status_code == 422
        detail = refused.json()["detail"][0]
        assert detail["loc"][-1] == "target" and detail["type"] == "not_shared_space"
        assert "cmos" in detail["msg"]
        default = http.post("/v1/search", json={k: v for k, v in query.items() if k != "target"})
        assert default.json()["target"] == "text"


# -- landmarks grown for the classes the pool missed (grow_landmarks) ----------------------------
def classes_in_turn(n_classes: int = 5, per_class: int = 60) -> list[Pair]:
    """``per_class`` pairs of each class, one class at a time, ascending (``--order class``)."""
    pairs = class_stream(n_classes * per_class * 3, 8, 5, seed=11, n_classes=n_classes)
    return [
        p
        for c in range(n_classes)
        for p in [p for p in pairs if tuple(p.labels) == (c,)][:per_class]
    ]


GROW_PARAMS = {
    "q": 4,
    "m_img": 40,
    "m_txt": 10,
    "landmark_pool": 100,
    "batch": 16,
    "solve_first": 8,
    "solve_every": 50,
    "grow_landmarks": 0.0,
}


def test_grown_landmarks_cover_the_classes_the_pool_missed() -> None:
    """The pool holds the first two classes of five: with ``grow_landmarks = g`` every class
    seen ends with at least ``ceil(g m / C)`` landmarks a side, the ``k``-th class having
    added at most ``ceil(g m / k)``; with 0 the landmarks stay those drawn from the pool."""
    pairs = classes_in_turn()
    frozen = StreamLearner("sdsrl", 8, 5, GROW_PARAMS, seed=0)
    grown = StreamLearner("sdsrl", 8, 5, {**GROW_PARAMS, "grow_landmarks": 0.5}, seed=0)
    frozen.learn(pairs[:100])
    pool_img = frozen.model.map_img.landmarks.copy()  # type: ignore[attr-defined]
    frozen.learn(pairs[100:])
    grown.learn(pairs)
    f, g = frozen.model, grown.model
    assert isinstance(f, SDSRL) and isinstance(g, SDSRL)
    assert f.map_img is not None and g.map_img is not None and g.map_txt is not None
    np.testing.assert_array_equal(f.map_img.landmarks, pool_img)
    assert set(np.flatnonzero(f.landmark_classes_img)) == {0, 1}
    for m, nm, counts in (
        (40, g.map_img, g.landmark_classes_img),
        (10, g.map_txt, g.landmark_classes_txt),
    ):
        assert len(counts) == 5 and counts.min() >= math.ceil(0.5 * m / 5)
        added = len(nm.landmarks) - m
        assert 0 < added <= sum(math.ceil(0.5 * m / k) for k in range(1, 6))
    assert g.solves == f.solves and not g.owes_growth


def test_counted_landmarks_follow_the_growth() -> None:
    """The work counts' landmarks (``_steady_sizes``): the pool's draw before the freeze, then
    those held plus what the classes seen still owe (a class new to them ``ceil(g m / C)`` a
    side); without growth, the pool's draw throughout."""
    pairs = classes_in_turn()
    learner = StreamLearner("sdsrl", 8, 5, {**GROW_PARAMS, "grow_landmarks": 0.5}, seed=0)
    learner.learn(pairs[:90])
    m = learner.model
    assert isinstance(m, SDSRL) and not m.frozen and m._steady_sizes() == (40, 10, 2)
    learner.learn(pairs[90:125])  # frozen at the 100th pair; class 2 from the 120th, pending
    assert m.map_img is not None and m.map_txt is not None and m.owes_growth
    held = len(m.map_img.landmarks), len(m.map_txt.landmarks)
    owed = math.ceil(0.5 * 40 / 3), math.ceil(0.5 * 10 / 3)
    assert m._steady_sizes() == (held[0] + owed[0], held[1] + owed[1], 3)
    learner.learn(pairs[125:])
    assert m._steady_sizes() == (len(m.map_img.landmarks), len(m.map_txt.landmarks), 5)
    frozen = StreamLearner("sdsrl", 8, 5, GROW_PARAMS, seed=0)
    frozen.learn(pairs)
    assert frozen.model._steady_sizes() == (40, 10, 5)  # type: ignore[attr-defined]


def test_growth_rebases_the_statistics_onto_a_span_holding_the_old_one() -> None:
    """``T = U_new' K(new, old) U_old`` carries the old features into the grown map's
    coordinates: on the old landmarks (where the old map is exact) ``T phi_old = phi_new``,
    and the statistics and ``A`` move by ``T``."""
    pairs = classes_in_turn()
    model = SDSRL(8, 5, **{**GROW_PARAMS, "grow_landmarks": 0.5})  # type: ignore[arg-type]
    rng, stats = np.random.default_rng(0), LearnStats()
    for pair in pairs[:100]:
        model._add(pair)
    model._freeze(rng)
    model.solve(rng)
    old, gram, lab, a = model.map_img, model.gram_img, model.lab_img, model.a
    assert old is not None
    for pair in pairs[150:166]:  # a class the pool missed
        model._add(pair)
    model._fold()
    new = model.map_img
    assert new is not None and len(new.landmarks) > len(old.landmarks)
    t = new.proj.T @ old.kernel(new.landmarks) @ old.proj
    np.testing.assert_allclose(
        t @ old.features(old.landmarks).T, new.features(old.landmarks).T, atol=1e-6
    )
    np.testing.assert_allclose(model.a, t @ a)
    phi = new.features(
        np.asarray([power_normalize(p.img, model.power_img) for p in pairs[150:166]])
    )
    np.testing.assert_allclose(model.gram_img, t @ gram @ t.T + phi.T @ phi, rtol=1e-9, atol=1e-9)
    assert model.lab_img.shape == (new.dim, 3) and stats.as_dict() == LearnStats().as_dict()
    np.testing.assert_allclose(model.lab_img[:, :2], t @ lab[:, :2], atol=1e-9)


@pytest.mark.parametrize("cut", [90, 170])
def test_grown_checkpoint_round_trip_continues_identically(cut: int) -> None:
    pairs = classes_in_turn()
    params = {**GROW_PARAMS, "grow_landmarks": 0.5}
    whole, first = whole_and_cut("sdsrl", 8, 5, params, pairs, cut, seed=3)
    resumed = StreamLearner.from_state(*first.state())
    resumed.learn(pairs[cut:])
    assert_same_scores(resumed.model, whole.model, 8, 5)


def test_a_checkpoint_from_before_growth_restores_the_frozen_rule() -> None:
    """A checkpoint without ``grow_landmarks``, the landmarks' class counts nor
    ``grown_classes`` (as written before they came) restores with the landmarks frozen and
    continues as the model that wrote it, bit for bit."""
    pairs = classes_in_turn()
    whole, first = whole_and_cut("sdsrl", 8, 5, GROW_PARAMS, pairs, 170, seed=3)
    arrays, meta = first.state()
    old_arrays = {k: v for k, v in arrays.items() if not k.startswith("model.landmark_classes")}
    assert len(old_arrays) == len(arrays) - 2
    old_meta = copy.deepcopy(meta)
    assert old_meta["params"].pop("grow_landmarks") == 0.0
    old_meta["model_meta"].pop("grown_classes")
    resumed = StreamLearner.from_state(old_arrays, old_meta)
    assert isinstance(resumed.model, SDSRL) and resumed.model.grow_landmarks == 0.0
    resumed.learn(pairs[170:])
    assert_same_scores(resumed.model, whole.model, 8, 5)


def test_two_ranks_split_again_after_rank_zero_grows_for_a_new_class(
    settings: Settings, r: redis.Redis
) -> None:
    """Two ranks (rank 0's worker stepped here, rank 1 a follower on a thread: gloo on
    loopback, a real Redis) learn the classes in turn with growth, then a tail of known
    classes. A round that meets a new class is split and holds the landmarks; the next is
    rank 0's alone and grows them for the class; the round after is split again. Every pair
    is learned once."""
    pairs = classes_in_turn() + class_stream(60, 8, 5, seed=12, n_classes=5)
    StreamProducer(r, settings.namespace).push_pairs(pairs)
    params = {**GROW_PARAMS, "grow_landmarks": 0.5}
    ranks = settings.model_copy(update={"read_batch": 15, "dist_timeout_s": 20.0})
    worker = build_worker(ranks, r, "sdsrl", params=params, world=2)
    assert isinstance(worker, RankZeroWorker)
    follower = RankFollower(r, "sdsrl", 1, 2, namespace=settings.namespace, timeout_s=20.0)
    stop = threading.Event()
    thread = threading.Thread(target=follower.run, args=(stop,), daemon=True)
    thread.start()
    # Per round (a read of 30 pairs): split, landmarks, columns, columns grown, growth owed.
    rounds: list[tuple[bool, int, int, int, bool]] = []
    try:
        worker.prepare(stop)
        assert worker.hold_lease()
        for _ in range(100):
            split_before = worker.split_rounds
            if not worker.step():  # the first read takes over the group's pending entries
                continue
            assert worker.learner is not None
            m = worker.learner.model
            assert isinstance(m, SDSRL) and m.map_img is not None
            rounds.append(
                (
                    worker.split_rounds > split_before,
                    len(m.map_img.landmarks),
                    len(m.class_index),
                    int(np.count_nonzero(m.landmark_classes_img)),
                    m.owes_growth,
                )
            )
            if worker.learner.pairs_seen == len(pairs):
                break
        worker.run(stop, until_idle=True)  # the final checkpoint; the follower is told to stop
    finally:
        stop.set()
        thread.join(30)
    assert len(rounds) == len(pairs) // 30
    m = worker.learner.model  # type: ignore[union-attr]
    assert isinstance(m, SDSRL) and m.map_img is not None and m.map_txt is not None
    for at in range(4, len(rounds) - 1):
        split, size, classes, _, owes = rounds[at]
        if owes:  # a split round met a new class: its landmarks held, every rank's alike
            assert split and size == rounds[at - 1][1] and classes > rounds[at - 1][2]
            grew = rounds[at + 1]  # rank 0 alone, growing for it; then split again
            assert not grew[0] and grew[1] > size and grew[3] == classes and not grew[4]
            assert rounds[at + 2][0]
    assert [at for at, (*_, owes) in enumerate(rounds) if owes] == [4, 6, 8]
    assert all(split for split, *_ in rounds[-2:])
    assert follower.rounds == worker.split_rounds == sum(split for split, *_ in rounds)
    # Each pair counted once, its features in the statistics (forget 1: the weight counts them).
    assert worker.learner.pairs_seen == m.pairs == len(pairs)  # type: ignore[union-attr]
    assert m.weight == len(pairs) and not m.pending_img
    for side, m0 in (("img", 40), ("txt", 10)):
        counts = getattr(m, f"landmark_classes_{side}")
        assert len(counts) == 5 and counts.min() >= math.ceil(0.5 * m0 / 5)
