"""MPL-CD on the Wikipedia training set: the loss after each outer loop, from a cold start and
warm-started after 256 more pairs, with the time each solve takes. Prints JSON.

    python scripts/sdsrl_descent.py wiki
"""

from __future__ import annotations

import json
import sys
import time

import numpy as np

from streamxm.models.base import LearnStats
from streamxm.models.projections import mpl_cd, projection_loss
from streamxm.models.sdsrl import SDSRL
from streamxm.tools.datasets import iter_pairs, load_dataset


def main(path: str) -> None:
    ds = load_dataset(path)
    pairs = list(iter_pairs(ds))
    rng = np.random.default_rng(0)
    model = SDSRL(ds.img_train.shape[1], ds.txt_train.shape[1], outer=100, tol=1e-6)
    start = time.perf_counter()
    model.fit(pairs[:-256], rng, LearnStats())
    cold_seconds = time.perf_counter() - start
    cold = list(model.cd_losses)
    g, h = model.targets()
    start = time.perf_counter()
    model.fit(pairs[-256:], rng, LearnStats())
    warm_seconds = time.perf_counter() - start
    g2, h2 = model.targets()
    # Same targets from a fresh random start: how much the warm start saves.
    fresh = mpl_cd(g2, h2, 0.01 * rng.normal(size=model.a.shape),
                   0.01 * rng.normal(size=model.b.shape), rng, outer=100, tol=1e-6)
    print(json.dumps({
        "classes": g.shape[1], "q": model.q, "feature_dims": [len(g), len(h)],
        "loss_at_zero": projection_loss(0 * model.a, 0 * model.b, g, h),
        "cold_losses": cold, "cold_seconds": round(cold_seconds, 3),
        "warm_losses": model.cd_losses, "warm_seconds": round(warm_seconds, 3),
        "fresh_start_outer_loops_to_same_tolerance": len(fresh.losses) - 1,
    }))


if __name__ == "__main__":
    main(sys.argv[1])
