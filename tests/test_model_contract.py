"""One contract, every model: through the public :class:`streamxm.Learner`, a saved and loaded
model continues exactly like the original, results do not depend on how the stream is cut into
calls, ``get_params`` matches the constructor, embeddings' inner products are the similarity, and
a bad parameter raises an error that names it."""

from __future__ import annotations

import inspect
import json
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from streamxm import Learner
from streamxm.learning.stream_learner import StreamLearner
from streamxm.models import MODEL_NAMES, model_class
from streamxm.models.heads import SlotFeatures
from streamxm.stream.messages import make_pair
from tests.conftest import class_stream

IMG, TXT = 16, 8
# Sizes that keep the slow models quick on a toy stream; the contract is the same.
SMALL: dict[str, dict[str, Any]] = {
    "cmomks": {"budget": 60, "landmarks": 40, "triplets_per_pair": 2},
    "sam": {"hidden": 32, "dim": 8, "batch_size": 20, "replay": 100, "epoch_pairs": 100},
    "sdsrl": {"m_img": 30, "m_txt": 16, "landmark_pool": 60, "solve_every": 50},
    "scsm": {"window": 120, "solve_every": 50},
    "cca": {"solve_every": 50},
}
# One parameter per model set out of range: the error must name it.
BAD = {
    "cmos": ("C", -1.0),
    "cmomks": ("beta", 1.5),
    "pairwise": ("lr", 0.0),
    "pairwise:bipartite": ("negatives", 0),
    "pairwise:marginal": ("max_classes", 0),
    "cca": ("k", 0),
    "sdsrl": ("forget", 2.0),
    "scsm": ("groups", 1),
    "sam": ("dropout", 1.0),
}


def _stream(n: int = 240, seed: int = 0) -> tuple[np.ndarray, np.ndarray, list[list[int]]]:
    pairs = class_stream(n, IMG, TXT, seed=seed)
    return (
        np.stack([p.img for p in pairs]),
        np.stack([p.txt for p in pairs]),
        [list(p.labels) for p in pairs],
    )


def _learner(model: str) -> Learner:
    return Learner(model, IMG, TXT, seed=0, **SMALL.get(model, {}))


def _state(learner: Learner) -> dict[str, np.ndarray]:
    learner._learner.flush()
    arrays, _ = learner._learner.state()
    return arrays


def _assert_same(a: Learner, b: Learner) -> None:
    sa, sb = _state(a), _state(b)
    assert sorted(sa) == sorted(sb)
    for name in sa:
        assert np.array_equal(sa[name], sb[name]), name


@pytest.mark.parametrize("model", MODEL_NAMES)
def test_a_saved_and_loaded_model_continues_exactly(model: str, tmp_path: Path) -> None:
    imgs, txts, labels = _stream()
    whole = _learner(model)
    whole.learn_many(imgs, txts, labels)
    first = _learner(model)
    first.learn_many(imgs[:150], txts[:150], labels[:150])
    first.save(tmp_path / "m.npz")
    resumed = Learner.load(tmp_path / "m.npz")
    assert resumed.model == model and resumed.pairs_seen == 150
    resumed.learn_many(imgs[150:], txts[150:], labels[150:])
    _assert_same(resumed, whole)


@pytest.mark.parametrize("model", MODEL_NAMES)
def test_results_do_not_depend_on_where_the_stream_is_cut(model: str) -> None:
    imgs, txts, labels = _stream(160)
    at_once = _learner(model)
    at_once.learn_many(imgs, txts, labels)
    one_by_one = _learner(model)
    for i in range(len(imgs)):
        one_by_one.learn_one(imgs[i], txts[i], labels[i])
    ragged = _learner(model)
    for start, stop in ((0, 7), (7, 64), (64, 65), (65, 160)):
        ragged.learn_many(imgs[start:stop], txts[start:stop], labels[start:stop])
    _assert_same(one_by_one, at_once)
    _assert_same(ragged, at_once)


@pytest.mark.parametrize("model", MODEL_NAMES)
def test_get_params_matches_the_constructor(model: str) -> None:
    learner = _learner(model)
    params = learner.get_params()
    signature = [
        p
        for p in inspect.signature(model_class(model).__init__).parameters
        if p not in ("self", "img_dim", "txt_dim")
    ]
    assert sorted(params) == sorted(signature)
    for name, value in SMALL.get(model, {}).items():
        assert params[name] == value
    json.dumps(params)  # checkpoints carry them as JSON
    # The same parameters build the same model.
    again = Learner(model, IMG, TXT, seed=0, **{k: v for k, v in params.items() if k != "variant"})
    assert again.get_params() == params


@pytest.mark.parametrize("model", MODEL_NAMES)
def test_embeddings_inner_products_are_the_similarity(model: str) -> None:
    imgs, txts, labels = _stream()
    learner = _learner(model)
    learner.learn_many(imgs, txts, labels)
    probe_i, probe_t = imgs[:7] + 0.01, txts[:9] + 0.01
    inner = (
        learner.embed_images(probe_i).astype(np.float64)
        @ learner.embed_texts(probe_t).astype(np.float64).T
    )
    assert np.allclose(inner, learner.similarity(probe_i, probe_t), rtol=1e-4, atol=1e-5)
    hits = learner.search(probe_i[0], probe_t, k=4)
    assert [h.index for h in hits] == list(np.argsort(-inner[0], kind="stable")[:4])


