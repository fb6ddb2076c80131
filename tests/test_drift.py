"""Drift: ADWIN on the per-pair mistake indicator finds a switch in the image-text relation
within a few hundred pairs for every model, stays quiet on a steady stream, and its counts
survive a checkpoint."""

import numpy as np
import pytest

from streamxm.learning.stream_learner import StreamLearner
from streamxm.models import MODEL_NAMES
from streamxm.storage.checkpoint import Checkpoint, decode_blob, encode_blob
from streamxm.stream.messages import Pair, make_pair
from tests.conftest import class_stream

# Small models where the defaults would dwarf a 16-d toy stream; the behaviour under test is the
# detector's, fed by each model's own mistakes.
FAST = {
    "cmomks": {"budget": 200, "landmarks": 100},
    "sam": {"hidden": 64, "dim": 16},
    "sdsrl": {"m_img": 100, "m_txt": 50},
}


# CMOMKS's kernels take seconds over 2,400 pairs: part of the slow set.
#: cmomks and sam learn these streams slowest: they run with the long tests (`make test-long`).
MODELS = [
    pytest.param(m, marks=[pytest.mark.slow, pytest.mark.long]) if m in ("cmomks", "sam") else m
    for m in MODEL_NAMES
]


def relation_switch_stream(seed: int, n: int, switch: int) -> list[Pair]:
    """Labelled pairs of 4 classes whose image and text both lean to their class's centre;
    from pair ``switch`` on, the texts of class c lean to class c + 1's centre instead: the
    relation between the modalities changes, which supervised and unsupervised models alike
    must notice."""
    rng = np.random.default_rng(seed)
    centres_img, centres_txt = rng.random((4, 16)), rng.random((4, 8))
    pairs = []
    for i in range(n):
        c = int(rng.integers(4))
        t = (c + 1) % 4 if i >= switch else c
        pairs.append(
            make_pair(
                str(i), centres_img[c] + rng.random(16), centres_txt[t] + rng.random(8), labels=[c]
            )
        )
    return pairs


def _learner(model: str, seed: int = 0) -> StreamLearner:
    # CMOMKS's rolling evaluation (a gallery through its kernels before every pair) is most of
    # its time and feeds nothing the detector sees; SAM's flushes its batch, so it stays.
    eval_every = 10**9 if model == "cmomks" else 1
    return StreamLearner(model, 16, 8, FAST.get(model), seed=seed, eval_every=eval_every)


@pytest.mark.parametrize("model", MODELS)
def test_every_model_finds_a_relation_switch_within_300_pairs(model: str) -> None:
    learner = _learner(model)
    learner.learn(relation_switch_stream(0, 2400, switch=1600))
    positions = np.array(learner.drift.positions)
    assert ((positions >= 1600) & (positions < 1900)).any(), positions


@pytest.mark.parametrize("model", MODELS)
def test_a_steady_stream_raises_at_most_a_handful_of_alarms(model: str) -> None:
    learner = _learner(model)
    learner.learn(relation_switch_stream(1, 2400, switch=10**9))
    assert learner.drift.detections <= 3, learner.drift.positions


def switching_stream(seed: int, n: int = 3000) -> list[Pair]:
    """Halfway, the features of class c start arriving labelled c + 1."""
    pairs = class_stream(n, 16, 8, seed=seed)
    half = n // 2
    return pairs[:half] + [
        make_pair(p.id, p.img, p.txt, labels=[(p.labels[0] + 1) % 4]) for p in pairs[half:]
    ]


def test_a_label_switch_is_detected_soon_after_it_happens() -> None:
    for seed in (0, 1):
        learner = StreamLearner("cmos", 16, 8, seed=seed)
        learner.learn(switching_stream(seed))
        positions = np.array(learner.drift.positions)
        assert learner.drift.detections == len(positions)
        assert ((positions >= 1500) & (positions < 1600)).any(), positions
        assert not ((positions >= 1400) & (positions < 1500)).any(), positions


def test_a_steady_stream_raises_no_alarm_once_learned() -> None:
    learner = StreamLearner("cmos", 16, 8, seed=0)
    learner.learn(class_stream(3000, 16, 8, seed=0))
    assert all(p < 1500 for p in learner.drift.positions)  # only while the model improves


def test_drift_counts_survive_a_checkpoint() -> None:
    learner = StreamLearner("cmos", 16, 8, seed=0)
    learner.learn(switching_stream(0, 2000))
    arrays, meta = learner.state()
    restored_ckpt = decode_blob(encode_blob(Checkpoint(1, arrays, meta)))
    restored = StreamLearner.from_state(restored_ckpt.arrays, restored_ckpt.meta)
    assert restored.drift.detections == learner.drift.detections > 0
    assert restored.drift.positions == learner.drift.positions
    assert restored.drift.fed == learner.drift.fed
