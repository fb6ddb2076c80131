"""Top-k inner-product search over the gallery's blocks of rows, and the thread that coalesces
concurrent queries into one matrix product.

The interface is two functions: :func:`index_block` turns a float32 row block into what the
backend scans, and :func:`top_k` returns each query's best ``k`` scores and global row positions.
Three backends; ``streamxm bench scan --json`` times them side by side (one thread, 32 queries,
1,000,000 rows, figures in ``docs/benchmarks.md``):

- **int8** (PyTorch, on CPUs whose oneDNN u8 x s8 product is exact: VNNI, checked at first
  use): each row as 8-bit codes and one scale, a quarter of the float32 bytes, scanned by an
  integer product with exact int32 sums. The default where available.
- **bfloat16** (PyTorch elsewhere): rows in bfloat16, half the float32 bytes, one bf16 matrix
  product (AVX-512 BF16).
- **float32** (always available, the reference): blocked BLAS products and ``argpartition``.

The reduced-precision scans only *propose* candidates: each score they return is raised by the
backend's rigorous error bound, so the best score of a row left out bounds every left-out row's
exact score, and the server re-ranks the candidates with the served version and proves the
top ``k`` complete against that bound (or scans the float32 rows when it cannot).

FAISS (``faiss-cpu``) was measured for this role and not chosen: its flat inner-product search
and its 8-bit scalar quantiser scan each query on its own, so over a million rows on one thread
both are slower than the batched float32 path here, the flat search several times so, at 128
and at 512 dimensions (``streamxm bench scan`` includes FAISS when it is importable). Keeping the
interface this small leaves room for a vector database backend later.

:class:`QueryCoalescer` gathers the queries that arrive while a product runs and answers them
with the next one: under load the product's cost is shared by a batch of queries (one pass over
the gallery's memory instead of one per query); an idle server answers at once.
"""

from __future__ import annotations

import queue
import threading
from collections.abc import Sequence
from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import Any

import numpy as np
from numpy.typing import NDArray

__all__ = [
    "Bf16Block",
    "Block",
    "Int8Block",
    "QueryCoalescer",
    "bf16_native",
    "bf16_score_error",
    "index_block",
    "int8_available",
    "top_k",
    "top_k_bounded",
]

_BLOCK = 65_536  # rows per product: bounds the (queries x rows) float32 temporary
_GROUP = 32  # rows per group of a full bfloat16 chunk's two-step selection

#: What :func:`top_k` scans: float32 rows, or the same rows as a :class:`Bf16Block`.
Block = Any
#: One query's answer from :class:`QueryCoalescer`: scores and global rows, best first, and
#: the largest scan score of any row left out.
Found = tuple[NDArray[np.float32], NDArray[np.int64], float]

torch: Any
try:
    import torch
except ImportError:  # the float32 backend serves alone
    torch = None


def index_block(rows: NDArray[np.float32], precision: str = "auto") -> Block:
    """Rows as the backend scans them: an ``"int8"`` :class:`Int8Block`, a ``"bfloat16"``
    :class:`Bf16Block`, or the ``"float32"`` array itself.

    ``"auto"``: int8 where PyTorch is installed and this CPU's int8 product is exact
    (:func:`int8_available`), else bfloat16 where the CPU multiplies it natively
    (:func:`bf16_native`), else float32: emulated bfloat16 products are tens of times slower
    than float32 ones (AVX2 without AVX512-BF16 or AMX).
    """
    if precision == "auto":
        if torch is not None and int8_available():
            precision = "int8"
        elif torch is not None and bf16_native():
            precision = "bfloat16"
        else:
            precision = "float32"
    if precision == "float32":
        return rows
    if torch is None:
        raise ImportError(f"{precision} search needs PyTorch: pip install 'streamxm[torch]'")
    if precision == "int8":
        if not int8_available():
            raise RuntimeError("this CPU's int8 product (oneDNN) is not exact: use bfloat16")
        return Int8Block.of(rows)
    return Bf16Block.of(rows)


