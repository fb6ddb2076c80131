"""Checkpoints: arrays plus JSON metadata, versioned, checksummed, never pickled.

A checkpoint blob is an uncompressed ``.npz`` holding the state arrays and a ``__meta__`` array of
UTF-8 JSON bytes; it is read back with ``allow_pickle=False``, so a blob from anywhere can at
worst fail to load. Every version is stored with its SHA-256; a version whose bytes do not match
(truncated, corrupted) is skipped in favour of the newest good one, with a log line and a count in
``sxm:<ns>:ckpt:corrupt`` (exported as ``streamxm_checkpoint_corrupt_total``). A worker that falls
back replays the stream from the older version's last applied entry (see the worker), so a bad
blob costs time, not pairs.

Two stores: Redis (default; the write is part of the worker's commit transaction, together with
the acknowledgements, dead letters and statistics) and a directory (files written to a temporary
name, fsynced, then renamed; the commit transaction follows the rename).
"""

from __future__ import annotations

import contextlib
import hashlib
import io
import json
import logging
import os
import re
import time
from abc import ABC, abstractmethod
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import redis
from numpy.typing import NDArray

from streamxm.faults import pause_point
from streamxm.keys import Keys
from streamxm.redis_conn import str_hash, text

__all__ = [
    "Checkpoint",
    "CheckpointStore",
    "DirectoryCheckpointStore",
    "LeaseLost",
    "RedisCheckpointStore",
    "decode_blob",
    "encode_blob",
]

log = logging.getLogger(__name__)

FORMAT_VERSION = 1
_META = "__meta__"

PipelineHook = Callable[["redis.client.Pipeline"], None]


@dataclass
class Checkpoint:
    """One version of a model's learner state."""

    version: int
    arrays: dict[str, NDArray[Any]]
    meta: dict[str, Any]
    last_id: str = "0-0"
    created: float = field(default_factory=time.time)


def encode_blob(ckpt: Checkpoint) -> bytes:
    """Serialise to ``.npz`` bytes (arrays + JSON); object arrays are refused."""
    meta = {"format": FORMAT_VERSION, "version": ckpt.version, "last_id": ckpt.last_id,
            "created": ckpt.created, "state": ckpt.meta}
    arrays = {}
    for name, arr in ckpt.arrays.items():
        arr = np.asarray(arr)
        if arr.dtype.hasobject:
            raise TypeError(f"array {name!r} has object dtype; checkpoints hold plain arrays")
        arrays[name] = arr
    arrays[_META] = np.frombuffer(json.dumps(meta).encode(), dtype=np.uint8)
    out = io.BytesIO()
    np.savez(out, allow_pickle=False, **arrays)
    return out.getvalue()


def decode_blob(blob: bytes) -> Checkpoint:
    """Parse bytes from :func:`encode_blob`; never unpickles."""
    with np.load(io.BytesIO(blob), allow_pickle=False) as data:
        meta = json.loads(bytes(data[_META]).decode())
        arrays = {k: data[k] for k in data.files if k != _META}
    if meta.get("format") != FORMAT_VERSION:
        raise ValueError(f"unsupported checkpoint format {meta.get('format')!r}")
    return Checkpoint(version=int(meta["version"]), arrays=arrays, meta=meta["state"],
                      last_id=str(meta["last_id"]), created=float(meta["created"]))


def _sha(blob: bytes) -> str:
    return hashlib.sha256(blob).hexdigest()


class LeaseLost(RuntimeError):
    """The commit was refused: the caller no longer holds the learner lease."""


def _check_lease(pipe: redis.client.Pipeline, lease: tuple[str, str] | None) -> None:
    """WATCH the lease key and verify we own it; the transaction then fails if it changes."""
    if lease is None:
        return
    key, owner = lease
    pipe.watch(key)  # type: ignore[no-untyped-call]
    current = pipe.get(key)
    if current is None or text(current) != owner:
        pipe.unwatch()
        raise LeaseLost(f"lease {key} is held by {current!r}, not {owner!r}")


class CheckpointStore(ABC):
    """Where a model's checkpoints live. ``head`` is cheap: the API polls it."""

    def __init__(self, client: redis.Redis, keys: Keys, keep: int = 3) -> None:
        self.r = client
        self.keys = keys
        self.keep = keep

    @abstractmethod
    def head(self, model: str) -> dict[str, Any] | None:
        """Metadata of the newest version (``version``, ``created``, ``last_id``...)."""

    def _versions(self, model: str) -> list[tuple[int, str]]:
        """Stored (version, sha256), newest first, as the head lists them."""
        head = self.head(model)
        return [] if head is None else list(head["history"])

    def _history(self, model: str, version: int, blob: bytes) -> tuple[
            list[tuple[int, str]], list[tuple[int, str]]]:
        """(versions kept, versions to delete) once ``version`` with ``blob`` is the newest."""
        history = [(version, _sha(blob)), *self._versions(model)]
        return history[: self.keep], history[self.keep :]

    @abstractmethod
    def _read(self, model: str, version: int) -> bytes | None:
        """The blob of one version."""

    @abstractmethod
    def commit(self, model: str, ckpt: Checkpoint, head_extra: dict[str, Any],
               hook: PipelineHook | None = None, lease: tuple[str, str] | None = None) -> None:
        """Make ``ckpt`` durable and newest; ``hook`` adds commands to the same transaction.

        ``lease`` is ``(key, owner)``: the commit happens only while ``key`` holds ``owner``
        (:class:`LeaseLost` otherwise, ``redis.WatchError`` if it changes meanwhile), so a worker
        that lost its lease can never overwrite its successor's checkpoint.
        """

    def load_latest(self, model: str) -> Checkpoint | None:
        """The newest version whose bytes verify; older good ones replace corrupt ones."""
        for version, sha in self._versions(model):
            blob = self._read(model, version)
            problem = None
            if blob is None:
                problem = "missing"
            elif _sha(blob) != sha:
                problem = "checksum mismatch"
            else:
                try:
                    return decode_blob(blob)
                except (ValueError, OSError, KeyError) as exc:
                    problem = f"unreadable ({exc})"
            log.error("checkpoint %s v%d %s; falling back to the previous version",
                      model, version, problem)
            # Counting is best effort: a Redis hiccup must not hide the good version.
            with contextlib.suppress(redis.RedisError):
                self.r.hincrby(self.keys.checkpoint_corrupt, model, 1)
        return None

    def corrupt_count(self, model: str) -> int:
        """Corrupt versions of ``model`` found so far, by any process of the namespace."""
        return int(text(self.r.hget(self.keys.checkpoint_corrupt, model) or 0))


