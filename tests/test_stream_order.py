"""Streams as they arrive: class-ordered and noisy benchmark streams, and the class-balanced
memory of the replay buffer (bounded, balanced, checkpointed exactly)."""

from __future__ import annotations

import json
import subprocess
from pathlib import Path

import numpy as np
import pytest

from streamxm.learning.learner import StreamLearner
from streamxm.learning.replay import ReplayBuffer
from streamxm.stream.messages import make_pair
from streamxm.tools.datasets import load_dataset, noisy_labels, stream_order
from streamxm.worker.checkpoint import Checkpoint, decode_blob, encode_blob
from tests.conftest import PY, assert_same_learner, class_stream


def test_class_order_is_stable_and_noise_changes_exactly_the_asked_fraction() -> None:
    rng = np.random.default_rng(0)
    y = rng.integers(0, 5, size=400)
    rows = stream_order(y, "class")
    assert (np.diff(y[rows]) >= 0).all()
    for c in range(5):  # stable: file order within a class
        assert (np.diff(rows[y[rows] == c]) > 0).all()
    assert sorted(stream_order(y, "shuffled", seed=3).tolist()) == list(range(400))
    noisy = noisy_labels(y, 0.2, seed=0)
    changed = [i for i, labels in enumerate(noisy) if labels != [int(y[i])]]
    assert len(changed) == 80 and all(noisy[i][0] != y[i] for i in changed)
    assert noisy == noisy_labels(y, 0.2, seed=0) != noisy_labels(y, 0.2, seed=1)
    with pytest.raises(ValueError, match="order"):
        stream_order(y, "random")


def test_memory_stays_balanced_and_bounded_over_a_long_class_ordered_stream() -> None:
    buf = ReplayBuffer(100, 2, 1, memory=60, seed=0)
    for i in range(20_000):
        c = i // 2000  # ten classes, one after the other
        buf.add(make_pair(str(i), [float(c), 1.0], [1.0], labels=[c]))
    memory = buf.labels[buf.recent :, 0]
    assert len(buf) == 100 and buf.stored == 60
    assert np.bincount(memory, minlength=10).tolist() == [6] * 10
    # Each class keeps a uniform sample of its own history, not its first or last pairs.
    ring = buf.labels[: buf.recent, 0]
    assert set(ring.tolist()) == {9}
    # The rows moved with their labels (image feature 0 is the class).
    assert np.array_equal(buf.img[buf.recent :, 0], memory.astype(np.float32))


def test_unlabelled_pairs_keep_a_uniform_sample_of_the_whole_history() -> None:
    buf = ReplayBuffer(300, 1, 1, memory=200, seed=1)
    for i in range(10_000):
        buf.add(make_pair(str(i), [float(i)], [0.0]))
    kept = buf.img[buf.recent :, 0]
    # A reservoir: spread over the history evicted from the ring (0 .. 9,899) in proportion.
    counts = np.histogram(kept, bins=5, range=(0, 9900))[0]
    assert counts.min() >= 25, counts


def test_a_learner_with_memory_continues_exactly_after_a_checkpoint() -> None:
    pairs = class_stream(1200, 8, 4, seed=5)
    pairs.sort(key=lambda p: p.labels[0])  # class order: the memory does real work
    for model, params in (("cmos", {"replay": 2}), ("pairwise:marginal", None)):
        whole = StreamLearner(model, 8, 4, params, seed=0, buffer_capacity=120, buffer_memory=80)
        whole.learn(pairs)
        first = StreamLearner(model, 8, 4, params, seed=0, buffer_capacity=120, buffer_memory=80)
        first.learn(pairs[:700])
        arrays, meta = first.state()
        ckpt = decode_blob(encode_blob(Checkpoint(1, arrays, meta)))
        resumed = StreamLearner.from_state(ckpt.arrays, ckpt.meta)
        assert resumed.buffer.memory == 80 and resumed.buffer.stored == 80
        resumed.learn(pairs[700:])
        assert_same_learner(resumed, whole)


