"""The gallery spread over Ray actors (``STREAMXM_GALLERY_BACKEND=ray``).

The API joins a Ray cluster (``STREAMXM_RAY_ADDRESS``, or starts one on this machine) and runs
``STREAMXM_GALLERY_SHARDS`` actors, each a :class:`~streamxm.serving.shard.GalleryShard` over
its part of the gallery (:mod:`streamxm.serving.sharding`). :class:`RayGallery` is what the
API's :class:`~streamxm.serving.server.ModelServer` talks to:

- **versions**: the API puts a new version's checkpoint state into Ray's object store once and
  every shard builds its part's index from it at the same time; the API serves the version once
  every shard holds it (:meth:`RayGallery.apply`);
- **search**: each shard answers with its part's proven top k by the versions the API names;
  the merge of those is the exact top k (:func:`~streamxm.serving.sharding.merge_hits`);
- **faults**: shard actors are restarted by Ray (``max_restarts=-1``); a restarted shard reads
  its part again and is given the versions the API serves (:meth:`RayGallery.heal`).
  Meanwhile a search waits at most ``timeout`` seconds and then raises
  :class:`~streamxm.serving.shard.ShardsUnavailable` (503 with ``Retry-After``), or, when the
  request accepts it, answers from the shards that did, saying which share of the gallery that
  covers.

Ray is imported only here, and only when this backend is chosen: the default ``local`` backend
starts and imports nothing of it.
"""

from __future__ import annotations

import asyncio
import logging
import os
import time
from collections.abc import Mapping, Sequence
from typing import Any

from streamxm.config import Settings
from streamxm.models.ensemble import REFERENCE_ITEMS
from streamxm.service import limits_from, open_store
from streamxm.serving.served import ModelNotReady
from streamxm.serving.shard import (
    AppliedVersion,
    GalleryShard,
    ShardAnswer,
    ShardedHits,
    ShardError,
    ShardQuery,
    ShardStatus,
    ShardsUnavailable,
)
from streamxm.serving.sharding import merge_hits, reference_keys, smallest
from streamxm.storage.checkpoint import Checkpoint
from streamxm.storage.rows import GalleryRows
from streamxm.storage.slots import ShardPart
from streamxm.stream.keys import Keys
from streamxm.stream.redis_conn import connect

__all__ = ["RayGallery", "ShardHost"]

log = logging.getLogger(__name__)


def import_ray() -> Any:
    """Ray, or a clear error naming the extra that installs it."""
    try:
        import ray
    except ImportError:
        raise RuntimeError(
            "STREAMXM_GALLERY_BACKEND=ray needs Ray: pip install 'streamxm[ray]'"
        ) from None
    return ray


def gpus_per_shard(asked: float | None, cluster_gpus: float, shards: int) -> float:
    """The GPUs each shard actor asks for: ``asked`` when set (``STREAMXM_SHARD_GPUS``), else an
    equal share of the cluster's GPUs, at most one a shard (Ray places fractions of a GPU on
    one device, and whole GPUs only up to one here: a shard's towers use one device), and none
    on a cluster without GPUs.

    >>> gpus_per_shard(None, 0.0, 4), gpus_per_shard(None, 1.0, 4), gpus_per_shard(None, 8.0, 2)
    (0.0, 0.25, 1.0)
    >>> gpus_per_shard(0.0, 8.0, 2)
    0.0
    """
    if asked is not None:
        return asked
    if cluster_gpus <= 0:
        return 0.0
    # Rounded down to Ray's resource precision, so that every share fits the cluster.
    return min(1.0, int(cluster_gpus / shards * 10_000) / 10_000)


