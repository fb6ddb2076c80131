"""``streamxm bench``: quality on a benchmark file, through the learning code the worker runs."""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
from tqdm import tqdm

from streamxm.learning.evaluation import (
    Split,
    label_relevance,
    mean_average_precision,
    retrieval_maps,
)
from streamxm.learning.schedule import EvalEvery
from streamxm.learning.stream_learner import StreamLearner
from streamxm.models import model_class
from streamxm.models.ensemble import Ensemble, EnsembleSpec, is_ensemble, parse_ensemble
from streamxm.stream.messages import Pair, make_pair
from streamxm.tools.datasets import (
    BURST_RUN,
    ORDERS,
    Dataset,
    iter_pairs,
    load_dataset,
    row_labels,
)

__all__ = ["database_split", "ensemble_maps", "evaluate_model", "quality", "stream_order", "train"]

#: Share of its own file-order mAP a model must keep, per direction, when the pairs arrive one
#: class at a time, in any class order, or in topic bursts (means over seeds).
ORDER_SHARE = 0.97
#: The orders ``bench order`` runs beside file order by default: classes ascending, topic bursts
#: of random length, classes in a random order per seed (``stream_order``).
BENCH_ORDERS = ("class", "bursts", "class-shuffled")
#: Share of its own clean file-order mAP a model that reads labels must keep, per direction,
#: when a fraction of the training labels is wrong (means over seeds).
NOISE_SHARE = 0.93
#: Drift detections allowed on the friendly file-order stream (reported; not a bar).
QUIET_DRIFT = 3
DIRECTIONS = ("map_i2t", "map_t2i")


def evaluate_model(learner: StreamLearner, ds: Dataset) -> dict[str, float]:
    """Test-split mAP, whole gallery, relevant = shares a label; for models with a shared space
    also the same-modality directions (``map_i2i``, ``map_t2t``: the query itself stays in the
    gallery, as in the papers that report them)."""
    learner.flush()
    return retrieval_maps(learner.model, (ds.img_test, ds.txt_test, ds.y_test))


def train(
    learner: StreamLearner,
    pairs: list[Pair],
    protocol: str,
    epochs: int = 5,
    progress: bool = False,
    desc: str = "",
) -> int:
    """Feed ``pairs`` to ``learner`` by ``protocol``; returns the number of passes.

    ``stream`` feeds each pair once, in order; ``offline`` gives models with a batch fit
    (``batch_fit``) all pairs at once, and feeds the others the pairs ``epochs`` times (in
    order each time: they see the data as a longer stream).
    """
    if protocol not in ("stream", "offline"):
        raise ValueError("protocol must be 'stream' or 'offline'")
    batch = protocol == "offline" and learner.model.batch_fit
    passes = 1 if protocol == "stream" or batch else epochs
    with tqdm(total=passes * len(pairs), disable=not progress, unit="pair", desc=desc) as bar:
        for _ in range(passes):
            if batch:
                learner.fit(pairs)
                bar.update(len(pairs))
                continue
            for i in range(0, len(pairs), 256):
                learner.learn(pairs[i : i + 256])
                bar.update(len(pairs[i : i + 256]))
    return passes


