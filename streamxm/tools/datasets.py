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
    "ORDERS",
    "PUBLISHED_WIKI",
    "Dataset",
    "bundled_wiki_path",
    "iter_pairs",
    "load_dataset",
    "noisy_labels",
    "stream_order",
    "synthetic_arrays",
    "synthetic_pairs",
]

#: Orders a benchmark can stream the training rows in (``stream_order``).
ORDERS = ("file", "class", "shuffled")

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


#: Short dataset names: the files the package bundles.
def bundled_digits_path() -> Path:
    """The digits two-view file shipped inside the package: signed features of another kind
    (provenance in ``streamxm/data/README.md``)."""
    return Path(str(resources.files("streamxm") / "data" / "digits_dct_kl.npz"))


BUNDLED = {"wiki": bundled_wiki_path, "digits": bundled_digits_path}


def load_dataset(path: str | Path) -> Dataset:
    """Load a benchmark ``.npz`` without unpickling anything; ``"wiki"`` names the bundled
    Wikipedia file (``streamxm/data/README.md``).

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


def stream_order(y: NDArray[Any], order: str = "file", seed: int = 0) -> NDArray[np.intp]:
    """Row indices in the order a stream delivers them.

    ``file``: as stored. ``class``: sorted by each row's first (smallest) label, stable, rows
    without a label last: a stream that arrives one topic at a time. ``shuffled``: a seeded
    random permutation.

    >>> stream_order(np.array([2, 0, 2, 1, 0]), "class").tolist()
    [1, 4, 3, 0, 2]
    """
    n = len(y)
    if order == "file":
        return np.arange(n)
    if order == "class":
        first = np.array([min(row_labels(y, i), default=np.iinfo(np.int64).max) for i in range(n)])
        return np.argsort(first, kind="stable")
    if order == "shuffled":
        return np.random.default_rng(seed).permutation(n)
    raise ValueError(f"order must be one of {', '.join(ORDERS)}, got {order!r}")


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
) -> Iterator[Pair]:
    """Training rows as validated pairs (ids ``<prefix>-<row>``), in ``order``
    (:func:`stream_order`), with a fraction ``label_noise`` of the labels wrong
    (:func:`noisy_labels`), or none if ``unlabelled``."""
    rows = stream_order(ds.y_train, order, seed)
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
