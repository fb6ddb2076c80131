"""A digest of every model's learned state after one fixed stream, to compare two checkouts.

    PYTHONPATH=CHECKOUT python scripts/state_digest.py [--skip-array pool_group]

The stream: 1,500 synthetic pairs (24/12 dimensions, six classes), the first half sorted by class
(bursts), learned through the worker's ``StreamLearner`` in calls of 100 with a rolling
evaluation every 97 pairs. Prints one line per model: its name and the first 16 hex digits of a
sha256 over its checkpoint arrays (names and bytes, sorted by name). Equal lines in two checkouts
mean a refactor left learning bit for bit as it was; ``--skip-array`` leaves out arrays whose name
contains the given text (state a change adds on purpose).
"""

from __future__ import annotations

import argparse
import hashlib

import numpy as np

from streamxm.learning.stream_learner import StreamLearner
from streamxm.models import MODEL_NAMES
from streamxm.stream.messages import Pair
from streamxm.tools.datasets import synthetic_pairs


def bursty_stream() -> list[Pair]:
    """1,500 synthetic pairs, the first half sorted by class."""
    pairs = synthetic_pairs(1500, 24, 12, n_classes=6, spread=0.5)
    order = sorted(range(750), key=lambda i: pairs[i].labels) + list(range(750, 1500))
    return [pairs[i] for i in order]


def digest(name: str, stream: list[Pair], skip: list[str]) -> str:
    params = {"budget": 100, "landmarks": 40} if name == "cmomks" else None
    learner = StreamLearner(name, 24, 12, params, eval_every=97)
    for start in range(0, len(stream), 100):
        learner.learn(stream[start : start + 100])
    learner.flush()
    arrays, _ = learner.state()
    h = hashlib.sha256()
    for key in sorted(k for k in arrays if not any(s in k for s in skip)):
        h.update(key.encode())
        h.update(np.ascontiguousarray(arrays[key]).tobytes())
    return h.hexdigest()[:16]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--skip-array", action="append", default=[], metavar="TEXT")
    args = parser.parse_args()
    stream = bursty_stream()
    for name in MODEL_NAMES:
        print(name, digest(name, stream, args.skip_array), flush=True)


if __name__ == "__main__":
    main()
