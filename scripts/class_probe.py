"""Where a model loses in a stream order: its test-split AP per class, the classes in the order
the stream meets them.

    python scripts/class_probe.py cmomks --order class-shuffled --seed 0 [--param k=v ...]

Trains as :func:`streamxm.tools.bench.quality` does (one streaming pass over the bundled
Wikipedia set in ``--order``, the defaults updated by ``--param``, values read as JSON, the
rolling gauge off), then prints one JSON object: the mAP of each direction (equal to
``quality``'s), per direction the mean AP of each class's test queries in the order the stream
first meets the classes, each class's test queries, and for a model with a landmark pool
(cmomks) its points per class, the Hedge weights, and the triplets held in the support and
projected onto the pool.
"""

from __future__ import annotations

import argparse
import json
from typing import Any

import numpy as np

from streamxm.cli import parse_params
from streamxm.learning.evaluation import label_relevance, mean_average_precision
from streamxm.learning.stream_learner import StreamLearner
from streamxm.tools.bench import train
from streamxm.tools.datasets import bundled_wiki_path, iter_pairs, load_dataset


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("model")
    ap.add_argument("--order", default="file")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--param", action="append", default=[])
    args = ap.parse_args()
    params = parse_params(args.param)
    ds = load_dataset(bundled_wiki_path())
    pairs = list(iter_pairs(ds, order=args.order, seed=args.seed))
    learner = StreamLearner(
        args.model,
        ds.img_train.shape[1],
        ds.txt_train.shape[1],
        params,
        seed=args.seed,
        eval_every=10**9,
    )
    train(learner, pairs, "stream")
    learner.flush()
    model = learner.model
    scores = {"i2t": model.similarity(ds.img_test, ds.txt_test)}
    scores["t2i"] = scores["i2t"].T
    relevant = label_relevance(ds.y_test, ds.y_test)
    met: list[int] = []
    for pair in pairs:
        if pair.labels and int(pair.labels[0]) not in met:
            met.append(int(pair.labels[0]))
    out: dict[str, Any] = {
        "model": args.model,
        "order": args.order,
        "seed": args.seed,
        "params": params,
        "classes_met": met,
    }
    for direction, s in scores.items():
        out[f"map_{direction}"] = round(mean_average_precision(s, relevant), 4)
        out[f"class_ap_{direction}"] = [
            round(mean_average_precision(s[ds.y_test == c], relevant[ds.y_test == c]), 3)
            for c in met
        ]
    out["test_queries"] = [int(np.count_nonzero(ds.y_test == c)) for c in met]
    if hasattr(model, "pool_group"):
        out["pool_points"] = [int(np.count_nonzero(model.pool_group == c)) for c in met]
        out["theta"] = np.round(model.theta, 3).tolist()
        out["support_triplets"] = int(model.support_size)
        out["projected"] = int(model.projected)
    print(json.dumps(out))


if __name__ == "__main__":
    main()
