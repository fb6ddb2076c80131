"""From untagged key names (``sxm:<ns>:...``) to hash-tagged ones (``sxm:{<ns>}:...``).

Data written before keys carried the namespace as a hash tag keeps its old names; a worker,
indexer or API that finds such keys and none of the new ones refuses to start
(:class:`LegacyKeys`) instead of starting an empty namespace beside them. ``streamxm
migrate-keys`` renames them, on the single server they live on, before the namespace moves to a
cluster (a cluster cannot rename across slots). ``RENAME`` moves a key with everything in it
(a stream keeps its consumer groups, pending entries and last id), so learners continue where
they stopped. Stop the namespace's workers, indexers and APIs first: a producer pushing during
the renames would create the old stream again.
"""

from __future__ import annotations

import re

import redis

from streamxm.stream.keys import Keys
from streamxm.stream.redis_conn import text

__all__ = ["LegacyKeys", "MigrationConflict", "legacy_keys", "migrate_keys", "require_migrated"]

_NAMESPACE = re.compile(r"[A-Za-z0-9_.-]{1,64}")  # STREAMXM_NAMESPACE's own rule
# Keys every used namespace has: their presence under the old names marks unmigrated data.
_MARKERS = ("pairs", "models", "schema")


class LegacyKeys(RuntimeError):
    """The namespace's data is under the untagged key names: run ``streamxm migrate-keys``."""


class MigrationConflict(RuntimeError):
    """A key exists under both names: the migration renames nothing."""


def legacy_keys(r: redis.Redis, keys: Keys) -> list[str]:
    """The namespace's keys under the untagged names (namespaces hold no glob characters)."""
    return sorted(text(k) for k in r.scan_iter(match=f"{keys.legacy_prefix}:*", count=1000))


def require_migrated(r: redis.Redis, keys: Keys) -> None:
    """Raise :class:`LegacyKeys` when the namespace has data only under the old names."""

    def present(prefix: str) -> bool:
        return any(r.exists(f"{prefix}:{name}") for name in _MARKERS)

    if present(keys.legacy_prefix) and not present(keys.prefix):
        raise LegacyKeys(
            f"namespace {keys.namespace!r} has its data under the untagged key names "
            f"({keys.legacy_prefix}:...); stop its workers and APIs and run "
            f"`streamxm migrate-keys --namespace {keys.namespace}` once"
        )


def migrate_keys(r: redis.Redis, keys: Keys, dry_run: bool = False) -> list[tuple[str, str]]:
    """Rename every ``sxm:<ns>:...`` key to ``sxm:{<ns>}:...``; returns the (old, new) names.

    Nothing is renamed when any new name is taken already (:class:`MigrationConflict` lists
    them). Renames use ``RENAMENX``, so a key written under the new name meanwhile is not
    overwritten; running it again after a partial run renames what is left.
    """
    if not _NAMESPACE.fullmatch(keys.namespace):  # a glob character would match others' keys
        raise ValueError(f"not a namespace name: {keys.namespace!r}")
    renames = [(old, keys.prefix + old[len(keys.legacy_prefix) :]) for old in legacy_keys(r, keys)]
    taken = [new for _, new in renames if r.exists(new)]
    if taken:
        raise MigrationConflict(
            f"{len(taken)} key(s) exist under both names, e.g. "
            f"{', '.join(taken[:3])}; nothing was renamed"
        )
    if not dry_run:
        for old, new in renames:
            if not r.renamenx(old, new):
                raise MigrationConflict(
                    f"{new} appeared during the migration; {old} and the "
                    f"keys after it were left under the old names"
                )
    return renames
