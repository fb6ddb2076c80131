"""Marginal matching fitted to convergence offline (scikit-learn's L-BFGS multinomial logistic
regression per modality), over regularisation strengths and input power maps; prints JSON.

Shows how high the marginal model itself can go on a benchmark file, independent of any online
optimiser. Needs the dev extras (scikit-learn)::

    python scripts/marginal_exact_optimum.py wiki
"""

from __future__ import annotations

import json
import sys
import warnings

from sklearn.linear_model import LogisticRegression

from streamxm.learning.evaluation import label_relevance, mean_average_precision
from streamxm.models.moments import power_normalize
from streamxm.tools.datasets import load_dataset


def main(path: str) -> None:
    warnings.filterwarnings("ignore")
    ds = load_dataset(path)
    rel = label_relevance(ds.y_test, ds.y_test)
    rows = []
    for power in (1.0, 0.5, 0.35):
        post = {}
        for c in (0.3, 1.0, 3.0, 10.0):
            for side, train, test in (("img", ds.img_train, ds.img_test),
                                      ("txt", ds.txt_train, ds.txt_test)):
                clf = LogisticRegression(C=c, max_iter=5000)
                clf.fit(power_normalize(train, power), ds.y_train)
                post[side, c] = clf.predict_proba(power_normalize(test, power))
        for ci in (0.3, 1.0, 3.0, 10.0):
            for ct in (0.3, 1.0, 3.0, 10.0):
                s = post["img", ci] @ post["txt", ct].T
                rows.append({"power": power, "C_img": ci, "C_txt": ct,
                             "map_i2t": round(mean_average_precision(s, rel), 4),
                             "map_t2i": round(mean_average_precision(s.T, rel.T), 4)})
    best = max(rows, key=lambda r: r["map_i2t"])
    print(json.dumps({"best_i2t": best, "grid": rows}))


if __name__ == "__main__":
    main(sys.argv[1])
