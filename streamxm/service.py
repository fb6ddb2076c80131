"""Wiring from settings to parts: one place that turns ``Settings`` into clients and stores."""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import redis

from streamxm.config import Settings
from streamxm.storage.checkpoint import (
    CheckpointStore,
    DirectoryCheckpointStore,
    RedisCheckpointStore,
)
from streamxm.stream.keys import Keys
from streamxm.stream.messages import Limits
from streamxm.stream.migrate import require_migrated
from streamxm.stream.redis_conn import Replication
from streamxm.worker.indexer import GalleryIndexer
from streamxm.worker.loop import CheckpointPolicy, LearnerWorker, StreamReading

__all__ = [
    "build_indexer",
    "build_worker",
    "limits_from",
    "open_namespace",
    "open_store",
    "settings_group",
]


def settings_group(settings: Settings, prefix: str, names: Iterable[str]) -> dict[str, Any]:
    """The settings ``<prefix><name>`` of ``names``, keyed by ``name``: a part's parameters
    from its group of settings (``champion_margin`` is the champion rule's ``margin``)."""
    return {name: getattr(settings, prefix + name) for name in names}


def limits_from(settings: Settings) -> Limits:
    return Limits(
        max_dim=settings.max_dim,
        max_labels=settings.max_labels,
        max_label_value=settings.max_label_value,
        max_id_length=settings.max_id_length,
    )


def open_store(settings: Settings, client: redis.Redis) -> CheckpointStore:
    keys = Keys(settings.namespace)
    replication = Replication.of(settings)
    if settings.checkpoint_store == "dir":
        return DirectoryCheckpointStore(
            client,
            keys,
            settings.checkpoint_dir,
            keep=settings.checkpoint_keep,
            replication=replication,
        )
    return RedisCheckpointStore(
        client, keys, keep=settings.checkpoint_keep, replication=replication
    )


def open_namespace(settings: Settings, client: redis.Redis) -> Keys:
    """The namespace's keys, once its data is known not to be under the old untagged names
    (:class:`~streamxm.stream.migrate.LegacyKeys` otherwise)."""
    keys = Keys(settings.namespace)
    require_migrated(client, keys)
    return keys


#: The settings ``checkpoint_<name>`` a learner worker's :class:`CheckpointPolicy` takes.
_CHECKPOINTS = ("every_pairs", "every_seconds", "max_share", "in_background")


def build_worker(
    settings: Settings,
    client: redis.Redis,
    model: str,
    params: dict[str, Any] | None = None,
    learner_options: dict[str, Any] | None = None,
    world: int = 1,
) -> LearnerWorker:
    """A model's learner; with ``world > 1``, rank 0 of a distributed learner
    (:mod:`streamxm.worker.ranks`; the other ranks are :class:`RankFollower`)."""
    learner_options = {
        "buffer_capacity": settings.buffer_capacity,
        "buffer_memory": settings.buffer_memory,
        "eval_every": settings.eval_every,
        **(learner_options or {}),
    }
    kind: type[LearnerWorker] = LearnerWorker
    extra: dict[str, Any] = {}
    if world > 1:
        # torch (the ``sam`` extra) only where ranks are asked for.
        from streamxm.worker.ranks import RankZeroWorker

        kind = RankZeroWorker
        extra = {"world": world, "host": settings.dist_host, "timeout_s": settings.dist_timeout_s}
    return kind(
        client,
        open_store(settings, client),
        model,
        namespace=settings.namespace,
        consumer=settings.consumer,
        params=params,
        learner_options=learner_options,
        seed=settings.seed,
        checkpoints=CheckpointPolicy(**settings_group(settings, "checkpoint_", _CHECKPOINTS)),
        reading=StreamReading(
            read_batch=settings.read_batch,
            block_ms=settings.block_ms,
            lease_ttl_ms=settings.lease_ttl_ms,
        ),
        limits=limits_from(settings),
        retain_entries=settings.gallery_max if settings.stream_retention else None,
        progress_every_seconds=settings.progress_every_seconds,
        **extra,
    )


def build_indexer(settings: Settings, client: redis.Redis) -> GalleryIndexer:
    return GalleryIndexer(
        client,
        open_store(settings, client),
        settings.namespace,
        consumer=settings.consumer,
        max_items=settings.gallery_max,
        block_ms=settings.block_ms,
        lease_ttl_ms=settings.lease_ttl_ms,
        limits=limits_from(settings),
        parts=settings.gallery_parts,
    )
