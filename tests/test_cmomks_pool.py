"""CMOMKS's landmark pool rebuilt from the class-balanced memory (``rebuild_pool``), and the
paper's frozen pool one parameter away."""

import numpy as np

from streamxm.learning.stream_learner import StreamLearner
from streamxm.models.base import LearnStats
from streamxm.models.cmomks import CMOMKS
from streamxm.models.cmomks_pool import balanced_draw, rebuild
from streamxm.serving.gallery import Gallery, GalleryChunk
from streamxm.serving.served import EmbeddedGallery
from streamxm.stream.messages import Pair
from tests.conftest import assert_same_learner, assert_same_scores, class_stream

KERNELS = [{"img_gamma": 0.5, "txt_gamma": 0.5}, {"img_gamma": 4.0, "txt_gamma": 2.0}]
PARAMS = {"kernels": KERNELS, "landmarks": 20, "budget": 30}
BUFFER = {"buffer_capacity": 40, "buffer_memory": 40}


def _class_ordered(n: int = 400) -> list[Pair]:
    return sorted(class_stream(n, 6, 4, seed=6, n_classes=5), key=lambda p: p.labels[0])


def _learner(rebuild_pool: int, **params: object) -> StreamLearner:
    return StreamLearner(
        "cmomks", 6, 4, {**PARAMS, "rebuild_pool": rebuild_pool, **params}, seed=1, **BUFFER
    )


def test_the_balanced_draw_gives_each_class_an_even_share_its_count_allows() -> None:
    groups = np.array([0] * 30 + [1] * 3 + [2] * 12 + [3] * 9)
    picks = balanced_draw(groups, 20, np.random.default_rng(0))
    assert len(set(picks.tolist())) == 20 and np.all(np.diff(picks) > 0)
    # Class 1 gives its 3; the other 17 are shared 6, 6, 5 among classes 0, 2 and 3.
    counts = np.bincount(groups[picks], minlength=4)
    assert counts[1] == 3 and sorted(counts[[0, 2, 3]].tolist()) == [5, 6, 6]


def test_a_class_ordered_stream_rebuilds_the_pool_until_it_holds_every_class_seen() -> None:
    pairs = _class_ordered()
    learner = _learner(5)
    learner.learn(pairs)
    model = learner.model
    assert isinstance(model, CMOMKS)
    assert set(model.pool_group.tolist()) == {0, 1, 2, 3, 4}
    assert 1 <= model.pool_rebuilds <= 4  # every rebuild adds a class; the first pool held one
    # The pool's rows are the memory's, prepared; the search index rows rank as the model does.
    probe_i, probe_t = (
        np.random.default_rng(0).random((5, 6)),
        np.random.default_rng(1).random((7, 4)),
    )
    emb = model.embed_images(probe_i) @ model.embed_texts(probe_t).T
    np.testing.assert_allclose(emb, model.similarity(probe_i, probe_t), rtol=1e-4, atol=1e-6)
    for modality, query, rows in (("image", probe_i, probe_t), ("text", probe_t, probe_i)):
        got = model.index_rows("text" if modality == "image" else "image", rows) @ (
            model.index_query(modality, query).T
        )
        want = model.similarity(probe_i, probe_t)
        np.testing.assert_allclose(
            got, want.T if modality == "image" else want, rtol=1e-4, atol=1e-5
        )


def test_the_papers_frozen_pool_is_one_parameter_away() -> None:
    pairs = _class_ordered()
    learner = _learner(0)
    learner.learn(pairs)
    model = learner.model
    assert isinstance(model, CMOMKS) and model.pool_rebuilds == 0
    assert set(model.pool_group.tolist()) == {0}  # the first 20 pairs: class 0 only
    # A checkpoint from before the pool's classes and the parameter restores the frozen pool.
    arrays, meta = learner.state()
    arrays = {k: v for k, v in arrays.items() if k != "model.pool_group"}
    meta["params"] = {k: v for k, v in meta["params"].items() if k != "rebuild_pool"}
    meta["model_meta"] = {k: v for k, v in meta["model_meta"].items() if k != "pool_rebuilds"}
    before = StreamLearner.from_state(arrays, meta)
    assert isinstance(before.model, CMOMKS) and before.model.rebuild_pool == 0
    more = _class_ordered(600)[400:]
    learner.learn(more)
    before.learn(more)
    assert_same_scores(before.model, learner.model, 6, 4)
    assert np.array_equal(before.model.A, model.A)


