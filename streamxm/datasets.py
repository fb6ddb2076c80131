"""Benchmark files in the contract of ``DESIGN.md`` and the pairs they stream."""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass
from importlib import resources
from pathlib import Path
from typing import Any

import numpy as np
from numpy.typing import NDArray

from streamxm.messages import Pair, make_pair

__all__ = ["PUBLISHED_WIKI", "Dataset", "bundled_wiki_path", "iter_pairs", "load_dataset"]

#: Published figures on the Wikipedia SIFT128/LDA10 features (``../shared/datasets/README.md``):
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


def load_dataset(path: str | Path) -> Dataset:
    """Load a benchmark ``.npz`` without unpickling anything."""
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


def iter_pairs(
    ds: Dataset, limit: int | None = None, unlabelled: bool = False, prefix: str = "train"
) -> Iterator[Pair]:
    """Training rows as validated pairs in file order (labels withheld if ``unlabelled``)."""
    n = len(ds.img_train) if limit is None else min(limit, len(ds.img_train))
    for i in range(n):
        yield make_pair(
            f"{prefix}-{i}", ds.img_train[i], ds.txt_train[i],
            labels=None if unlabelled else row_labels(ds.y_train, i),
        )
