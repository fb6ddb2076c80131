"""Test-split mAP of SAM every few epochs of offline training (quoted in docs/benchmarks.md).

    python scripts/sam_epochs.py wiki --seed 0 \
        [--every 10] [--param dropout=0.1 --param power_img=null]

Prints one JSON object: the parameters and, per traced epoch, image->text and text->image mAP.
"""

from __future__ import annotations

import argparse
import json

import numpy as np

from streamxm.learning.evaluation import label_relevance, mean_average_precision
from streamxm.models import LearnStats
from streamxm.models.sam import SAM
from streamxm.tools.datasets import iter_pairs, load_dataset


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("dataset")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--every", type=int, default=10)
    parser.add_argument("--param", action="append", default=[], metavar="KEY=VALUE")
    args = parser.parse_args()
    params = {k: json.loads(v) for k, v in (item.split("=", 1) for item in args.param)}
    ds = load_dataset(args.dataset)
    model = SAM(ds.img_train.shape[1], ds.txt_train.shape[1], **params)
    relevant = label_relevance(ds.y_test, ds.y_test)
    trace = []
    for epoch in model.fit_epochs(list(iter_pairs(ds)), np.random.default_rng(args.seed),
                                  LearnStats()):
        if epoch % args.every == 0:
            zi = model.embed_images(ds.img_test).astype(np.float64)
            zt = model.embed_texts(ds.txt_test).astype(np.float64)
            trace.append({"epoch": epoch,
                          "map_i2t": round(mean_average_precision(zi @ zt.T, relevant), 4),
                          "map_t2i": round(mean_average_precision(zt @ zi.T, relevant), 4)})
    print(json.dumps({"seed": args.seed, "params": model.params(), "trace": trace}))


if __name__ == "__main__":
    main()
