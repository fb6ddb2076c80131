"""The search index: both backends of top_k, the coalescer, the completeness proof of the
bfloat16 candidates, and the tier merge of gallery chunks."""

from __future__ import annotations

import numpy as np
import pytest

from streamxm.serving.candidates import proven_complete
from streamxm.serving.gallery import Gallery, GalleryChunk
from streamxm.serving.index import (
    QueryCoalescer,
    bf16_score_error,
    index_block,
    int8_available,
    top_k,
    top_k_bounded,
)

torch = pytest.importorskip("torch")

#: The reduced-precision backends this machine can build.
APPROXIMATE = ["bfloat16"] + (["int8"] if int8_available() else [])


def _unit(x: np.ndarray) -> np.ndarray:
    return (x / np.linalg.norm(x, axis=1, keepdims=True)).astype(np.float32)


def test_float32_top_k_is_exact_with_ties_in_row_order() -> None:
    rng = np.random.default_rng(0)
    rows = _unit(rng.random((1000, 16)))
    rows[700] = rows[100]  # a tie: the earlier row ranks first
    q = rows[100] + 0.0
    _scores, got = top_k(q[None, :], [rows[:400], rows[400:]], 5)
    want = np.argsort(-(rows.astype(np.float64) @ q), kind="stable")[:5]
    assert got[0].tolist()[:2] == [100, 700]
    assert set(got[0].tolist()) == set(want.tolist())


@pytest.mark.parametrize("precision", APPROXIMATE)
def test_reduced_precision_candidates_hold_the_exact_top_k_when_scores_spread(
    precision: str,
) -> None:
    rng = np.random.default_rng(1)
    rows = _unit(rng.random((5000, 64)) + 2 * (rng.random((5000, 1)) > 0.9))
    q = rng.normal(size=64).astype(np.float32)
    exact = set(np.argsort(-(rows @ q))[:10].tolist())
    _proposed, got = top_k(q[None, :], [index_block(rows, precision)], 100)
    assert exact <= set(got[0].tolist())


def test_bfloat16_blocks_come_in_few_shapes_and_never_return_their_padding() -> None:
    # PyTorch keeps memory per bfloat16 product shape: blocks of every row count must map to a
    # handful of padded shapes (the API grew 20 MB a minute before), and the zero rows of the
    # padding (score 0, above every negative score here) must never come back as results.
    shapes = {
        index_block(np.ones((n, 4), np.float32), "bfloat16").tensor.shape[0]
        for n in range(1, 70_000, 37)
    }
    assert len(shapes) <= 40
    rng = np.random.default_rng(4)
    rows = -_unit(rng.random((1500, 8)))
    block = index_block(rows, "bfloat16")
    assert len(block) == 1500 and block.tensor.shape[0] > 1500
    for m in (1, 3, 17):
        q = rng.random((m, 8)).astype(np.float32)
        scores, got = top_k(q, [block], 1500)
        assert got.shape == (m, 1500) and got.max() < 1500 and (scores < 0).all()
        assert all(sorted(r) == list(range(1500)) for r in got.tolist())


@pytest.mark.parametrize("precision", APPROXIMATE)
def test_the_completeness_proof_fails_when_scores_are_flatter_than_the_scan(precision: str) -> None:
    rng = np.random.default_rng(2)
    # Rows equal to 3 decimals: neither bfloat16 nor int8 can order them, the proof must say so.
    base = rng.random(32)
    rows = _unit(base + 1e-4 * rng.random((3000, 32)))
    q = rng.normal(size=32).astype(np.float32)
    blocks = [index_block(rows, precision)]
    _, got, ceiling = top_k_bounded(q[None, :], blocks, 100)
    assert not proven_complete(float(ceiling[0]), rows[got[0]], q, 10, blocks)
    # Spread scores: proven.
    rows = _unit(rng.random((3000, 32)) ** 4)
    blocks = [index_block(rows, precision)]
    _, got, ceiling = top_k_bounded(q[None, :], blocks, 100)
    assert proven_complete(float(ceiling[0]), rows[got[0]], q, 10, blocks)
    # float32 blocks need no proof.
    assert proven_complete(float(ceiling[0]), rows[got[0]], q, 10, [rows])


