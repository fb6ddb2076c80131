"""Issue 22: data under the untagged key names (``sxm:<ns>:...``, before hash tags) is refused
by workers and migrated by ``streamxm migrate-keys``, after which learning continues exactly."""

from __future__ import annotations

import json
import subprocess

import pytest
import redis

from streamxm.config import Settings
from streamxm.service import build_indexer, build_worker
from streamxm.stream.keys import Keys
from streamxm.stream.migrate import LegacyKeys, MigrationConflict, migrate_keys
from streamxm.stream.producer import StreamProducer
from streamxm.stream.redis_conn import text
from tests.conftest import PY, assert_same_learner, class_stream, latest, reference, worker_env


def _to_legacy(r: redis.Redis, keys: Keys) -> list[str]:
    """Rename the namespace's keys to the untagged names data had before hash tags."""
    names = sorted(text(k) for k in r.scan_iter(match=f"{keys.prefix}:*"))
    for name in names:
        r.rename(name, keys.legacy_prefix + name[len(keys.prefix) :])
    return names


def test_legacy_keys_are_refused_then_migrated_and_learning_goes_on(
    r: redis.Redis, settings: Settings
) -> None:
    keys = Keys(settings.namespace)
    pairs = class_stream(300, 12, 6, seed=8)
    StreamProducer(r, settings.namespace).push_pairs(pairs[:150])
    build_worker(settings, r, "cmos").run(until_idle=True)
    tagged = _to_legacy(r, keys)
    assert "sxm:{" + settings.namespace + "}:pairs" in tagged
    assert r.exists(f"sxm:{settings.namespace}:pairs") and not r.exists(keys.pairs)

    with pytest.raises(LegacyKeys, match="migrate-keys"):
        build_worker(settings, r, "cmos").run(until_idle=True)
    with pytest.raises(LegacyKeys):
        build_indexer(settings, r).run(until_idle=True)
    with pytest.raises(LegacyKeys):  # a producer too: it would start the namespace afresh
        StreamProducer(r, settings.namespace).push_pairs(pairs[150:])
    assert not r.exists(keys.models) and not r.exists(keys.schema)  # nothing written
    env = worker_env(settings)
    refused = subprocess.run(
        [*PY, "worker", "--model", "cmos"], env=env, capture_output=True, text=True, timeout=60
    )
    assert refused.returncode == 2 and "migrate-keys" in refused.stderr

    dry = subprocess.run(
        [*PY, "migrate-keys", "--dry-run"],
        env=env,
        capture_output=True,
        text=True,
        timeout=60,
        check=True,
    )
    assert json.loads(dry.stdout)["keys"] == tagged and not r.exists(keys.pairs)
    done = subprocess.run(
        [*PY, "migrate-keys"], env=env, capture_output=True, text=True, timeout=60, check=True
    )
    assert json.loads(done.stdout)["renamed"] == len(tagged)
    assert sorted(text(k) for k in r.scan_iter(match=f"{keys.prefix}:*")) == tagged
    assert not list(r.scan_iter(match=f"{keys.legacy_prefix}:*"))

    # The stream kept its consumer group and position: the rest is learned once, exactly.
    StreamProducer(r, settings.namespace).push_pairs(pairs[150:])
    build_worker(settings, r, "cmos").run(until_idle=True)
    assert_same_learner(latest(settings, r), reference(pairs))


def test_a_migration_never_overwrites_a_key_under_the_new_name(
    r: redis.Redis, settings: Settings
) -> None:
    keys = Keys(settings.namespace)
    StreamProducer(r, settings.namespace).push_pairs(class_stream(5, 4, 2, seed=1))
    _to_legacy(r, keys)
    r.set(keys.schema, "taken")
    with pytest.raises(MigrationConflict, match="nothing was renamed"):
        migrate_keys(r, keys)
    with pytest.raises(ValueError, match="not a namespace"):  # a glob would match every one
        migrate_keys(r, Keys("*"))
    assert r.exists(f"{keys.legacy_prefix}:pairs") and not r.exists(keys.pairs)
