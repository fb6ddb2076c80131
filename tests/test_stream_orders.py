"""The family of stream orders ``bench order`` judges a model on (issue 61): topic bursts of
random length, classes in a random order per seed, beside file order, classes ascending and
wrong labels; each seeded, on the bundled Wikipedia training split."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
from numpy.typing import NDArray

from streamxm.tools.datasets import (
    BURST_RUN,
    ORDERS,
    burst_runs,
    iter_pairs,
    load_dataset,
    stream_order,
)
from tests.conftest import cli_json, run_cli, save_benchmark

SEEDS = range(6)


@pytest.fixture(scope="module")
def y() -> NDArray[np.int64]:
    labels = load_dataset("wiki").y_train
    assert labels.ndim == 1 and len(np.unique(labels)) == 10
    return labels


def runs_of(classes: NDArray[np.int64]) -> list[tuple[int, int]]:
    """The stream's maximal runs of one class: ``(class, length)``."""
    cuts = np.flatnonzero(np.diff(classes)) + 1
    return [(int(part[0]), len(part)) for part in np.split(classes, cuts)]


@pytest.mark.parametrize("order", ORDERS)
def test_every_order_is_a_permutation_of_the_rows_and_the_same_for_the_same_seed(
    y: NDArray[np.int64], order: str
) -> None:
    orders = [stream_order(y, order, seed) for seed in SEEDS]
    for rows in orders:
        assert rows.dtype.kind == "i" and np.array_equal(np.sort(rows), np.arange(len(y)))
    assert all(
        np.array_equal(rows, stream_order(y, order, seed)) for seed, rows in enumerate(orders)
    )
    distinct = {tuple(rows.tolist()) for rows in orders}
    # File and ascending class order take no seed; the others differ with every seed.
    assert len(distinct) == (1 if order in ("file", "class") else len(SEEDS))


def test_file_and_class_order_are_as_before(y: NDArray[np.int64]) -> None:
    """The existing figures stay reproducible: file order as stored, class order the stable
    ascending sort by label, whatever the seed."""
    assert np.array_equal(stream_order(y, "file", 7), np.arange(len(y)))
    assert np.array_equal(stream_order(y, "class", 7), np.argsort(y, kind="stable"))
    assert np.array_equal(
        stream_order(y, "shuffled", 3), np.random.default_rng(3).permutation(len(y))
    )


@pytest.mark.parametrize("burst_run", [BURST_RUN, (5, 12)])
def test_bursts_are_runs_of_one_class_of_a_length_in_the_range_but_a_class_last(
    y: NDArray[np.int64], burst_run: tuple[int, int]
) -> None:
    low, high = burst_run
    for seed in SEEDS:
        runs = burst_runs(y, seed, burst_run)
        rows = stream_order(y, "bursts", seed, burst_run)
        assert np.array_equal(rows, np.concatenate([r for _, r in runs]))
        last_run = {c: i for i, (c, _) in enumerate(runs)}
        for i, (c, r) in enumerate(runs):
            assert (y[r] == c).all() and len(r) >= 1
            if i != last_run[c]:
                assert low <= len(r) <= high, (seed, i, c, len(r))
            else:
                assert len(r) <= high
        # A class chosen again at once only when no other class has pairs left.
        for i in range(1, len(runs)):
            if runs[i][0] == runs[i - 1][0]:
                assert {c for c, _ in runs[i:]} == {runs[i][0]}
        # In the stream: topics change every low..high pairs, bar the classes' remainders and
        # the tail where one class is left.
        maximal = runs_of(y[rows])
        tail = next(i for i, (c, _) in enumerate(runs) if {k for k, _ in runs[i:]} == {c})
        assert len(maximal) == tail + 1
        in_range = sum(low <= n <= high for _, n in maximal[:-1])
        assert in_range >= len(maximal) - 1 - 10  # at most one short run per class
        # Topics come back: classes recur after other classes, in random order.
        assert len(runs) > 10 and [c for c, _ in runs[:10]] != sorted(c for c, _ in runs[:10])
    # Pairs within a class arrive shuffled, not in file order.
    first = burst_runs(y, 0, burst_run)[0][1]
    assert not (np.diff(first) > 0).all()


def test_classes_in_a_random_order_each_contiguous_and_shuffled_within(
    y: NDArray[np.int64],
) -> None:
    sequences = []
    for seed in SEEDS:
        rows = stream_order(y, "class-shuffled", seed)
        maximal = runs_of(y[rows])
        assert len(maximal) == 10  # each class in one contiguous block
        assert all(n == int((y == c).sum()) for c, n in maximal)
        sequences.append(tuple(c for c, _ in maximal))
        block = rows[y[rows] == maximal[0][0]]
        assert not (np.diff(block) > 0).all()  # shuffled within the class
    assert len(set(sequences)) == len(SEEDS)  # every seed its own class order
    assert tuple(range(10)) not in sequences  # ... and not ascending


