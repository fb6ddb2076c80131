"""A learner worker's commits: the checkpoint, its dead letters, the acknowledgements and the
worker's statistics in one lease-fenced transaction, on the worker's thread or on a thread of
its own while the worker learns on.

:class:`CommitLedger` keeps what awaits the next commit (:class:`Pending`) and when it is due
(:class:`CheckpointPolicy`); the worker takes a :class:`Commit` from its state and decides what
a lost lease means (:meth:`~streamxm.worker.loop.LearnerWorker.commit`); :class:`CheckpointWriter`
only writes it and hands it back with what the write raised.
"""

from __future__ import annotations

import logging
import threading
import time
from dataclasses import dataclass, field
from typing import Any

import redis

from streamxm import defaults as D
from streamxm.storage.checkpoint import Checkpoint, CheckpointStore, LeaseLost
from streamxm.stream.keys import Keys
from streamxm.stream.redis_conn import NotReplicated, wait_replicated
from streamxm.worker.lease import Lease

__all__ = ["CheckpointPolicy", "CheckpointWriter", "Commit", "CommitLedger", "Pending"]

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class CheckpointPolicy:
    """When a learner worker checkpoints (``STREAMXM_CHECKPOINT_*``).

    Parameters
    ----------
    every_pairs, every_seconds
        Checkpoint after this many pairs or this long, whichever comes first.
    max_share
        Most of the worker's time its checkpoints may take: a checkpoint that took ``c``
        seconds (encoding, hashing and writing the state, the commit transaction) holds the
        next one back for at least ``c (1 - share) / share`` seconds, so a model whose state
        is large checkpoints less often instead of learning less. Checkpoints are points of
        the stream at which everything before them is durable; when they come does not change
        what is learned.
    in_background
        Write scheduled checkpoints from a thread while learning goes on (the state is copied
        first: the checkpoint's bytes are what they would be at that point); ``False`` writes
        them on the learning path. Explicit commits and the final checkpoint are always
        written before they return.
    """

    every_pairs: int = D.CHECKPOINT_EVERY_PAIRS
    every_seconds: float = D.CHECKPOINT_EVERY_SECONDS
    max_share: float = D.CHECKPOINT_MAX_SHARE
    in_background: bool = D.CHECKPOINT_IN_BACKGROUND


@dataclass
class Pending:
    """What was applied since the last checkpoint and awaits the commit."""

    ack: list[str] = field(default_factory=list)
    dead: list[dict[str, str | bytes]] = field(default_factory=list)
    pairs: int = 0

    def __bool__(self) -> bool:
        return bool(self.ack or self.dead)


@dataclass
class Commit:
    """One checkpoint's commit: what it makes durable, taken when it was started."""

    pending: Pending
    #: ``None``: only dead letters so far, nothing to checkpoint.
    ckpt: Checkpoint | None
    head_extra: dict[str, Any]
    stats: dict[str, str]
    #: The last entry it applies.
    last_id: str
    started: float
    #: When the write ended (set by the thread that wrote it).
    ended: float = 0.0
    thread: threading.Thread | None = None
    #: What the write raised (set by the thread that wrote it).
    error: BaseException | None = None


