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

__all__ = ["Bf16Block", "Block", "QueryCoalescer", "bf16_score_error", "index_block", "top_k"]

_BLOCK = 65_536  # rows per product: bounds the (queries x rows) float32 temporary

#: What :func:`top_k` scans: float32 rows, or the same rows as a :class:`Bf16Block`.
Block = Any

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
    a few size classes and query batches padded to powers of two, the shapes, and that
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
    m = len(queries)
    best_s = np.empty((m, 0), dtype=np.float32)
    best_r = np.empty((m, 0), dtype=np.int64)
    offset = 0
    for block in blocks:
        for start in range(0, len(block), _BLOCK):
            if isinstance(block, Bf16Block):
                scores, rows = _top_k_bf16(queries, block, start, k)
                best_s = np.concatenate([best_s, scores], axis=1)
                best_r = np.concatenate([best_r, rows + (offset + start)], axis=1)
                continue
            part = block[start : start + _BLOCK]
            scores = queries @ part.T
            if part.shape[0] > k:
                keep = np.argpartition(-scores, k - 1, axis=1)[:, :k]
                scores = np.take_along_axis(scores, keep, axis=1)
                rows = keep + (offset + start)
            else:
                rows = np.broadcast_to(np.arange(len(part)) + (offset + start), scores.shape)
            best_s = np.concatenate([best_s, scores], axis=1)
            best_r = np.concatenate([best_r, rows], axis=1)
            if best_s.shape[1] > 4 * k:
                best_s, best_r = _best(best_s, best_r, k)
        offset += len(block)
    return _best(best_s, best_r, k)


def _top_k_bf16(queries: NDArray[np.float32], block: Bf16Block, start: int, k: int
                ) -> tuple[NDArray[np.float32], NDArray[np.int64]]:
    """Top ``k`` of the block's rows ``start : start + _BLOCK`` (a bounded set of shapes: the
    padded block's rows, queries padded to a power of two)."""
    m, rows = len(queries), min(_BLOCK, block.rows - start)
    batch = torch.zeros((1 << (m - 1).bit_length(), queries.shape[1]), dtype=torch.bfloat16)
    batch[:m] = torch.from_numpy(queries)
    part = block.tensor[start : start + _BLOCK]
    scores = (batch @ part.T)[:m, :rows].float()
    values, found = torch.topk(scores, min(k, rows), dim=1)
    return values.numpy(), found.numpy().astype(np.int64)


def _best(scores: NDArray[np.float32], rows: NDArray[np.int64], k: int
          ) -> tuple[NDArray[np.float32], NDArray[np.int64]]:
    # Sort by row first, then stably by score: equal scores keep row (gallery) order.
    by_row = np.argsort(rows, axis=1, kind="stable")
    scores, rows = np.take_along_axis(scores, by_row, 1), np.take_along_axis(rows, by_row, 1)
    order = np.argsort(-scores, axis=1, kind="stable")[:, :k]
    return np.take_along_axis(scores, order, 1), np.take_along_axis(rows, order, 1)


@dataclass
class _Request:
    blocks: Sequence[Block]
    query: NDArray[np.float32]
    k: int
    future: Future[tuple[NDArray[np.float32], NDArray[np.int64]]] = field(
        default_factory=Future)


class QueryCoalescer:
    """One thread that answers :func:`top_k` requests, a batch of them per product.

    Requests that name the same blocks (the same tuple object: one served index) are stacked
    into one query matrix and searched with the largest ``k`` among them.
    """

    def __init__(self, max_batch: int = 64) -> None:
        self.max_batch = max_batch
        self._queue: queue.SimpleQueue[_Request | None] = queue.SimpleQueue()
        self._thread = threading.Thread(target=self._run, name="streamxm-search", daemon=True)
        self._thread.start()
        self.batches = 0
        self.queries = 0

    def search(self, blocks: Sequence[Block], query: NDArray[np.float32], k: int
               ) -> tuple[NDArray[np.float32], NDArray[np.int64]]:
        """Block until the query's batch is answered; its scores and rows, best first."""
        return self.submit(blocks, query, k).result()

    def submit(self, blocks: Sequence[Block], query: NDArray[np.float32], k: int
               ) -> Future[tuple[NDArray[np.float32], NDArray[np.int64]]]:
        """The query's scores and rows, best first, when its batch is answered."""
        request = _Request(blocks, np.ascontiguousarray(query, dtype=np.float32), k)
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
            scores, rows = top_k(np.stack([r.query for r in group]), group[0].blocks, k)
            self.batches += 1
            self.queries += len(group)
            for i, request in enumerate(group):
                request.future.set_result((scores[i, : request.k], rows[i, : request.k]))
        except Exception as exc:  # every waiting request hears of it, the thread lives on
            for request in group:
                if not request.future.done():
                    request.future.set_exception(exc)
