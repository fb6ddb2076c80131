"""Shares of file order for one model in some stream orders, as ``streamxm bench order``
computes them, with the rolling gauge off (it does not change learning, and costs a quarter of
the time or more).

    python scripts/order_probe.py sam --seeds 0,1,2,3,4 --orders file,class,bursts \
        [--param k=v ...] [--ref earlier.json] > out.json

Each (order, seed) is one :func:`streamxm.tools.bench.quality` call on the bundled Wikipedia
set, the defaults updated by ``--param`` (values read as JSON). Prints one JSON object: the
per-seed mAP per order, and per order its mean's share of the file-order mean, per direction;
without ``file`` among the orders, ``--ref`` names an earlier output whose file-order runs
stand in.
"""

from __future__ import annotations

import argparse
import json
import sys
from typing import Any

import numpy as np

from streamxm.cli import parse_params
from streamxm.tools.bench import quality
from streamxm.tools.datasets import bundled_wiki_path


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("model")
    ap.add_argument("--seeds", default="0,1,2,3,4")
    ap.add_argument("--orders", default="file,class,bursts,class-shuffled")
    ap.add_argument("--param", action="append", default=[])
    ap.add_argument("--ref")
    args = ap.parse_args()
    seeds = [int(s) for s in args.seeds.split(",")]
    orders = args.orders.split(",")
    if "file" not in orders and not args.ref:
        ap.error("without file among --orders, --ref must name an earlier output")
    params = parse_params(args.param)
    runs: dict[str, dict[str, list[float]]] = {}
    for order in orders:
        runs[order] = {}
        for seed in seeds:
            r = quality(
                bundled_wiki_path(),
                args.model,
                seed=seed,
                params=params,
                order=order,
                eval_every=10**9,
            )
            runs[order][str(seed)] = [r["map_i2t"], r["map_t2i"]]
            print(order, seed, runs[order][str(seed)], file=sys.stderr, flush=True)
    if "file" in runs:
        file_runs = runs["file"]
    else:
        with open(args.ref) as f:
            file_runs = json.load(f)["runs"]["file"]
    file_mean = np.mean([file_runs[str(s)] for s in seeds], axis=0)
    out: dict[str, Any] = {"model": args.model, "params": params, "seeds": seeds, "runs": runs}
    out["shares"] = {
        o: (np.mean(list(v.values()), axis=0) / file_mean).round(3).tolist()
        for o, v in runs.items()
        if o != "file"
    }
    print(json.dumps(out))


if __name__ == "__main__":
    main()
