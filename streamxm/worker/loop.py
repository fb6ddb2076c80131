"""The learner worker: read the stream with a consumer group, learn, checkpoint, acknowledge.

Delivery guarantees (``docs/design.md``):

- One consumer group per model, so every model sees every pair.
- One *active* learner per model at a time, chosen by a lease in Redis (``sxm:{<ns>}:lease:<m>``,
  ``SET NX PX``, refreshed every loop). A sequential online learner has one model state, so
  further workers of the same model are hot standbys: when the active one dies its lease expires,
  a standby takes it, loads the newest checkpoint and claims the dead consumer's pending entries
  (``XAUTOCLAIM``). This replaces "several workers split the load" for the sequential models.
- Entries are acknowledged (``XACK``) only in the same Redis transaction that makes the checkpoint
  containing their effect durable (with the Redis store; the directory store renames the file
  first). The checkpoint records the last applied entry id.
- A learner that takes the lease (start, restart, takeover, lost connection) loads the newest good
  checkpoint, claims every pending entry of the group, acknowledges those up to the checkpoint's
  last applied id (applied; only the acknowledgement was lost) and *replays the stream* from that
  id up to the group's last delivered id (``XRANGE``) before reading new entries. Replaying from
  the checkpoint rather than from the pending list also covers a corrupt newest checkpoint (the
  fallback version's successors were acknowledged already) and a read whose reply was lost. So
  no pair is lost and none is applied twice, provided the stream is not trimmed below the
  checkpoint.
- A lost Redis connection never stops the worker: it drops its in-memory state, backs off
  (exponentially, up to 5 s) and takes the lease again, which reloads and replays as above.
- Entries that cannot be decoded or validated go to ``sxm:{<ns>}:dead`` with their reason, in the
  same commit transaction, and never stop the worker.
- An entry counts as applied only once learning it returned. If learning raises (a bug, a
  ``MemoryError``), the half-updated state is dropped, nothing of the batch is committed, and
  the worker backs off and reloads the checkpoint and replays, like after a lost connection.
  After ``max_learn_attempts`` failures on the same entry it is dead-lettered with reason
  ``learn_error`` (the exception in ``detail``) and learning goes on after it.
- A scheduled checkpoint is written in the background: the learner's state is copied, then
  encoded, hashed and committed by a thread while learning goes on. Entries applied meanwhile
  wait for the next checkpoint; a new one starts only after the last has ended, and a dropped
  state (lost lease, lost connection) waits for it before anything is reloaded, so the store
  never moves behind the worker's back.
- SIGTERM (``stop`` set) ends with a final checkpoint and releases the lease.

:class:`LearnerWorker` runs the loop's steps; its collaborators do one job each: reading the
group and replaying after a takeover (:mod:`streamxm.worker.reading`), sorting and decoding a
read (:mod:`streamxm.worker.entries`), counting failures (:mod:`streamxm.worker.failures`),
what awaits the next commit and writing it (:mod:`streamxm.worker.checkpoints`), and the
progress line (:mod:`streamxm.worker.progress`).
"""

from __future__ import annotations

import copy
import logging
import os
import socket
import threading
import time
from dataclasses import dataclass
from typing import Any

import numpy as np
import redis

from streamxm import defaults as D
from streamxm.learning.stats import WorkerStats
from streamxm.learning.stream_learner import LearnFailed, StreamLearner
from streamxm.models import split_name
from streamxm.storage.checkpoint import Checkpoint, CheckpointStore
from streamxm.stream.keys import Keys
from streamxm.stream.messages import Limits, Pair
from streamxm.stream.migrate import require_migrated
from streamxm.stream.redis_conn import UNAVAILABLE, StreamEntry
from streamxm.stream.retention import entry_id_key, trim_stream
from streamxm.worker.checkpoints import CheckpointPolicy, CheckpointWriter, Commit, CommitLedger
from streamxm.worker.entries import EntryDecoder
from streamxm.worker.failures import EntryFailed, LearnFailures, back_off
from streamxm.worker.lease import Lease
from streamxm.worker.leased import LeasedConsumer
from streamxm.worker.progress import ProgressLine, stream_lag
from streamxm.worker.reading import GroupReader

# CheckpointPolicy, EntryFailed and entry_id_key are imported from here too.
__all__ = ["CheckpointPolicy", "EntryFailed", "LearnerWorker", "StreamReading", "entry_id_key"]

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class StreamReading:
    """How a learner worker reads the stream and holds its lease: entries per read
    (``XREADGROUP COUNT``), how long a read blocks, the lease's time to live."""

    read_batch: int = D.READ_BATCH
    block_ms: int = D.BLOCK_MS
    lease_ttl_ms: int = D.LEASE_TTL_MS