class CommitLedger:
    """What a learner worker applied since its last checkpoint, when the next one is due, and
    the dead letters its checkpoints count.

    Parameters
    ----------
    policy
        When to checkpoint.
    consumer
        The worker's name, for its log lines.
    """

    def __init__(self, policy: CheckpointPolicy, consumer: str) -> None:
        self.policy, self.consumer = policy, consumer
        self.pending = Pending()
        #: Dead letters committed (those of a commit being written included).
        self.dead_letters = 0
        self.last_commit = time.monotonic()
        self.commit_seconds = 0.0  # what the last checkpoint took

    def restart(self, dead_letters: int) -> None:
        """After a checkpoint was loaded (it counted ``dead_letters``): nothing pending, the
        interval counted from now."""
        self.dead_letters = dead_letters
        self.pending = Pending()
        self.last_commit = time.monotonic()

    def drop(self) -> None:
        """Forget what is pending: the state it was applied to is gone."""
        self.pending = Pending()

    def applied(self, ack: list[str], dead: list[dict[str, str | bytes]], pairs: int) -> None:
        """Entries applied (``pairs`` of them learned), to be acknowledged by the next commit
        with the dead letters among them."""
        self.pending.ack.extend(ack)
        self.pending.dead.extend(dead)
        self.pending.pairs += pairs

    def uncommitted_dead_letters(self) -> int:
        """The dead letters a checkpoint would count now."""
        return self.dead_letters + len(self.pending.dead)

    def due(self) -> bool:
        """Pairs are pending, the checkpoint interval (pairs or seconds) has passed and so has
        the wait that keeps checkpoints within their share of the time."""
        if not self.pending:
            return False
        since = time.monotonic() - self.last_commit
        share = self.policy.max_share
        if since < self.commit_seconds * (1.0 - share) / share:
            return False
        return self.pending.pairs >= self.policy.every_pairs or since >= self.policy.every_seconds

    def take(self) -> Pending | None:
        """What the next commit makes durable, no longer pending (its dead letters counted);
        ``None`` when nothing is pending."""
        pending = self.pending
        if not pending:
            return None
        self.pending = Pending()
        self.dead_letters += len(pending.dead)
        return pending

    def settle(self, job: Commit) -> bool:
        """After a write: ``True`` once it committed (the schedule counts from its end);
        ``False`` when it lost the lease or was not replicated: the caller drops its state,
        what is pending with it. Another failure puts its entries back for the next commit
        and is raised."""
        if isinstance(job.error, (LeaseLost, redis.WatchError)):
            log.error("worker %s lost the lease during a commit; dropping its state", self.consumer)
            return False
        if isinstance(job.error, NotReplicated):
            # Committed on the master, maybe not on its replicas: a failover now could lose the
            # commit while this process went on from it. Reload what the store holds instead.
            log.error(
                "worker %s: commit not replicated (%s); reloading its checkpoint",
                self.consumer,
                job.error,
            )
            return False
        if job.error is not None:
            # Not committed: its entries go with the next commit, unless the caller drops
            # the state (as the loop does when Redis is unreachable).
            later = self.pending
            self.pending = Pending(
                job.pending.ack + later.ack,
                job.pending.dead + later.dead,
                job.pending.pairs + later.pairs,
            )
            self.dead_letters -= len(job.pending.dead)
            raise job.error
        self.last_commit = job.ended  # the schedule counts from the write, not from now
        self.commit_seconds = job.ended - job.started
        return True


class CheckpointWriter:
    """Writes :class:`Commit` s of one model's learner, at most one on a background thread.

    Parameters
    ----------
    client, store, keys
        Redis, the checkpoint store and the namespace's keys.
    model, group, consumer
        The model, its consumer group and this worker's name in it.
    lease
        The model's lease: a commit is fenced by it.
    """

    def __init__(
        self,
        client: redis.Redis,
        store: CheckpointStore,
        keys: Keys,
        model: str,
        group: str,
        consumer: str,
        lease: Lease,
    ) -> None:
        self.r, self.store, self.keys = client, store, keys
        self.model, self.group, self.consumer, self.lease = model, group, consumer, lease
        self.writing: Commit | None = None  # the commit being written in the background

    def write(self, job: Commit) -> None:
        """Write ``job`` now; what the write raised is kept on ``job.error``."""
        try:
            self._transaction(job)
        except Exception as exc:  # handed to the worker, which raises what it does not handle
            job.error = exc
        finally:
            job.ended = time.monotonic()

    def start(self, job: Commit) -> None:
        """Write ``job`` on a thread of its own (:meth:`ended` hands it back)."""
        job.thread = threading.Thread(
            target=self.write, args=(job,), daemon=True, name=f"checkpoint-{self.model}"
        )
        self.writing = job
        job.thread.start()

    def ended(self, wait: bool) -> Commit | None:
        """The background commit once its write has ended (waiting for it with ``wait``);
        None while there is none, or while it is still being written and ``wait`` is off."""
        job = self.writing
        if job is None or job.thread is None or (not wait and job.thread.is_alive()):
            return None
        job.thread.join()
        self.writing = None
        return job

    def abandon(self) -> None:
        """Wait for the background commit to end, whatever its outcome, and forget it: the
        store then holds what a reload reads."""
        writing, self.writing = self.writing, None
        if writing is not None and writing.thread is not None:
            writing.thread.join()

    def _transaction(self, job: Commit) -> None:
        """The checkpoint, its dead letters, acknowledgements and stats in one transaction."""
        pending = job.pending

        def hook(pipe: redis.client.Pipeline) -> None:
            if pending.ack:
                pipe.xack(self.keys.pairs, self.group, *pending.ack)
            for letter in pending.dead:
                pipe.xadd(self.keys.dead, letter)  # type: ignore[arg-type]
                pipe.hincrby(self.keys.dead_counts, f"{self.model}|{letter['reason']!s}", 1)
            pipe.hset(self.keys.stats(self.model), mapping=job.stats)  # type: ignore[arg-type]

        if job.ckpt is None:
            with self.r.pipeline(transaction=True) as pipe:
                hook(pipe)
                pipe.execute()
            wait_replicated(self.r, self.keys.replicated, self.store.replication)
        else:
            self.store.commit(
                self.model,
                job.ckpt,
                job.head_extra,
                hook=hook,
                lease=(self.keys.lease(self.model), self.consumer),
                fence=self.lease.fence,
            )