def test_chunks_offering_fewer_rows_bound_what_they_leave_out() -> None:
    # Each chunk of 65,536 rows offers 100 and the best 400 of the union come back: no row
    # left out has a scan score above the ceiling, which a plain top 400 can only lower.
    rng = np.random.default_rng(6)
    rows = _unit(rng.random((200_000, 16)) ** 3)
    q = rng.normal(size=(3, 16)).astype(np.float32)
    for blocks in [[index_block(rows, p)] for p in APPROXIMATE] + [[rows]]:
        _, got, ceiling = top_k_bounded(q, blocks, 400, per_chunk=100)
        every_score, every_row, nothing_left = top_k_bounded(q, blocks, len(rows))
        assert (nothing_left == -np.inf).all()
        for i in range(3):
            assert len(set(got[i].tolist())) == 400
            scan = np.empty(len(rows), dtype=np.float32)
            scan[every_row[i]] = every_score[i]
            left_out = np.setdiff1d(np.arange(len(rows)), got[i])
            assert scan[left_out].max() <= ceiling[i]
        _, _, plain_ceiling = top_k_bounded(q, blocks, 400)
        assert (plain_ceiling <= ceiling).all()


def test_the_bfloat16_error_bound_holds_for_rows_that_round_the_same_way() -> None:
    # Every coordinate just above a bfloat16 rounding midpoint (each factor rounds down by
    # ~2^-8), and some of them placed so the float32 sum also rounds down at the output: the
    # scan's error reaches ~1.45 * 2^-7 |q||x|, past the 2^-7 |q| first used (without the
    # output's rounding), and within bf16_score_error.
    rng = np.random.default_rng(5)
    worst = 0.0
    for m in range(0, 40):
        for _ in range(20):
            v = np.full(64, 1 + 2**-8) - rng.uniform(0, 2**-14, size=64)
            v[:m] = 1 + 2**-7 + 2**-8 - rng.uniform(0, 2**-14, size=m)
            # Powers of two keep the midpoints: a row of norm ~1 (64 entries near 1/8).
            row, query = (v / 8).astype(np.float32), (v * 2).astype(np.float32)
            block = index_block(row[None, :], "bfloat16")
            scan = float((torch.from_numpy(query).to(torch.bfloat16) @ block.tensor[0]).float())
            exact = row.astype(np.float64) @ query.astype(np.float64)
            norms = np.linalg.norm(row.astype(np.float64)) * np.linalg.norm(
                query.astype(np.float64)
            )
            error = abs(scan - exact)
            assert error <= bf16_score_error(norms, scan)  # |x| ~ 1: scaled by it
            worst = max(worst, error / norms)
            # What top_k returns is the scan raised by the bound: above the exact product.
            bound, _ = top_k(query[None, :], [block], 1)
            assert exact * (1 + 1e-6) <= bound[0, 0] * norms / np.linalg.norm(query)
    assert worst > 1.2 * 2.0**-7  # the first bound (2^-7 |q|) was wrong for such rows


@pytest.mark.skipif(not int8_available(), reason="no exact int8 product on this CPU")
def test_the_int8_scan_bounds_every_exact_product_from_above() -> None:
    # Rows whose every coordinate sits just off a rounding midpoint of its 8-bit code (the
    # largest quantisation error a row can have), queries aligned with those errors, queries of
    # very different norms in one batch (one quantisation step for all), a zero query and a
    # zero row: every returned score is an upper bound of the exact product, and not a loose
    # one (within 3% of the query's norm).
    rng = np.random.default_rng(7)
    d = 96
    codes = rng.integers(1, 120, size=(3000, d)).astype(np.float64)
    codes[:, 0] = 127
    rows = codes + 0.5 - 1e-3
    rows[:, 0] = 127
    rows = rows / np.linalg.norm(rows, axis=1, keepdims=True)
    rows[17] = 0
    rows = rows.astype(np.float32)
    residual = rows - np.rint(rows / (rows.max(axis=1, keepdims=True) / 127 + 1e-30)) * (
        rows.max(axis=1, keepdims=True) / 127
    )
    queries = np.vstack(
        [
            residual[:4] * 1e3,
            rng.normal(size=(3, d)),
            np.zeros((1, d)),
            rng.normal(size=(2, d)) * 1e-4,
            rng.normal(size=(2, d)) * 1e4,
        ]
    )
    queries = queries.astype(np.float32)
    block = index_block(rows, "int8")
    scores, found = top_k(queries, [block], len(rows))
    exact = queries.astype(np.float64) @ rows.T.astype(np.float64)
    norms = np.linalg.norm(queries.astype(np.float64), axis=1)
    for i in range(len(queries)):
        bound = np.empty(len(rows))
        bound[found[i]] = scores[i]
        assert (bound >= exact[i]).all()
        assert (bound - exact[i] <= 0.03 * norms[i] + 1e-30).all()