class ShardHost:
    """The body of a shard actor: a :class:`~streamxm.serving.shard.GalleryShard` built in
    the actor's process from the API's settings (``settings_json``, with the resolved Redis
    URL), following its part of the gallery on a thread of its own."""

    def __init__(self, settings_json: str, index: int, count: int) -> None:
        settings = Settings.model_validate_json(settings_json)
        assert settings.redis_url is not None, "the API hands shards a resolved Redis URL"
        # The actor's own log (Ray's worker log files): version builds, failed searches.
        logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(message)s")
        client = connect(settings, settings.redis_url, retries=2, timeout=30.0)
        self.shard = GalleryShard(
            client,
            open_store(settings, client),
            Keys(settings.namespace),
            ShardPart(index, count),
            gallery_max=settings.gallery_max,
            limits=limits_from(settings),
            candidates=settings.search_candidates,
            grace=2 * settings.shard_timeout_seconds,
        )
        self.shard.start()

    def apply(
        self, name: str, version: int, state: tuple[dict[str, Any], dict[str, Any]]
    ) -> AppliedVersion:
        return self.shard.apply(name, version, state)

    def search_batch(self, queries: list[ShardQuery]) -> list[ShardAnswer | ShardError]:
        """Each query's answer from this shard, the batch searched on one thread with its scans
        together; a query's error is its answer."""
        answers = self.shard.search_many(queries)
        return [self._answer(a, q) for a, q in zip(answers, queries, strict=True)]

    def _answer(
        self, answer: ShardAnswer | Exception, query: ShardQuery
    ) -> ShardAnswer | ShardError:
        if isinstance(answer, ModelNotReady):  # a version or the part not there yet: expected
            return ShardError(type(answer).__name__, str(answer))
        if isinstance(answer, Exception):  # sent back as data: the API decides (503, partial)
            log.error(
                "shard %d: search of %s failed", self.shard.part.index, query.name, exc_info=answer
            )
            return ShardError(type(answer).__name__, str(answer))
        return answer

    def status(self) -> ShardStatus:
        return self.shard.status()

    def reference_candidates(self) -> GalleryRows:
        return self.shard.reference_candidates()

    def set_reference(self, sample: GalleryRows) -> None:
        self.shard.set_reference(sample)


