"""Benchmark files in the contract of ``docs/design.md`` and the pairs they stream."""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass
from importlib import resources
from pathlib import Path
from typing import Any

import numpy as np
from numpy.typing import NDArray

from streamxm.stream.messages import Pair, make_pair

__all__ = [
    "BURST_RUN",
    "ORDERS",
    "PUBLISHED_WIKI",
    "Dataset",
    "bundled_wiki_path",
    "burst_runs",
    "iter_pairs",
    "load_dataset",
    "noisy_labels",
    "stream_order",
    "synthetic_arrays",
    "synthetic_pairs",
]

#: Orders a benchmark can stream the training rows in (``stream_order``).
ORDERS = ("file", "class", "shuffled", "bursts", "class-shuffled")
#: Shortest and longest topic burst of the ``bursts`` order, in pairs (both included): a stream
#: that changes topic every 30 to 100 pairs (issue 61).
BURST_RUN = (30, 100)

#: Published figures on the Wikipedia SIFT128/LDA10 features (``streamxm/data/README.md``):
#: method -> (image->text, text->image, source).
PUBLISHED_WIKI: dict[str, tuple[float, float, str]] = {
    "CCA": (0.2757, 0.2002, "Menon et al., SDM 2015, Table 1"),
    "logistic, cross-product, no labels": (0.2760, 0.2118, "Menon et al., SDM 2015, Table 1"),
    "bipartite, cross-product, no labels": (0.2700, 0.2068, "Menon et al., SDM 2015, Table 1"),
    "semantic matching": (0.2935, 0.2278, "Menon et al., SDM 2015, Table 1"),
    "marginal SM": (0.3328, 0.2411, "Menon et al., SDM 2015, Table 1"),
}

_REQUIRED = ("img_train", "txt_train", "y_train", "img_test", "txt_test", "y_test")


@dataclass(frozen=True)
class Dataset:
    """Train and test splits; labels are an int vector or a 0/1 matrix."""

    img_train: NDArray[np.float32]
    txt_train: NDArray[np.float32]
    y_train: NDArray[Any]
    img_test: NDArray[np.float32]
    txt_test: NDArray[np.float32]
    y_test: NDArray[Any]
    name: str = ""


def bundled_wiki_path() -> Path:
    """The Wikipedia file shipped inside the package (provenance in ``streamxm/data``)."""
    return Path(str(resources.files("streamxm") / "data" / "wiki_sift128_lda10.npz"))


def bundled_digits_path() -> Path:
    """The digits two-view file shipped inside the package: signed features of another kind
    (provenance in ``streamxm/data/README.md``)."""
    return Path(str(resources.files("streamxm") / "data" / "digits_dct_kl.npz"))


#: Short dataset names: the files the package bundles.
BUNDLED = {"wiki": bundled_wiki_path, "digits": bundled_digits_path}


def load_dataset(path: str | Path) -> Dataset:
    """Load a benchmark ``.npz`` without unpickling anything; ``"wiki"`` and ``"digits"`` name
    the bundled files (``streamxm/data/README.md``).

    >>> load_dataset("wiki").img_train.shape
    (2173, 128)
    """
    if str(path) in BUNDLED:
        path = BUNDLED[str(path)]()
    with np.load(path, allow_pickle=False) as data:
        missing = [k for k in _REQUIRED if k not in data.files]
        if missing:
            raise ValueError(f"{path}: missing arrays {missing}")
        arrays = {k: data[k] for k in _REQUIRED}
    for split in ("train", "test"):
        n = {len(arrays[f"{m}_{split}"]) for m in ("img", "txt", "y")}
        if len(n) != 1:
            raise ValueError(f"{path}: {split} arrays differ in length")
    return Dataset(
        img_train=arrays["img_train"].astype(np.float32),
        txt_train=arrays["txt_train"].astype(np.float32),
        y_train=arrays["y_train"],
        img_test=arrays["img_test"].astype(np.float32),
        txt_test=arrays["txt_test"].astype(np.float32),
        y_test=arrays["y_test"],
        name=Path(path).stem,
    )


def row_labels(y: NDArray[Any], i: int) -> list[int]:
    """Labels of row ``i``: an int class, or the set columns of a 0/1 matrix."""
    row = y[i]
    if np.ndim(row) == 0:
        return [int(row)]
    return [int(j) for j in np.flatnonzero(row)]