class LearnerWorker(LeasedConsumer):
    """Learn one model from the namespace's stream: a leased consumer
    (:class:`~streamxm.worker.leased.LeasedConsumer`) whose work is :meth:`step`.

    Parameters
    ----------
    client
        Redis client.
    store
        Checkpoint store.
    model
        Model name (``docs/design.md``).
    namespace
        Stream namespace.
    consumer
        Consumer name in the group (default ``<host>-<pid>``).
    params
        Model parameters, used when no checkpoint exists yet.
    learner_options
        Extra :class:`~streamxm.learning.stream_learner.StreamLearner` options (buffer size,
        rolling-mAP schedule).
    checkpoints
        When to checkpoint (:class:`CheckpointPolicy`).
    reading
        How the stream is read and the lease held (:class:`StreamReading`).
    limits
        What a pair may hold (the stream's validator).
    max_learn_attempts
        Failures of learning one entry before it is dead-lettered as ``learn_error``.
    retain_entries
        After each checkpoint, trim the stream to what anything still needs, keeping at least
        this many newest entries for the search gallery (:mod:`streamxm.stream.retention`);
        ``None`` never trims.
    progress_every_seconds
        While it leads, log a progress line this often (:mod:`streamxm.worker.progress`);
        0 never does.
    """

    recoverable = (*UNAVAILABLE, EntryFailed)

    def __init__(
        self,
        client: redis.Redis,
        store: CheckpointStore,
        model: str,
        namespace: str = "default",
        consumer: str | None = None,
        params: dict[str, Any] | None = None,
        learner_options: dict[str, Any] | None = None,
        seed: int = 0,
        checkpoints: CheckpointPolicy = CheckpointPolicy(),  # noqa: B008 - frozen
        reading: StreamReading = StreamReading(),
        limits: Limits = Limits(),
        max_learn_attempts: int = 3,
        retain_entries: int | None = None,
        progress_every_seconds: float = D.PROGRESS_EVERY_SECONDS,
    ) -> None:
        split_name(model)  # an unknown name fails here, before anything is registered
        self.r = client
        self.store = store
        self.model = model
        self.keys = Keys(namespace)
        self.group = self.keys.group(model)
        self.consumer = consumer or f"{socket.gethostname()}-{os.getpid()}"
        self.params = params
        self.learner_options = learner_options or {}
        self.seed = seed
        self.read_batch = reading.read_batch
        self.retain_entries = retain_entries
        self.learner: StreamLearner | None = None
        self.version = 0
        self.last_id = "0-0"
        self.leader = False
        self._learned_time: float | None = None
        self._backoff = 0.0  # the last back-off, doubled while failures go on
        self.ledger = CommitLedger(checkpoints, self.consumer)
        self.entries = EntryDecoder(self.r, self.keys, self.model, self.consumer, limits)
        self.failures = LearnFailures(self.consumer, max_learn_attempts)
        self.reader = GroupReader(self.r, self.keys, self.group, self.consumer, reading.block_ms)
        self.lease = Lease(self.r, self.keys.lease(self.model), self.consumer, reading.lease_ttl_ms)
        self.writer = CheckpointWriter(
            self.r, store, self.keys, self.model, self.group, self.consumer, self.lease
        )
        self.progress = ProgressLine(self.consumer, self.model, progress_every_seconds)

    # -- lifecycle -------------------------------------------------------------------------
    def setup(self) -> None:
        """Register the model and create its consumer group (from the stream's start), once
        the namespace's data is known not to be under the old untagged key names."""
        require_migrated(self.r, self.keys)  # before sadd writes a key under the new names
        self.r.sadd(self.keys.models, self.model)
        self.reader.create_group()

    # -- the leased consumer's steps (streamxm/worker/leased.py) --------------------------
    def prepare(self, stop: threading.Event) -> None:
        """:meth:`setup`, again after a back-off while Redis cannot be reached."""
        self._backoff = 0.0  # each run starts from the shortest wait
        while not stop.is_set():
            try:
                self.setup()
                break
            except UNAVAILABLE as exc:
                self._backoff = back_off(stop, self._backoff, self.consumer, exc)
        log.info(
            "worker %s: model %s, namespace %s", self.consumer, self.model, self.keys.namespace
        )

    def work(self) -> bool:
        """One :meth:`step` and the progress line; idle when it read nothing and was not
        replaying its own pending entries."""
        was_recovering = self.reader.replaying
        read = self.step()
        self._report_progress()
        self._backoff = 0.0
        return read == 0 and not was_recovering

    def recover(self, stop: threading.Event, exc: Exception) -> None:
        """A lost connection drops the state (the next lease reloads and replays); an entry
        that failed to learn is counted against it (dead-lettered after the last attempt)."""
        if isinstance(exc, EntryFailed):
            self._backoff = self.failures.failed(stop, self._backoff, exc)
            return
        self._drop_state()
        self._backoff = back_off(stop, self._backoff, self.consumer, exc)

    def finish(self) -> None:
        """The leader's final checkpoint and the lease released (the leased consumer's), and
        where the worker stopped."""
        super().finish()
        log.info(
            "worker %s stopped at entry %s, version %d", self.consumer, self.last_id, self.version
        )

    def _drop_state(self) -> None:
        """Forget everything not in a checkpoint; the next lease reloads and replays (after the
        checkpoint being written has ended, whatever its outcome: the store then holds what
        the reload reads)."""
        self.writer.abandon()
        self.leader, self.learner = False, None
        self.ledger.drop()
        self.entries.forget()

    def _refresh_lease(self) -> bool:
        """Extend the lease we hold; if it is gone, drop the state (a successor owns it)."""
        if self.lease.extend():
            return True
        log.warning("worker %s lost the lease of %s", self.consumer, self.model)
        self._drop_state()
        return False

    def hold_lease(self) -> bool:
        if self.leader and self._refresh_lease():
            return True
        # Our own name in the key: a lease we held before a lost connection, still valid.
        if self.lease.acquire():
            self.leader = True
            self._load()
            return True
        return False

    def _load(self) -> None:
        """The newest good checkpoint (none: a fresh learner), and the group taken over from
        its position (:meth:`~streamxm.worker.reading.GroupReader.take_over`)."""
        ckpt = self.store.load_latest(self.model)
        if ckpt is None:
            self.learner, self.version, self.last_id, dead_letters = None, 0, "0-0", 0
        else:
            self.learner = StreamLearner.from_state(ckpt.arrays, ckpt.meta)
            self.version, self.last_id = ckpt.version, ckpt.last_id
            dead_letters = int(ckpt.meta.get("worker", {}).get("dead_letters", 0))
        self.ledger.restart(dead_letters)
        replay_to = self.reader.take_over(self.last_id)
        log.info(
            "worker %s leads %s from version %d (entry %s), replaying to %s",
            self.consumer,
            self.model,
            self.version,
            self.last_id,
            replay_to,
        )
        self.progress.restart(self._progress_stats())

    # -- one read -> learn -> maybe checkpoint cycle ---------------------------------------
    def step(self) -> int:
        """Read one batch (our own pending entries first after a takeover), learn, and commit if
        due. Returns the number of entries read."""
        if not self._reap(wait=False):
            return 0  # the background checkpoint lost the lease: the state is gone
        entries = self.reader.read(self.read_batch)
        self._apply(entries)
        if self._checkpoint_due():
            if not self.ledger.policy.in_background:
                self.commit()
            # The last checkpoint must have ended (only a write longer than the interval makes
            # this wait) and its time decides whether the next is due yet.
            elif self._reap(wait=True) and self._checkpoint_due():
                self._commit_in_background()
        return len(entries)

    def _checkpoint_due(self) -> bool:
        """Whether a checkpoint is due (:meth:`~streamxm.worker.checkpoints.CommitLedger.due`)."""
        return self.ledger.due()

    def _apply(self, entries: list[StreamEntry]) -> None:
        """Learn a read's pairs; its entries count as applied (pending the next commit) only
        once learning returned."""
        read = self.entries.sort(entries, self.last_id, self.failures)
        if read.already:
            self.reader.ack(read.already)
        if read.pairs and not self._learn(read.pairs, read.pair_entries):
            return
        self.ledger.applied(read.ack, read.dead, len(read.pairs))
        self.last_id = read.last_id
        if read.pairs:
            self._learned_time = time.time()

    def _new_learner(self, first: Pair) -> StreamLearner:
        return StreamLearner(
            self.model,
            first.img.shape[0],
            first.txt.shape[0],
            self.params,
            seed=self.seed,
            **self.learner_options,
        )

    def _learn(self, pairs: list[Pair], pair_entries: list[str]) -> bool:
        """Learn decoded pairs (``pair_entries``: their entry ids); ``False`` if the state was
        dropped meanwhile (the lease was lost), so nothing of them counts as applied."""
        if self.learner is None:
            self.learner = self._new_learner(pairs[0])
        # A slow model (or a large batch) must not outlive the lease, or every commit would
        # be fenced off and the same batch retried forever: a heartbeat holds it meanwhile.
        try:
            with self.lease.heartbeat() as lost:
                self.learner.learn(pairs)
        except LearnFailed as exc:
            # The state holds part of the batch: it must never reach a checkpoint.
            self._drop_state()
            raise EntryFailed(pair_entries[exc.index], str(exc.__cause__)) from exc
        except BaseException:
            self._drop_state()  # e.g. KeyboardInterrupt: nothing half-learned is committed
            raise
        if lost.is_set():
            log.warning("worker %s lost the lease of %s while learning", self.consumer, self.model)
            self._drop_state()
            return False
        return True

    # -- commit ------------------------------------------------------------------------------
    def commit(self) -> None:
        """Checkpoint, dead-letter and acknowledge everything since the last commit, atomically,
        before returning (after the background checkpoint, if one is being written)."""
        if not self._reap(wait=True):
            return
        job = self._snapshot(copied=False)
        if job is not None:
            self.writer.write(job)
            self._finish(job)

    def _commit_in_background(self) -> None:
        """Start the commit of everything since the last one on a thread (:meth:`_reap` ends
        it); learning goes on from a copy of the state."""
        job = self._snapshot(copied=True)
        if job is not None:
            self.writer.start(job)

    def _reap(self, wait: bool) -> bool:
        """End the background checkpoint if it is done (or ``wait`` for it): its outcome as a
        synchronous commit's. ``False`` if it lost the lease, so the state is dropped."""
        job = self.writer.ended(wait)
        return True if job is None else self._finish(job)

    def _snapshot(self, copied: bool) -> Commit | None:
        """What the next commit makes durable, taken now; the state's arrays ``copied`` when
        learning goes on while it is written."""
        pending = self.ledger.take()
        if pending is None:
            return None
        ckpt, extra = None, {}
        if self.learner is not None:
            self.version += 1
            arrays, meta = self.learner.state()
            if copied:
                arrays = {name: np.array(value, copy=True) for name, value in arrays.items()}
                meta = copy.deepcopy(meta)
            meta["worker"] = {"dead_letters": self.ledger.dead_letters}
            ckpt = Checkpoint(self.version, arrays, meta, last_id=self.last_id)
            extra = {"pairs_seen": self.learner.pairs_seen}
        return Commit(pending, ckpt, extra, self._stats_fields(), self.last_id, time.monotonic())

    def _finish(self, job: Commit) -> bool:
        """After a write (:meth:`~streamxm.worker.checkpoints.CommitLedger.settle`): on success
        the schedule and the failure counts move on; a lost lease or a commit not replicated
        drops the state (``False``); anything else is raised, its entries left for the next
        commit."""
        if not self.ledger.settle(job):
            self._drop_state()
            return False
        self.failures.committed(job.last_id)
        log.debug(
            "checkpoint %s v%d at %s",
            self.model,
            job.ckpt.version if job.ckpt is not None else self.version,
            job.last_id,
        )
        self._trim()
        return True

    def _trim(self) -> None:
        if self.retain_entries is None:
            return
        try:
            trim_stream(self.r, self.keys, self.retain_entries)
        except redis.RedisError as exc:  # the next checkpoint tries again
            log.warning("stream trim failed (will retry): %s", exc)

    # -- statistics and the progress line ----------------------------------------------------
    def _report_progress(self) -> None:
        """The progress line, when its interval is up; otherwise only a clock read, so the
        cost per read stays nil whatever the interval."""
        if self.leader and self.progress.due():
            stats = self._progress_stats()
            self.progress.report(
                stats, lambda: stream_lag(self.r, self.keys, self.group, self.consumer, stats)
            )

    def _progress_stats(self) -> WorkerStats:
        """The counters a checkpoint would write now (dead letters not yet committed too)."""
        return WorkerStats.of_learner(
            self.learner,
            version=self.version,
            last_id=self.last_id,
            dead_letters=self.ledger.uncommitted_dead_letters(),
            consumer=self.consumer,
        )

    def _stats_fields(self) -> dict[str, str]:
        return WorkerStats.of_learner(
            self.learner,
            version=self.version,
            last_id=self.last_id,
            checkpoint_time=time.time(),
            learned_time=self._learned_time,
            dead_letters=self.ledger.dead_letters,
            consumer=self.consumer,
        ).to_hash()
