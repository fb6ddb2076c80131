"""Prometheus metrics for the API's ``/metrics``.

Learning metrics live in Redis (each worker writes its statistics hash with every checkpoint);
:class:`StreamCollector` reads them at scrape time, so one scrape target shows ingest, learning,
serving and stream health. Names follow Prometheus conventions (``_total`` counters, base units).

A scrape never waits on Redis for long: the reads run on a helper thread, and a scrape that does
not get them within ``timeout`` (a stalled or unreachable Redis) answers with the last values it
read and ``streamxm_redis_up 0``, well inside Prometheus's scrape timeout.
"""

from __future__ import annotations

import contextlib
import threading
import time
from collections.abc import Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from concurrent.futures import TimeoutError as FutureTimeout
from typing import TypeVar

import redis
from prometheus_client import CollectorRegistry, Counter, Histogram
from prometheus_client.core import (
    CounterMetricFamily,
    GaugeMetricFamily,
    HistogramMetricFamily,
    Metric,
)
from prometheus_client.registry import Collector
from redis.exceptions import RedisClusterException

from streamxm.learning.stats import WorkerStats
from streamxm.learning.stream_learner import UPDATE_BUCKETS
from streamxm.models import DIRECTIONS
from streamxm.serving.server import ModelServer
from streamxm.storage.segments import CorruptSegments
from streamxm.stream.keys import Keys
from streamxm.stream.messages import REASONS
from streamxm.stream.redis_conn import str_hash, str_set, text
from streamxm.stream.retention import entry_id_key

__all__ = ["ApiMetrics", "StreamCollector", "method_label"]

_Family = TypeVar("_Family", CounterMetricFamily, GaugeMetricFamily)

REQUEST_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0)
_METHODS = frozenset({"GET", "HEAD", "POST", "PUT", "PATCH", "DELETE", "OPTIONS"})


def method_label(method: str) -> str:
    """The HTTP method as a metric label: any method outside the standard ones is ``other``, so
    clients cannot grow the label set (a method name is whatever token a client sends).

    >>> method_label("POST"), method_label("X" * 8000)
    ('POST', 'other')
    """
    return method if method in _METHODS else "other"


class ApiMetrics:
    """The API process's own metrics, in a registry of its own (one per app)."""

    def __init__(
        self, client: redis.Redis, server: ModelServer, keys: Keys, timeout: float = 0.5
    ) -> None:
        self.registry = CollectorRegistry()
        self.request_seconds = Histogram(
            "streamxm_request_duration_seconds",
            "HTTP request latency",
            ["route", "method"],
            buckets=REQUEST_BUCKETS,
            registry=self.registry,
        )
        self.requests = Counter(
            "streamxm_requests",
            "HTTP requests by status",
            ["route", "method", "status"],
            registry=self.registry,
        )
        self.version_lag = Histogram(
            "streamxm_served_version_lag_seconds",
            "per query: seconds since a checkpoint "
            "newer than the version that answered was written (0: the newest answered)",
            ["model"],
            buckets=(0.0, 0.25, 0.5, 1.0, 2.0, 5.0, 10.0, 30.0, 60.0),
            registry=self.registry,
        )
        self.pairs_accepted = Counter(
            "streamxm_api_pairs_accepted",
            "pairs accepted by POST /v1/pairs",
            registry=self.registry,
        )
        self.registry.register(StreamCollector(client, server, keys, timeout))


def _one_sample(
    kind: type[CounterMetricFamily] | type[GaugeMetricFamily],
    name: str,
    documentation: str,
    value: float,
    namespace: str | None = None,
) -> Metric:
    """A family of one sample: the ``namespace``'s where one is given, else unlabelled."""
    names, values = ([], []) if namespace is None else (["namespace"], [namespace])
    family = kind(name, documentation, labels=names)
    family.add_metric(values, value)
    return family


def _families(kind: type[_Family], labels: list[str], *named: tuple[str, str]) -> list[_Family]:
    """Families of one ``kind`` and label names, one per (name, documentation)."""
    return [kind(name, documentation, labels=labels) for name, documentation in named]


