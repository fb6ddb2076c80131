"""Several ranks learning one model: the collectives of a round and the merge of the ranks.

A distributed learner (``streamxm worker --world-size N``, :mod:`streamxm.worker.ranks`)
runs in synchronous rounds. Rank 0 reads a batch from the stream and sends each rank a share;
every rank learns its share from the same model; then one merge makes the ranks equal again.
What each model merges, and how, it says itself (:meth:`~streamxm.models.opt_in.MergesRanks.
merge_parts`): sufficient statistics are **summed** (each rank's change since the last merge, so
the merged statistics are one learner's on the same pairs), parameters are **averaged** weighted
by the pairs each rank learned (iterative parameter mixing). The learner's own counters (pairs,
triplets, mistakes, update times) are summed; its replay buffer, rolling mAP and drift detector
stay per rank, and rank 0's are the ones checkpointed.

Everything that travels between ranks is plain arrays: shares are message v1 frames
(:func:`~streamxm.stream.messages.encode_frames`), a learner's whole state is a checkpoint blob
(arrays + JSON, :func:`~streamxm.storage.checkpoint.encode_blob`). Nothing is pickled.
"""

from __future__ import annotations

import contextlib
import datetime
import json
import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
import torch.distributed as dist
from numpy.typing import NDArray
from torch.distributed import Store  # type: ignore[attr-defined]

from streamxm.learning.stream_learner import StreamLearner
from streamxm.models import DIRECTIONS
from streamxm.models.base import MergeParts
from streamxm.models.opt_in import mergeable
from streamxm.storage.checkpoint import Checkpoint, decode_blob, encode_blob
from streamxm.stream.messages import Pair, decode_frames, decode_pair, encode_frames

__all__ = [
    "RankGroup",
    "RankMerge",
    "balanced_first",
    "decode_learner",
    "decode_share",
    "encode_learner",
    "encode_share",
    "split_share",
]

_OPS = ("sum", "mix", "mean", "total", "max")


class RankGroup:
    """The process group of one distributed learner and the few collectives a round needs.

    ``store`` is the generation's rendezvous store (in Redis:
    :class:`~streamxm.worker.rendezvous.RedisStore`); ``host`` the address this rank's gloo
    sockets bind to and the others reach it at; ``timeout`` bounds every collective, so a rank
    that hangs fails the round within it (one that dies closes its sockets, which the others see
    at once). The group is gloo's process group itself, not ``torch.distributed``'s global one,
    so nothing outlives :meth:`close`.
    """

    def __init__(
        self, store: Store, rank: int, world: int, timeout_s: float, host: str = "127.0.0.1"
    ) -> None:
        self.rank, self.world = rank, world
        # torch's stubs omit the gloo group's options and collectives: typed as Any.
        gloo: Any = dist.ProcessGroupGloo
        options = gloo._Options()
        options._timeout = datetime.timedelta(seconds=timeout_s)
        options._devices = [gloo.create_device(hostname=host)]
        self.pg: Any = gloo(store, rank, world, options)

    def _pg(self) -> Any:
        if self.pg is None:
            raise RuntimeError("the process group is closed")
        return self.pg

    def close(self) -> None:
        pg, self.pg = self.pg, None
        if pg is not None:
            with contextlib.suppress(RuntimeError):
                pg.shutdown()

    def _broadcast(self, tensor: torch.Tensor) -> None:
        options = dist.BroadcastOptions()
        options.rootRank, options.rootTensor = 0, 0
        self._pg().broadcast([tensor], options).wait()

    def broadcast_ints(self, values: Sequence[int] | None, size: int) -> list[int]:
        """Rank 0's ``values`` (``size`` of them) on every rank."""
        t = torch.zeros(size, dtype=torch.int64)
        if self.rank == 0:
            assert values is not None and len(values) == size
            t[:] = torch.tensor(list(values), dtype=torch.int64)
        self._broadcast(t)
        return [int(x) for x in t.tolist()]

    def broadcast_bytes(self, data: bytes | None) -> bytes:
        """Rank 0's ``data`` on every rank."""
        (size,) = self.broadcast_ints([len(data or b"")], 1)
        buf = torch.zeros(size, dtype=torch.uint8)
        if self.rank == 0 and size:
            buf[:] = torch.frombuffer(bytearray(data or b""), dtype=torch.uint8)
        if size:
            self._broadcast(buf)
        return bytes(buf.numpy().tobytes())

    def send_bytes(self, data: bytes, dst: int) -> None:
        if data:
            self._pg().send([torch.frombuffer(bytearray(data), dtype=torch.uint8)], dst, 0).wait()

    def recv_bytes(self, size: int, src: int = 0) -> bytes:
        buf = torch.zeros(size, dtype=torch.uint8)
        if size:
            self._pg().recv([buf], src, 0).wait()
        return bytes(buf.numpy().tobytes())

    def _all_reduce(self, tensor: torch.Tensor, op: Any) -> None:
        options = dist.AllreduceOptions()
        options.reduceOp = op
        self._pg().allreduce([tensor], options).wait()

    def sum_ints(self, values: Sequence[int]) -> list[int]:
        t = torch.tensor(list(values), dtype=torch.int64)
        self._all_reduce(t, dist.ReduceOp.SUM)
        return [int(x) for x in t.tolist()]

    def all_reduce_(self, flat: NDArray[Any], op: str = "sum") -> None:
        """Reduce a contiguous array in place (``op``: ``"sum"`` or ``"max"``)."""
        self._all_reduce(
            torch.from_numpy(flat), dist.ReduceOp.MAX if op == "max" else dist.ReduceOp.SUM
        )


