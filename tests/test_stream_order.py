"""Streams as they arrive: class-ordered and noisy benchmark streams, and the class-balanced
memory of the replay buffer (bounded, balanced, checkpointed exactly)."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

from streamxm.buffer.replay import BURST_THRESHOLD, MAX_GROUPS, ReplayBuffer
from streamxm.learning.stream_learner import StreamLearner
from streamxm.models.sam import SAM
from streamxm.storage.checkpoint import Checkpoint, decode_blob, encode_blob
from streamxm.stream.messages import Pair, make_pair
from streamxm.tools.datasets import load_dataset, noisy_labels, stream_order
from tests.conftest import (
    assert_same_learner,
    class_stream,
    cli_json,
    run_cli,
    three_class_benchmark,
)


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
    # A reservoir: spread over the whole history (0 .. 9,999) in proportion.
    counts = np.histogram(kept, bins=5, range=(0, 10_000))[0]
    assert counts.min() >= 25, counts


def test_a_learner_with_memory_continues_exactly_after_a_checkpoint() -> None:
    pairs = class_stream(1200, 8, 4, seed=5)
    pairs.sort(key=lambda p: p.labels[0])  # class order: the memory does real work
    # Pairwise: the checkpoint falls between whitener refreshes with 60 moment rows pending
    # (700 = 10 x 64 + 60) and a cache of whitened rows that the restored learner rebuilds.
    whitening = {"whiten_first": 16, "whiten_every": 100}
    for model, params in (
        ("cmos", {"replay": 2}),
        ("pairwise:marginal", None),
        ("pairwise", whitening),
        ("pairwise:bipartite", whitening),
        ("cca", {"solve_every": 100}),
    ):
        whole = StreamLearner(model, 8, 4, params, seed=0, buffer_capacity=120, buffer_memory=80)
        whole.learn(pairs)
        first = StreamLearner(model, 8, 4, params, seed=0, buffer_capacity=120, buffer_memory=80)
        first.learn(pairs[:700])
        arrays, meta = first.state()
        ckpt = decode_blob(encode_blob(Checkpoint(1, arrays, meta)))
        resumed = StreamLearner.from_state(ckpt.arrays, ckpt.meta)
        assert resumed.buffer.memory == 80 and resumed.buffer.stored == 80
        assert resumed.buffer.recent == 120 and resumed.buffer.bursty()  # the memory is in use
        resumed.learn(pairs[700:])
        assert_same_learner(resumed, whole)


def test_bench_quality_streams_in_the_asked_order_with_noise(tmp_path: Path) -> None:
    path = three_class_benchmark(tmp_path / "tiny.npz", seed=0, n=150, n_train=120)
    assert len(load_dataset(path).y_train) == 120
    quality = ("bench", "quality", "--dataset", str(path), "--model", "cmos")
    result = cli_json(
        *quality,
        *("--order", "class", "--label-noise", "0.2", "--buffer-memory", "100", "--json"),
        timeout=120,
    )
    assert (result["order"], result["label_noise"], result["buffer_memory"]) == ("class", 0.2, 100)
    assert isinstance(result["drift_detections"], int) and result["map_i2t"] > 0
    bad = run_cli(*quality, "--label-noise", "1.5")
    assert bad.returncode == 2 and "fraction" in bad.stderr


def burst_pairs(pairs: list[Pair], ring: int, memory: int) -> int:
    """How many of ``pairs`` arrive while a learner's buffer is in a burst with its memory
    drawable (the ring full), by the buffer alone."""
    buf = ReplayBuffer(ring + memory, 1, 1, memory=memory)
    count = 0
    for pair in pairs:
        buf.add(make_pair(pair.id, [0.0], [0.0], labels=list(pair.labels)))
        count += buf.drawable() > buf.recent
    return count


def test_cmos_replays_remembered_queries_during_a_burst_only() -> None:
    pairs = sorted(class_stream(600, 8, 4, seed=6), key=lambda p: p.labels[0])

    def learned(replay: int) -> StreamLearner:
        params = {"triplets_per_pair": 2, "replay": replay}
        learner = StreamLearner("cmos", 8, 4, params, seed=0, buffer_capacity=120, buffer_memory=80)
        learner.learn(pairs)
        return learner

    plain, rehearsed = learned(0), learned(2)
    # Up to two more triplets per pair that arrives in a burst (fewer where a remembered query
    # finds no negative), none otherwise.
    bursts = burst_pairs(pairs, 120, 80)
    extra = sum(rehearsed.stats.triplets.values()) - sum(plain.stats.triplets.values())
    assert 200 <= bursts < 600 and bursts <= extra <= 2 * bursts
    # The learner counts the pairs that arrived in a burst (the ring need not be full).
    assert bursts <= rehearsed.pairs_in_burst < 600
    arrays, meta = rehearsed.state()
    assert StreamLearner.from_state(arrays, meta).pairs_in_burst == rehearsed.pairs_in_burst
    with pytest.raises(ValueError, match="replay"):
        StreamLearner("cmos", 8, 4, {"replay": -1})


@pytest.mark.parametrize(
    "model",
    ["cmos", pytest.param("cmomks", marks=pytest.mark.long), "pairwise", "pairwise:marginal"],
)
def test_a_well_mixed_stream_is_learned_exactly_as_without_memory(model: str) -> None:
    """The memory is drawn from during a burst only: on a stream whose classes are mixed
    (never a burst) a learner with a memory learns bit for bit as one with the ring alone,
    so the file-order figures do not move; in class order the two part."""
    params = {"budget": 40, "landmarks": 20} if model == "cmomks" else None
    mixed = class_stream(500, 8, 4, seed=3)
    # No rolling evaluation: it learns nothing, and for CMOMKS it is most of the time.
    ring_only = StreamLearner(
        model, 8, 4, params, seed=0, buffer_capacity=120, buffer_memory=0, eval_every=10**9
    )
    remembering = StreamLearner(
        model, 8, 4, params, seed=0, buffer_capacity=120, buffer_memory=120, eval_every=10**9
    )
    for learner in (ring_only, remembering):
        learner.learn(mixed)
    assert burst_pairs(mixed, 120, 120) == 0 == remembering.pairs_in_burst
    ring_arrays, _ = ring_only.model.state()
    memory_arrays, _ = remembering.model.state()
    for name, array in ring_arrays.items():
        assert np.array_equal(array, memory_arrays[name]), name
    bursty = sorted(mixed, key=lambda p: p.labels[0])
    for learner in (ring_only, remembering):
        learner.learn(bursty)
    ring_arrays, _ = ring_only.model.state()
    memory_arrays, _ = remembering.model.state()
    assert any(not np.array_equal(a, memory_arrays[k]) for k, a in ring_arrays.items())


def test_the_burst_signal_tells_a_topic_burst_from_a_mixed_stream() -> None:
    """``burst`` is how much more the last 100 arrivals are concentrated on few classes than a
    random sample of the stream's mix: exact on a hand-made stream, decided in integers (the
    same after a checkpoint), quiet on random streams of 10 or 1,000 classes (a distance between
    the mixes would call the latter a burst forever), loud when topics come one at a time."""
    buf = ReplayBuffer(300, 1, 1, memory=100)
    for i in range(400):  # 30 of each of ten classes, then classes 3 and 4 alternating
        label = i % 10 if i < 300 else 3 + i % 2
        buf.add(make_pair(str(i), [0.0], [0.0], labels=[label]))
    # window: 50 / 50, S = 0.5; stream: 80, 80 and eight classes of 30 out of 400.
    p = (2 * 80**2 + 8 * 30**2) / 400**2
    expected = p + (1 - p) / 100
    assert buf.burst() == pytest.approx((0.5 - expected) / (1 - expected))  # 0.42
    assert buf.bursty() and buf.drawable() == 300
    arrays, meta = buf.state()
    restored = ReplayBuffer.from_state(arrays, json.loads(json.dumps(meta)))
    assert restored.burst() == buf.burst() and restored.bursty()
    assert (restored.window, restored.window_sq, restored.arrived_sq) == (
        buf.window,
        buf.window_sq,
        buf.arrived_sq,
    )
    rng = np.random.default_rng(0)
    for classes in (10, 1000):
        mixed = ReplayBuffer(300, 1, 1, memory=100)
        for i in range(3000):
            mixed.add(make_pair(str(i), [0.0], [0.0], labels=[int(rng.integers(classes))]))
            assert not mixed.bursty(), (classes, i, mixed.burst())
        assert mixed.drawable() == mixed.recent == 200
    topics = ReplayBuffer(300, 1, 1, memory=100)
    flags = []
    for i in range(3000):  # 50 classes, 60 pairs each, one after the other
        topics.add(make_pair(str(i), [0.0], [0.0], labels=[i // 60]))
        flags.append(topics.bursty())
        assert flags[-1] == (topics.burst() > BURST_THRESHOLD)
    assert sum(flags[100:]) >= 0.9 * 2900
    unlabelled = ReplayBuffer(300, 1, 1, memory=100)
    for i in range(400):
        unlabelled.add(make_pair(str(i), [0.0], [0.0]))
    assert unlabelled.burst() == 0.0 and unlabelled.drawable() == 200


@pytest.mark.long
def test_the_counts_per_class_stay_bounded_however_many_labels_arrive() -> None:
    """Labels may be ids up to a million: the buffer's counts (and the checkpoint's JSON) keep
    at most 2 * MAX_GROUPS + 1 keys, a random order of 50,000 distinct labels still reads as no
    burst, ids arriving one topic at a time still read as bursts, and a checkpoint written with a
    count per label restores summed onto the bounded keys."""
    rng = np.random.default_rng(1)
    ids = rng.choice(1_000_001, size=50_000, replace=False)
    mixed = ReplayBuffer(300, 1, 1, memory=100)
    for i, label in enumerate(ids.tolist()):
        mixed.add(make_pair(str(i), [0.0], [0.0], labels=[label]))
        assert not mixed.bursty(), (i, mixed.burst())
    assert len(mixed.arrived) <= 2 * MAX_GROUPS and len(mixed.seen) <= 2 * MAX_GROUPS
    assert sum(mixed.arrived.values()) == sum(mixed.seen.values()) == len(ids)
    _, meta = mixed.state()
    assert len(json.dumps(meta)) < 300_000  # ~27 bytes a key, not one per label
    topics = ReplayBuffer(300, 1, 1, memory=100)
    flags = []
    for i in range(3000):  # 30 topics of 100 pairs, each topic one large id
        topics.add(make_pair(str(i), [0.0], [0.0], labels=[int(ids[i // 100])]))
        flags.append(topics.bursty())
    assert sum(flags[100:]) >= 0.9 * 2900
    arrays, meta = topics.state()
    meta["arrived"] = [[int(ids[t]), 100] for t in range(30)]  # as written before the bound
    restored = ReplayBuffer.from_state(arrays, json.loads(json.dumps(meta)))
    assert restored.arrived == topics.arrived and restored.arrived_sq == topics.arrived_sq
    assert restored.bursty() == topics.bursty()


def test_a_checkpoint_from_before_the_burst_signal_offers_its_ring_to_the_memory() -> None:
    """Such a buffer (memory filled from the pairs the ring evicted; no ``arrived``) restores
    with its ring's pairs offered to the memory, as the new buffer offers every arrival, and
    the stream's mix is what the memory has been offered."""
    buf = ReplayBuffer(60, 1, 1, memory=20, seed=3)
    for i in range(200):
        buf.add(make_pair(str(i), [float(i)], [0.0], labels=[i // 50]))
    arrays, meta = buf.state()
    del meta["arrived"]
    old = ReplayBuffer.from_state(arrays, meta)
    assert sum(old.seen.values()) == sum(buf.seen.values()) + 40  # the ring, offered once more
    assert old.arrived == old.seen and old.arrived_sq == sum(n * n for n in old.seen.values())
    assert old.size == old.recent + old.stored and old.stored == 20
    old.add(make_pair("next", [1.0], [0.0], labels=[3]))  # and it goes on, counting as it goes
    assert old.arrived == old.seen


@pytest.mark.parametrize("model", ["cmos", "pairwise", "pairwise:marginal", "cca"])
def test_each_model_gets_its_own_memory_unless_told(model: str) -> None:
    """The models that draw from the buffer keep a class-balanced memory beside the ring by
    default (cmos and the marginal model twice the ring); the order-free ones none. An explicit
    size, 0 included, wins; a checkpoint keeps the size it was written with."""
    learner = StreamLearner(model, 8, 4, seed=0, buffer_capacity=200)
    expected = {"cmos": 400, "pairwise": 200, "pairwise:marginal": 400, "cca": 0}[model]
    assert learner.buffer.memory == expected and learner.buffer.recent == 200
    if model == "cmos":
        assert learner.model.params()["replay"] == 6
    assert (
        StreamLearner(model, 8, 4, seed=0, buffer_capacity=200, buffer_memory=0).buffer.memory == 0
    )
    assert (
        StreamLearner(model, 8, 4, seed=0, buffer_capacity=200, buffer_memory=50).buffer.memory
        == 50
    )
    learner.learn(sorted(class_stream(400, 8, 4, seed=2), key=lambda p: p.labels[0]))
    if expected:  # the classes that stopped arriving are still remembered, beside the last ones
        remembered = set(learner.buffer.labels[learner.buffer.recent :, 0].tolist())
        assert remembered == {0, 1, 2, 3}
        assert set(learner.buffer.labels[: learner.buffer.recent, 0].tolist()) <= {1, 2, 3}


@pytest.mark.long
def test_bench_order_checks_each_model_against_its_own_file_order_over_seeds(
    tmp_path: Path,
) -> None:
    """``streamxm bench order --seeds`` runs each model in file order, class order and with
    wrong labels (only where the model reads labels) per seed, and derives every mean, share and
    check from the per-seed figures it prints."""
    path = three_class_benchmark(tmp_path / "tiny.npz", seed=1, n=150, n_train=120)
    result = cli_json(
        *("bench", "order", "--dataset", str(path), "--model", "cmos", "--model", "scsm"),
        *("--label-noise", "0.3", "--seeds", "0,1", "--json"),
        timeout=300,
    )
    assert (result["benchmark"], result["label_noise"], result["seeds"]) == (
        "stream-order",
        0.3,
        [0, 1],
    )
    rows = {row["model"]: row for row in result["models"]}
    assert list(rows) == ["cmos", "scsm"]
    assert rows["scsm"]["noisy"] is None and rows["scsm"]["noisy_share"] is None
    assert rows["cmos"]["file"]["per_seed"][0]["buffer_memory"] == 1000
    for row in rows.values():
        conditions = ["file", "class"] + (["noisy"] if row["noisy"] else [])
        for name in conditions:
            run = row[name]
            assert [s["seed"] for s in run["per_seed"]] == [0, 1]
            for d in ("map_i2t", "map_t2i"):
                values = [s[d] for s in run["per_seed"]]
                assert run["mean"][d] == pytest.approx(np.mean(values))
                assert run["std"][d] == pytest.approx(np.std(values))
        for d in ("map_i2t", "map_t2i"):
            assert row["class_share"][d] == pytest.approx(
                row["class"]["mean"][d] / row["file"]["mean"][d]
            )
        checks = row["checks"]
        assert checks["class_keeps_share"] == (min(row["class_share"].values()) >= 0.97)
        assert row["met"] == all(checks.values())
    cmos = rows["cmos"]
    for d in ("map_i2t", "map_t2i"):
        assert cmos["noisy_share"][d] == pytest.approx(
            cmos["noisy"]["mean"][d] / cmos["file"]["mean"][d]
        )
    assert cmos["checks"]["noisy_keeps_share"] == (min(cmos["noisy_share"].values()) >= 0.93)
    assert rows["scsm"]["checks"]["noisy_keeps_share"]  # reads no label: nothing to keep
    # Seeds differ: at least one condition's figures move with the seed.
    assert any(
        row[n]["std"][d] > 0
        for row in rows.values()
        for n in ("file", "class")
        for d in ("map_i2t", "map_t2i")
    )
    assert result["all_met"] == all(row["met"] for row in rows.values())
    bad = run_cli("bench", "order", "--dataset", str(path), "--model", "nope")
    assert bad.returncode == 2 and "unknown model" in bad.stderr
    twice = run_cli("bench", "order", "--dataset", str(path), "--seeds", "1,1")
    assert twice.returncode == 2 and "repeats a seed" in twice.stderr


def test_a_cmos_checkpoint_from_before_replay_continues_as_it_learned() -> None:
    """A checkpoint written before ``replay`` existed (a memory, no ``replay`` key) is restored
    with replay off, as it learned, not with today's default of six replayed queries per pair."""
    pairs = sorted(class_stream(500, 8, 4, seed=4), key=lambda p: p.labels[0])
    then = StreamLearner("cmos", 8, 4, {"replay": 0}, seed=0, buffer_capacity=120, buffer_memory=80)
    then.learn(pairs[:250])
    arrays, meta = then.state()
    del meta["params"]["replay"]  # as such a checkpoint has it
    restored = StreamLearner.from_state(arrays, meta)
    assert restored.model.params()["replay"] == 0 and restored.buffer.memory == 80
    restored.learn(pairs[250:])
    then.learn(pairs[250:])
    assert_same_learner(restored, then)
    fresh = StreamLearner("cmos", 8, 4, seed=0, buffer_capacity=120, buffer_memory=80)
    assert fresh.model.params()["replay"] == 6  # the default only for a fresh learner


def test_a_blank_memory_setting_means_the_models_own(monkeypatch: pytest.MonkeyPatch) -> None:
    from streamxm.config import Settings

    monkeypatch.setenv("STREAMXM_BUFFER_MEMORY", "")
    assert Settings(_env_file=None).buffer_memory is None  # type: ignore[call-arg]
    monkeypatch.setenv("STREAMXM_BUFFER_MEMORY", "250")
    assert Settings(_env_file=None).buffer_memory == 250  # type: ignore[call-arg]
    monkeypatch.setenv("STREAMXM_BUFFER_MEMORY", "-1")
    with pytest.raises(ValueError, match="buffer_memory"):
        Settings(_env_file=None)  # type: ignore[call-arg]


_SMALL_SAM = {"hidden": 16, "dim": 8, "batch_size": 30, "replay": 600, "epoch_pairs": 100}


class _RecordingSAM(SAM):
    """SAM that keeps the labels of every mini-batch's reservoir rows (instrumentation only)."""

    fills: list[list[int]]

    def step(self, img, txt, labels, new, stats, epoch):  # type: ignore[no-untyped-def]
        self.fills = getattr(self, "fills", [])
        self.fills.append([lab[0] for lab, n in zip(labels, new, strict=True) if not n])
        return super().step(img, txt, labels, new, stats, epoch)


def test_sam_fills_its_batches_class_balanced_during_a_burst_only() -> None:
    """In a burst the reservoir rows of a mini-batch come from every class alike (the arriving
    class, just begun, is a small share of the reservoir); on a mixed stream SAM learns bit for
    bit as with ``balance=False``."""
    mixed = class_stream(400, 8, 4, seed=2)
    learners = [
        StreamLearner("sam", 8, 4, {**_SMALL_SAM, "balance": b}, seed=0, eval_every=10**9)
        for b in (True, False)
    ]
    for learner in learners:
        learner.learn(mixed)
    assert learners[0].pairs_in_burst == 0
    on, off = (learner.model.state()[0] for learner in learners)
    assert all(np.array_equal(a, off[k]) for k, a in on.items())

    bursty = sorted(class_stream(600, 8, 4, seed=2), key=lambda p: p.labels[0])
    shares = {}
    for balance in (True, False):
        # No rehearsal: every recorded fill is a stream step's, two pairs apart.
        settings = {**_SMALL_SAM, "balance": balance, "rehearse": 0}
        model = _RecordingSAM(8, 4, **settings)
        learner = StreamLearner("sam", 8, 4, settings, seed=0, eval_every=10**9)
        learner.model = model
        learner.learn(bursty)
        last = bursty[-1].labels[0]
        # The last class's first 60 pairs (a burst): its share of the fill's rows.
        start = next(i for i, p in enumerate(bursty) if p.labels[0] == last)
        steps = model.fills[(start + 10) // 2 : (start + 60) // 2]
        rows = [c for fill in steps for c in fill]
        shares[balance] = rows.count(last) / len(rows)
    # Uniform: the class is at most 60 of ~500 stored rows; balanced: about 1 in 4 classes.
    assert shares[False] < 0.12 < 0.18 < shares[True], shares
