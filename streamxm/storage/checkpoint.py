"""Checkpoints: arrays plus JSON metadata, versioned, checksummed, never pickled.

A checkpoint blob is an uncompressed ``.npz`` holding the state arrays and a ``__meta__`` array of
UTF-8 JSON bytes; it is read back with ``allow_pickle=False``, so a blob from anywhere can at
worst fail to load. Every version is stored with its SHA-256; a version whose bytes do not match
(truncated, corrupted) is skipped in favour of the newest good one, with a log line and a count in
``sxm:{<ns>}:ckpt:corrupt`` (exported as ``streamxm_checkpoint_corrupt_total``). A worker that falls
back replays the stream from the older version's last applied entry (see the worker), so a bad
blob costs time, not pairs.

Two stores, one commit protocol. The *head* (newest version, its last applied entry, and the
kept versions with their checksums) is a Redis hash written in the worker's commit transaction,
together with the acknowledgements, dead letters and statistics, and fenced by the learner lease
(``WATCH``): only the lease holder's transaction can make a version current. The blob lives in
Redis (default; written in the same transaction) or in a directory, as an immutable file named by
its version *and its checksum* (``v<version>-<sha256[:16]>.npz``), written to a temporary name of
its own, fsynced and renamed before the transaction. A writer that lost its lease while writing
(a GC or VM pause longer than the lease) therefore leaves at most an orphan file that no head
names: it can neither write into its successor's file of the same version nor make its own
current. Orphans older than an hour are swept by later commits.
"""

from __future__ import annotations

import contextlib
import hashlib
import io
import json
import logging
import os
import re
import threading
import time
import uuid
from abc import ABC, abstractmethod
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import redis
from numpy.typing import NDArray

from streamxm import defaults as D
from streamxm.faults import pause_point
from streamxm.stream.keys import Keys
from streamxm.stream.redis_conn import Replication, str_hash, text, wait_replicated
from streamxm.stream.retention import entry_id_key

