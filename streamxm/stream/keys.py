"""Redis key names, one place for all of them (``docs/design.md``: ``sxm:<ns>:...``)."""

from __future__ import annotations

from dataclasses import dataclass

__all__ = ["Keys"]


@dataclass(frozen=True)
class Keys:
    """Key names of one namespace.

    Examples
    --------
    >>> Keys("default").pairs
    'sxm:default:pairs'
    """

    namespace: str = "default"

    @property
    def prefix(self) -> str:
        return f"sxm:{self.namespace}"

    @property
    def pairs(self) -> str:
        """The pairs stream (message v1)."""
        return f"{self.prefix}:pairs"

    @property
    def dead(self) -> str:
        """Dead-letter stream: undecodable or invalid entries with their reason."""
        return f"{self.prefix}:dead"

    @property
    def dead_counts(self) -> str:
        """Hash: dead letters per reason."""
        return f"{self.prefix}:dead:counts"

    @property
    def schema(self) -> str:
        """The namespace's dimensions, fixed on first use (JSON)."""
        return f"{self.prefix}:schema"

    @property
    def ingested(self) -> str:
        """Counter of pairs added to the stream by the project's producers."""
        return f"{self.prefix}:ingested"

    @property
    def models(self) -> str:
        """Set of model names with a learner in this namespace."""
        return f"{self.prefix}:models"

    def group(self, model: str) -> str:
        """Consumer group of a model: every model sees every pair."""
        return model

    def lease(self, model: str) -> str:
        """The learner lease: one active learner per model at a time."""
        return f"{self.prefix}:lease:{model}"

    def stats(self, model: str) -> str:
        """Hash of learning statistics, written with each checkpoint, read by the API."""
        return f"{self.prefix}:stats:{model}"

    @property
    def checkpoint_corrupt(self) -> str:
        """Hash: checkpoint versions found corrupt (checksum or parse) per model."""
        return f"{self.prefix}:ckpt:corrupt"

    def checkpoint_head(self, model: str) -> str:
        return f"{self.prefix}:ckpt:{model}:head"

    def checkpoint_blob(self, model: str, version: int) -> str:
        return f"{self.prefix}:ckpt:{model}:v:{version}"
