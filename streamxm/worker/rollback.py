"""Rolling a model back to a version its store still keeps.

``streamxm rollback --model NAME --to VERSION`` makes the kept version both the one the API
serves and the one the learner continues from:

1. The learner lease is taken from whoever holds it (a token of the rollback's own). The active
   worker's next lease refresh or commit fails, and it drops everything not checkpointed, as
   after any lost lease; its commit in flight, if any, fails on the lease's WATCH.
2. The kept version's state is committed as a *new* version (the head's version + 1), so
   versions only grow and every reader sees an ordinary new checkpoint; its stream position is
   the kept version's. The rollback is recorded in the model's history list
   (``Keys.history``) in the same transaction.
3. The lease is released. The next learner to take it loads the new version and replays the
   stream after its position, up to what the group has delivered, exactly as after a crash.

What happens to what was learned after the kept version: the pairs are not lost; they are
learned again, on top of the kept state, in stream order (retention keeps them: the stream is
trimmed only below the oldest kept version). For a deterministic learner with the same code and
settings that reproduces the same model; a rollback therefore pays off with a changed worker
(a fixed bug, other parameters) or when it is the version served meanwhile that matters.
"""

from __future__ import annotations

import json
import time
import uuid
from dataclasses import asdict, dataclass

import redis

from streamxm.learning.stream_learner import StreamLearner
from streamxm.storage.checkpoint import Checkpoint, CheckpointStore
from streamxm.stream.keys import Keys
from streamxm.worker.lease import RELEASE_LEASE

__all__ = ["HISTORY_MAX", "Rollback", "history", "rollback"]

HISTORY_MAX = 100  # events kept per model


@dataclass(frozen=True)
class Rollback:
    """What :func:`rollback` did."""

    model: str
    to_version: int
    from_version: int  # the head before
    new_version: int  # the kept state, committed again under this version
    replay_from: str  # stream position the learner continues after
    time: float


def rollback(
    client: redis.Redis,
    store: CheckpointStore,
    keys: Keys,
    model: str,
    to_version: int,
    lease_ms: int = 30_000,
) -> Rollback:
    """Make kept version ``to_version`` of ``model`` the newest (see the module docstring);
    :class:`~streamxm.storage.checkpoint.VersionNotKept` when the store does not keep it."""
    ckpt = store.load_kept(model, to_version)
    owner = f"rollback-{uuid.uuid4().hex[:12]}"
    lease_key = keys.lease(model)
    client.set(lease_key, owner, px=lease_ms)  # taken, not waited for: fences the learner
    try:
        head = store.head(model)
        assert head is not None  # it named to_version a moment ago; heads are never deleted
        learner = StreamLearner.from_state(ckpt.arrays, ckpt.meta)
        done = Rollback(
            model=model,
            to_version=to_version,
            from_version=int(head["version"]),
            new_version=int(head["version"]) + 1,
            replay_from=ckpt.last_id,
            time=time.time(),
        )
        again = Checkpoint(
            version=done.new_version, arrays=ckpt.arrays, meta=ckpt.meta, last_id=ckpt.last_id
        )

        def record(pipe: redis.client.Pipeline) -> None:
            pipe.lpush(keys.history(model), json.dumps({"event": "rollback", **asdict(done)}))
            pipe.ltrim(keys.history(model), 0, HISTORY_MAX - 1)

        store.commit(
            model,
            again,
            {"pairs_seen": learner.pairs_seen, "rolled_back_to": to_version},
            hook=record,
            lease=(lease_key, owner),
        )
    finally:
        client.eval(RELEASE_LEASE, 1, lease_key, owner)
    return done


def history(client: redis.Redis, keys: Keys, model: str) -> list[dict[str, object]]:
    """The model's recorded events, newest first."""
    return [json.loads(item) for item in client.lrange(keys.history(model), 0, -1)]