def _lag_families(
    models: dict[str, WorkerStats], groups: dict[str, dict[str, object]], length: int
) -> Iterator[Metric]:
    """Each model's lag in the stream and its entries pending, from its consumer group's
    info in ``groups`` (the stream ``length`` long)."""
    lag, pending = _families(
        GaugeMetricFamily,
        ["model"],
        (
            "streamxm_stream_lag",
            "stream entries, from any producer, the model's learner has not "
            "yet applied and checkpointed",
        ),
        ("streamxm_stream_pending", "entries delivered to the group but not acknowledged"),
    )
    for model, stats in models.items():
        group = groups.get(model, {})
        waiting = int(group.get("pending", 0))  # type: ignore[call-overload]
        undelivered = group.get("lag")  # Redis >= 7; None where it cannot tell
        if undelivered is not None:
            lag.add_metric([model], int(undelivered) + waiting)  # type: ignore[call-overload]
        else:  # exact while the stream keeps every entry
            done = stats.pairs_processed + stats.dead_letters
            lag.add_metric([model], max(0.0, length - done))
        pending.add_metric([model], waiting)
    yield from (lag, pending)


class StreamCollector(Collector):
    """Reads stream and learner state from Redis on every scrape, within ``timeout`` seconds."""

    def __init__(
        self, client: redis.Redis, server: ModelServer, keys: Keys, timeout: float = 0.5
    ) -> None:
        self.r = client
        self.server = server
        self.keys = keys
        self.timeout = timeout
        self._reader = ThreadPoolExecutor(max_workers=1, thread_name_prefix="metrics-read")
        self._lock = threading.Lock()
        self._inflight: Future[list[Metric]] | None = None
        self._last: list[Metric] = []  # the last complete read: served while Redis is away

    def collect(self) -> Iterator[Metric]:
        up = GaugeMetricFamily(
            "streamxm_redis_up", "1 if the API could read stream state from Redis at this scrape"
        )
        with self._lock:
            # One read at a time: scrapes during a stall share the read in flight rather than
            # piling up threads blocked on Redis.
            if self._inflight is None or self._inflight.done():
                self._inflight = self._reader.submit(lambda: list(self._collect()))
            inflight = self._inflight
        try:
            families = inflight.result(timeout=self.timeout)
            self._last, fresh = families, True
        except (FutureTimeout, redis.RedisError, RedisClusterException):
            families, fresh = self._last, False
        up.add_metric([], 1.0 if fresh else 0.0)
        yield up
        yield from families

    def _collect(self) -> Iterator[Metric]:
        models = sorted(str_set(self.r.smembers(self.keys.models)))
        stats = {m: str_hash(self.r.hgetall(self.keys.stats(m))) for m in models}
        parsed = {m: WorkerStats.from_hash(raw) for m, raw in stats.items()}
        yield from self._stream_families(parsed)
        yield from self._learning_families(parsed)
        yield from self._serving_families(models)
        yield from self._distributed_families(stats)
        yield from self._failure_families(models)
        yield from self._shard_families()

    def _shard_families(self) -> Iterator[Metric]:
        """Each gallery shard of the ``ray`` backend, as the last refresh saw it."""
        shards = self.server.shards
        if shards is None:
            return
        up, rows, memory, on_gpu = _families(
            GaugeMetricFamily,
            ["shard"],
            ("streamxm_gallery_shard_up", "1 if the gallery shard answered"),
            ("streamxm_gallery_shard_rows", "gallery items the shard holds"),
            ("streamxm_gallery_shard_resident_bytes", "resident memory of the shard's process"),
            ("streamxm_gallery_shard_on_gpu", "1 if the shard's towers run on a GPU"),
        )
        version, build = _families(
            GaugeMetricFamily,
            ["shard", "model"],
            ("streamxm_gallery_shard_version", "newest version of a model the shard holds"),
            (
                "streamxm_gallery_shard_build_seconds",
                "seconds the shard took to build its part's index of the newest version",
            ),
        )
        for index, status in enumerate(shards.statuses):
            shard = str(index)
            up.add_metric([shard], float(status is not None and status.caught_up))
            if status is None:
                continue
            rows.add_metric([shard], status.rows)
            memory.add_metric([shard], status.resident_bytes)
            on_gpu.add_metric([shard], float(status.device == "cuda"))
            for model, held in status.versions.items():
                version.add_metric([shard, model], max(held))
                build.add_metric([shard, model], status.build_seconds.get(model, 0.0))
        yield from (up, rows, memory, on_gpu, version, build)

    def _stream_families(self, models: dict[str, WorkerStats]) -> Iterator[Metric]:
        """The stream: pairs ingested, its length and each model's lag in it, retention (and
        the searcher's scan counts, between them)."""
        ns = self.keys.namespace
        ingested = int(text(self.r.get(self.keys.ingested) or 0))
        yield _one_sample(
            CounterMetricFamily,
            "streamxm_pairs_ingested",
            "pairs added to the stream by streamxm producers",
            ingested,
            ns,
        )
        # The stream's own counts, not the project's ingest counter: entries written by other
        # producers are lag too.
        groups: dict[str, dict[str, object]] = {}
        length = 0
        with contextlib.suppress(redis.ResponseError):  # no stream yet
            length = int(self.r.xlen(self.keys.pairs))
            for info in self.r.xinfo_groups(self.keys.pairs):
                groups[text(info["name"])] = info
        yield _one_sample(
            GaugeMetricFamily, "streamxm_stream_length", "entries in the pairs stream", length, ns
        )
        yield from self._scan_families()
        yield from self._retention_families()
        yield from _lag_families(models, groups, length)

    def _scan_families(self) -> Iterator[Metric]:
        """The searcher's scans that were not the plain candidate scan."""
        searcher = self.server.searcher
        for name, documentation, count in (
            (
                "streamxm_search_exact_scans",
                "searches whose reduced-precision candidates could "
                "not be proven complete, answered by a float32 scan instead",
                searcher.exact_scans,
            ),
            (
                "streamxm_search_expansions",
                "candidate scans repeated with four times the rows "
                "because the first could not prove the top k complete (embedding scans, "
                "ensembles)",
                searcher.expansions,
            ),
            (
                "streamxm_search_earlier_index_scans",
                "candidate scans of an earlier version's "
                "index (a model that embeds raw vectors, while its served version embeds the "
                "gallery): re-ranked exactly, not proven complete",
                searcher.earlier_index_scans,
            ),
        ):
            yield _one_sample(CounterMetricFamily, name, documentation, count)

    def _retention_families(self) -> Iterator[Metric]:
        """What retention trimmed from the stream, and up to where."""
        ns = self.keys.namespace
        retention = str_hash(self.r.hgetall(self.keys.retention))
        yield _one_sample(
            CounterMetricFamily,
            "streamxm_stream_trimmed",
            "entries trimmed from the pairs stream by retention",
            int(retention.get("trimmed_total", 0)),
            ns,
        )
        if "trimmed_to" in retention:
            yield _one_sample(
                GaugeMetricFamily,
                "streamxm_stream_trim_position_seconds",
                "time (unix seconds) in the id of the oldest entry retention keeps",
                entry_id_key(retention["trimmed_to"])[0] / 1000,
                ns,
            )

    def _learning_families(self, models: dict[str, WorkerStats]) -> Iterator[Metric]:
        """What each model's learner wrote with its newest checkpoint."""
        processed, drifts, bursts = _families(
            CounterMetricFamily,
            ["model"],
            ("streamxm_pairs_processed", "pairs applied by the model's learner"),
            ("streamxm_drift_detected", "changes in the mistake rate found by ADWIN"),
            (
                "streamxm_pairs_in_burst",
                "pairs that arrived while the stream was in a burst of few "
                "classes (the models with a memory of the whole history then also draw from it)",
            ),
        )
        triplets, mistakes = _families(
            CounterMetricFamily,
            ["model", "direction"],
            ("streamxm_triplets", "triplets learned from"),
            ("streamxm_mistakes", "triplets ranked wrongly before the update (s(q,p)-s(q,n)<=0)"),
        )
        rolling = GaugeMetricFamily(
            "streamxm_rolling_map",
            "test-then-train rolling mAP (0..1)",
            labels=["model", "direction"],
        )
        age, ckpt_version = _families(
            GaugeMetricFamily,
            ["model"],
            ("streamxm_checkpoint_age_seconds", "seconds since the newest checkpoint"),
            ("streamxm_checkpoint_version", "newest checkpoint version"),
        )
        update = HistogramMetricFamily(
            "streamxm_update_duration_seconds", "time to test-then-train one pair", labels=["model"]
        )
        now = time.time()
        for model, stats in models.items():
            processed.add_metric([model], stats.pairs_processed)
            drifts.add_metric([model], stats.drift_detected)
            bursts.add_metric([model], stats.pairs_in_burst)
            for d in DIRECTIONS:
                triplets.add_metric([model, d], stats.triplets[d])
                mistakes.add_metric([model, d], stats.mistakes[d])
                value = stats.rolling_map[d]
                if value is not None:
                    rolling.add_metric([model, d], value)
            if stats.checkpoint_time is not None:
                age.add_metric([model], max(0.0, now - stats.checkpoint_time))
                ckpt_version.add_metric([model], stats.version or 0)
            buckets, cumulative = [], 0.0
            for bound, in_bucket in zip(UPDATE_BUCKETS, stats.update_buckets, strict=True):
                cumulative += in_bucket
                buckets.append(("+Inf" if bound == float("inf") else repr(bound), cumulative))
            update.add_metric([model], buckets, stats.update_seconds_sum)
        yield from (
            processed,
            triplets,
            mistakes,
            rolling,
            age,
            ckpt_version,
            update,
            drifts,
            bursts,
        )

    def _serving_families(self, models: list[str]) -> Iterator[Metric]:
        """What this API serves: versions, gallery sizes, champions."""
        served_version, gallery, embedding, index_version = _families(
            GaugeMetricFamily,
            ["model"],
            ("streamxm_model_version", "model version the API serves"),
            ("streamxm_gallery_items", "items in the search gallery"),
            (
                "streamxm_version_embedding_seconds",
                "seconds the newest embedding of the gallery took (0: a fixed space needs none)",
            ),
            (
                "streamxm_index_version",
                "version whose embeddings of the gallery propose the "
                "served version's candidates (below streamxm_model_version while a model that "
                "embeds raw vectors embeds it again)",
            ),
        )
        champion = GaugeMetricFamily(
            "streamxm_champion",
            "1 for the model that answers model=auto in a direction (its "
            "rolling mAP leads, with hysteresis), 0 for the other served models",
            labels=["model", "direction"],
        )
        for model in models:
            served = self.server.served.get(model)
            if served is not None:
                served_version.add_metric([model], served.version)
                gallery.add_metric([model], served.gallery_size)
                embedding.add_metric([model], served.index_seconds)
                index_version.add_metric([model], served.index_version)
                for direction in DIRECTIONS:
                    champion.add_metric(
                        [model, direction],
                        float(self.server.champion.champions.get(direction) == model),
                    )
        yield from (served_version, gallery, champion, embedding, index_version)

    def _distributed_families(self, stats: dict[str, dict[str, str]]) -> Iterator[Metric]:
        """Distributed learners: ranks, rounds, time in the collective, formations."""
        ranks = GaugeMetricFamily(
            "streamxm_distributed_ranks",
            "ranks of a distributed learner (streamxm worker --world-size)",
            labels=["model"],
        )
        rounds, collective, generations = _families(
            CounterMetricFamily,
            ["model"],
            (
                "streamxm_distributed_rounds",
                "rounds the ranks learned and merged, as of the "
                "newest checkpoint (since rank 0 started)",
            ),
            (
                "streamxm_distributed_collective_seconds",
                "seconds rank 0 spent in the merge and "
                "the wait for the slowest rank (since rank 0 started)",
            ),
            (
                "streamxm_distributed_generations",
                "times the ranks' group was formed: the first, "
                "then once after every lost or restarted rank",
            ),
        )
        for model, raw in stats.items():
            if raw.get("dist_world"):
                ranks.add_metric([model], int(raw["dist_world"]))
                rounds.add_metric([model], int(raw.get("dist_split_rounds", 0)))
                collective.add_metric([model], float(raw.get("dist_collective_seconds", 0.0)))
                generation = text(self.r.hget(self.keys.dist(model), "gen") or 0)
                generations.add_metric([model], int(generation))
        yield from (ranks, rounds, collective, generations)

    def _failure_families(self, models: list[str]) -> Iterator[Metric]:
        """What went wrong: corrupt checkpoints and segments, dead letters. Every counter
        someone alerts on exists at 0 from the start (per registered model and reason), so
        increase() sees the first event, not only the second."""
        corrupt = CounterMetricFamily(
            "streamxm_checkpoint_corrupt",
            "checkpoint versions that failed their checksum or did not parse (the previous good "
            "version was used)",
            labels=["model"],
        )
        counts = str_hash(self.r.hgetall(self.keys.checkpoint_corrupt))
        for model in sorted({*models, *counts}):
            corrupt.add_metric([model], int(counts.get(model, 0)))
        yield corrupt

        dead = CounterMetricFamily(
            "streamxm_dead_letters", "entries dead-lettered, by reason", labels=["model", "reason"]
        )
        letters = {
            tuple(key.partition("|")[::2]): int(count)
            for key, count in str_hash(self.r.hgetall(self.keys.dead_counts)).items()
        }
        for model, reason in sorted({*((m, r) for m in models for r in REASONS), *letters}):
            dead.add_metric([model, reason], letters.get((model, reason), 0))
        yield dead

        lost = CorruptSegments(self.r, self.keys).read()
        yield _one_sample(
            CounterMetricFamily,
            "streamxm_gallery_segments_corrupt",
            "gallery segments found missing or corrupt and quarantined (search serves the rest)",
            len(lost),
            self.keys.namespace,
        )
        yield _one_sample(
            CounterMetricFamily,
            "streamxm_gallery_rows_lost",
            "gallery rows lost with corrupt segments",
            sum(lost.values()),
            self.keys.namespace,
        )
