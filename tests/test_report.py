"""``streamxm report`` on a small benchmark file: plots, summary and curves."""

from pathlib import Path

import numpy as np
import pytest

from streamxm.cli import main
from streamxm.learning.evaluation import label_relevance
from streamxm.tools.report import interpolated_pr, report
from tests.conftest import save_benchmark


def write_dataset(path: Path, seed: int = 0) -> Path:
    rng = np.random.default_rng(seed)
    centres_i, centres_t = rng.normal(size=(3, 12)), rng.normal(size=(3, 6))

    def split(n: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        y = rng.integers(3, size=n)
        return (
            centres_i[y] + 0.8 * rng.normal(size=(n, 12)),
            centres_t[y] + 0.8 * rng.normal(size=(n, 6)),
            y,
        )

    return save_benchmark(path, split(300), split(90))


def test_report_writes_plots_summary_and_curves(tmp_path: Path) -> None:
    data = write_dataset(tmp_path / "toy.npz")
    result = report(data, ["cmos", "cca"], tmp_path / "out", every=100)
    for name in ("map_vs_pairs.png", "mistake_ratio.png", "pr_curves.png"):
        png = (tmp_path / "out" / name).read_bytes()
        assert png[:8] == b"\x89PNG\r\n\x1a\n" and len(png) > 10_000, name
    summary = (tmp_path / "out" / "summary.md").read_text()
    assert "| cca |" in summary and "0.2757" in summary  # the published CCA figure beside ours
    assert "| cmos |" in summary and "no comparable published figure" in summary
    for run in result["runs"]:
        assert [p["pairs"] for p in run["points"]] == [100, 200, 300]
        assert all(0 < p["i2t"] <= 1 and 0 <= p["mistake_ratio_t2i"] <= 1 for p in run["points"])
        assert len(run["pr"]["i2t"]) == 11
    # Well separated classes: the learned models beat chance (1/3) by far.
    assert all(run["final"]["i2t"] > 0.6 for run in result["runs"])
    assert (tmp_path / "out" / "report.json").exists()


def test_interpolated_precision_matches_a_direct_computation() -> None:
    rng = np.random.default_rng(1)
    scores = rng.normal(size=(5, 40))
    relevant = label_relevance(rng.integers(3, size=5), rng.integers(3, size=40))
    got = interpolated_pr(scores, relevant)
    expected = []
    for q in range(5):
        order = np.argsort(-scores[q], kind="stable")
        rel = relevant[q][order]
        prec = [rel[: k + 1].mean() for k in range(40)]
        rec = [rel[: k + 1].sum() / rel.sum() for k in range(40)]
        expected.append(
            [
                max(p for p, r in zip(prec, rec, strict=True) if r >= level - 1e-12)
                for level in np.linspace(0, 1, 11)
            ]
        )
    assert got == pytest.approx(np.mean(expected, axis=0))


def test_report_cli_rejects_an_empty_model_list(tmp_path: Path) -> None:
    data = write_dataset(tmp_path / "toy.npz")
    assert (
        main(["report", "--dataset", str(data), "--models", ",", "--out", str(tmp_path / "o")]) == 2
    )