def stream_order(
    y: NDArray[Any], order: str = "file", seed: int = 0, burst_run: tuple[int, int] = BURST_RUN
) -> NDArray[np.intp]:
    """Row indices in the order a stream delivers them.

    A row's class is its first (smallest) label. ``file``: as stored. ``class``: sorted by
    class, ascending, stable, rows without a label last: a stream that arrives one topic at a
    time. ``shuffled``: a seeded random permutation. ``bursts``: topic bursts of random length
    (:func:`burst_runs`, lengths ``burst_run``), seeded. ``class-shuffled``: one topic at a
    time with the classes in a random order and the rows of each class shuffled, seeded; rows
    without a label are a class of their own. The seeded orders change with the seed and are
    the same for the same seed; ``file`` and ``class`` take none.

    >>> stream_order(np.array([2, 0, 2, 1, 0]), "class").tolist()
    [1, 4, 3, 0, 2]
    >>> y = np.array([2, 0, 2, 1, 0])
    >>> [y[stream_order(y, "class-shuffled", seed)].tolist() for seed in (0, 3)]
    [[2, 2, 0, 0, 1], [1, 0, 0, 2, 2]]
    """
    n = len(y)
    if order == "file":
        return np.arange(n)
    if order == "class":
        return np.argsort(_row_classes(y), kind="stable")
    if order == "shuffled":
        return np.random.default_rng(seed).permutation(n)
    if order == "bursts":
        runs = burst_runs(y, seed, burst_run)
        return np.concatenate([rows for _, rows in runs]) if runs else np.arange(0)
    if order == "class-shuffled":
        rng = np.random.default_rng([seed, 3])
        groups = _class_rows(y, rng)
        blocks = [groups[int(c)] for c in rng.permutation(sorted(groups))]
        return np.concatenate(blocks) if blocks else np.arange(0)
    raise ValueError(f"order must be one of {', '.join(ORDERS)}, got {order!r}")


def burst_runs(
    y: NDArray[Any], seed: int = 0, burst_run: tuple[int, int] = BURST_RUN
) -> list[tuple[int, NDArray[np.intp]]]:
    """The topic bursts of the ``bursts`` order (:func:`stream_order`): ``(class, rows)`` runs
    that together use every row once.

    Each class's rows (class: first label; rows without a label are a class of their own) are
    shuffled; then, until every row is used, a class is chosen uniformly at random among
    those with rows left, other than the last run's (unless it is the only one left), and a
    run of its next rows follows, of a length drawn uniformly from ``burst_run`` (both ends
    included) or what the class has left if fewer: so every run but a class's last lies in
    the range, and two runs of one class meet only when no other class is left. Seeded.

    >>> runs = burst_runs(np.repeat([0, 1, 2], 50), seed=0, burst_run=(10, 20))
    >>> sum(len(rows) for _, rows in runs), all(10 <= len(r) <= 20 for _, r in runs[:3])
    (150, True)
    """
    low, high = burst_run
    if not 1 <= low <= high:
        raise ValueError(f"burst_run must be (low, high) with 1 <= low <= high, got {burst_run}")
    rng = np.random.default_rng([seed, 2])
    groups = _class_rows(y, rng)
    classes = sorted(groups)
    used = dict.fromkeys(classes, 0)
    runs: list[tuple[int, NDArray[np.intp]]] = []
    last: int | None = None
    while True:
        left = [c for c in classes if used[c] < len(groups[c])]
        if not left:
            return runs
        choices = [c for c in left if c != last] or left
        c = int(choices[rng.integers(len(choices))])
        length = min(int(rng.integers(low, high + 1)), len(groups[c]) - used[c])
        runs.append((c, groups[c][used[c] : used[c] + length]))
        used[c] += length
        last = c


#: The class of a row without a label (after every real class).
_NO_LABEL = np.iinfo(np.int64).max


def _row_classes(y: NDArray[Any]) -> NDArray[np.int64]:
    """Each row's class: its first (smallest) label, :data:`_NO_LABEL` if it has none."""
    return np.array([min(row_labels(y, i), default=_NO_LABEL) for i in range(len(y))], np.int64)