@pytest.mark.skipif(not int8_available(), reason="no exact int8 product on this CPU")
def test_int8_blocks_come_in_few_shapes_and_never_return_their_padding() -> None:
    shapes = {
        index_block(np.ones((n, 4), np.float32), "int8").parts[0].scales.shape[0]
        for n in range(1, 65_536, 37)
    }
    assert len(shapes) <= 40
    rng = np.random.default_rng(4)
    rows = -_unit(rng.random((70_000, 8)))
    block = index_block(rows, "int8")
    assert len(block) == 70_000 and len(block.parts) == 2
    q = rng.random((3, 8)).astype(np.float32)
    scores, got = top_k(q, [block], 70_000)
    assert got.max() < 70_000 and (scores < 0).all()
    assert all(sorted(r) == list(range(70_000)) for r in got.tolist())


def test_concurrent_queries_coalesce_into_batches() -> None:
    rng = np.random.default_rng(3)
    rows = rng.random((20_000, 32), dtype=np.float32)
    blocks = (rows,)
    coalescer = QueryCoalescer()
    queries = rng.random((64, 32), dtype=np.float32)
    # Submitted without waiting (64 threads each calling search() started too slowly on a
    # loaded machine, once, for any two to meet in a batch).
    futures = [coalescer.submit(blocks, queries[i], 5) for i in range(64)]
    results = {i: future.result(timeout=60)[1].tolist() for i, future in enumerate(futures)}
    coalescer.close()
    for i in range(64):
        assert results[i] == top_k(queries[i : i + 1], blocks, 5)[1][0].tolist()
    assert coalescer.queries == 64 and coalescer.batches < 64


def test_gallery_chunks_merge_tier_by_tier_and_the_cap_holds() -> None:
    rng = np.random.default_rng(4)
    gallery = Gallery()
    for i in range(200):
        ids = np.array([f"{i}-{j}" for j in range(100)])
        gallery = gallery.appended(
            GalleryChunk.of(
                ids, rng.random((100, 8), dtype=np.float32), rng.random((100, 4), dtype=np.float32)
            ),
            15_000,
        )
    assert len(gallery) == 15_000
    assert len(gallery.chunks) <= 12
    assert gallery.ids_at(np.array([0, 14_999])) == ["50-0", "199-99"]
    unit, norms = gallery.locate(np.array([0, 14_999]), "image")
    np.testing.assert_allclose(np.linalg.norm(unit, axis=1), 1.0, rtol=1e-6)
    np.testing.assert_allclose(unit[1] * norms[1], gallery.chunks[-1].raw("image", [99])[0])


def test_unit_rows_of_tiny_and_zero_vectors_stay_finite() -> None:
    """A valid pair may carry a vector of norm 1e-40 (finite, so accepted): its unit row is
    computed in float64, where 1 / norm does not overflow."""
    from streamxm.storage.rows import _unit_rows

    unit, norms = _unit_rows(np.array([[1e-40, 0, 0], [3, 4, 0], [0, 0, 0]], dtype=np.float32))
    assert np.isfinite(unit).all()
    np.testing.assert_allclose(unit, [[1, 0, 0], [0.6, 0.8, 0], [0, 0, 0]], rtol=1e-6)
    np.testing.assert_allclose(norms, [1e-40, 5, 0], rtol=1e-5)