class RedisCheckpointStore(CheckpointStore):
    """Blobs under ``sxm:<ns>:ckpt:<model>:v:<version>``, head hash beside them."""

    def head(self, model: str) -> dict[str, Any] | None:
        raw = str_hash(self.r.hgetall(self.keys.checkpoint_head(model)))
        return _parse_head(raw) if raw else None

    def _read(self, model: str, version: int) -> bytes | None:
        value = self.r.get(self.keys.checkpoint_blob(model, version))
        return None if value is None else bytes(value)  # type: ignore[arg-type]

    def commit(self, model: str, ckpt: Checkpoint, head_extra: dict[str, Any],
               hook: PipelineHook | None = None, lease: tuple[str, str] | None = None) -> None:
        blob = encode_blob(ckpt)
        kept, dropped = self._history(model, ckpt.version, blob)
        with self.r.pipeline(transaction=True) as pipe:
            _check_lease(pipe, lease)
            pipe.multi()
            pipe.set(self.keys.checkpoint_blob(model, ckpt.version), blob)
            for version, _ in dropped:
                pipe.delete(self.keys.checkpoint_blob(model, version))
            pipe.delete(self.keys.checkpoint_head(model))
            pipe.hset(self.keys.checkpoint_head(model),
                      mapping=_head_fields(ckpt, kept, head_extra))  # type: ignore[arg-type]
            if hook:
                hook(pipe)
            pipe.publish(self.keys.checkpoint_channel, f"{model} {ckpt.version}")
            pause_point("checkpoint.before_exec")
            pipe.execute()


class DirectoryCheckpointStore(CheckpointStore):
    """Blobs as ``<dir>/<ns>/<model>/v<version>.npz``, head as ``HEAD.json`` (atomic renames)."""

    def __init__(self, client: redis.Redis, keys: Keys, root: str | Path, keep: int = 3) -> None:
        super().__init__(client, keys, keep)
        self.root = Path(root) / keys.namespace

    def _dir(self, model: str) -> Path:
        return self.root / re.sub(r"[^A-Za-z0-9_.-]", "_", model)

    def head(self, model: str) -> dict[str, Any] | None:
        try:
            return _parse_head(json.loads((self._dir(model) / "HEAD.json").read_text()))
        except FileNotFoundError:
            return None

    def _read(self, model: str, version: int) -> bytes | None:
        try:
            return (self._dir(model) / f"v{version:012d}.npz").read_bytes()
        except FileNotFoundError:
            return None

    @staticmethod
    def _write_atomic(path: Path, data: bytes) -> None:
        tmp = path.with_name(path.name + ".tmp")
        with open(tmp, "wb") as f:
            half = len(data) // 2
            f.write(data[:half])
            f.flush()
            pause_point("checkpoint.partial_write")
            f.write(data[half:])
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
        fd = os.open(path.parent, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)

    def commit(self, model: str, ckpt: Checkpoint, head_extra: dict[str, Any],
               hook: PipelineHook | None = None, lease: tuple[str, str] | None = None) -> None:
        directory = self._dir(model)
        directory.mkdir(parents=True, exist_ok=True)
        blob = encode_blob(ckpt)
        kept, dropped = self._history(model, ckpt.version, blob)
        with self.r.pipeline(transaction=True) as pipe:
            _check_lease(pipe, lease)
            self._write_atomic(directory / f"v{ckpt.version:012d}.npz", blob)
            self._write_atomic(directory / "HEAD.json",
                               json.dumps(_head_fields(ckpt, kept, head_extra)).encode())
            for version, _ in dropped:
                with contextlib.suppress(FileNotFoundError):
                    (directory / f"v{version:012d}.npz").unlink()
            pipe.multi()
            if hook:
                hook(pipe)
            pipe.publish(self.keys.checkpoint_channel, f"{model} {ckpt.version}")
            pause_point("checkpoint.before_commit")
            pipe.execute()


def _head_fields(ckpt: Checkpoint, history: list[tuple[int, str]],
                 extra: dict[str, Any]) -> dict[str, str]:
    fields = {"version": str(ckpt.version), "created": repr(ckpt.created),
              "last_id": ckpt.last_id,
              "history": ",".join(f"{v}:{sha}" for v, sha in history)}
    fields.update({k: str(v) for k, v in extra.items()})
    return fields


def _parse_head(raw: dict[str, str]) -> dict[str, Any]:
    head: dict[str, Any] = dict(raw)
    head["version"] = int(raw["version"])
    head["created"] = float(raw["created"])
    head["history"] = [(int(v), sha) for v, sha in
                       (item.split(":", 1) for item in raw["history"].split(",") if item)]
    return head
