"""One model learned by N ranks: ``streamxm worker --model NAME --world-size N --rank R``.

Rank 0 is a :class:`~streamxm.worker.loop.LearnerWorker` that holds the model's lease: it alone
reads the stream, validates, dead-letters, checkpoints and acknowledges, exactly as a single
learner does. What changes is how a batch is learned (:class:`RankZeroWorker`): rank 0 reads
``N x read_batch`` entries, sends every other rank (:class:`RankFollower`) a contiguous share,
learns its own, and one merge (:mod:`streamxm.learning.rounds`) makes all ranks' models
equal again. Only then does the round count as applied, so a checkpoint always covers a stream
prefix that every rank has learned and merged, and its transaction acknowledges every rank's
entries (they were all read by rank 0).

Failures:

- A rank that dies closes its sockets: the round's next collective fails on every rank at once
  (one that hangs fails it after ``STREAMXM_DIST_TIMEOUT_S``). Rank 0 drops its state (nothing
  of the round was committed), reloads the checkpoint and replays the stream after it, as after
  any lost state; the others drop theirs and rejoin.
- Formation and rejoining go through Redis and nothing else (:mod:`streamxm.worker.rendezvous`:
  no rendezvous port is opened): rank 0 publishes a new *generation* in
  ``sxm:{<ns>}:dist:<model>`` each time it forms the group, and the ranks exchange their gloo
  addresses through that generation's keys. A rank joins the newest generation, claiming its
  rank number in it; a generation whose rank is already claimed (formed before that rank died)
  is skipped, so a restarted rank waits for the next one, which rank 0 publishes as soon as it
  notices the loss. Each rank's gloo sockets bind to its ``host`` (``STREAMXM_DIST_HOST``,
  loopback by default); what they carry is unencrypted, so ranks on several machines belong on
  a private network.
- The world is fixed: rank 0 learns only when all ``N`` ranks are present (after each loss it
  waits for the missing rank to come back). A second process started as rank 0 is a standby, as
  for a single learner: it takes over when the lease expires.
- After every (re)formation, and before the first split round after rank 0 learned alone, rank 0
  sends its whole learner state (a checkpoint blob: arrays + JSON) to every rank.

Rounds in which the model cannot be split (:meth:`~streamxm.models.opt_in.MergesRanks.
merge_parts` returns ``None``: SDSRL before its landmarks freeze and while a class first seen
in a split round is owed landmark growth, SAM before its first step; or the model does not opt
into :class:`~streamxm.models.opt_in.MergesRanks`: CMOMKS and SCSM) are learned by rank 0 alone
while the others wait.
"""

from __future__ import annotations

import contextlib
import logging
import threading
import time
from dataclasses import dataclass
from typing import Any

import numpy as np
import redis

from streamxm.learning.rounds import (
    RankGroup,
    RankMerge,
    balanced_first,
    decode_learner,
    decode_share,
    encode_learner,
    encode_share,
    split_share,
)
from streamxm.learning.stream_learner import LearnFailed, StreamLearner
from streamxm.models.opt_in import mergeable
from streamxm.stream.keys import Keys
from streamxm.stream.messages import Pair
from streamxm.worker.failures import EntryFailed
from streamxm.worker.loop import LearnerWorker
from streamxm.worker.rendezvous import Rendezvous

__all__ = ["RankFollower", "RankZeroWorker"]

log = logging.getLogger(__name__)

# Round header: kind, sync (rank 0's state follows), split (shares follow), then one share size
# per rank > 0.
_IDLE, _ROUND, _STOP = 0, 1, 2


