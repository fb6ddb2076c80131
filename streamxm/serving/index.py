"""Top-k inner-product search over the gallery's blocks of rows, and the thread that coalesces
concurrent queries into one matrix product.

The interface is two functions: :func:`index_block` turns a float32 row block into what the
backend scans, and :func:`top_k` returns each query's best ``k`` scores and global row positions.
Two backends, measured on this 2-core machine (one thread, 100,000 unit rows, 32 queries,
``docs/benchmarks.md``):

- **bfloat16** (when PyTorch is installed, the ``sam`` extra): rows stored once more in
  bfloat16 (half the float32 bytes), scanned by one bf16 matrix product (AVX-512 BF16) and
  ``torch.topk``: 7.9 ms at 128 dimensions, 17.8 ms at 512. Its scores round to 3 significant
  digits, so it only *proposes* candidates; the served version re-ranks them exactly
  (recall@10 of 100 candidates against the exact float32 ranking: 1.0 in that probe).
- **float32** (always available, the reference): blocked BLAS products and ``argpartition``:
  32 ms and 57 ms.

FAISS (``faiss-cpu``) was measured for this role and not chosen: its flat inner-product search
took 0.54 s for 32 queries over 1,000,000 x 128 rows on one thread where the float32 path here
took 0.16 s (2.15 s against 0.45 s at 512 dimensions), and its 8-bit scalar quantiser scans one
query at a time (0.88 s for 32 at 512). Keeping the interface this small leaves room for a vector
database backend later.

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

__all__ = ["Bf16Block", "Block", "QueryCoalescer", "bf16_score_error", "index_block", "top_k",
           "top_k_bounded"]

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
    """Rows as the backend scans them: a ``"bfloat16"`` tensor (``"auto"``: when PyTorch is
    installed) or the ``"float32"`` array itself."""
    if precision == "auto":
        precision = "float32" if torch is None else "bfloat16"
    if precision == "float32":
        return rows
    if torch is None:
        raise ImportError("bfloat16 search needs PyTorch: pip install 'streamxm[sam]'")
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
    rows arrive grew the API by ~20 MB a minute (``bench soak``). With row counts drawn from
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


def bf16_score_error(query_norm: float, score: float) -> float:
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
    the largest scan score among rows left out bounds all of their true scores.
    """
    u = 2.0**-8
    return ((2 * u + u * u) * query_norm + u / (1 - u) * abs(score)) * 1.01


def top_k(queries: NDArray[np.float32], blocks: Sequence[Block], k: int
          ) -> tuple[NDArray[np.float32], NDArray[np.int64]]:
    """The ``k`` largest inner products of each query with the rows of ``blocks`` (taken as one
    array in order), best first; fewer than ``k`` when there are fewer rows. On float32 blocks
    the scores are exact and ties keep row order; on bfloat16 blocks both are approximate.

    >>> blocks = [np.eye(3, dtype=np.float32), np.ones((1, 3), dtype=np.float32)]
    >>> scores, rows = top_k(np.array([[0, 1, 0.5]], dtype=np.float32), blocks, 2)
    >>> scores.tolist(), rows.tolist()
    ([[1.5, 1.0]], [[3, 1]])
    """
    scores, rows, _ = top_k_bounded(queries, blocks, k)
    return scores, rows