def test_a_multi_label_row_streams_as_its_first_label_and_unlabelled_rows_group() -> None:
    y = np.zeros((300, 4), dtype=np.int64)
    rng = np.random.default_rng(0)
    y[np.arange(300), rng.integers(0, 4, size=300)] = 1
    y[rng.random(300) < 0.3, 0] = 1  # a second label, smaller, on about a third of the rows
    y[:20] = 0  # rows with no label at all
    first = np.where(y.any(axis=1), y.argmax(axis=1), -1)  # the smallest set column
    assert ((y.sum(axis=1) == 2) & (first == 0)).sum() > 30
    ascending = stream_order(y, "class")
    assert (np.diff(np.where(first[ascending] < 0, 99, first[ascending])) >= 0).all()
    for seed in (0, 1):
        shuffled = stream_order(y, "class-shuffled", seed)
        assert len(runs_of(first[shuffled])) == 5  # four classes and the unlabelled rows
        for c, rows in burst_runs(y, seed, (10, 30)):
            assert {int(v) for v in first[rows]} == {-1 if c == np.iinfo(np.int64).max else c}


def test_a_burst_range_must_be_ordered_and_positive(y: NDArray[np.int64]) -> None:
    for bad in ((0, 10), (20, 10)):
        with pytest.raises(ValueError, match="burst_run"):
            stream_order(y, "bursts", 0, bad)
    ds = load_dataset("wiki")
    pairs = list(iter_pairs(ds, limit=5, order="bursts", seed=2, burst_run=(3, 4)))
    assert [p.id for p in pairs] == [
        f"train-{i}" for i in stream_order(ds.y_train, "bursts", 2, (3, 4))[:5]
    ]


def test_bench_order_runs_every_order_and_checks_each(tmp_path: Path) -> None:
    """``bench order`` on a small slice of the Wikipedia split: file order, each of the
    orders and wrong labels per seed, a share and a check for each."""
    ds = load_dataset("wiki")
    path = save_benchmark(
        tmp_path / "wiki_slice.npz",
        (ds.img_train[:400], ds.txt_train[:400], ds.y_train[:400]),
        (ds.img_test[:150], ds.txt_test[:150], ds.y_test[:150]),
    )
    order = ("bench", "order", "--dataset", str(path))
    result = cli_json(
        *order, "--model", "cmos", "--seeds", "0,1", "--burst-run", "20,60", "--json", timeout=300
    )
    assert result["orders"] == ["class", "bursts", "class-shuffled"]
    assert result["burst_run"] == [20, 60] and result["seeds"] == [0, 1]
    assert (result["order_share"], result["noise_share"]) == (0.97, 0.93)
    assert "machine" in result
    (row,) = result["models"]
    assert set(row["checks"]) == {
        "class_keeps_share",
        "bursts_keeps_share",
        "class_shuffled_keeps_share",
        "noisy_keeps_share",
    }
    for name in ("class", "bursts", "class-shuffled", "noisy"):
        run = row[name]
        assert [s["seed"] for s in run["per_seed"]] == [0, 1]
        for d in ("map_i2t", "map_t2i"):
            assert run["mean"][d] == pytest.approx(np.mean([s[d] for s in run["per_seed"]]))
            assert row["shares"][name][d] == pytest.approx(run["mean"][d] / row["file"]["mean"][d])
        bar = 0.93 if name == "noisy" else 0.97
        check = f"{name.replace('-', '_')}_keeps_share"
        assert row["checks"][check] == (min(row["shares"][name].values()) >= bar)
    assert row["class_share"] == row["shares"]["class"]
    assert row["noisy_share"] == row["shares"]["noisy"]
    assert row["met"] == all(row["checks"].values()) and result["all_met"] == row["met"]
    assert result["missed"] == (
        {} if row["met"] else {"cmos": [k for k, ok in row["checks"].items() if not ok]}
    )
    # The seeds' orders differ: so do the figures they give.
    assert all(row[name]["std"]["map_i2t"] > 0 for name in ("bursts", "class-shuffled"))

    cca = cli_json(*order, "--model", "cca", "--order", "bursts", "--json", timeout=120)
    assert cca["orders"] == ["bursts"] and set(cca["models"][0]["checks"]) == {
        "bursts_keeps_share",
        "noisy_keeps_share",
    }
    assert cca["models"][0]["noisy"] is None  # reads no label
    quality = cli_json(
        *("bench", "quality", "--dataset", str(path), "--model", "cca"),
        *("--order", "class-shuffled", "--seed", "4", "--json"),
        timeout=120,
    )
    assert quality["order"] == "class-shuffled"
    # --param reaches every run: file order is bench quality's figure with the same parameter.
    tuned = cli_json(*order, "--model", "cmos", "--order", "bursts", "--param", "C=0.01", "--json")
    alone = cli_json(
        *("bench", "quality", "--dataset", str(path), "--model", "cmos", "--param", "C=0.01"),
        "--json",
        timeout=120,
    )
    assert tuned["params"] == {"C": 0.01} and result["params"] == {}
    tuned_file = tuned["models"][0]["file"]["per_seed"][0]
    assert tuned_file["map_i2t"] == alone["map_i2t"]
    assert tuned_file["map_i2t"] != row["file"]["per_seed"][0]["map_i2t"]
    for bad in (["--burst-run", "60,20"], ["--burst-run", "x"], ["--order", "file"]):
        wrong = run_cli(*order, *bad)
        assert wrong.returncode == 2, (bad, wrong.stderr)