__all__ = [
    "Checkpoint",
    "CheckpointStore",
    "DirectoryCheckpointStore",
    "LeaseLost",
    "RedisCheckpointStore",
    "VersionNotKept",
    "VersionUnreadable",
    "blob_sha",
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
    meta = {
        "format": FORMAT_VERSION,
        "version": ckpt.version,
        "last_id": ckpt.last_id,
        "created": ckpt.created,
        "state": ckpt.meta,
    }
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
    return Checkpoint(
        version=int(meta["version"]),
        arrays=arrays,
        meta=meta["state"],
        last_id=str(meta["last_id"]),
        created=float(meta["created"]),
    )


def blob_sha(blob: bytes) -> str:
    """SHA-256 of a blob, hex: what heads and manifests record to verify it."""
    return hashlib.sha256(blob).hexdigest()


class VersionNotKept(LookupError):
    """A version of a model that its store does not keep (any more, or ever)."""


class VersionUnreadable(VersionNotKept):
    """A version the store keeps whose bytes are missing, fail their checksum or do not parse
    (logged and counted in ``streamxm_checkpoint_corrupt_total`` when found)."""


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


@dataclass(frozen=True)
class _BlobWrite:
    """One durable write (:meth:`CheckpointStore.commit_blobs`): new versions of ``name``
    (``(version, blob)``, none or several), and the versions (with their SHA-256) the head keeps
    and drops with it."""

    name: str
    blobs: tuple[tuple[int, bytes], ...]
    kept: list[tuple[int, str]]
    dropped: list[tuple[int, str]]


class CheckpointStore(ABC):
    """Where a model's checkpoints live. ``head`` is cheap: the API polls it."""

    #: Fail point just before the commit transaction is sent.
    before_exec_point = "checkpoint.before_exec"

    def __init__(
        self,
        client: redis.Redis,
        keys: Keys,
        keep: int = D.CHECKPOINT_KEEP,
        replication: Replication = Replication(),
    ) -> None:
        self.r = client
        self.keys = keys
        self.keep = keep
        #: Replicas that must hold a commit before it returns (NotReplicated otherwise).
        self.replication = replication

    def head(self, model: str) -> dict[str, Any] | None:
        """Metadata of the newest version (``version``, ``created``, ``last_id``, ``history``)."""
        raw = str_hash(self.r.hgetall(self.keys.checkpoint_head(model)))
        return _parse_head(raw) if raw else None

    def _versions(self, model: str) -> list[tuple[int, str]]:
        """Stored (version, sha256), newest first, as the head lists them."""
        head = self.head(model)
        return [] if head is None else list(head["history"])

    @abstractmethod
    def _read(self, model: str, version: int, sha: str) -> bytes | None:
        """The blob of one version."""

    # Optional steps of the commit (empty where a store has nothing to do there).
    def _stage(self, model: str, version: int, sha: str, blob: bytes) -> None:  # noqa: B027
        """Make the blob durable before the transaction, if it does not travel inside it."""

    def _put(self, pipe: redis.client.Pipeline, write: _BlobWrite) -> None:  # noqa: B027
        """Add the blob (and the deletion of dropped versions) to the transaction, if stored
        in Redis."""

    def _after_commit(self, write: _BlobWrite) -> None:  # noqa: B027
        """Delete what the committed head no longer names, if stored outside Redis."""

    def commit(
        self,
        model: str,
        ckpt: Checkpoint,
        head_extra: dict[str, Any],
        hook: PipelineHook | None = None,
        lease: tuple[str, str] | None = None,
        fence: threading.Lock | None = None,
    ) -> None:
        """Make ``ckpt`` durable and newest; ``hook`` adds commands to the same transaction.

        ``lease`` is ``(key, owner)``: the commit happens only while ``key`` holds ``owner``
        (:class:`LeaseLost` otherwise, ``redis.WatchError`` if it changes meanwhile), so a worker
        that lost its lease can never overwrite its successor's checkpoint. ``fence`` is held
        from the ``WATCH`` of the lease to the ``EXEC``: the owner's own refresh of the lease
        from another thread would change the watched key and abort the transaction, so the
        refresh skips while it is held.
        """
        blob = encode_blob(ckpt)
        sha = blob_sha(blob)
        previous = self.head(model)
        history = [(ckpt.version, sha), *(previous["history"] if previous else [])]
        kept, dropped = history[: self.keep], history[self.keep :]
        # The earliest stream position of a kept version: what retention must keep after it
        # (not always the oldest version's: a rollback commits an old position anew).
        positions = {**(previous or {}).get("positions", {}), ckpt.version: ckpt.last_id}
        kept_from = min((positions.get(v, "0-0") for v, _ in kept), key=entry_id_key)
        head_extra = {
            **head_extra,
            "kept_from": kept_from,
            "positions": ",".join(f"{v}:{positions[v]}" for v, _ in kept if v in positions),
        }

        def with_head(pipe: redis.client.Pipeline) -> None:
            pipe.delete(self.keys.checkpoint_head(model))
            fields = _head_fields(ckpt, kept, head_extra)
            pipe.hset(self.keys.checkpoint_head(model), mapping=fields)  # type: ignore[arg-type]
            if hook:
                hook(pipe)

        self.commit_blobs(
            model, [(ckpt.version, sha, blob)], kept, dropped, with_head, lease, fence=fence
        )

    def commit_blobs(
        self,
        name: str,
        blobs: Sequence[tuple[int, str, bytes]],
        kept: list[tuple[int, str]],
        dropped: list[tuple[int, str]],
        hook: PipelineHook,
        lease: tuple[str, str] | None = None,
        fence: threading.Lock | None = None,
    ) -> None:
        """The durable write under :meth:`commit`: ``blobs`` (``(version, sha256, bytes)``,
        any number) staged, stored and made current by ``hook``'s commands in one lease-fenced
        transaction; ``dropped`` blobs deleted with it, ``kept`` ones left alone (the search
        gallery's segments use it too). ``fence``: as in :meth:`commit`."""
        write = _BlobWrite(name, tuple((v, b) for v, _, b in blobs), kept, dropped)
        for version, sha, blob in blobs:
            self._stage(name, version, sha, blob)
        with self.r.pipeline(transaction=True) as pipe, fence or contextlib.nullcontext():
            _check_lease(pipe, lease)
            pipe.multi()
            self._put(pipe, write)
            hook(pipe)
            pause_point(self.before_exec_point)
            pipe.execute()
        wait_replicated(self.r, self.keys.replicated, self.replication)
        self._after_commit(write)

    def read_blob(self, name: str, version: int, sha: str) -> bytes | None:
        """The stored bytes of one version, when they verify against ``sha``."""
        blob = self._read(name, version, sha)
        return blob if blob is not None and blob_sha(blob) == sha else None

    def _verified(self, model: str, version: int, sha: str) -> Checkpoint | str:
        """A kept version's checkpoint, or what is wrong with it (logged and counted)."""
        blob = self._read(model, version, sha)
        if blob is None:
            problem = "missing"
        elif blob_sha(blob) != sha:
            problem = "checksum mismatch"
        else:
            try:
                return decode_blob(blob)
            except (ValueError, OSError, KeyError) as exc:
                problem = f"unreadable ({exc})"
        log.error("checkpoint %s v%d %s", model, version, problem)
        # Counting is best effort: a Redis hiccup must not hide a good version.
        with contextlib.suppress(redis.RedisError):
            self.r.hincrby(self.keys.checkpoint_corrupt, model, 1)
        return problem

    def load(self, model: str, version: int) -> Checkpoint | None:
        """One kept version whose bytes verify; ``None`` when it is not kept (or corrupt)."""
        for kept, sha in self._versions(model):
            if kept == version:
                ckpt = self._verified(model, version, sha)
                return ckpt if isinstance(ckpt, Checkpoint) else None
        return None

    def kept_versions(self, model: str) -> list[int]:
        """The model's kept versions, newest first."""
        return [v for v, _ in self._versions(model)]

    def unreadable_versions(self, model: str) -> dict[int, str]:
        """Kept versions whose bytes do not verify, and why (reads every kept version)."""
        out = {}
        for version, sha in self._versions(model):
            ckpt = self._verified(model, version, sha)
            if not isinstance(ckpt, Checkpoint):
                out[version] = ckpt
        return out

    def load_kept(self, model: str, version: int) -> Checkpoint:
        """:meth:`load`, or :class:`VersionNotKept` naming the version and the kept ones
        (:class:`VersionUnreadable` when it is kept but its bytes do not verify)."""
        versions = self._versions(model)
        kept = ", ".join(str(v) for v, _ in versions) or "none"
        for candidate, sha in versions:
            if candidate == version:
                ckpt = self._verified(model, version, sha)
                if isinstance(ckpt, Checkpoint):
                    return ckpt
                raise VersionUnreadable(
                    f"model {model!r} version {version} is kept but "
                    f"unreadable ({ckpt}); kept versions: {kept}"
                )
        raise VersionNotKept(
            f"model {model!r} version {version} is not kept; kept versions: {kept}"
        )

    def load_latest(self, model: str) -> Checkpoint | None:
        """The newest version whose bytes verify; older good ones replace corrupt ones."""
        for version, sha in self._versions(model):
            ckpt = self._verified(model, version, sha)
            if isinstance(ckpt, Checkpoint):
                return ckpt
            log.error(
                "checkpoint %s: falling back from v%d to the previous version", model, version
            )
        return None

    def corrupt_count(self, model: str) -> int:
        """Corrupt versions of ``model`` found so far, by any process of the namespace."""
        return int(text(self.r.hget(self.keys.checkpoint_corrupt, model) or 0))


class RedisCheckpointStore(CheckpointStore):
    """Blobs under ``sxm:{<ns>}:ckpt:<model>:v:<version>``, head hash beside them."""

    def _read(self, model: str, version: int, sha: str) -> bytes | None:
        value = self.r.get(self.keys.checkpoint_blob(model, version))
        return None if value is None else bytes(value)  # type: ignore[arg-type]

    def _put(self, pipe: redis.client.Pipeline, write: _BlobWrite) -> None:
        for version, blob in write.blobs:
            pipe.set(self.keys.checkpoint_blob(write.name, version), blob)
        for old, _ in write.dropped:
            pipe.delete(self.keys.checkpoint_blob(write.name, old))


class DirectoryCheckpointStore(CheckpointStore):
    """Blobs as ``<dir>/<ns>/<model>/v<version>-<sha256[:16]>.npz``; the head in Redis.

    Directories written before the head moved to Redis (``HEAD.json``, ``v<version>.npz``) are
    still read until the first new commit.
    """

    before_exec_point = "checkpoint.before_commit"
    #: Files no head names (a fenced-off writer's, a killed writer's temporary) older than this
    #: are deleted by the next commit; younger ones may belong to a commit in flight.
    orphan_seconds = 3600.0

    def __init__(
        self,
        client: redis.Redis,
        keys: Keys,
        root: str | Path,
        keep: int = D.CHECKPOINT_KEEP,
        replication: Replication = Replication(),
    ) -> None:
        super().__init__(client, keys, keep, replication)
        self.root = Path(root) / keys.namespace

    def _dir(self, model: str) -> Path:
        return self.root / re.sub(r"[^A-Za-z0-9_.-]", "_", model)

    @staticmethod
    def _name(version: int, sha: str) -> str:
        return f"v{version:012d}-{sha[:16]}.npz"

    def head(self, model: str) -> dict[str, Any] | None:
        head = super().head(model)
        if head is not None:
            return head
        try:  # the layout before the head moved to Redis
            return _parse_head(json.loads((self._dir(model) / "HEAD.json").read_text()))
        except FileNotFoundError:
            return None

    def _read(self, model: str, version: int, sha: str) -> bytes | None:
        for name in (self._name(version, sha), f"v{version:012d}.npz"):
            try:
                return (self._dir(model) / name).read_bytes()
            except FileNotFoundError:
                continue
        return None

    def _stage(self, model: str, version: int, sha: str, blob: bytes) -> None:
        directory = self._dir(model)
        directory.mkdir(parents=True, exist_ok=True)
        path = directory / self._name(version, sha)
        # A temporary name no other writer can share; renaming onto an existing file of the
        # same name replaces identical bytes (the name carries the checksum).
        tmp = directory / f".{path.name}.{os.getpid()}.{uuid.uuid4().hex}.tmp"
        try:
            with open(tmp, "wb") as f:
                half = len(blob) // 2
                f.write(blob[:half])
                f.flush()
                pause_point("checkpoint.partial_write")
                f.write(blob[half:])
                f.flush()
                os.fsync(f.fileno())
            os.replace(tmp, path)
        finally:
            with contextlib.suppress(FileNotFoundError):
                tmp.unlink()
        fd = os.open(directory, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)

    def _after_commit(self, write: _BlobWrite) -> None:
        directory = self._dir(write.name)
        named = {self._name(v, sha) for v, sha in write.kept}
        for version, sha in write.dropped:
            with contextlib.suppress(FileNotFoundError):
                (directory / self._name(version, sha)).unlink()
        cutoff = time.time() - self.orphan_seconds
        for path in directory.iterdir():
            if path.name in named or not (
                path.name.endswith((".npz", ".tmp")) or path.name == "HEAD.json"
            ):
                continue
            with contextlib.suppress(FileNotFoundError):
                if path.stat().st_mtime < cutoff:
                    path.unlink()


def _head_fields(
    ckpt: Checkpoint, history: list[tuple[int, str]], extra: dict[str, Any]
) -> dict[str, str]:
    fields = {
        "version": str(ckpt.version),
        "created": repr(ckpt.created),
        "last_id": ckpt.last_id,
        "history": ",".join(f"{v}:{sha}" for v, sha in history),
    }
    fields.update({k: str(v) for k, v in extra.items()})
    return fields


def _parse_head(raw: dict[str, str]) -> dict[str, Any]:
    head: dict[str, Any] = dict(raw)
    head["version"] = int(raw["version"])
    head["created"] = float(raw["created"])
    head["history"] = [
        (int(v), sha)
        for v, sha in (item.split(":", 1) for item in raw["history"].split(",") if item)
    ]
    head["positions"] = {
        int(v): last_id
        for v, last_id in (
            item.split(":", 1) for item in raw.get("positions", "").split(",") if item
        )
    }
    return head