def top_k_bounded(queries: NDArray[np.float32], blocks: Sequence[Block], k: int,
                  per_chunk: int | None = None
                  ) -> tuple[NDArray[np.float32], NDArray[np.int64], NDArray[np.float32]]:
    """:func:`top_k`, where each chunk of ``_BLOCK`` rows offers at most ``per_chunk`` rows
    (default ``k``), with each query's *ceiling*: the largest scan score of any row not
    returned (``-inf`` when every row is).

    Why per chunk: a top-k selection costs more the larger ``k`` (``torch.topk`` of 400 takes
    2.4 times as long as of 100 per chunk here), but a completeness proof needs only a low
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
    offset = 0
    for block in blocks:
        for start in range(0, len(block), _BLOCK):
            if isinstance(block, Bf16Block):
                scores, rows, cut = _top_k_bf16(queries, block, start, per_chunk)
            else:
                scores, rows, cut = _top_k_float32(queries, block[start : start + _BLOCK],
                                                   per_chunk)
            np.maximum(ceiling, cut, out=ceiling)
            best_s = np.concatenate([best_s, scores], axis=1)
            best_r = np.concatenate([best_r, rows + (offset + start)], axis=1)
            if best_s.shape[1] > 4 * k:
                best_s, best_r, cut = _best(best_s, best_r, k)
                np.maximum(ceiling, cut, out=ceiling)
        offset += len(block)
    best_s, best_r, cut = _best(best_s, best_r, k)
    return best_s, best_r, np.maximum(ceiling, cut)


def _top_k_float32(queries: NDArray[np.float32], part: NDArray[np.float32], k: int
                   ) -> tuple[NDArray[np.float32], NDArray[np.int64], NDArray[np.float32]]:
    """Top ``k`` of one chunk (unordered), local rows, and the best score left out."""
    scores = queries @ part.T
    if part.shape[0] <= k:
        rows = np.broadcast_to(np.arange(len(part)), scores.shape)
        return scores, rows, np.full(len(queries), -np.inf, dtype=np.float32)
    order = np.argpartition(-scores, k, axis=1)
    keep = order[:, :k]
    cut = np.take_along_axis(scores, order[:, k : k + 1], axis=1)[:, 0]
    return np.take_along_axis(scores, keep, axis=1), keep, cut


def _top_k_bf16(queries: NDArray[np.float32], block: Bf16Block, start: int, k: int
                ) -> tuple[NDArray[np.float32], NDArray[np.int64], NDArray[np.float32]]:
    """Top ``k`` of the block's rows ``start : start + _BLOCK`` and the best score left out (a
    bounded set of shapes: the padded block's rows, queries padded to a multiple of 8, which
    wastes less of a compute-bound product than the power of two it was: 17 queries cost 24
    rows, not 32).

    A full chunk is selected in two steps: the maximum of each group of ``_GROUP`` rows, the
    best ``k + 1`` groups by it, then the best ``k`` rows of those groups. A row in a group
    left out scored at most the best left-out group's maximum, so the ceiling stays a bound;
    ``torch.topk`` over all 65,536 scores per query was 15% of the API's CPU at 1M (perf).
    """
    m, rows = len(queries), min(_BLOCK, block.rows - start)
    batch = torch.zeros((-(-m // 8) * 8, queries.shape[1]), dtype=torch.bfloat16)
    batch[:m] = torch.from_numpy(queries)
    part = block.tensor[start : start + _BLOCK]
    scores = (batch @ part.T)[:m].float()
    if rows < _BLOCK or (k + 1) * _GROUP * 4 > _BLOCK:
        values, found, cut = _select(scores[:, :rows], k)
        return values.numpy(), found.numpy().astype(np.int64), cut.numpy().copy()
    grouped = scores.view(m, _BLOCK // _GROUP, _GROUP)
    _, groups, group_cut = _select(grouped.amax(dim=2), k)
    inside = torch.gather(grouped, 1, groups[:, :, None].expand(m, k, _GROUP)).reshape(m, -1)
    values, found, cut = _select(inside, k)
    found = groups.gather(1, found // _GROUP) * _GROUP + found % _GROUP
    return (values.numpy(), found.numpy().astype(np.int64),
            torch.maximum(group_cut, cut).numpy().copy())


def _select(scores: Any, k: int) -> tuple[Any, Any, Any]:
    """Each row's ``k`` largest values (tensors), their columns, and the largest value left
    out (``-inf`` when none is)."""
    if scores.shape[1] <= k:
        values, found = torch.topk(scores, scores.shape[1], dim=1)
        return values, found, torch.full((len(scores),), -np.inf)
    values, found = torch.topk(scores, k + 1, dim=1)
    return values[:, :k], found[:, :k], values[:, k]


def _best(scores: NDArray[np.float32], rows: NDArray[np.int64], k: int
          ) -> tuple[NDArray[np.float32], NDArray[np.int64], NDArray[np.float32]]:
    """The best ``k`` of each query's (score, row) pairs and the best score cut off."""
    # Sort by row first, then stably by score: equal scores keep row (gallery) order.
    by_row = np.argsort(rows, axis=1, kind="stable")
    scores, rows = np.take_along_axis(scores, by_row, 1), np.take_along_axis(rows, by_row, 1)
    order = np.argsort(-scores, axis=1, kind="stable")
    cut = (np.take_along_axis(scores, order[:, k : k + 1], 1)[:, 0] if scores.shape[1] > k
           else np.full(len(scores), -np.inf, dtype=np.float32))
    order = order[:, :k]
    return np.take_along_axis(scores, order, 1), np.take_along_axis(rows, order, 1), cut


@dataclass
class _Request:
    blocks: Sequence[Block]
    query: NDArray[np.float32]
    k: int
    per_chunk: int | None
    future: Future[Found] = field(default_factory=Future)


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

    def search(self, blocks: Sequence[Block], query: NDArray[np.float32], k: int,
               per_chunk: int | None = None) -> Found:
        """Block until the query's batch is answered; its scores and rows, best first, and
        its ceiling (:func:`top_k_bounded`)."""
        return self.submit(blocks, query, k, per_chunk).result()

    def submit(self, blocks: Sequence[Block], query: NDArray[np.float32], k: int,
               per_chunk: int | None = None) -> Future[Found]:
        """:meth:`search`'s answer when the query's batch is answered."""
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
            k = max(r.k for r in group)
            per_chunk = max(r.k if r.per_chunk is None else r.per_chunk for r in group)
            scores, rows, ceiling = top_k_bounded(np.stack([r.query for r in group]),
                                                  group[0].blocks, k, per_chunk)
            self.batches += 1
            self.queries += len(group)
            for i, request in enumerate(group):
                mine = float(ceiling[i])
                if scores.shape[1] > request.k:  # rows past its own k are left out too
                    mine = max(mine, float(scores[i, request.k]))
                request.future.set_result((scores[i, : request.k], rows[i, : request.k],
                                           mine))
        except Exception as exc:  # every waiting request hears of it, the thread lives on
            for request in group:
                if not request.future.done():
                    request.future.set_exception(exc)