def test_a_restored_learner_continues_bit_identically_across_rebuilds() -> None:
    pairs = _class_ordered()
    whole = _learner(5)
    whole.learn(pairs)
    cut = _learner(5)
    cut.learn(pairs[:200])
    assert isinstance(cut.model, CMOMKS) and isinstance(whole.model, CMOMKS)
    assert 1 <= cut.model.pool_rebuilds < whole.model.pool_rebuilds  # rebuilt before and after
    resumed = StreamLearner.from_state(*cut.state())
    resumed.learn(pairs[200:])
    assert_same_learner(resumed, whole)


def _closed_model() -> CMOMKS:
    """A model whose pool is 4 random vectors a side, each twice, with triplets projected."""
    model = CMOMKS(6, 4, kernels=KERNELS, landmarks=8, budget=4, margin=1e3)
    rng = np.random.default_rng(0)
    model.raw = (rng.random((4, 6)), rng.random((4, 4)))  # type: ignore[attr-defined]
    for i in range(8):
        model.img_side.add_to_pool(model.raw[0][i % 4])  # type: ignore[attr-defined]
        model.txt_side.add_to_pool(model.raw[1][i % 4])  # type: ignore[attr-defined]
    model.img_side.close_pool()
    model.txt_side.close_pool()
    for i in range(12):
        img, txt = rng.random((2, 6)).astype(np.float32), rng.random((2, 4)).astype(np.float32)
        model.learn_triplet(img, txt, i % 2 == 1, LearnStats(), group=i % 3)
    assert model.projected == 8
    model.tau[:] = 0.0  # the support's part out: its query points re-centre with the pool
    return model


def _double_differences(model: CMOMKS) -> np.ndarray:
    """``s(v1, t1) - s(v2, t1) - s(v1, t2) + s(v2, t2)`` over probe pairs: the score with the
    terms in one side only (which the centring moves) taken out."""
    probe_i, probe_t = (
        np.random.default_rng(5).random((6, 6)),
        np.random.default_rng(6).random((6, 4)),
    )
    s = model.kernel_scores(probe_i, probe_t)
    return np.asarray(s[:, :-1, :-1] - s[:, 1:, :-1] - s[:, :-1, 1:] + s[:, 1:, 1:])


def test_a_rebuild_keeps_a_exactly_where_the_old_landmarks_lie_in_the_new_pool() -> None:
    """The old pool's 4 points and 4 new ones: the old landmarks lie in the new pool, so the
    re-based ``A`` keeps the double differences of its scores, though the centring moved."""
    model = _closed_model()
    before, c_before = _double_differences(model), model.img_side.c.copy()
    rng = np.random.default_rng(7)
    raw_img, raw_txt = model.raw  # type: ignore[attr-defined]

    class History:
        img = np.vstack([raw_img, rng.random((4, 6))]).astype(np.float32)
        txt = np.vstack([raw_txt, rng.random((4, 4))]).astype(np.float32)

    rebuild(model, History(), np.arange(8), np.arange(8))  # type: ignore[arg-type]
    assert model.pool_rebuilds == 1 and model.pool_group.tolist() == list(range(8))
    assert not np.allclose(model.img_side.c, c_before)
    np.testing.assert_allclose(_double_differences(model), before, rtol=1e-4, atol=1e-5)


def test_a_served_index_is_rebuilt_whole_after_a_pool_rebuild() -> None:
    """The version after a rebuild shares no pool with the earlier one: its index is computed
    anew from the gallery (no update from the earlier rows), and ranks as it scores."""
    pairs = _class_ordered()
    learner = _learner(5)
    learner.learn(pairs[:100])
    earlier = StreamLearner.from_state(*learner.state()).model
    learner.learn(pairs[100:300])
    later = StreamLearner.from_state(*learner.state()).model
    assert isinstance(earlier, CMOMKS) and isinstance(later, CMOMKS)
    assert later.pool_rebuilds > earlier.pool_rebuilds
    assert later.index_update(earlier, "image") is None
    held = GalleryChunk.of(
        np.array([p.id for p in pairs]),
        np.vstack([p.img for p in pairs]),
        np.vstack([p.txt for p in pairs]),
    )
    index = EmbeddedGallery.build(1, earlier.embedding(), Gallery((held,)))
    since = EmbeddedGallery.build(2, later.embedding(), Gallery((held,)), index)
    fresh = EmbeddedGallery.build(2, later.embedding(), Gallery((held,)))
    for modality in ("image", "text"):
        np.testing.assert_array_equal(since.blocks(modality)[0], fresh.blocks(modality)[0])
    query = later.index_query("image", pairs[5].img[None, :])[0]
    np.testing.assert_allclose(
        since.blocks("text")[0] @ query,
        later.similarity(pairs[5].img[None, :], np.vstack([p.txt for p in pairs]))[0],
        rtol=1e-4,
        atol=5e-5,
    )