class RankZeroWorker(LearnerWorker):
    """Rank 0 of ``world`` ranks (see the module docstring); the other arguments are
    :class:`LearnerWorker`'s, ``read_batch`` per rank."""

    def __init__(
        self,
        *args: Any,
        world: int,
        host: str = "127.0.0.1",
        timeout_s: float = 60.0,
        **kwargs: Any,
    ) -> None:
        if world < 2:
            raise ValueError("a distributed learner needs world >= 2")
        super().__init__(*args, **kwargs)
        self.world = world
        self.read_batch *= world  # rank 0 reads a round: every rank's share
        self.host = host
        self.timeout_s = timeout_s
        self.rendezvous = Rendezvous(self.r, self.keys, self.model)
        self._group: RankGroup | None = None
        self._merge: RankMerge | None = None
        self._synced = False
        self._sent = False
        self.rounds = self.split_rounds = 0
        self.collective_seconds = self.scatter_seconds = 0.0
        self.merge_bytes = 0
        # Seconds rank 0 spent learning its shares, and the slowest other rank its shares.
        self.learn_seconds = self.peer_learn_seconds = 0.0
        # Rank 0's work between rounds (commit, read, validation) while the others wait.
        self.between_seconds = 0.0
        self.commit_seconds = 0.0  # checkpoints written inside rounds
        self._round_end: float | None = None
        # Moving averages that size rank 0's share: a commit's seconds (the ledger's, which
        # the checkpoint schedule waits by too), sending the shares' seconds, a pair's learning
        # on rank 0 and on the slowest other rank.
        self.ledger.commit_seconds = self._scatter_seconds = 0.0
        self._pair_seconds = self._peer_pair_seconds = 0.0

    # -- the group -------------------------------------------------------------------------
    def _form(self) -> bool:
        """Publish a new generation and wait (up to the timeout) for every rank to join."""
        gen = self.rendezvous.publish(self.world)
        store = self.rendezvous.store(gen, self.timeout_s)
        store.add("claim/0", 1)
        log.info(
            "rank 0 of %s: forming generation %d of %d ranks on %s",
            self.model,
            gen,
            self.world,
            self.host,
        )
        try:
            with self.lease.heartbeat() as lost:
                group = RankGroup(store, 0, self.world, self.timeout_s, self.host)
        except (RuntimeError, ValueError) as exc:  # DistStoreError: a rank did not come
            log.warning("rank 0 of %s: generation %d not formed (%s)", self.model, gen, exc)
            return False
        if lost.is_set():
            group.close()
            return False
        self._group, self._merge, self._synced = group, RankMerge(group), False
        log.info("rank 0 of %s: %d ranks learning (generation %d)", self.model, self.world, gen)
        return True

    def _teardown(self, stop: bool = False) -> None:
        group, self._group, self._merge = self._group, None, None
        if group is None:
            return
        if stop:
            with contextlib.suppress(RuntimeError):  # the others may be gone already
                group.broadcast_ints(self._header(_STOP), self.world + 2)
        group.close()

    def _header(
        self, kind: int, sync: bool = False, split: bool = False, sizes: list[int] | None = None
    ) -> list[int]:
        """A round's header: kind, whether rank 0's state follows, whether shares follow, and
        each other rank's share size in bytes."""
        return [kind, int(sync), int(split), *(sizes or [0] * (self.world - 1))]

    def _drop_state(self) -> None:
        super()._drop_state()
        self._teardown()  # the others drop theirs and rejoin the next generation
        self._synced = False

    def _load(self) -> None:
        super()._load()
        self._synced = False

    def run(self, stop: threading.Event | None = None, until_idle: bool = False) -> None:
        try:
            super().run(stop, until_idle)
        finally:
            self._teardown(stop=True)

    def step(self) -> int:
        self._sent = False
        read = super().step()
        if not self._sent and self._group is not None:
            try:  # nothing to learn: keep the others' collectives from timing out
                self._group.broadcast_ints(self._header(_IDLE), self.world + 2)
            except RuntimeError as exc:
                log.warning("rank 0 of %s: a rank left (%s)", self.model, exc)
                self._drop_state()
        return read

    # -- one round -------------------------------------------------------------------------
    def _learn(self, pairs: list[Pair], pair_entries: list[str]) -> bool:
        """Learn one read as rounds of at most the model's ``merge_every`` pairs a rank; the
        read counts as applied only once every one of its rounds was merged."""
        if self.learner is None:
            self.learner = self._new_learner(pairs[0])
        model = mergeable(self.learner.model)
        step = ((model.merge_every if model is not None else None) or len(pairs)) * self.world
        for at in range(0, len(pairs), step):
            # Only the first round of a read may commit: the state after a later one holds
            # pairs of this read that the commit's acknowledgements and position do not cover.
            if not self._round(
                pairs[at : at + step], pair_entries[at : at + step], may_commit=at == 0
            ):
                return False
        return True

    def _round(self, pairs: list[Pair], pair_entries: list[str], may_commit: bool) -> bool:
        """One round: plan the shares, send them, commit the rounds before (while the others
        learn), learn rank 0's share, merge. False when the round failed and the state was
        dropped (it is replayed from the checkpoint)."""
        if self._group is None and not self._form():
            self._drop_state()
            return False
        self._sent = True
        if self._round_end is not None:
            self.between_seconds += time.perf_counter() - self._round_end
        if self.learner is None:  # cannot happen after _learn; never skip pairs silently
            self._drop_state()
            return False
        plan = self._plan(pairs, may_commit)
        try:
            with self.lease.heartbeat() as lost:
                self._send(plan)
                if plan.commit_now and not self._commit_in_round():
                    return False
                failed, learn_ms = self._learn_share(plan)
                if plan.split:
                    self._merge_split(plan, pair_entries, failed, learn_ms)
                else:
                    self._synced = False  # the others' copies are behind rank 0 now
                    if failed is not None:
                        self._drop_state()
                        raise EntryFailed(pair_entries[failed.index], str(failed.__cause__))
                self.rounds += 1
                self._round_end = time.perf_counter()
        except EntryFailed:
            raise
        except RuntimeError as exc:  # a collective failed: a rank died or hung
            log.warning(
                "rank 0 of %s: round failed (%s); state dropped, reloading", self.model, exc
            )
            self._drop_state()
            return False
        except BaseException:
            self._drop_state()
            raise
        if lost.is_set():
            log.warning("rank 0 of %s lost the lease during a round", self.model)
            self._drop_state()
            return False
        return True

    def _plan(self, pairs: list[Pair], may_commit: bool) -> _RoundPlan:
        """Who learns which pairs. The checkpoint of the rounds before this one is written
        while the others learn their shares, and rank 0's share is sized so that it finishes
        with them: smaller by what the commit and sending the shares cost it, and by the
        ranks' measured speeds."""
        assert self.learner is not None
        # No flush here: a round rank 0 learns alone must be the single learner's exact work.
        model = mergeable(self.learner.model)
        split = model is not None and model.merge_parts() is not None
        commit_now = may_commit and super()._checkpoint_due()  # the single learner's rule
        extra = self._scatter_seconds + (self.ledger.commit_seconds if commit_now else 0.0)
        first = balanced_first(
            len(pairs), self.world, self._pair_seconds, self._peer_pair_seconds, extra
        )
        shares = (
            split_share(len(pairs), self.world, first)
            if split
            else [(0, len(pairs))] + [(len(pairs), len(pairs))] * (self.world - 1)
        )
        labels = [p.labels for p in pairs]
        payloads = [encode_share(pairs[a:b], labels) if split else b"" for a, b in shares[1:]]
        return _RoundPlan(
            pairs, labels, shares, payloads, split, commit_now, sync=split and not self._synced
        )

    def _send(self, plan: _RoundPlan) -> None:
        """The round's header, rank 0's whole state when the others need it, their shares."""
        assert self._group is not None and self._merge is not None and self.learner is not None
        start = time.perf_counter()
        self._group.broadcast_ints(
            self._header(_ROUND, plan.sync, plan.split, [len(p) for p in plan.payloads]),
            self.world + 2,
        )
        if plan.sync:
            self._group.broadcast_bytes(encode_learner(self.learner, self.version, self.last_id))
            self._merge.reset(self.learner)
            self._synced = True
        for rank, payload in enumerate(plan.payloads, start=1):
            self._group.send_bytes(payload, rank)
        took = time.perf_counter() - start
        self.scatter_seconds += took
        if plan.split:
            self._scatter_seconds = _ema(self._scatter_seconds, took)

    def _commit_in_round(self) -> bool:
        """Checkpoint the rounds before this one; False when the commit lost the lease (the
        state and the group are dropped then)."""
        start = time.perf_counter()
        self.commit()
        if not self.leader:
            return False
        took = time.perf_counter() - start
        self.ledger.commit_seconds = _ema(self.ledger.commit_seconds, took)
        self.commit_seconds += took
        return True

    def _learn_share(self, plan: _RoundPlan) -> tuple[LearnFailed | None, int]:
        """Rank 0 learns its share; what failed (if anything) and the milliseconds it took."""
        assert self.learner is not None
        model = mergeable(self.learner.model)
        if plan.split and model is not None:
            model.register_labels(plan.labels)
        a, b = plan.shares[0]
        failed: LearnFailed | None = None
        start = time.perf_counter()
        try:
            self.learner.learn(plan.pairs[a:b])
        except LearnFailed as exc:
            failed = exc
        learn_ms = int(1000 * (time.perf_counter() - start))
        if b > a and failed is None:
            self._pair_seconds = _ema(self._pair_seconds, learn_ms / 1000 / (b - a))
        return failed, learn_ms

    def _merge_split(
        self, plan: _RoundPlan, pair_entries: list[str], failed: LearnFailed | None, learn_ms: int
    ) -> None:
        """Every rank's outcome and time, then the merge; a pair that failed on any rank is
        raised as :class:`EntryFailed` (every rank drops its state)."""
        assert self._group is not None and self._merge is not None and self.learner is not None
        start = time.perf_counter()
        status = [0] * (3 * self.world)
        status[2 * self.world] = learn_ms
        if failed is not None:
            status[0], status[self.world] = 1, failed.index + 1
        status = self._group.sum_ints(status)
        self.learn_seconds += learn_ms / 1000
        self.peer_learn_seconds += max(status[2 * self.world + 1 :]) / 1000
        shares = plan.shares
        peer = max(
            (
                status[2 * self.world + r] / 1000 / (shares[r][1] - shares[r][0])
                for r in range(1, self.world)
                if shares[r][1] > shares[r][0]
            ),
            default=0.0,
        )
        if peer:
            self._peer_pair_seconds = _ema(self._peer_pair_seconds, peer)
        bad = [r for r in range(self.world) if status[r]]
        if bad:
            rank = bad[0]
            index = shares[rank][0] + status[self.world + rank] - 1
            detail = (
                str(failed.__cause__)
                if rank == 0 and failed is not None
                else f"learning raised on rank {rank}"
            )
            self._drop_state()
            raise EntryFailed(pair_entries[index], detail)
        a, b = shares[0]
        report = self._merge.merge(self.learner, b - a)
        self.collective_seconds += time.perf_counter() - start
        self.merge_bytes = report.bytes
        self.split_rounds += 1

    def _checkpoint_due(self) -> bool:
        # After a round the next round commits (inside it); an idle step commits here.
        return not self._sent and super()._checkpoint_due()

    def _stats_fields(self) -> dict[str, str]:
        fields = super()._stats_fields()
        fields.update(
            {
                "dist_world": str(self.world),
                "dist_rounds": str(self.rounds),
                "dist_split_rounds": str(self.split_rounds),
                "dist_collective_seconds": repr(self.collective_seconds),
                "dist_scatter_seconds": repr(self.scatter_seconds),
                "dist_merge_bytes": str(self.merge_bytes),
                "dist_learn_seconds": repr(self.learn_seconds),
                "dist_peer_learn_seconds": repr(self.peer_learn_seconds),
                "dist_between_seconds": repr(self.between_seconds),
                "dist_commit_seconds": repr(self.commit_seconds),
            }
        )
        return fields