def _class_rows(y: NDArray[Any], rng: np.random.Generator) -> dict[int, NDArray[np.intp]]:
    """Each class's rows (:func:`_row_classes`), shuffled by ``rng``, classes ascending."""
    first = _row_classes(y)
    return {
        int(c): rng.permutation(np.flatnonzero(first == c)).astype(np.intp)
        for c in np.unique(first)
    }


def noisy_labels(y: NDArray[Any], fraction: float, seed: int = 0) -> list[list[int]]:
    """Every row's labels, with those of ``round(fraction * n)`` rows (chosen at random, seeded)
    each replaced by a random *other* class among the classes of ``y``: wrong labels, as a
    careless annotator or a mislabelled crawl gives them.

    >>> y = np.array([0, 1, 2, 0, 1, 2, 0, 1, 2, 0])
    >>> labels = noisy_labels(y, 0.3, seed=1)
    >>> sum(a != [int(b)] for a, b in zip(labels, y))
    3
    """
    if not 0 <= fraction <= 1:
        raise ValueError(f"label noise must be a fraction in [0, 1], got {fraction}")
    n = len(y)
    labels = [row_labels(y, i) for i in range(n)]
    classes = sorted({c for row in labels for c in row})
    if fraction == 0 or len(classes) < 2:
        return labels
    rng = np.random.default_rng([seed, 1])
    for i in rng.choice(n, size=round(fraction * n), replace=False):
        labels[i] = sorted({int(rng.choice([c for c in classes if c != old])) for old in labels[i]})
    return labels


def iter_pairs(
    ds: Dataset,
    limit: int | None = None,
    unlabelled: bool = False,
    prefix: str = "train",
    order: str = "file",
    label_noise: float = 0.0,
    seed: int = 0,
    burst_run: tuple[int, int] = BURST_RUN,
) -> Iterator[Pair]:
    """Training rows as validated pairs (ids ``<prefix>-<row>``), in ``order``
    (:func:`stream_order`, topic bursts of ``burst_run`` pairs), with a fraction
    ``label_noise`` of the labels wrong (:func:`noisy_labels`), or none if ``unlabelled``."""
    rows = stream_order(ds.y_train, order, seed, burst_run)
    labels = noisy_labels(ds.y_train, label_noise, seed)
    for i in rows[:limit]:
        yield make_pair(
            f"{prefix}-{i}",
            ds.img_train[i],
            ds.txt_train[i],
            labels=None if unlabelled else labels[i],
        )


def synthetic_arrays(
    n: int, img_dim: int, txt_dim: int, n_classes: int = 10, seed: int = 0, spread: float = 1.0
) -> tuple[NDArray[np.float32], NDArray[np.float32], NDArray[np.int64]]:
    """Images, texts and classes of :func:`synthetic_pairs`, as three arrays."""
    rng = np.random.default_rng(seed)
    centers_v = rng.random((n_classes, img_dim), dtype=np.float32)
    centers_t = rng.random((n_classes, txt_dim), dtype=np.float32)
    classes = rng.integers(n_classes, size=n)
    imgs = centers_v[classes] + spread * rng.random((n, img_dim), dtype=np.float32)
    txts = centers_t[classes] + spread * rng.random((n, txt_dim), dtype=np.float32)
    return imgs, txts, classes


def synthetic_pairs(
    n: int, img_dim: int, txt_dim: int, n_classes: int = 10, seed: int = 0, spread: float = 1.0
) -> list[Pair]:
    """Labelled pairs whose image and text lean towards a per-class centre: non-negative, like
    histogram features. Centres and noise are uniform in [0, 1); ``spread`` scales the noise.
    The pairs' vectors are views of :func:`synthetic_arrays`' arrays, ids ``s<row>``.

    >>> pairs = synthetic_pairs(6, img_dim=3, txt_dim=2, n_classes=3)
    >>> [p.labels for p in pairs], pairs[0].img.shape, bool((pairs[0].img >= 0).all())
    ([(2,), (1,), (1,), (1,), (2,), (0,)], (3,), True)
    """
    imgs, txts, classes = synthetic_arrays(n, img_dim, txt_dim, n_classes, seed, spread)
    return [make_pair(f"s{i}", imgs[i], txts[i], labels=[int(classes[i])]) for i in range(n)]