def test_bench_quality_streams_in_the_asked_order_with_noise(tmp_path: Path) -> None:
    rng = np.random.default_rng(0)
    centres = rng.normal(size=(3, 8))
    y = rng.integers(3, size=150)
    img, txt = centres[y] + 0.5 * rng.normal(size=(150, 8)), centres[y, :5] + 0.5 * rng.normal(
        size=(150, 5))
    path = tmp_path / "tiny.npz"
    np.savez(path, img_train=img[:120], txt_train=txt[:120], y_train=y[:120],
             img_test=img[120:], txt_test=txt[120:], y_test=y[120:])
    assert len(load_dataset(path).y_train) == 120
    out = subprocess.run([*PY, "bench", "quality", "--dataset", str(path), "--model", "cmos",
                          "--order", "class", "--label-noise", "0.2", "--buffer-memory", "100",
                          "--json"], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr[-2000:]
    result = json.loads(out.stdout)
    assert (result["order"], result["label_noise"], result["buffer_memory"]) == ("class", 0.2,
                                                                                 100)
    assert isinstance(result["drift_detections"], int) and result["map_i2t"] > 0
    bad = subprocess.run([*PY, "bench", "quality", "--dataset", str(path), "--model", "cmos",
                          "--label-noise", "1.5"], capture_output=True, text=True, timeout=60)
    assert bad.returncode == 2 and "fraction" in bad.stderr


def test_cmos_replay_learns_remembered_queries_and_is_checked() -> None:
    pairs = sorted(class_stream(600, 8, 4, seed=6), key=lambda p: p.labels[0])
    plain = StreamLearner("cmos", 8, 4, {"triplets_per_pair": 2, "replay": 0}, seed=0,
                          buffer_capacity=120, buffer_memory=80)
    plain.learn(pairs)
    rehearsed = StreamLearner("cmos", 8, 4, {"triplets_per_pair": 2, "replay": 2}, seed=0,
                              buffer_capacity=120, buffer_memory=80)
    rehearsed.learn(pairs)
    # Up to two more triplets per pair once the memory holds pairs (after the first 40); fewer
    # while it holds too few classes for a negative.
    extra = sum(rehearsed.stats.triplets.values()) - sum(plain.stats.triplets.values())
    assert 600 - 40 <= extra <= 2 * (600 - 40)
    with pytest.raises(ValueError, match="replay"):
        StreamLearner("cmos", 8, 4, {"replay": -1})



@pytest.mark.parametrize("model", ["cmos", "pairwise", "pairwise:marginal", "cca"])
def test_each_model_gets_its_own_memory_unless_told(model: str) -> None:
    """CMOS replays remembered queries, so by default its buffer keeps a class-balanced memory
    (15%) and it replays one per pair; the others keep the ring their figures were tuned on.
    An explicit size, 0 included, wins; a checkpoint keeps the size it was written with."""
    learner = StreamLearner(model, 8, 4, seed=0, buffer_capacity=200)
    expected = 30 if model == "cmos" else 0
    assert learner.buffer.memory == expected
    if model == "cmos":
        assert learner.model.params()["replay"] == 1
    assert StreamLearner(model, 8, 4, seed=0, buffer_capacity=200,
                         buffer_memory=0).buffer.memory == 0
    assert StreamLearner(model, 8, 4, seed=0, buffer_capacity=200,
                         buffer_memory=50).buffer.memory == 50
    learner.learn(sorted(class_stream(400, 8, 4, seed=2), key=lambda p: p.labels[0]))
    if expected:  # the classes that stopped arriving are still remembered, beside the last one
        remembered = set(learner.buffer.labels[learner.buffer.recent :, 0].tolist())
        assert remembered == {0, 1, 2}
        assert set(learner.buffer.labels[: learner.buffer.size, 0].tolist()) == {0, 1, 2, 3}


def test_bench_order_checks_each_model_against_the_reference(tmp_path: Path) -> None:
    """``streamxm bench order`` runs each model in file order, class order and with wrong labels
    (only where the model reads labels) and derives every check from the figures it prints."""
    rng = np.random.default_rng(1)
    centres = rng.normal(size=(3, 8))
    y = rng.integers(3, size=150)
    img = centres[y] + 0.5 * rng.normal(size=(150, 8))
    txt = centres[y, :5] + 0.5 * rng.normal(size=(150, 5))
    path = tmp_path / "tiny.npz"
    np.savez(path, img_train=img[:120], txt_train=txt[:120], y_train=y[:120],
             img_test=img[120:], txt_test=txt[120:], y_test=y[120:])
    out = subprocess.run([*PY, "bench", "order", "--dataset", str(path), "--model", "cmos",
                          "--model", "scsm", "--label-noise", "0.3", "--json"],
                         capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-2000:]
    result = json.loads(out.stdout)
    assert (result["benchmark"], result["label_noise"], result["reference"]) == (
        "stream-order", 0.3, "cca")
    ref = result["reference_runs"]
    rows = {row["model"]: row for row in result["models"]}
    assert list(rows) == ["cmos", "scsm"]
    assert rows["scsm"]["noisy"] is None  # it never reads a label
    assert rows["cmos"]["noisy"] is not None and rows["cmos"]["file"]["buffer_memory"] == 75
    for row in rows.values():
        f, c = row["file"], row["class"]
        for d in ("map_i2t", "map_t2i"):
            assert row["class_share"][d] == pytest.approx(c[d] / f[d])
        checks = row["checks"]
        assert checks["class_keeps_share"] == (min(row["class_share"].values()) >= 0.97)
        assert checks["class_reaches_reference"] == (c["mean"] >= ref["class"]["mean"])
        assert checks["file_drift_quiet"] == (f["drift_detections"] <= 3)
        assert row["met"] == all(checks.values())
    noisy = rows["cmos"]["noisy"]
    assert rows["cmos"]["checks"]["noisy_beats_reference"] == (
        noisy["mean"] > ref["noisy"]["mean"])
    assert result["all_met"] == all(row["met"] for row in rows.values())
    bad = subprocess.run([*PY, "bench", "order", "--dataset", str(path), "--model", "nope"],
                         capture_output=True, text=True, timeout=60)
    assert bad.returncode == 2 and "unknown model" in bad.stderr


def test_a_cmos_checkpoint_from_before_replay_continues_as_it_learned() -> None:
    """A checkpoint written before ``replay`` existed (a memory, no ``replay`` key) is restored
    with replay off, as it learned, not with today's default of one replayed query per pair."""
    pairs = sorted(class_stream(500, 8, 4, seed=4), key=lambda p: p.labels[0])
    then = StreamLearner("cmos", 8, 4, {"replay": 0}, seed=0, buffer_capacity=120,
                         buffer_memory=80)
    then.learn(pairs[:250])
    arrays, meta = then.state()
    del meta["params"]["replay"]  # as such a checkpoint has it
    restored = StreamLearner.from_state(arrays, meta)
    assert restored.model.params()["replay"] == 0 and restored.buffer.memory == 80
    restored.learn(pairs[250:])
    then.learn(pairs[250:])
    assert_same_learner(restored, then)
    fresh = StreamLearner("cmos", 8, 4, seed=0, buffer_capacity=120, buffer_memory=80)
    assert fresh.model.params()["replay"] == 1  # the default only for a fresh learner