# -- what travels ----------------------------------------------------------------------------------
def split_share(count: int, world: int, first: int | None = None) -> list[tuple[int, int]]:
    """Contiguous ``[start, stop)`` shares of ``count`` pairs for ``world`` ranks (contiguous, so
    each rank learns a sub-stream in stream order): rank 0's share ``first`` pairs (it has
    other work in the round), the rest as even as possible; all even by default.

    >>> split_share(10, 3)
    [(0, 4), (4, 7), (7, 10)]
    >>> split_share(10, 2, first=3)
    [(0, 3), (3, 10)]
    """
    if first is None or world == 1:
        sizes = [len(part) for part in np.array_split(np.arange(count), world)]
    else:
        first = max(0, min(count, first))
        sizes = [
            first,
            *(len(part) for part in np.array_split(np.arange(count - first), world - 1)),
        ]
    starts = np.concatenate([[0], np.cumsum(sizes)[:-1]]).astype(int)
    return [(int(s), int(s + n)) for s, n in zip(starts, sizes, strict=True)]


def balanced_first(
    count: int, world: int, rank0_pair_s: float, peer_pair_s: float, rank0_extra_s: float
) -> int | None:
    """Rank 0's share that makes every rank finish together: rank 0 spends ``rank0_extra_s``
    on other work in the round and ``rank0_pair_s`` a pair, the slowest other rank
    ``peer_pair_s`` a pair; ``None`` (even shares) until both rates are known.

    >>> balanced_first(512, 2, 0.003, 0.003, 0.15)
    231
    """
    if rank0_pair_s <= 0 or peer_pair_s <= 0:
        return None
    others = peer_pair_s / (world - 1)
    return int(max(0.0, (count * others - rank0_extra_s) / (rank0_pair_s + others)))


def encode_share(pairs: Sequence[Pair], round_labels: Sequence[tuple[int, ...]]) -> bytes:
    """A rank's share of a round: the labels of the whole round in stream order (so every rank
    numbers classes alike) and its pairs as message v1 frames."""
    head = json.dumps([list(labels) for labels in round_labels]).encode()
    return len(head).to_bytes(4, "little") + head + encode_frames(pairs)


def decode_share(
    body: bytes, img_dim: int | None = None, txt_dim: int | None = None
) -> tuple[list[Pair], list[tuple[int, ...]]]:
    """Undo :func:`encode_share` (rank 0 validated the pairs when it read them)."""
    size = int.from_bytes(body[:4], "little")
    labels = [tuple(int(x) for x in item) for item in json.loads(body[4 : 4 + size])]
    frames = decode_frames(body[4 + size :], max_pairs=len(body))
    return [decode_pair(fields, img_dim, txt_dim) for fields in frames], labels


def encode_learner(learner: StreamLearner | None, version: int, last_id: str) -> bytes:
    """A learner's whole state as a checkpoint blob (empty: no learner yet)."""
    if learner is None:
        return b""
    arrays, meta = learner.state()
    return encode_blob(Checkpoint(version, arrays, meta, last_id=last_id))


def decode_learner(blob: bytes) -> StreamLearner | None:
    if not blob:
        return None
    ckpt = decode_blob(blob)
    return StreamLearner.from_state(ckpt.arrays, ckpt.meta)


# -- the merge -------------------------------------------------------------------------------------
def _learner_parts(learner: StreamLearner) -> MergeParts:
    """The learner's own counters, summed across ranks (exactly: each pair counts once)."""
    parts: MergeParts = {
        "learner.pairs_seen": ("sum", np.asarray(learner.pairs_seen)),
        "learner.pairs_unlabelled": ("sum", np.asarray(learner.pairs_unlabelled)),
        "learner.pairs_in_burst": ("sum", np.asarray(learner.pairs_in_burst)),
        "learner.update_seconds": ("sum", np.asarray(learner.update_seconds)),
        "learner.update_hist": ("sum", np.asarray(learner.update_hist)),
    }
    for key in ("triplets", "mistakes", "loss", "updates"):
        values = getattr(learner.stats, key)
        parts[f"learner.{key}"] = ("sum", np.asarray([values[d] for d in DIRECTIONS]))
    return parts