def quality(
    dataset: str | Path,
    model: str,
    protocol: str = "stream",
    unlabelled: bool = False,
    seed: int = 0,
    epochs: int = 5,
    params: dict[str, Any] | None = None,
    progress: bool = False,
    order: str = "file",
    label_noise: float = 0.0,
    buffer_memory: int | None = None,
    eval_every: EvalEvery = 1,
    burst_run: tuple[int, int] = BURST_RUN,
) -> dict[str, Any]:
    """Train on the train split (see :func:`train` for the protocols) and score the test split
    (:func:`evaluate_model`). ``eval_every``: the rolling evaluation's schedule while it
    learns (the gauge, ``rolling_map``, and its standard error over the window,
    ``rolling_map_stderr``: the spread of the gauge at that schedule). The training pairs
    arrive in ``order`` (``file``, ``class``: one topic at a time, ``shuffled``, ``bursts``:
    topic bursts of ``burst_run`` pairs, ``class-shuffled``: one topic at a time, classes in a
    random order; :func:`~streamxm.tools.datasets.stream_order`) with a
    fraction ``label_noise`` of their labels replaced by another class
    (:func:`~streamxm.tools.datasets.noisy_labels`); the test split is untouched.

    ``model`` may be an ensemble (``ensemble:sdsrl+sam``): each member is trained and scored
    as on its own (same seed and stream, under ``members``), then the fused ranking is scored
    (:mod:`streamxm.models.ensemble`); ``params`` then go to every member."""
    ds = load_dataset(dataset)
    run = {
        "dataset": str(dataset),
        "model": model,
        "protocol": protocol,
        "eval_every": eval_every,
        "unlabelled": unlabelled,
        "order": order,
        **({"burst_run": list(burst_run)} if order == "bursts" else {}),
        "label_noise": label_noise,
        "buffer_memory": buffer_memory,
        "seed": seed,
    }
    pairs = list(
        iter_pairs(
            ds,
            unlabelled=unlabelled,
            order=order,
            label_noise=label_noise,
            seed=seed,
            burst_run=burst_run,
        )
    )

    def member(name: str) -> tuple[StreamLearner, dict[str, Any]]:
        learner = StreamLearner(
            name,
            ds.img_train.shape[1],
            ds.txt_train.shape[1],
            params,
            seed=seed,
            buffer_memory=buffer_memory,
            eval_every=eval_every,
        )
        start = time.perf_counter()
        passes = train(learner, pairs, protocol, epochs, progress, desc=f"{name} {protocol}")
        seconds = time.perf_counter() - start
        return learner, _trained_figures(learner, ds, {**run, "model": name}, passes, seconds)

    if not is_ensemble(model):
        return member(model)[1]
    spec = parse_ensemble(model)
    return _ensemble_figures(spec, {name: member(name) for name in spec.members}, ds, run)


def _trained_figures(
    learner: StreamLearner, ds: Dataset, run: dict[str, Any], passes: int, seconds: float
) -> dict[str, Any]:
    """What :func:`quality` reports of a model it trained: ``run`` (how), its test-split mAP
    and what its learner counted on the way."""
    return {
        **run,
        "passes": passes,
        "buffer_memory": learner.buffer.memory,  # as resolved: the model's own by default
        "train_pairs": len(ds.img_train),
        "test_pairs": len(ds.img_test),
        **evaluate_model(learner, ds),
        "mistakes": dict(learner.stats.mistakes),
        "triplets": dict(learner.stats.triplets),
        "rolling_map": learner.rolling_map(),
        "rolling_map_stderr": {
            d: (float(np.std(q) / np.sqrt(len(q))) if q else None)
            for d, q in learner.rolling_ap.items()
        },
        "pairs_evaluated": learner.pairs_evaluated,
        "drift_detections": learner.drift.detections,
        "pairs_in_burst": learner.pairs_in_burst,
        "params": learner.model.params(),
        "train_seconds": round(seconds, 3),
    }


def _ensemble_figures(
    spec: EnsembleSpec,
    trained: dict[str, tuple[StreamLearner, dict[str, Any]]],
    ds: Dataset,
    run: dict[str, Any],
) -> dict[str, Any]:
    """What :func:`quality` reports of an ensemble: the fused ranking's test-split mAP beside
    its ``trained`` members' figures."""
    fused = Ensemble(spec, {name: learner.model for name, (learner, _) in trained.items()})
    members = {name: result for name, (_, result) in trained.items()}
    maps = ensemble_maps(fused, (ds.img_test, ds.txt_test, ds.y_test))
    best = max(members, key=lambda m: _mean_map(members[m]))
    return {
        **run,
        "train_pairs": len(ds.img_train),
        "test_pairs": len(ds.img_test),
        "weights": dict(zip(spec.members, spec.weights, strict=True)),
        **maps,
        "mean_map": _mean_map(maps),
        "best_member": best,
        "best_member_mean_map": _mean_map(members[best]),
        "members": members,
    }


