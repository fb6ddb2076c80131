"""Redis key names, one place for all of them (``docs/design.md``: ``sxm:{<ns>}:...``).

Every key of a namespace carries the namespace as its hash tag (``{<ns>}``), so on a Redis
Cluster a namespace lives in one hash slot: the commit transaction (checkpoint, head, XACK,
dead letters, statistics) and the lease scripts touch keys of one slot and stay atomic, while
different namespaces spread over the masters. Data written under the earlier untagged names
(``sxm:<ns>:...``) is renamed by ``streamxm migrate-keys`` (:mod:`streamxm.stream.migrate`).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import overload

__all__ = ["Keys"]


class _Key:
    """A namespace-wide key: ``<prefix>:<suffix>``, read as a string attribute of :class:`Keys`."""

    def __init__(self, suffix: str, doc: str) -> None:
        self.suffix = suffix
        self.__doc__ = doc

    @overload
    def __get__(self, keys: None, owner: type) -> _Key: ...
    @overload
    def __get__(self, keys: Keys, owner: type) -> str: ...
    def __get__(self, keys: Keys | None, owner: type) -> _Key | str:
        return self if keys is None else f"{keys.prefix}:{self.suffix}"


@dataclass(frozen=True)
class Keys:
    """Key names of one namespace.

    Examples
    --------
    >>> Keys("default").pairs
    'sxm:{default}:pairs'
    """

    namespace: str = "default"

    @property
    def prefix(self) -> str:
        return f"sxm:{{{self.namespace}}}"

    @property
    def legacy_prefix(self) -> str:
        """The untagged prefix of data written before hash tags (``streamxm migrate-keys``)."""
        return f"sxm:{self.namespace}"

    pairs = _Key("pairs", "The pairs stream (message v1).")
    dead = _Key("dead", "Dead-letter stream: undecodable or invalid entries with their reason.")
    dead_counts = _Key("dead:counts", "Hash: dead letters per reason.")
    schema = _Key("schema", "The namespace's dimensions, fixed on first use (JSON).")
    ingested = _Key("ingested", "Counter of pairs added to the stream by the project's producers.")
    models = _Key("models", "Set of model names with a learner in this namespace.")
    gallery = _Key(
        "gallery",
        "Hash: the search gallery's manifest (live segments, rows retired, "
        "stream position covered, revision)",
    )
    gallery_corrupt = _Key(
        "gallery:corrupt",
        "Hash: gallery segments found corrupt, <seq>:<sha> -> rows lost "
        "(written once per segment by whoever read it first; the indexer then drops it from "
        "the manifest)",
    )
    retention = _Key(
        "retention",
        "Hash: the last trim of the pairs stream (position, time, entries trimmed in all)",
    )
    replicated = _Key(
        "replicated",
        "Counter written just before a WAIT (the write the WAIT "
        "covers on its connection; see redis_conn.wait_replicated).",
    )
    checkpoint_corrupt = _Key(
        "ckpt:corrupt", "Hash: checkpoint versions found corrupt (checksum or parse) per model."
    )

    def group(self, model: str) -> str:
        """Consumer group of a model: every model sees every pair."""
        return model

    def lease(self, model: str) -> str:
        """The learner lease: one active learner per model at a time."""
        return f"{self.prefix}:lease:{model}"

    def dist(self, model: str) -> str:
        """Hash of a distributed learner: rendezvous generation and rank 0's store address."""
        return f"{self.prefix}:dist:{model}"

    def stats(self, model: str) -> str:
        """Hash of learning statistics, written with each checkpoint, read by the API."""
        return f"{self.prefix}:stats:{model}"

    def history(self, model: str) -> str:
        """List of the model's operator events, newest first (JSON; rollbacks)."""
        return f"{self.prefix}:history:{model}"

    def checkpoint_head(self, model: str) -> str:
        return f"{self.prefix}:ckpt:{model}:head"

    def checkpoint_blob(self, model: str, version: int) -> str:
        return f"{self.prefix}:ckpt:{model}:v:{version}"