def _padded_rows(n: int) -> int:
    """``n`` rounded up to one of a few sizes per doubling (at most 25% more)."""
    step = max(1024, 1 << max(0, n.bit_length() - 3))
    return -(-n // step) * step


@dataclass(frozen=True, eq=False)
class Bf16Block:
    """Rows in bfloat16, zero-padded to a size class of :func:`_padded_rows`.

    Why padded: PyTorch's bfloat16 matrix product (oneDNN) keeps state for every distinct
    operand shape it meets, and never frees it; a gallery whose blocks take every size as
    rows arrive grew the API's memory steadily (``bench soak``). With row counts drawn from
    a few size classes and query batches padded to a multiple of 8, the shapes, and that
    memory, stay bounded. The padding rows score 0 and are cut before the top k.
    """

    tensor: Any  # torch.Tensor, (padded rows, dim)
    rows: int

    @classmethod
    def of(cls, rows: NDArray[np.float32]) -> Bf16Block:
        padded = torch.zeros((_padded_rows(len(rows)), rows.shape[1]), dtype=torch.bfloat16)
        padded[: len(rows)] = torch.from_numpy(np.ascontiguousarray(rows, dtype=np.float32))
        return cls(padded, len(rows))

    def __len__(self) -> int:
        return self.rows


@dataclass(frozen=True, eq=False)
class Int8Block:
    """Unit rows as int8 codes with one float32 scale per row, packed for oneDNN's u8 x s8
    product (VNNI): a quarter of the float32 bytes, and twice bfloat16's multiply-adds per
    instruction.

    Row ``r`` is stored as ``scale[r] * code[r]`` with ``scale[r] = max|x_r| / 127`` and
    ``code`` its rounded quotient; ``error`` is the largest ``|x_r - scale[r] code[r]|`` of a
    part (computed in float32 and raised 1%, far above that arithmetic's rounding), which the
    scan's bound needs. The int32 accumulation is exact, so the only errors are the two
    quantisations and the float32 output (see :func:`top_k_bounded`). Parts hold at most
    ``_BLOCK`` rows, padded like :class:`Bf16Block` (code 0: they score 0 and are cut).
    """

    parts: tuple[_Int8Part, ...]
    rows: int

    @classmethod
    def of(cls, rows: NDArray[np.float32]) -> Int8Block:
        rows = np.ascontiguousarray(rows, dtype=np.float32)
        return cls(
            tuple(_Int8Part.of(rows[s : s + _BLOCK]) for s in range(0, len(rows), _BLOCK)),
            len(rows),
        )

    def __len__(self) -> int:
        return self.rows


@dataclass(frozen=True, eq=False)
class _Int8Part:
    packed: Any  # oneDNN's packed weight, (dim, padded rows)
    scales: Any  # torch float32, (padded rows,)
    zero_points: Any  # torch int32 zeros, (padded rows,)
    error: float  # largest |x_r - scale[r] code[r]| of the part's rows
    rows: int  # real rows (the rest are padding)

    @classmethod
    def of(cls, rows: NDArray[np.float32]) -> _Int8Part:
        padded = _padded_rows(len(rows))
        codes = np.zeros((padded, rows.shape[1]), dtype=np.int8)
        scales = np.ones(padded, dtype=np.float32)
        worst = 0.0
        # Slices of 1,024 rows stay in cache: 6 passes over each instead of over 128 MB.
        for s in range(0, len(rows), 1024):
            part = rows[s : s + 1024]
            scale = np.maximum(part.max(axis=1), -part.min(axis=1)) / np.float32(127)
            scale[scale == 0] = 1
            q = part * (np.float32(1) / scale)[:, None]
            np.rint(q, out=q)
            np.clip(q, -127, 127, out=q)
            codes[s : s + len(part)] = q
            q *= scale[:, None]
            q -= part
            worst = max(worst, float(np.einsum("ij,ij->i", q, q).max()))
            scales[s : s + len(part)] = scale
        packed = torch.ops.onednn.qlinear_prepack(torch.from_numpy(codes), [8, rows.shape[1]])
        return cls(
            packed,
            torch.from_numpy(scales),
            torch.zeros(padded, dtype=torch.int32),
            float(np.sqrt(worst)) * 1.01,
            len(rows),
        )


_int8_checked: bool | None = None


def int8_available() -> bool:
    """Whether oneDNN's u8 x s8 product is exact here (checked once, on the extreme codes).

    Without VNNI, x86 kernels add pairs of u8 x s8 products in saturating int16
    (``vpmaddubsw``): codes of 255 and 127 would overflow and the scan's error bound would not
    hold. A wrong or missing kernel makes this False, and bfloat16 serves.
    """
    global _int8_checked
    if _int8_checked is None:
        _int8_checked = False
        if torch is not None:
            try:
                rng = np.random.default_rng(0)
                codes = np.full((16, 64), 127, dtype=np.int8)
                codes[8:] = rng.integers(-127, 128, size=(8, 64))
                qx = np.full((8, 64), 255, dtype=np.uint8)
                qx[4:] = rng.integers(0, 256, size=(4, 64))
                packed = torch.ops.onednn.qlinear_prepack(torch.from_numpy(codes), [8, 64])
                got = torch.ops.onednn.qlinear_pointwise(
                    torch.from_numpy(qx),
                    1.0,
                    128,
                    packed,
                    torch.ones(16),
                    torch.zeros(16, dtype=torch.int32),
                    None,
                    1.0,
                    0,
                    torch.float32,
                    "none",
                    [],
                    "",
                ).numpy()
                want = (qx.astype(np.int64) - 128) @ codes.astype(np.int64).T
                _int8_checked = bool(np.array_equal(got, want.astype(np.float32)))
            except (RuntimeError, AttributeError):  # no oneDNN int8 kernel in this build
                _int8_checked = False
    return _int8_checked


def bf16_native() -> bool:
    """Whether this CPU multiplies bfloat16 in hardware (AVX512-BF16 or AMX), as PyTorch
    reports it; an older PyTorch that cannot tell counts as no."""
    cpu: Any = getattr(torch, "cpu", None)
    try:
        return bool(cpu._is_avx512_bf16_supported() or cpu._is_amx_tile_supported())
    except AttributeError:  # no torch, or one without these probes
        return False


def bf16_score_error(query_norm: Any, score: Any) -> Any:
    """Largest difference between the exact inner product of a unit row with a query of norm
    ``query_norm`` and that row's bfloat16 scan score, for a scan score ``score``.

    bfloat16 keeps 8 significant bits (unit roundoff ``u = 2^-8``). Rounding both factors
    moves each product by at most ``(2u + u^2)`` of itself, so the sum by at most
    ``(2u + u^2) |q|`` for a unit row (Cauchy-Schwarz). The product's *output* is bfloat16
    too, and its rounding moves the score by at most ``u`` of the unrounded score, that is
    ``u / (1 - u) |score|``. float32 accumulation over at most 65,536 terms adds well under
    1% of the first term: hence the 1% margin. The output's rounding was left out of the
    first version of this bound (``2^-7 |q|``); rows built to round the same way reach
    ``1.45 * 2^-7 |q|`` (``tests/test_search_index.py``). The bound grows with ``score``, so
    the largest scan score among rows left out bounds all of their true scores. Floats or
    numpy arrays (broadcast).
    """
    u = 2.0**-8
    return ((2 * u + u * u) * query_norm + u / (1 - u) * abs(score)) * 1.01


def top_k(
    queries: NDArray[np.float32], blocks: Sequence[Block], k: int
) -> tuple[NDArray[np.float32], NDArray[np.int64]]:
    """The ``k`` largest inner products of each query with the rows of ``blocks`` (taken as one
    array in order), best first; fewer than ``k`` when there are fewer rows. On float32 blocks
    the scores are exact and ties keep row order; on reduced-precision blocks the scores are
    upper bounds of the exact products (see :func:`top_k_bounded`) and the order approximate.

    >>> blocks = [np.eye(3, dtype=np.float32), np.ones((1, 3), dtype=np.float32)]
    >>> scores, rows = top_k(np.array([[0, 1, 0.5]], dtype=np.float32), blocks, 2)
    >>> scores.tolist(), rows.tolist()
    ([[1.5, 1.0]], [[3, 1]])
    """
    scores, rows, _ = top_k_bounded(queries, blocks, k)
    return scores, rows


def top_k_bounded(
    queries: NDArray[np.float32], blocks: Sequence[Block], k: int, per_chunk: int | None = None
) -> tuple[NDArray[np.float32], NDArray[np.int64], NDArray[np.float32]]:
    """:func:`top_k`, where each chunk of ``_BLOCK`` rows offers at most ``per_chunk`` rows
    (default ``k``), with each query's *ceiling*: a bound on the exact inner product of any
    row not returned (``-inf`` when every row is).

    On float32 blocks the scores are the products themselves. On bfloat16 and int8 blocks
    each score is its row's scan score raised by that backend's error bound
    (:func:`bf16_score_error`; for int8, the two quantisations and the float32 output,
    :class:`_Int8Queries`): an upper bound on the exact product, increasing with the scan
    score, so the best rows by it are the best by the scan and the largest bound left out is
    the ceiling. A caller that re-ranks the returned rows exactly has the exact top ``j`` when
    its ``j``-th best exact score is above the ceiling.

    Why per chunk: a top-k selection costs more the larger ``k`` (``torch.topk`` of 400 per
    chunk takes much longer than of 100), but a completeness proof needs only a low
    ceiling, not the exact top ``k`` of the scan. 100 rows from each of 16 chunks leave out no
    row scoring above roughly the union's 1,600th, at the selection cost of 100.

    >>> rows = np.arange(8, dtype=np.float32)[:, None]
    >>> scores, found, ceiling = top_k_bounded(np.ones((1, 1), np.float32), [rows], 3)
    >>> found.tolist(), ceiling.tolist()
    ([[7, 6, 5]], [4.0])
    """
    m = len(queries)
    per_chunk = k if per_chunk is None else max(1, min(per_chunk, k))
    best_s = np.empty((m, 0), dtype=np.float32)
    best_r = np.empty((m, 0), dtype=np.int64)
    ceiling = np.full(m, -np.inf, dtype=np.float32)
    bf16: _Bf16Queries | None = None
    int8: _Int8Queries | None = None
    offset = 0
    for block in blocks:
        for start in range(0, len(block), _BLOCK):
            if isinstance(block, Int8Block):
                int8 = int8 or _Int8Queries.of(queries)
                scores, rows, cut = int8.top_k(block.parts[start // _BLOCK], per_chunk)
            elif isinstance(block, Bf16Block):
                bf16 = bf16 or _Bf16Queries.of(queries)
                scores, rows, cut = bf16.top_k(block, start, per_chunk)
            else:
                scores, rows, cut = _top_k_float32(
                    queries, block[start : start + _BLOCK], per_chunk
                )
            np.maximum(ceiling, cut, out=ceiling)
            best_s = np.concatenate([best_s, scores], axis=1)
            best_r = np.concatenate([best_r, rows + (offset + start)], axis=1)
            if best_s.shape[1] > 4 * k:
                best_s, best_r, cut = _best(best_s, best_r, k)
                np.maximum(ceiling, cut, out=ceiling)
        offset += len(block)
    best_s, best_r, cut = _best(best_s, best_r, k)
    return best_s, best_r, np.maximum(ceiling, cut)


def _top_k_float32(
    queries: NDArray[np.float32], part: NDArray[np.float32], k: int
) -> tuple[NDArray[np.float32], NDArray[np.int64], NDArray[np.float32]]:
    """Top ``k`` of one chunk (unordered), local rows, and the best score left out. Rows that
    tie at the cut are kept in row order (the first of them), as a search's answer lists ties
    at every ``k``: ``argpartition`` alone keeps any of them."""
    scores = queries @ part.T
    if part.shape[0] <= k:
        rows = np.broadcast_to(np.arange(len(part)), scores.shape)
        return scores, rows, np.full(len(queries), -np.inf, dtype=np.float32)
    order = np.argpartition(-scores, k, axis=1)
    keep = order[:, :k]
    kept = np.take_along_axis(scores, keep, axis=1)
    cut = np.take_along_axis(scores, order[:, k : k + 1], axis=1)[:, 0]
    lowest = kept.min(axis=1)
    for i in np.flatnonzero(cut >= lowest):  # a tie across the cut: rare, one query at a time
        above = np.flatnonzero(scores[i] > lowest[i])
        level = np.flatnonzero(scores[i] == lowest[i])[: k - len(above)]
        keep[i] = np.concatenate([above, level])
        kept[i] = scores[i, keep[i]]
    return kept, keep, cut


def _padded_batch(m: int) -> int:
    """Query rows of a reduced-precision product: ``m`` rounded up to a multiple of 8, which
    bounds oneDNN's set of shapes (see :class:`Bf16Block`) and wastes less of a compute-bound
    product than rounding up to a power of two would (17 queries cost 24 rows, not 32)."""
    return -(-m // 8) * 8


@dataclass(frozen=True, eq=False)
class _Bf16Queries:
    """A batch of queries as a bfloat16 scan multiplies them, with their norms."""

    batch: Any  # torch bfloat16, (padded queries, dim)
    norms: NDArray[np.float64]

    @classmethod
    def of(cls, queries: NDArray[np.float32]) -> _Bf16Queries:
        batch = torch.zeros((_padded_batch(len(queries)), queries.shape[1]), dtype=torch.bfloat16)
        batch[: len(queries)] = torch.from_numpy(queries)
        return cls(batch, np.linalg.norm(queries.astype(np.float64), axis=1))

    def top_k(
        self, block: Bf16Block, start: int, k: int
    ) -> tuple[NDArray[np.float32], NDArray[np.int64], NDArray[np.float32]]:
        """Top ``k`` of the block's rows ``start : start + _BLOCK`` and the best left out, as
        upper bounds (scan score plus :func:`bf16_score_error`)."""
        m = len(self.norms)
        part = block.tensor[start : start + _BLOCK]
        scores = (self.batch @ part.T)[:m].float()
        values, found, cut = _select_chunk(scores, min(_BLOCK, block.rows - start), k)
        return self.bound(values), found, self.bound(cut[:, None])[:, 0]

    def bound(self, scores: NDArray[np.float32]) -> NDArray[np.float32]:
        with np.errstate(invalid="ignore"):  # -inf (nothing left out) stays -inf below
            raised = scores + bf16_score_error(self.norms[:, None], scores)
        return np.where(np.isneginf(scores), scores, raised).astype(np.float32)


@dataclass(frozen=True, eq=False)
class _Int8Queries:
    """A batch of queries as an int8 scan multiplies them, and what its error bound needs.

    Each query ``q`` is scaled to a largest coordinate of 1 (``rho = max |q_i|``) so that every
    query of the batch uses the whole code range under oneDNN's one scale per query matrix,
    whatever its norm or spread, and quantised with the step ``s = 1/127``:
    ``q = rho s c + r`` with integer codes ``c`` in [-127, 127] (sent as ``c + 128``) and ``r``
    the residual, computed in float64. For a row ``x = x~ + d`` (``|x| <= 1``, ``|d| <=`` the
    part's ``error``) and the scan's output ``o``, which is ``s c . x~`` to float32's rounding:

        q . x = rho o + rho (s c . x~ - o) + rho s c . d + r . x
             <= rho o + rho |s c| (error + 2e-6) + |r| (1 + 1e-6)

    and the last two terms (raised 0.1% for the float64 arithmetic) are the query's slack.
    """

    codes: Any  # torch uint8, (padded queries, dim)
    step: float
    norms: NDArray[np.float64]  # rho
    code_norms: NDArray[np.float64]  # |s c|
    residuals: NDArray[np.float64]  # |r|

    @classmethod
    def of(cls, queries: NDArray[np.float32]) -> _Int8Queries:
        q = queries.astype(np.float64)
        norms = np.abs(q).max(axis=1, initial=0.0)
        step = float(np.float32(1 / 127))
        codes = np.clip(np.rint(q / (np.where(norms > 0, norms, 1.0)[:, None] * step)), -127, 127)
        batch = np.full((_padded_batch(len(q)), q.shape[1]), 128, dtype=np.uint8)
        batch[: len(q)] = codes + 128
        quantised = step * codes
        return cls(
            torch.from_numpy(batch),
            step,
            norms,
            np.linalg.norm(quantised, axis=1),
            np.linalg.norm(q - norms[:, None] * quantised, axis=1),
        )

    def top_k(
        self, part: _Int8Part, k: int
    ) -> tuple[NDArray[np.float32], NDArray[np.int64], NDArray[np.float32]]:
        """Top ``k`` of one part's rows and the best left out, as upper bounds."""
        m = len(self.norms)
        scores = torch.ops.onednn.qlinear_pointwise(
            self.codes,
            self.step,
            128,
            part.packed,
            part.scales,
            part.zero_points,
            None,
            1.0,
            0,
            torch.float32,
            "none",
            [],
            "",
        )[:m]
        values, found, cut = _select_chunk(scores, part.rows, k)
        slack = (
            self.norms * self.code_norms * (part.error + 2e-6) + self.residuals * (1 + 1e-6)
        ) * 1.001
        with np.errstate(invalid="ignore"):  # 0 * -inf for a zero query: -inf kept below
            cut = np.where(np.isneginf(cut), cut, self.norms * cut + slack)
        return (
            (self.norms[:, None] * values + slack[:, None]).astype(np.float32),
            found,
            cut.astype(np.float32),
        )


def _select_chunk(
    scores: Any, rows: int, k: int
) -> tuple[NDArray[np.float32], NDArray[np.int64], NDArray[np.float32]]:
    """The top ``k`` of a chunk's scan scores (a float32 tensor, queries x padded rows, of
    which the first ``rows`` are real), their local rows and the best score left out.

    A full chunk is selected in two steps: the maximum of each group of ``_GROUP`` rows, the
    best ``k + 1`` groups by it, then the best ``k`` rows of those groups. A row in a group
    left out scored at most the best left-out group's maximum, so the cut stays a bound;
    ``torch.topk`` over all 65,536 scores per query was a large share of the API's CPU at
    1,000,000 rows (perf).
    """
    m = len(scores)
    if rows < _BLOCK or (k + 1) * _GROUP * 4 > _BLOCK:
        values, found, cut = _select(scores[:, :rows], k)
        return values.numpy(), found.numpy().astype(np.int64), cut.numpy().copy()
    grouped = scores[:, :_BLOCK].reshape(m, _BLOCK // _GROUP, _GROUP)
    _, groups, group_cut = _select(grouped.amax(dim=2), k)
    inside = torch.gather(grouped, 1, groups[:, :, None].expand(m, k, _GROUP)).reshape(m, -1)
    values, found, cut = _select(inside, k)
    found = groups.gather(1, found // _GROUP) * _GROUP + found % _GROUP
    return (
        values.numpy(),
        found.numpy().astype(np.int64),
        torch.maximum(group_cut, cut).numpy().copy(),
    )


def _select(scores: Any, k: int) -> tuple[Any, Any, Any]:
    """Each row's ``k`` largest values (tensors), their columns, and the largest value left
    out (``-inf`` when none is)."""
    if scores.shape[1] <= k:
        values, found = torch.topk(scores, scores.shape[1], dim=1)
        return values, found, torch.full((len(scores),), -np.inf)
    values, found = torch.topk(scores, k + 1, dim=1)
    return values[:, :k], found[:, :k], values[:, k]


def _best(
    scores: NDArray[np.float32], rows: NDArray[np.int64], k: int
) -> tuple[NDArray[np.float32], NDArray[np.int64], NDArray[np.float32]]:
    """The best ``k`` of each query's (score, row) pairs and the best score cut off."""
    # Sort by row first, then stably by score: equal scores keep row (gallery) order.
    by_row = np.argsort(rows, axis=1, kind="stable")
    scores, rows = np.take_along_axis(scores, by_row, 1), np.take_along_axis(rows, by_row, 1)
    order = np.argsort(-scores, axis=1, kind="stable")
    cut = (
        np.take_along_axis(scores, order[:, k : k + 1], 1)[:, 0]
        if scores.shape[1] > k
        else np.full(len(scores), -np.inf, dtype=np.float32)
    )
    order = order[:, :k]
    return np.take_along_axis(scores, order, 1), np.take_along_axis(rows, order, 1), cut


@dataclass
class _Request:
    blocks: Sequence[Block]
    query: NDArray[np.float32]
    k: int
    per_chunk: int | None
    future: Future[Found] = field(default_factory=Future)


def scan_together(
    blocks: Sequence[Block], requests: Sequence[tuple[NDArray[np.float32], int, int | None]]
) -> list[Found]:
    """Several queries' :func:`top_k_bounded` of the same ``blocks`` in one product: each
    request is (query, k, per_chunk), all searched with the largest ``k`` and ``per_chunk``
    (more rows per chunk only lowers each one's ceiling), each answered with its own ``k``
    best and a ceiling that covers the rows past them."""
    k = max(r[1] for r in requests)
    per_chunk = max(r[1] if r[2] is None else r[2] for r in requests)
    scores, rows, ceiling = top_k_bounded(np.stack([r[0] for r in requests]), blocks, k, per_chunk)
    found: list[Found] = []
    for i, (_, own_k, _) in enumerate(requests):
        mine = float(ceiling[i])
        if scores.shape[1] > own_k:  # rows past its own k are left out too
            mine = max(mine, float(scores[i, own_k]))
        found.append((scores[i, :own_k], rows[i, :own_k], mine))
    return found


class QueryCoalescer:
    """One thread that answers :func:`top_k_bounded` requests, a batch of them per product.

    Requests that name the same blocks (the same tuple object: one served index) are stacked
    into one query matrix and searched with the largest ``k`` and ``per_chunk`` among them
    (more rows per chunk only lowers each one's ceiling).
    """

    def __init__(self, max_batch: int = 64) -> None:
        self.max_batch = max_batch
        self._queue: queue.SimpleQueue[_Request | None] = queue.SimpleQueue()
        self._thread = threading.Thread(target=self._run, name="streamxm-search", daemon=True)
        self._thread.start()
        self.batches = 0
        self.queries = 0

    def submit(
        self,
        blocks: Sequence[Block],
        query: NDArray[np.float32],
        k: int,
        per_chunk: int | None = None,
    ) -> Future[Found]:
        """The query's scores and rows, best first, and its ceiling (:func:`top_k_bounded`),
        once the query's batch is answered."""
        request = _Request(blocks, np.ascontiguousarray(query, dtype=np.float32), k, per_chunk)
        self._queue.put(request)
        return request.future

    def close(self) -> None:
        self._queue.put(None)
        self._thread.join(timeout=10)

    def _run(self) -> None:
        while True:
            first = self._queue.get()
            if first is None:
                return
            pending = [first]
            while len(pending) < self.max_batch:
                try:
                    more = self._queue.get_nowait()
                except queue.Empty:
                    break
                if more is None:
                    self._queue.put(None)
                    break
                pending.append(more)
            groups: dict[tuple[int, int], list[_Request]] = {}
            for request in pending:
                groups.setdefault((id(request.blocks), request.query.shape[0]), []).append(request)
            for group in groups.values():
                self._answer(group)

    def _answer(self, group: list[_Request]) -> None:
        try:
            found = scan_together(group[0].blocks, [(r.query, r.k, r.per_chunk) for r in group])
            self.batches += 1
            self.queries += len(group)
            for request, its in zip(group, found, strict=True):
                request.future.set_result(its)
        except Exception as exc:  # every waiting request hears of it, the thread lives on
            for request in group:
                if not request.future.done():
                    request.future.set_exception(exc)