def stream_order(
    dataset: str | Path,
    models: list[str],
    seeds: Sequence[int] = (0,),
    label_noise: float = 0.2,
    progress: bool = False,
    orders: Sequence[str] = BENCH_ORDERS,
    burst_run: tuple[int, int] = BURST_RUN,
    params: dict[str, Any] | None = None,
) -> dict[str, Any]:
    """How each model copes with the stream as it really arrives, against its own file-order
    figure: one streaming pass (:func:`quality`, each model's defaults updated by ``params``)
    per seed in file order,
    in each of ``orders`` (:func:`~streamxm.tools.datasets.stream_order`; by default
    :data:`BENCH_ORDERS`: ``class``, classes ascending, one topic at a time; ``bursts``, topic
    bursts of ``burst_run`` pairs, a class chosen at random for each; ``class-shuffled``, one
    topic at a time with the classes in a random order; each seed its own order) and in file
    order with a fraction ``label_noise`` of wrong labels (models that read labels only).

    Per model and condition (``file``, each order by name, ``noisy``): each seed's mAP per
    direction, their mean and standard deviation (``ddof=0``). Shares are ratios of means over
    the seeds, per direction: ``shares[order]`` = that order / file order, ``shares["noisy"]``
    = with wrong labels / file order (``class_share`` and ``noisy_share`` repeat two of them, as
    before). ``checks``: ``<order>_keeps_share`` (``-`` written ``_``),
    :data:`ORDER_SHARE` of the order's share in each direction; ``noisy_keeps_share``,
    :data:`NOISE_SHARE` of the noisy share (a model that reads no label meets it). ``met`` is
    their conjunction, ``all_met`` over every model; ``missed`` the checks each model missed,
    by model. The file-order drift detections (:data:`QUIET_DRIFT` on the friendly stream) are
    reported beside them.
    """
    orders = list(dict.fromkeys(orders))
    unknown = [o for o in orders if o not in ORDERS or o == "file"]
    if unknown or not orders:
        raise ValueError(f"orders: some of {', '.join(ORDERS[1:])}, got {unknown or orders}")
    conditions = _Conditions(dataset, seeds, progress, burst_run, params)
    rows = [_order_row(conditions, model, orders, label_noise) for model in models]
    return {
        "benchmark": "stream-order",
        "dataset": str(dataset),
        "params": params or {},
        "seeds": list(seeds),
        "orders": orders,
        "burst_run": list(burst_run),
        "label_noise": label_noise,
        "order_share": ORDER_SHARE,
        "noise_share": NOISE_SHARE,
        "models": rows,
        "missed": {
            r["model"]: [name for name, ok in r["checks"].items() if not ok]
            for r in rows
            if not r["met"]
        },
        "all_met": all(r["met"] for r in rows),
    }


@dataclass(frozen=True)
class _Conditions:
    """What every run of :func:`stream_order` shares: the data, the seeds, the bursts' lengths
    and the models' parameters."""

    dataset: str | Path
    seeds: Sequence[int]
    progress: bool
    burst_run: tuple[int, int]
    params: dict[str, Any] | None


def _order_row(
    conditions: _Conditions, model: str, orders: list[str], label_noise: float
) -> dict[str, Any]:
    """One model's row of :func:`stream_order`: each condition over the seeds, its share of
    file order and the checks of those shares."""
    reads = model_class(model).reads_labels
    runs: dict[str, dict[str, Any]] = {"file": _over_seeds(conditions, model, "file", 0.0)}
    for order in orders:
        runs[order] = _over_seeds(conditions, model, order, 0.0)
    if reads:
        runs["noisy"] = _over_seeds(conditions, model, "file", label_noise)
    file_mean = runs["file"]["mean"]
    shares = {
        name: {d: run["mean"][d] / file_mean[d] if file_mean[d] else 0.0 for d in DIRECTIONS}
        for name, run in runs.items()
        if name != "file"
    }
    checks = {
        f"{order.replace('-', '_')}_keeps_share": min(shares[order].values()) >= ORDER_SHARE
        for order in orders
    }
    checks["noisy_keeps_share"] = not reads or min(shares["noisy"].values()) >= NOISE_SHARE
    return {
        "model": model,
        **runs,
        "noisy": runs.get("noisy"),
        "shares": shares,
        "class_share": shares.get("class"),
        "noisy_share": shares.get("noisy"),
        "checks": checks,
        "met": all(checks.values()),
        "file_drift_detections": runs["file"]["drift_detections"],
    }


