"""SCSM on the Wikipedia training set without labels: the Eq. 14 objective after every step of
the alternation (the paper's Fig. 8), the purity of the groups Y against the withheld labels,
and a sweep of alpha, beta, r and the age schedule (offline protocol). Prints JSON lines.

    python scripts/scsm_analysis.py wiki [--sweep]
"""

from __future__ import annotations

import json
import sys
from typing import Any

import numpy as np

from streamxm.learning.stream_learner import StreamLearner
from streamxm.models.scsm import SCSM
from streamxm.tools.bench import evaluate_model
from streamxm.tools.datasets import iter_pairs, load_dataset


def run(path: str, params: dict[str, Any], seed: int = 0) -> dict[str, Any]:
    ds = load_dataset(path)
    learner = StreamLearner("scsm", ds.img_train.shape[1], ds.txt_train.shape[1], params, seed=seed)
    learner.fit(list(iter_pairs(ds, unlabelled=True)))
    model = learner.model
    assert isinstance(model, SCSM)
    rows = model._working_set()
    y, truth = model.y[rows], np.asarray(ds.y_train)[-len(rows):]
    purity = sum(int(np.bincount(truth[y == g]).max()) for g in range(model.groups)
                 if np.any(y == g)) / len(rows)
    maps = evaluate_model(learner, ds)
    return {"params": params, "seed": seed, "purity": round(purity, 4),
            "group_sizes": np.bincount(y, minlength=model.groups).tolist(),
            **{k: round(v, 4) for k, v in maps.items()}, "trace": model.trace}


def main(argv: list[str]) -> None:
    path = argv[0]
    print(json.dumps(run(path, {"iterations": 10})))
    if "--sweep" not in argv:
        return
    grid: list[dict[str, Any]] = (
        [{"alpha": a} for a in (0.0, 0.1, 0.3, 1.0, 3.0)]
        + [{"beta": b} for b in (1e-5, 1e-4, 1e-3, 1e-2)]
        + [{"r": r} for r in (3, 5, 10, 20)]
        + [{"iterations": t, "growth": g} for t in (0, 3, 5, 10) for g in (1.1, 1.2, 1.5)]
        + [{"groups": c} for c in (5, 10, 20)]
        + [{"center": False}, {"power_img": 1.0}]
    )
    for params in grid:
        out = run(path, params)
        out.pop("trace")
        print(json.dumps(out), flush=True)


if __name__ == "__main__":
    main(sys.argv[1:])
