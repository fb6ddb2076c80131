"""Writing a learner worker's commits: the checkpoint, its dead letters, the acknowledgements
and the worker's statistics in one lease-fenced transaction, on the worker's thread or on a
thread of its own while the worker learns on.

The worker decides what a commit holds (:class:`Commit`, taken from its state) and what its
outcome means (:meth:`~streamxm.worker.loop.LearnerWorker.commit`); :class:`CheckpointWriter`
only writes it and hands it back with what the write raised.
"""

from __future__ import annotations

import threading
import time
from dataclasses import dataclass, field
from typing import Any

import redis

from streamxm.storage.checkpoint import Checkpoint, CheckpointStore
from streamxm.stream.keys import Keys
from streamxm.stream.redis_conn import wait_replicated
from streamxm.worker.lease import Lease

__all__ = ["CheckpointWriter", "Commit", "Pending"]


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
