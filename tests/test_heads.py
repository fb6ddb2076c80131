"""Linear heads (streamxm/models/heads.py): a gallery embedded from kept features equals the
model's own embedding, for every model that has one, within the bound of how a large gallery
keeps the features (sdsrl's kernel rows: float16), and kept kernel rows are extended when
sdsrl's provisional landmarks grow."""

from __future__ import annotations

import numpy as np
import pytest

from streamxm.buffer.replay import ReplayBuffer
from streamxm.learning.stream_learner import StreamLearner
from streamxm.models.heads import RbfFeatures, SlotFeatures, power_features
from streamxm.serving.candidates import scan_margin
from streamxm.serving.gallery import GalleryChunk
from tests.conftest import IMG, TXT, class_stream
from tests.test_model_contract import SMALL


@pytest.mark.parametrize("name", ["cca", "scsm", "sdsrl", "pairwise:marginal"])
def test_a_linear_head_embeds_the_gallery_as_the_model_does(name: str) -> None:
    pairs = class_stream(200, IMG, TXT, seed=4)
    learner = StreamLearner(name, IMG, TXT, SMALL.get(name.split(":")[0], {}), seed=0)
    learner.learn(pairs[:150])
    learner.flush()
    model = learner.model
    gallery = pairs[150:]
    chunk = GalleryChunk.of(
        np.array([p.id for p in gallery]),
        np.stack([p.img for p in gallery]),
        np.stack([p.txt for p in gallery]),
    )
    for modality, embed, other in (
        ("image", model.embed_images, model.embed_texts),
        ("text", model.embed_texts, model.embed_images),
    ):
        head = model.linear_head(modality)
        assert head is not None
        want = embed(chunk.raw(modality)).astype(np.float64)
        units = chunk.unit(modality)
        computed = units if head.features is None else head.features(units)
        np.testing.assert_allclose(head.embed(computed), want, rtol=1e-5, atol=1e-6)
        if head.features is not None:
            np.testing.assert_array_equal(chunk.features(modality, head.features), computed)
        kept = chunk.features(modality, head.features, compact=True)  # a large gallery's
        got = head.embed(kept).astype(np.float64)
        error = chunk.kept_error(modality, head.features) if head.features else 0.0
        assert (error > 0) == (name == "sdsrl") == (kept.dtype == np.float16), name
        # Scores by the kept features stay within the search's rounding margin of the model's,
        # plus the bound of the kept features' rounding where there is one.
        queries = other(
            np.stack([p.txt if modality == "image" else p.img for p in pairs[:20]])
        ).astype(np.float64)
        exact, scanned = queries @ want.T, queries @ got.T
        reach = np.linalg.norm(queries, axis=1)[:, None] * np.linalg.norm(got, axis=1).max()
        margin = np.vectorize(scan_margin)(scanned, reach) / 10  # a tenth of it, at most
        bounds = np.array([head.score_error(error, q) for q in queries])[:, None]
        assert np.all(np.abs(exact - scanned) <= margin + bounds), name
        if error:  # the bound is not vacuous: within 20x of the largest error seen
            assert np.abs(exact - scanned).max() > bounds.max() / 20, name


def test_kernel_rows_are_kept_in_half_the_bytes_within_their_bound() -> None:
    """Each kept kernel row is within ``kept_error`` (L2) of the float32 row, keeping restored
    rows again changes no bit, and values near 1 keep more than float16's spacing there."""
    rng = np.random.default_rng(1)
    units = rng.random((500, IMG), dtype=np.float32)
    units /= np.linalg.norm(units, axis=1, keepdims=True)
    fmap = RbfFeatures(None, units[:60].astype(np.float64), 0.05)  # values near 1
    computed = fmap(units)
    kept = fmap.keep(computed)
    assert kept.dtype == np.float16 and kept.nbytes * 2 == computed.nbytes
    restored = fmap.restore(kept)
    errors = np.linalg.norm(restored - computed, axis=1)
    assert errors.max() <= fmap.kept_error(kept)
    assert errors.max() > fmap.kept_error(kept) / 10
    np.testing.assert_array_equal(fmap.keep(restored), kept)
    assert np.abs(restored - computed).max() < 2.0**-13  # float16 of the values: 2^-12


def test_kernel_rows_to_grown_landmarks_reuse_the_kept_columns() -> None:
    rng = np.random.default_rng(0)
    rows = rng.random((300, IMG), dtype=np.float32)
    chunk = GalleryChunk.of(
        np.array([str(i) for i in range(300)]), rows, rng.random((300, TXT), dtype=np.float32)
    )
    landmarks = rng.random((40, IMG))
    landmarks /= np.linalg.norm(landmarks, axis=1, keepdims=True)
    first = RbfFeatures(power_features(0.5), landmarks[:25], 1.0)
    grown = RbfFeatures(power_features(0.5), landmarks, 1.0)
    fresh = grown(chunk.unit("image"))
    for compact in (False, True):  # float32, and float16 as a large gallery keeps them
        chunk = GalleryChunk.of(chunk.ids, chunk.raw("image"), chunk.raw("text"))
        kept = chunk.features("image", first, compact)
        extended = chunk.features("image", grown, compact)  # 25 kept columns and 15 new
        np.testing.assert_array_equal(extended[:, :25], kept)
        assert extended.dtype == (np.float16 if compact else np.float32)
        errors = np.linalg.norm(grown.restore(extended) - fresh, axis=1)
        assert errors.max() <= max(grown.kept_error(extended), 1e-6)
    other = RbfFeatures(power_features(0.5), landmarks[::-1].copy(), 1.0)  # not a prefix
    assert other.extend({first.key: kept}, chunk.features("image", first.inputs)) is None


def test_kept_features_of_runs_of_slots_are_read_in_place() -> None:
    """The ring's newest pairs in any rotation (two runs of slots) are views of the kept rows
    that together equal the gathered copy; scattered slots are gathered."""
    buffer = ReplayBuffer(12, IMG, TXT)
    for pair in class_stream(17, IMG, TXT, seed=3):  # the ring has wrapped
        buffer.add(pair)
    kept, fmap = SlotFeatures(), power_features(0.5)
    for rows in (buffer.order()[-8:], buffer.order(), buffer.order()[:4]):
        runs = kept.runs(fmap, "image", buffer, rows)
        assert len(runs) == 1 + int(not np.array_equal(rows, np.sort(rows)))
        assert all(np.shares_memory(run, kept._kept["image"][1]) for run in runs)
        np.testing.assert_array_equal(
            np.concatenate(runs), kept.features(fmap, "image", buffer, rows)
        )
    scattered = np.array([0, 5, 9], dtype=np.intp)
    (gathered,) = kept.runs(fmap, "image", buffer, scattered)
    assert not np.shares_memory(gathered, kept._kept["image"][1])
    np.testing.assert_array_equal(gathered, kept.features(fmap, "image", buffer, scattered))