@pytest.mark.parametrize("model", MODEL_NAMES)
def test_index_rows_against_index_queries_are_the_similarity(model: str) -> None:
    """What a server's index keeps (the embedding kind's ``rows``) scores against a query of
    the other modality (its ``query``; a fixed space's query moved into the unit rows) as the
    similarity does, both ways."""
    pairs = class_stream(240, IMG, TXT, seed=0)
    learner = StreamLearner(model, IMG, TXT, SMALL.get(model, {}), seed=0)
    learner.learn(pairs)
    learner.flush()
    m = learner.model
    probe_i = np.stack([p.img for p in pairs[:7]]) + 0.01
    probe_t = np.stack([p.txt for p in pairs[:9]]) + 0.01
    want = m.similarity(probe_i, probe_t)
    kind = m.embedding()
    i2t = (
        kind.query("image", probe_i).astype(np.float64)
        @ kind.rows("text", probe_t).astype(np.float64).T
    )
    t2i = (
        kind.rows("image", probe_i).astype(np.float64)
        @ kind.query("text", probe_t).astype(np.float64).T
    )
    np.testing.assert_allclose(i2t, want, rtol=1e-4, atol=1e-5)
    np.testing.assert_allclose(t2i, want, rtol=1e-4, atol=1e-5)
    for modality, target, vectors, items in (
        ("image", "text", probe_i, probe_t),
        ("text", "image", probe_t, probe_i),
    ):
        units = items / np.linalg.norm(items, axis=1, keepdims=True)
        scanned = []
        for vector in vectors.astype(np.float32):
            query, constant = kind.scan_query(modality, target, vector)
            row_of = units if kind.fixed else kind.rows(target, items)
            scanned.append(row_of.astype(np.float64) @ query.astype(np.float64) + constant)
        got = np.array(scanned) if modality == "image" else np.array(scanned).T
        np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("model", MODEL_NAMES)
def test_the_rolling_evaluation_scores_as_the_similarity_does(model: str) -> None:
    """``evaluation_scores`` (kept features of the stored pairs, or the similarity) gives the
    arriving pair's scores against the newest stored pairs that :meth:`similarity` gives, as
    the stream goes on and the kept features age (slots written again, heads re-solved)."""
    pairs = class_stream(400, IMG, TXT, seed=0)
    # A ring of 150 slots: the stream writes every slot again twice over.
    inner = StreamLearner(model, IMG, TXT, SMALL.get(model), buffer_capacity=150, eval_every=10**9)
    kept = SlotFeatures()
    for start in range(0, 400, 40):
        inner.learn(pairs[start : start + 40])
        buffer, model_ = inner.buffer, inner.model
        rows = buffer.order()[buffer.stored :][-inner.eval_gallery :]
        probe = pairs[(start + 17) % 400]
        pair = make_pair("probe", probe.img + 0.01, probe.txt + 0.01, probe.labels)
        i2t, t2i = model_.evaluation_scores(pair, buffer, rows, kept)
        stacked_i = np.vstack([pair.img[None, :], buffer.img[rows]])
        stacked_t = np.vstack([pair.txt[None, :], buffer.txt[rows]])
        assert np.allclose(
            i2t, model_.similarity(pair.img[None, :], stacked_t)[0], rtol=1e-4, atol=1e-5
        )
        assert np.allclose(
            t2i, model_.similarity(stacked_i, pair.txt[None, :])[:, 0], rtol=1e-4, atol=1e-5
        )


@pytest.mark.parametrize("model", MODEL_NAMES)
def test_a_bad_parameter_raises_an_error_naming_it(model: str) -> None:
    name, value = BAD[model]
    with pytest.raises(ValueError, match=rf"^{name} must be "):
        Learner(model, IMG, TXT, **{name: value})
    with pytest.raises(TypeError, match="no_such_parameter"):
        Learner(model, IMG, TXT, no_such_parameter=1)
    with pytest.raises(ValueError, match=r"^model: unknown model"):
        Learner(model + "x", IMG, TXT)
    with pytest.raises(ValueError, match="img_dim"):
        Learner(model, 0, TXT)


@pytest.mark.parametrize("model", MODEL_NAMES)
def test_a_served_model_from_a_checkpoint_scores_as_the_learner_does(model: str) -> None:
    """The server obtains a model from a checkpoint without building a learner around it
    (``model_from_state``): its scores are the restored learner's, bit for bit, even with
    learning deferred in the checkpoint (CMOS's and the moments' pending blocks)."""
    from streamxm.learning.stream_learner import StreamLearner, model_from_state

    imgs, txts, labels = _stream(170)  # not a multiple of any flush or solve period
    learner = _learner(model)
    learner.learn_many(imgs, txts, labels)
    arrays, meta = learner._learner.state()  # as the worker checkpoints: no flush first
    restored = StreamLearner.from_state(arrays, meta)
    restored.flush()
    served = model_from_state(arrays, meta)
    np.testing.assert_array_equal(
        served.similarity(imgs[:20], txts), restored.model.similarity(imgs[:20], txts)
    )