class RayGallery:
    """The API's side of the sharded gallery: the shard actors, the versions applied to them
    and the merge of their answers.

    Parameters
    ----------
    settings
        The API's settings (shards read the same namespace and store).
    redis_url
        The Redis URL the API resolved (an embedded server's too).
    address
        A Ray cluster to join (``ray.init(address=...)``); ``None`` starts one here.
    shards
        Shard actors (``STREAMXM_GALLERY_SHARDS``).
    timeout
        Seconds a search waits for every shard before it fails or answers partially.
    apply_timeout
        Seconds a new version may take to be applied on every shard.
    """

    def __init__(
        self,
        settings: Settings,
        redis_url: str,
        address: str | None,
        shards: int,
        timeout: float,
        apply_timeout: float = 600.0,
    ) -> None:
        self.ray = import_ray()
        self.started_ray = not self.ray.is_initialized()
        if self.started_ray:
            # A cluster of this machine alone: one logical CPU per shard at least (they share
            # the cores; each shard's work is a scan or an index build at a time).
            cpus = None if address else max(os.cpu_count() or 1, shards)
            self.ray.init(
                address=address,
                num_cpus=cpus,
                namespace=f"streamxm-{settings.namespace}",
                include_dashboard=False,
                log_to_driver=False,
                configure_logging=False,
            )
        host = self.ray.remote(max_restarts=-1, max_task_retries=0, max_concurrency=16)(ShardHost)
        self.gpus = gpus_per_shard(
            settings.shard_gpus, self.ray.cluster_resources().get("GPU", 0.0), shards
        )
        payload = settings.model_copy(update={"redis_url": redis_url}).model_dump_json()
        self.parts = [ShardPart(i, shards) for i in range(shards)]
        self.actors = [
            host.options(
                num_cpus=1,
                num_gpus=self.gpus,
                name=f"shard-{i}-of-{shards}",
                get_if_exists=True,
                scheduling_strategy="SPREAD",  # one node's loss takes as few parts as it can
            ).remote(payload, i, shards)
            for i in range(shards)
        ]
        self.timeout, self.apply_timeout = timeout, apply_timeout
        # The newest state applied per model: (version, object ref), for restarted shards.
        self.applied: dict[str, tuple[int, Any]] = {}
        self.statuses: list[ShardStatus | None] = [None] * shards
        self._batches: dict[asyncio.AbstractEventLoop, _Batches] = {}
        #: The whole gallery's reference sample, and the shards' digests it was made from.
        self.reference: GalleryRows | None = None
        self._reference_from: list[str] = []

    # -- versions -------------------------------------------------------------------------------
    def apply(self, name: str, ckpt: Checkpoint) -> list[AppliedVersion]:
        """Every shard holds ``ckpt``'s version of ``name`` with its part's index built: one
        copy of the state in the object store, the shards building at the same time."""
        state = self.ray.put((ckpt.arrays, ckpt.meta))
        self.applied[name] = (ckpt.version, state)
        refs = [a.apply.remote(name, ckpt.version, state) for a in self.actors]
        return list(self.ray.get(refs, timeout=self.apply_timeout))

    def heal(self, served: Mapping[str, int]) -> None:
        """Give every shard that lacks it (a restarted one) the served version of each model,
        gather the reference sample again when a shard's part of it changed, and refresh what
        ``/readyz`` and ``/metrics`` show of the shards."""
        self.statuses = self.status()
        self._gather_reference(self.statuses)
        for actor, status in zip(self.actors, self.statuses, strict=True):
            if status is None or not status.caught_up:  # given versions once it has read
                continue
            for name, version in served.items():
                if version in status.versions.get(name, []) or name not in self.applied:
                    continue
                held, state = self.applied[name]
                if held == version:
                    log.info("shard %d: %s version %d applied again", status.index, name, version)
                    self.ray.get(
                        actor.apply.remote(name, version, state), timeout=self.apply_timeout
                    )

    def _gather_reference(self, statuses: list[ShardStatus | None]) -> None:
        """The whole gallery's reference sample from the shards' candidates (the smallest
        reference keys of their union, as one server picks them), given to every shard."""
        digests = [s.reference_digest if s is not None else "" for s in statuses]
        if "" in digests or digests == self._reference_from:
            return
        parts = self.ray.get(
            [a.reference_candidates.remote() for a in self.actors], timeout=self.timeout
        )
        union = GalleryRows.joined(parts)
        sample = union.taken(smallest(reference_keys(union.ids), REFERENCE_ITEMS))
        self.ray.get([a.set_reference.remote(sample) for a in self.actors], timeout=self.timeout)
        self.reference, self._reference_from = sample, digests

    def status(self) -> list[ShardStatus | None]:
        """Each shard's status (``None``: it did not answer within the search timeout)."""
        refs = [a.status.remote() for a in self.actors]
        ready, _ = self.ray.wait(refs, num_returns=len(refs), timeout=self.timeout)
        done = set(ready)
        out: list[ShardStatus | None] = []
        for ref in refs:
            try:
                out.append(self.ray.get(ref) if ref in done else None)
            except self.ray.exceptions.RayError:
                out.append(None)
        return out

    # -- search ---------------------------------------------------------------------------------
    async def search_async(self, query: ShardQuery, partial: bool = False) -> ShardedHits:
        """The merged top ``k`` of every shard's answer to ``query`` (see :meth:`merge`).
        Concurrent searches go to each shard together (:class:`_Batches`): one call per shard
        carries every search that arrived while the previous call was out."""
        loop = asyncio.get_running_loop()
        batches = self._batches.get(loop)
        if batches is None:
            batches = self._batches[loop] = _Batches(self.actors, self.timeout)
        return self.merge(await batches.ask(query), query.k, partial)

    def search(self, query: ShardQuery, partial: bool = False) -> ShardedHits:
        """:meth:`search_async` from a thread (one call per shard)."""
        refs = [a.search_batch.remote([query]) for a in self.actors]
        ready, _ = self.ray.wait(refs, num_returns=len(refs), timeout=self.timeout)
        answers: list[ShardAnswer | ShardError | BaseException | None] = []
        for ref in refs:
            try:
                answers.append(self.ray.get(ref)[0] if ref in ready else None)
            except Exception as exc:  # its actor died
                answers.append(exc)
        return self.merge(answers, query.k, partial)

    def merge(
        self,
        answers: Sequence[ShardAnswer | ShardError | BaseException | None],
        k: int,
        partial: bool,
    ) -> ShardedHits:
        """The shards' answers as one: every shard's, or with ``partial`` those that came,
        saying which share of the item space they cover; else
        :class:`~streamxm.serving.shard.ShardsUnavailable` naming the shards missing."""
        missing = [i for i, a in enumerate(answers) if not isinstance(a, ShardAnswer)]
        if missing and not partial:
            first = answers[missing[0]]
            why = (
                "no answer in time"
                if first is None
                else str(first)
                if isinstance(first, ShardError)
                else f"{type(first).__name__}: {first}"
            )
            raise ShardsUnavailable(missing, len(answers), why)
        got = [a for a in answers if isinstance(a, ShardAnswer)]
        covered = sum(
            p.share for p, a in zip(self.parts, answers, strict=True) if isinstance(a, ShardAnswer)
        )
        return ShardedHits(merge_hits([a.hits for a in got], k), covered, missing)

    def close(self) -> None:
        if self.started_ray:
            self.ray.shutdown()


