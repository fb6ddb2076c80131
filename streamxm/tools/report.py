"""``streamxm report``: the stream protocol for several models, drawn: test mAP against pairs
seen, the cumulative mistake ratio, precision-recall at the end, and a summary table beside the
published numbers."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import numpy as np
from numpy.typing import NDArray
from tqdm import tqdm

from streamxm.learning.evaluation import label_relevance
from streamxm.learning.stream_learner import StreamLearner
from streamxm.models import DIRECTIONS
from streamxm.tools.bench import evaluate_model
from streamxm.tools.datasets import PUBLISHED_WIKI, Dataset, iter_pairs, load_dataset

__all__ = ["PUBLISHED_FOR_MODEL", "interpolated_pr", "report"]

#: Published Wikipedia SIFT128/LDA10 figures that a model reproduces (same features and split;
#: the CMOS, CMOMKS and SAM papers used CNN features, so they have none here).
PUBLISHED_FOR_MODEL: dict[str, tuple[float, float, str]] = {
    "cca": PUBLISHED_WIKI["CCA"],
    "pairwise": PUBLISHED_WIKI["logistic, cross-product, no labels"],
    "pairwise:bipartite": PUBLISHED_WIKI["bipartite, cross-product, no labels"],
    "pairwise:marginal": PUBLISHED_WIKI["marginal SM"],
}

RECALL_LEVELS = np.linspace(0.0, 1.0, 11)


def interpolated_pr(
    scores: NDArray[np.floating], relevant: NDArray[np.bool_]
) -> NDArray[np.float64]:
    """11-point interpolated precision (at recall 0, 0.1, ..., 1), averaged over the queries
    that have a relevant item; ties keep gallery order, as the mAP does.

    >>> interpolated_pr(np.array([[0.9, 0.8, 0.1]]), np.array([[True, False, True]]))[[0, 5, 10]]
    array([1.        , 1.        , 0.66666667])
    """
    order = np.argsort(-scores, axis=1, kind="stable")
    rel = np.take_along_axis(relevant, order, axis=1)
    keep = rel.any(axis=1)
    rel = rel[keep]
    hits = np.cumsum(rel, axis=1)
    precision = hits / np.arange(1, rel.shape[1] + 1)
    recall = hits / rel.sum(axis=1, keepdims=True)
    # Interpolated precision at r: the best precision at any recall >= r.
    best_after = np.maximum.accumulate(precision[:, ::-1], axis=1)[:, ::-1]
    out = np.empty((len(rel), len(RECALL_LEVELS)))
    for j, level in enumerate(RECALL_LEVELS):
        first = np.argmax(recall >= level - 1e-12, axis=1)
        out[:, j] = best_after[np.arange(len(rel)), first]
    return np.asarray(out.mean(axis=0))


def _curves(
    model: str, ds: Dataset, seed: int, every: int, params: dict[str, Any] | None, progress: bool
) -> dict[str, Any]:
    learner = StreamLearner(model, ds.img_train.shape[1], ds.txt_train.shape[1], params, seed=seed)
    pairs = list(iter_pairs(ds))
    points: list[dict[str, float]] = []
    with tqdm(total=len(pairs), disable=not progress, unit="pair", desc=model) as bar:
        for at in range(0, len(pairs), every):
            chunk = pairs[at : at + every]
            learner.learn(chunk)
            bar.update(len(chunk))
            maps = evaluate_model(learner, ds)
            point = {
                "pairs": float(learner.pairs_seen),
                **{k: maps[f"map_{k}"] for k in DIRECTIONS},
            }
            for d in DIRECTIONS:
                t = learner.stats.triplets[d]
                point[f"mistake_ratio_{d}"] = learner.stats.mistakes[d] / t if t else 0.0
            points.append(point)
    model_ = learner.model
    rel = label_relevance(ds.y_test, ds.y_test)
    zi = model_.embed_images(ds.img_test).astype(np.float64)
    zt = model_.embed_texts(ds.txt_test).astype(np.float64)
    pr = {
        "i2t": interpolated_pr(zi @ zt.T, rel).tolist(),
        "t2i": interpolated_pr(zt @ zi.T, rel).tolist(),
    }
    return {
        "model": model,
        "points": points,
        "pr": pr,
        "final": {d: points[-1][d] for d in DIRECTIONS},
        "params": model_.params(),
    }


def _plot(runs: list[dict[str, Any]], out: Path) -> list[str]:
    try:
        import matplotlib
    except ModuleNotFoundError as exc:
        raise ImportError(
            "streamxm report draws with matplotlib, which is not installed: "
            "pip install 'streamxm[report]'"
        ) from exc

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    written = []
    styles = {"i2t": "-", "t2i": "--"}
    names = {"i2t": "image->text", "t2i": "text->image"}
    colours = plt.rcParams["axes.prop_cycle"].by_key()["color"]

    def save(fig: Any, name: str) -> None:
        fig.tight_layout()
        fig.savefig(out / name, dpi=120)
        plt.close(fig)
        written.append(name)

    for key, ylabel, title, name in (
        ("", "test mAP", "Test mAP while the stream is learned", "map_vs_pairs.png"),
        (
            "mistake_ratio_",
            "cumulative mistake ratio (mistakes / triplets)",
            "Mistakes before each update",
            "mistake_ratio.png",
        ),
    ):
        fig, ax = plt.subplots(figsize=(8, 5))
        for i, run in enumerate(runs):
            x = [p["pairs"] for p in run["points"]]
            for d in DIRECTIONS:
                ax.plot(
                    x,
                    [p[key + d] for p in run["points"]],
                    styles[d],
                    color=colours[i % len(colours)],
                    label=f"{run['model']} {names[d]}",
                )
        ax.set_xlabel("pairs seen (stream, file order)")
        ax.set_ylabel(ylabel)
        ax.set_title(title)
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8, ncol=2)
        save(fig, name)

    fig, axes = plt.subplots(1, 2, figsize=(11, 4.5), sharey=True)
    for ax, d in zip(axes, DIRECTIONS, strict=True):
        for i, run in enumerate(runs):
            ax.plot(
                RECALL_LEVELS,
                run["pr"][d],
                "-o",
                markersize=3,
                color=colours[i % len(colours)],
                label=run["model"],
            )
        ax.set_title(f"{names[d]}, after the stream")
        ax.set_xlabel("recall")
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
    axes[0].set_ylabel("interpolated precision")
    save(fig, "pr_curves.png")
    return written


def _summary(runs: list[dict[str, Any]], dataset: str) -> str:
    lines = [
        f"# streamxm report: {dataset}",
        "",
        "Stream protocol (each training pair once, in file order); test-split mAP.",
        "",
        "| model | image->text | text->image | published image->text | published "
        "text->image | source |",
        "|---|---|---|---|---|---|",
    ]
    for run in runs:
        pub = PUBLISHED_FOR_MODEL.get(run["model"])
        cells = (
            f"{pub[0]:.4f} | {pub[1]:.4f} | {pub[2]}"
            if pub
            else "- | - | no comparable published figure on these features"
        )
        lines.append(
            f"| {run['model']} | {run['final']['i2t']:.4f} | {run['final']['t2i']:.4f} | {cells} |"
        )
    lines += ["", "Plots: `map_vs_pairs.png`, `mistake_ratio.png`, `pr_curves.png`."]
    return "\n".join(lines) + "\n"


def report(
    dataset: str | Path,
    models: list[str],
    out: str | Path,
    seed: int = 0,
    every: int = 256,
    params: dict[str, Any] | None = None,
    progress: bool = False,
) -> dict[str, Any]:
    """Run the stream protocol for each model (``params`` go to every model), evaluate the test
    split every ``every`` pairs, and write the plots, ``summary.md`` and ``report.json`` to
    ``out``. Returns what ``report.json`` holds."""
    if not models:
        raise ValueError("name at least one model")
    if every < 1:
        raise ValueError("every must be >= 1")
    ds = load_dataset(dataset)
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    runs = [_curves(m, ds, seed, every, params, progress) for m in models]
    files = _plot(runs, out)
    (out / "summary.md").write_text(_summary(runs, str(dataset)))
    result = {
        "dataset": str(dataset),
        "seed": seed,
        "every": every,
        "runs": runs,
        "files": [*files, "summary.md", "report.json"],
    }
    (out / "report.json").write_text(json.dumps(result, indent=1))
    return result