@dataclass(frozen=True)
class _RoundPlan:
    """One round's pairs, their labels (every rank numbers classes alike), each rank's
    ``[start, stop)`` share and the encoded shares of the others; whether the round is split,
    commits the rounds before it, and sends rank 0's whole state first."""

    pairs: list[Pair]
    labels: list[tuple[int, ...]]
    shares: list[tuple[int, int]]
    payloads: list[bytes]
    split: bool
    commit_now: bool
    sync: bool


def _ema(previous: float, value: float, rate: float = 0.3) -> float:
    return value if not previous else (1 - rate) * previous + rate * value


class _Reform(Exception):
    """Rank 0 ended the generation (it stopped or lost its state)."""


class RankFollower:
    """Rank ``rank`` > 0 of a distributed learner of ``model``: joins rank 0's process group
    through Redis and learns the shares it is sent, until ``stop``."""

    def __init__(
        self,
        client: redis.Redis,
        model: str,
        rank: int,
        world: int,
        namespace: str = "default",
        timeout_s: float = 60.0,
        host: str = "127.0.0.1",
    ) -> None:
        if not 0 < rank < world:
            raise ValueError(f"a following rank is in 1..{world - 1}, got {rank}")
        self.model, self.rank, self.world = model, rank, world
        self.timeout_s, self.host = timeout_s, host
        self.rendezvous = Rendezvous(client, Keys(namespace), model)
        self.learner: StreamLearner | None = None
        self.rounds = 0

    def _join(self, stop: threading.Event, after: int) -> tuple[RankGroup, int] | None:
        """Join the newest generation after ``after`` whose rank slot is free."""
        while not stop.is_set():
            current = self.rendezvous.current()
            if current is None or current[0] <= after:
                stop.wait(0.2)
                continue
            gen, world = current
            if world != self.world:
                log.error(
                    "rank %d of %s: rank 0 runs %d ranks, this one was started for %d",
                    self.rank,
                    self.model,
                    world,
                    self.world,
                )
                stop.wait(1.0)
                continue
            try:
                store = self.rendezvous.store(gen, self.timeout_s)
                if store.add(f"claim/{self.rank}", 1) != 1:
                    after = gen  # formed before this rank left: wait for the next one
                    continue
                group = RankGroup(store, self.rank, self.world, self.timeout_s, self.host)
            except (RuntimeError, ValueError, OSError) as exc:
                log.warning(
                    "rank %d of %s: joining generation %d failed (%s)",
                    self.rank,
                    self.model,
                    gen,
                    exc,
                )
                after = gen
                continue
            log.info("rank %d of %s joined generation %d", self.rank, self.model, gen)
            return group, gen
        return None

    def run(self, stop: threading.Event | None = None) -> None:
        stop = stop or threading.Event()
        after = 0
        while not stop.is_set():
            try:
                joined = self._join(stop, after)
            except redis.RedisError as exc:
                log.warning("rank %d of %s: Redis unavailable (%s)", self.rank, self.model, exc)
                stop.wait(1.0)
                continue
            if joined is None:
                return
            group, after = joined
            try:
                self._follow(group, stop)
            except (_Reform, RuntimeError) as exc:
                log.warning(
                    "rank %d of %s: generation %d ended (%s); state dropped",
                    self.rank,
                    self.model,
                    after,
                    exc or "rank 0 stopped",
                )
            finally:
                self.learner = None
                group.close()

    def _follow(self, group: RankGroup, stop: threading.Event) -> None:
        merge = RankMerge(group)
        while not stop.is_set():
            kind, sync, split, *sizes = group.broadcast_ints(None, self.world + 2)
            if kind == _STOP:
                raise _Reform()
            if kind == _IDLE:
                continue
            if sync:
                self.learner = decode_learner(group.broadcast_bytes(None))
                if self.learner is not None:
                    # Rank 0's RNG state came along: draw this rank's triplets apart from it.
                    self.learner.rng = np.random.default_rng(
                        [self.learner.seed, self.rank, self.learner.pairs_seen]
                    )
                    merge.reset(self.learner)
            if not split:
                continue
            body = group.recv_bytes(sizes[self.rank - 1])
            if self.learner is None:
                raise RuntimeError("a split round before rank 0's state")
            pairs, labels = decode_share(body, self.learner.img_dim, self.learner.txt_dim)
            model = mergeable(self.learner.model)
            if model is not None:  # a split round: rank 0 split it, so the model merges
                model.register_labels(labels)
            status = [0] * (3 * self.world)
            start = time.perf_counter()
            try:
                self.learner.learn(pairs)
            except LearnFailed as exc:
                log.error("rank %d of %s: learning failed: %s", self.rank, self.model, exc)
                status[self.rank], status[self.world + self.rank] = 1, exc.index + 1
            status[2 * self.world + self.rank] = int(1000 * (time.perf_counter() - start))
            if any(group.sum_ints(status)[: self.world]):
                raise _Reform("learning failed on a rank")
            merge.merge(self.learner, len(pairs))
            self.rounds += 1