def _over_seeds(conditions: _Conditions, model: str, order: str, noise: float) -> dict[str, Any]:
    """One condition of :func:`stream_order`: each seed's figures, their mean and spread."""
    per_seed = []
    for seed in conditions.seeds:
        result = quality(
            conditions.dataset,
            model,
            seed=seed,
            params=conditions.params,
            order=order,
            label_noise=noise,
            progress=conditions.progress,
            burst_run=conditions.burst_run,
        )
        per_seed.append(
            {
                "seed": seed,
                **{d: float(result[d]) for d in DIRECTIONS},
                "drift_detections": int(result["drift_detections"]),
                "pairs_in_burst": result["pairs_in_burst"],
                "buffer_memory": result["buffer_memory"],
            }
        )
    values = {d: np.array([run[d] for run in per_seed]) for d in DIRECTIONS}
    return {
        "per_seed": per_seed,
        "mean": {d: float(v.mean()) for d, v in values.items()},
        "std": {d: float(v.std()) for d, v in values.items()},
        "drift_detections": [run["drift_detections"] for run in per_seed],
    }


def _mean_map(result: dict[str, Any]) -> float:
    return (float(result["map_i2t"]) + float(result["map_t2i"])) / 2


def ensemble_maps(fused: Ensemble, split: Split) -> dict[str, float]:
    """mAP of each cross-modal direction of an ensemble over ``split`` (queries and gallery);
    each query's member scores standardised over the whole gallery it ranks."""
    img, txt, y = split
    relevant = label_relevance(y, y)
    return {
        "map_i2t": mean_average_precision(fused.scores("i2t", img, txt, reference=txt), relevant),
        "map_t2i": mean_average_precision(fused.scores("t2i", txt, img, reference=img), relevant),
    }


def database_split(
    dataset: str | Path,
    model: str,
    seeds: list[int],
    query_fraction: float = 0.25,
    protocol: str = "offline",
    epochs: int = 5,
    params: dict[str, Any] | None = None,
    progress: bool = False,
) -> dict[str, Any]:
    """The protocol of papers that pool every pair (SDSRL's Table 1): train and test splits
    merged, a random ``query_fraction`` of the pairs are queries and the rest the database;
    the model learns from the database (with labels) and the database is also the gallery the
    queries rank. Each seed draws its own split (and seeds the learner); the figures are per
    seed and their mean and standard deviation.

    The gallery is the data the model was trained on, so this measures how well the model
    recalls its training set's classes, not how it generalises to unseen items
    (:func:`quality` scores an unseen test gallery).
    """
    if not 0 < query_fraction < 1:
        raise ValueError("query_fraction must be in (0, 1)")
    ds = load_dataset(dataset)
    img = np.vstack([ds.img_train, ds.img_test])
    txt = np.vstack([ds.txt_train, ds.txt_test])
    y = np.concatenate([ds.y_train, ds.y_test])
    n_query = round(query_fraction * len(img))
    runs, params_used = [], {}
    for seed in seeds:
        order = np.random.default_rng(seed).permutation(len(img))
        query, base = order[:n_query], order[n_query:]
        learner = StreamLearner(model, img.shape[1], txt.shape[1], params, seed=seed)
        pairs = [make_pair(f"db-{i}", img[i], txt[i], labels=row_labels(y, int(i))) for i in base]
        train(learner, pairs, protocol, epochs, progress, desc=f"{model} seed {seed}")
        learner.flush()
        maps = retrieval_maps(
            learner.model, (img[query], txt[query], y[query]), (img[base], txt[base], y[base])
        )
        runs.append({"seed": seed, **maps})
        params_used = learner.model.params()
    keys = [k for k in runs[0] if k.startswith("map_")]
    return {
        "dataset": str(dataset),
        "model": model,
        "protocol": protocol,
        "query_fraction": query_fraction,
        "queries": n_query,
        "database": len(img) - n_query,
        "params": params_used,
        "runs": runs,
        "mean": {k: float(np.mean([r[k] for r in runs])) for k in keys},
        "std": {k: float(np.std([r[k] for r in runs])) for k in keys},
    }