def _set_learner_parts(learner: StreamLearner, merged: dict[str, NDArray[Any]]) -> None:
    learner.pairs_seen = int(merged["learner.pairs_seen"])
    learner.pairs_unlabelled = int(merged["learner.pairs_unlabelled"])
    learner.pairs_in_burst = int(merged["learner.pairs_in_burst"])
    learner.update_seconds = float(merged["learner.update_seconds"])
    learner.update_hist = [int(x) for x in merged["learner.update_hist"]]
    for key in ("triplets", "mistakes", "loss", "updates"):
        cast = float if key == "loss" else int
        getattr(learner.stats, key).update(
            {d: cast(v) for d, v in zip(DIRECTIONS, merged[f"learner.{key}"], strict=True)}
        )


def _pad(base: NDArray[Any], shape: tuple[int, ...]) -> NDArray[Any]:
    """``base`` grown with zeros to ``shape`` (per-class columns added during the round)."""
    if base.shape == shape:
        return base
    out = np.zeros(shape, dtype=base.dtype)
    out[tuple(slice(0, n) for n in base.shape)] = base
    return out


@dataclass
class MergeReport:
    seconds: float
    bytes: int


class RankMerge:
    """Merges one rank's :class:`StreamLearner` with the other ranks' after each round.

    :meth:`reset` after the ranks were made equal (a state sent from rank 0, or a merge) takes
    the base that summed parts are measured from; :meth:`merge` after a round.
    """

    def __init__(self, group: RankGroup) -> None:
        self.group = group
        self.base: dict[str, NDArray[Any]] = {}
        self.pairs_before = 0

    def _parts(self, learner: StreamLearner) -> MergeParts:
        learner.flush()
        model = mergeable(learner.model)
        parts = model.merge_parts() if model is not None else None
        if parts is None:
            raise RuntimeError(f"{learner.model_name} cannot be split now but the round was")
        return {**{f"model.{k}": v for k, v in parts.items()}, **_learner_parts(learner)}

    def reset(self, learner: StreamLearner) -> None:
        self.base = {
            name: np.array(arr, copy=True)
            for name, (op, arr) in self._parts(learner).items()
            if op in ("sum", "mix")
        }
        self.pairs_before = learner.pairs_seen

    def merge(self, learner: StreamLearner, learned: int) -> MergeReport:
        """Combine the ranks; ``learned`` is the pairs this rank learned in the round."""
        start = time.perf_counter()
        parts = self._parts(learner)
        (total,) = self.group.sum_ints([learned])
        weight = learned / total if total else 1.0 / self.group.world
        # One flat buffer per (reduction, dtype): a handful of all-reduces, not one per array.
        buckets: dict[tuple[str, str], list[tuple[str, NDArray[Any]]]] = {}
        for name, (op, arr) in sorted(parts.items()):
            if op not in _OPS:
                raise ValueError(f"unknown merge operation {op!r} for {name}")
            arr = np.asarray(arr)
            # New arrays, written in place from here on (a 16 MB W is streamed as few times as
            # possible: the ranks' caches are shared).
            if op in ("sum", "mix"):
                value = np.subtract(arr, _pad(self.base.get(name, np.zeros_like(arr)), arr.shape))
                if op == "mix":
                    value *= 1.0 / np.sqrt(self.group.world)
            elif op == "mean":
                value = np.multiply(arr, weight)
            else:
                value = np.array(arr, copy=True)
            dtype = "float32" if arr.dtype == np.float32 else "float64"
            reduce = "max" if op == "max" else "sum"
            buckets.setdefault((reduce, dtype), []).append((name, np.asarray(value, dtype=dtype)))
        merged: dict[str, NDArray[Any]] = {}
        sent = 0
        for (reduce, dtype), items in buckets.items():
            flat = (
                np.ascontiguousarray(items[0][1]).reshape(-1)
                if len(items) == 1
                else np.concatenate([v.ravel() for _, v in items]).astype(dtype, copy=False)
            )
            self.group.all_reduce_(flat, reduce)
            sent += flat.nbytes
            at = 0
            for name, v in items:
                merged[name] = flat[at : at + v.size].reshape(v.shape)
                at += v.size
        for name, (op, arr) in parts.items():
            if op in ("sum", "mix"):
                merged[name] += _pad(self.base.get(name, np.zeros_like(arr)), np.shape(arr))
            if np.asarray(arr).dtype.kind in "iub":
                merged[name] = np.rint(merged[name]).astype(np.asarray(arr).dtype)
        _set_learner_parts(learner, merged)
        model = mergeable(learner.model)
        assert model is not None  # _parts split it
        model.set_merged({k[6:]: v for k, v in merged.items() if k.startswith("model.")})
        model.after_merge(self.pairs_before, learner.pairs_seen, learner.rng)
        # The next round's base is what every rank now holds (not a second read of the parts).
        self.base = {
            name: np.array(merged[name], copy=True)
            for name, (op, _) in parts.items()
            if op in ("sum", "mix")
        }
        self.pairs_before = learner.pairs_seen
        return MergeReport(time.perf_counter() - start, sent)