async def _awaited(ref: Any) -> Any:
    return await ref


class _Batches:
    """Searches of one event loop sent to the shards in batches, as
    :class:`~streamxm.serving.index.QueryCoalescer` sends scans: the searches that arrive while a
    batch is out go together in the next, one call per shard (an idle API sends each at once).
    A shard that does not answer a batch within ``timeout`` answers none of its searches."""

    #: Batches out at once: the next one is gathered while the shards work on the first.
    IN_FLIGHT = 2
    MAX_BATCH = 64

    def __init__(self, actors: list[Any], timeout: float) -> None:
        self.actors, self.timeout = actors, timeout
        self.waiting: list[tuple[ShardQuery, asyncio.Future[list[Any]]]] = []
        self.out = 0
        self.sending: set[asyncio.Future[None]] = set()

    async def ask(self, query: ShardQuery) -> list[ShardAnswer | ShardError | BaseException | None]:
        """Every shard's answer to ``query``, in shard order."""
        future: asyncio.Future[list[Any]] = asyncio.get_running_loop().create_future()
        self.waiting.append((query, future))
        if self.out < self.IN_FLIGHT:
            self.out += 1
            task = asyncio.ensure_future(self._send())
            self.sending.add(task)  # held until done: the loop keeps weak references only
            task.add_done_callback(self.sending.discard)
        return await future

    async def _send(self) -> None:
        try:
            while self.waiting:
                batch, self.waiting = self.waiting[: self.MAX_BATCH], self.waiting[self.MAX_BATCH :]
                queries = [q for q, _ in batch]
                calls = [
                    asyncio.ensure_future(_awaited(a.search_batch.remote(queries)))
                    for a in self.actors
                ]
                done, pending = await asyncio.wait(calls, timeout=self.timeout)
                for call in pending:
                    call.cancel()
                per_shard = [(c.exception() or c.result()) if c in done else None for c in calls]
                for at, (_, future) in enumerate(batch):
                    if not future.done():
                        future.set_result([r[at] if isinstance(r, list) else r for r in per_shard])
        finally:
            self.out -= 1


def wait_for_shards(gallery: RayGallery, seconds: float) -> None:
    """Block until every shard has read its part of the gallery (or ``seconds`` pass)."""
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        statuses = gallery.status()
        if all(s is not None and s.caught_up for s in statuses):
            return
        time.sleep(0.2)
    raise TimeoutError(f"shards not caught up after {seconds} s: {gallery.status()}")
