"""Drift: ADWIN on the mistake indicator finds a label-to-feature switch, and its counts survive
a checkpoint."""

import numpy as np

from streamxm.checkpoint import Checkpoint, decode_blob, encode_blob
from streamxm.learner import Learner
from streamxm.messages import Pair, make_pair
from tests.conftest import class_stream


def switching_stream(seed: int, n: int = 3000) -> list[Pair]:
    """Halfway, the features of class c start arriving labelled c + 1."""
    pairs = class_stream(n, 16, 8, seed=seed)
    half = n // 2
    return pairs[:half] + [make_pair(p.id, p.img, p.txt, labels=[(p.labels[0] + 1) % 4])
                           for p in pairs[half:]]


def test_a_label_switch_is_detected_soon_after_it_happens() -> None:
    for seed in (0, 1):
        learner = Learner("cmos", 16, 8, seed=seed)
        learner.learn(switching_stream(seed))
        positions = np.array(learner.drift.positions)
        assert learner.drift.detections == len(positions)
        assert ((positions >= 1500) & (positions < 1600)).any(), positions
        assert not ((positions >= 1400) & (positions < 1500)).any(), positions


def test_a_steady_stream_raises_no_alarm_once_learned() -> None:
    learner = Learner("cmos", 16, 8, seed=0)
    learner.learn(class_stream(3000, 16, 8, seed=0))
    assert all(p < 1500 for p in learner.drift.positions)  # only while the model improves


def test_drift_counts_survive_a_checkpoint() -> None:
    learner = Learner("cmos", 16, 8, seed=0)
    learner.learn(switching_stream(0, 2000))
    arrays, meta = learner.state()
    restored_ckpt = decode_blob(encode_blob(Checkpoint(1, arrays, meta)))
    restored = Learner.from_state(restored_ckpt.arrays, restored_ckpt.meta)
    assert restored.drift.detections == learner.drift.detections > 0
    assert restored.drift.positions == learner.drift.positions
    assert restored.drift.fed == learner.drift.fed
