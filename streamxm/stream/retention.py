"""Stream retention: trim the pairs stream to the oldest entry anything still needs.

What needs an entry (``docs/design.md``, "Retention"):

- every model's learner: the entries after the ``last_id`` of its *oldest kept* checkpoint (a
  restarted learner replays from its newest; the oldest kept one bounds a rollback), its
  group's pending entries and the entries not yet delivered to its group;
- the search gallery: with a gallery indexer, the entries after the position its segments
  cover (the manifest's ``last_id``); without one, the newest ``gallery_keep`` entries, which an
  API replica starting now reads to build its gallery.

Anything older is trimmed with ``XTRIM MINID``. The bound is computed from state that only moves
forward (checkpoints, acknowledgements, deliveries, the stream's end), so a bound computed a
moment ago is still safe when the trim runs, whichever process runs it and however many do.
A registered model without a consumer group or without a checkpoint needs everything, and
then nothing is trimmed. Every worker trims after each checkpoint it commits.
"""

from __future__ import annotations

import logging
import time

import redis

from streamxm.faults import pause_point
from streamxm.stream.keys import Keys
from streamxm.stream.redis_conn import str_hash, str_set, text

__all__ = ["BEFORE_TRIM", "entry_id_key", "retention_bound", "trim_stream"]

log = logging.getLogger(__name__)

#: Fail point between computing the bound and trimming (fault tests kill a worker there).
BEFORE_TRIM = "retention.before_trim"
#: Entries read per call to find the gallery's bound: the trim catches up by this many per call.
_GALLERY_SCAN = 2000


def entry_id_key(entry_id: str) -> tuple[int, int]:
    """Stream ids compare as ``(milliseconds, sequence)``.

    >>> entry_id_key("1700000000000-3") < entry_id_key("1700000000001-0")
    True
    """
    ms, _, seq = entry_id.partition("-")
    return int(ms), int(seq or 0)


def _model_bounds(r: redis.Redis, keys: Keys) -> list[str] | None:
    groups = {text(g["name"]): g for g in r.xinfo_groups(keys.pairs)}
    bounds = []
    for model in str_set(r.smembers(keys.models)):
        group = groups.get(keys.group(model))
        head = str_hash(r.hgetall(keys.checkpoint_head(model)))
        if group is None or not head.get("kept_from"):
            return None  # this learner would replay from the start
        bounds.append(head["kept_from"])
        bounds.append(text(group["last-delivered-id"]))
        pending = r.xpending(keys.pairs, keys.group(model))
        if pending["pending"]:
            bounds.append(text(pending["min"]))
    return bounds


def retention_bound(r: redis.Redis, keys: Keys, gallery_keep: int) -> str | None:
    """The oldest entry id still needed, or ``None`` when nothing may be trimmed now."""
    indexed = r.hget(keys.gallery, "last_id")
    if indexed is None:  # no gallery indexer: API replicas build the gallery from the stream
        excess = int(r.xlen(keys.pairs)) - gallery_keep
        if excess <= 0:
            return None
    bounds = _model_bounds(r, keys)
    if bounds is None:
        return None
    if indexed is not None:  # the segments hold the gallery up to this entry
        bounds.append(text(indexed))
    else:  # the first entry the gallery keeps, or (when far behind) _GALLERY_SCAN entries in
        scan = r.xrange(keys.pairs, "-", "+", count=min(excess, _GALLERY_SCAN) + 1) or []
        if not scan:
            return None
        bounds.append(text(scan[-1][0]))
    return min(bounds, key=entry_id_key)


def trim_stream(r: redis.Redis, keys: Keys, gallery_keep: int) -> int:
    """Trim the pairs stream to :func:`retention_bound`; the number of entries removed.

    Records the trim in ``keys.retention`` (``trimmed_to``, ``trimmed_total``, ``trimmed_at``)
    for the metrics."""
    bound = retention_bound(r, keys, gallery_keep)
    if bound is None:
        return 0
    pause_point(BEFORE_TRIM)
    # Approximate (``MINID ~``): whole radix-tree nodes only, so up to a node's entries (100 by
    # default) more than needed may stay; never fewer, and far cheaper than exact trimming.
    removed = int(r.xtrim(keys.pairs, minid=bound, approximate=True))
    if removed:
        with r.pipeline(transaction=True) as pipe:
            pipe.hset(keys.retention, mapping={"trimmed_to": bound, "trimmed_at": time.time()})
            pipe.hincrby(keys.retention, "trimmed_total", removed)
            pipe.execute()
        log.debug("trimmed %d entries of %s, to %s", removed, keys.pairs, bound)
    return removed
