"""Fixtures: a real redis-server (the embedded binary) for the whole session, a namespace per
test, and helpers to run the worker and the API for real."""

from __future__ import annotations

import contextlib
import os
import signal
import sys
import threading
import uuid
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest
import redis

from streamxm.config import Settings
from streamxm.learning.stream_learner import StreamLearner
from streamxm.models import CrossModalModel
from streamxm.service import open_store
from streamxm.serving.httpserver import server_options
from streamxm.stream.keys import Keys
from streamxm.stream.messages import Pair, make_pair
from streamxm.stream.redis_conn import EmbeddedRedis, connect, str_hash
from streamxm.threads import apply_threads
from streamxm.tools.processes import Child
from streamxm.tools.waiting import free_port, wait_for

# The suite computes as the service does (STREAMXM_THREADS, one thread per pool unless set), so
# it passes on a machine whose cores are shared; child processes inherit it.
apply_threads(int(os.environ.get("STREAMXM_THREADS", "1")))

ROOT = Path(__file__).resolve().parent.parent
SHARED_WIKI = ROOT.parent / "shared" / "datasets" / "wiki_sift128_lda10.npz"


def _servers_under(root: Path) -> list[tuple[int, str]]:
    """redis-server processes whose command line names a path under ``root``."""
    found = []
    for proc in Path("/proc").iterdir():
        if not proc.name.isdigit():
            continue
        try:
            cmdline = (proc / "cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
        except OSError:
            continue
        if "redis-server" in cmdline and str(root) in cmdline:
            found.append((int(proc.name), cmdline))
    return found


@pytest.fixture(scope="session", autouse=True)
def no_server_left_behind(tmp_path_factory: pytest.TempPathFactory) -> Iterator[None]:
    """Every test that starts a Redis server stops it: one left running fails the session."""
    root = tmp_path_factory.getbasetemp()
    yield
    left = [(pid, cmd) for pid, cmd in _servers_under(root) if str(root / "redis") not in cmd]
    for pid, _ in left:
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGTERM)
    assert not left, f"tests left redis-server processes running: {left}"


@pytest.fixture(scope="session")
def redis_url(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    """A system Redis from ``STREAMXM_TEST_REDIS_URL``, else the embedded server."""
    url = os.environ.get("STREAMXM_TEST_REDIS_URL")
    if url:
        yield url
        return
    server = EmbeddedRedis(tmp_path_factory.mktemp("redis"))
    yield server.start()
    server.stop()


@pytest.fixture
def namespace() -> str:
    return "t" + uuid.uuid4().hex[:10]


@pytest.fixture
def settings(redis_url: str, namespace: str, tmp_path: Path) -> Settings:
    return Settings(
        redis_url=redis_url,
        namespace=namespace,
        data_dir=tmp_path / "data",
        checkpoint_dir=tmp_path / "ckpt",
        checkpoint_every_seconds=0.2,
        block_ms=50,
        lease_ttl_ms=1000,
        _env_file=None,
    )  # type: ignore[call-arg]


@pytest.fixture
def r(settings: Settings) -> redis.Redis:
    return connect(settings)


def worker_env(settings: Settings, **extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("STREAMXM_")}
    env.update(
        STREAMXM_REDIS_URL=str(settings.redis_url),
        STREAMXM_NAMESPACE=settings.namespace,
        STREAMXM_BLOCK_MS="50",
        STREAMXM_LEASE_TTL_MS="1000",
    )
    env.update(extra)
    return env


PY = [sys.executable, "-m", "streamxm"]


class ApiServer:
    """The real app under uvicorn on a loopback port, in a thread."""

    def __init__(self, settings: Settings) -> None:
        import uvicorn

        from api.app import create_app

        self.port = free_port()
        self.app = create_app(settings)
        config = uvicorn.Config(
            self.app,
            host="127.0.0.1",
            port=self.port,
            log_level="warning",
            **server_options(settings),
        )
        self.server = uvicorn.Server(config)
        self.thread = threading.Thread(target=self.server.run, daemon=True)

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def __enter__(self) -> ApiServer:
        self.thread.start()
        wait_for(lambda: self.server.started, 20, "uvicorn to start")
        return self

    def __exit__(self, *exc: object) -> None:
        self.server.should_exit = True
        self.thread.join(timeout=10)


def metric(text: str, name: str, **labels: str) -> float | None:
    """The value of one sample in a Prometheus exposition (prometheus_client's own parser), or
    None if no sample of ``name`` carries ``labels``."""
    from prometheus_client.parser import text_string_to_metric_families

    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if sample.name == name and all(sample.labels.get(k) == v for k, v in labels.items()):
                return float(sample.value)
    return None


def class_stream(n: int, img_dim: int, txt_dim: int, seed: int, n_classes: int = 4) -> list[Pair]:
    """Labelled pairs whose two vectors both lean towards a per-class direction, plus noise."""
    rng = np.random.default_rng(seed)
    centers_v, centers_t = rng.random((n_classes, img_dim)), rng.random((n_classes, txt_dim))
    pairs = []
    for i in range(n):
        c = int(rng.integers(n_classes))
        pairs.append(
            make_pair(
                str(i),
                centers_v[c] + rng.random(img_dim),
                centers_t[c] + rng.random(txt_dim),
                labels=[c],
            )
        )
    return pairs


# -- shared by the fault, hardening and stream tests -------------------------------------------
IMG, TXT = 32, 16
# Timing and the drift detector's window are not model state (ADWIN's window is not
# checkpointed: no pickles); everything else must match bit for bit.
_NOT_STATE = {"update_seconds", "update_hist", "drift"}


def assert_same_learner(got: StreamLearner, want: StreamLearner) -> None:
    """Every state array bit for bit, and the JSON state apart from timing."""
    got.flush()
    want.flush()
    arrays_g, meta_g = got.state()
    arrays_w, meta_w = want.state()
    assert sorted(arrays_g) == sorted(arrays_w)
    for name in arrays_w:
        assert np.array_equal(arrays_g[name], arrays_w[name]), name
    strip = lambda m: {k: v for k, v in m.items() if k not in _NOT_STATE}  # noqa: E731
    assert strip(meta_g) == strip(meta_w)


def reference(pairs: list[Pair]) -> StreamLearner:
    learner = StreamLearner("cmos", pairs[0].img.shape[0], pairs[0].txt.shape[0], seed=0)
    learner.learn(pairs)
    return learner


def stats(r: redis.Redis, keys: Keys, model: str = "cmos") -> dict[str, str]:
    return str_hash(r.hgetall(keys.stats(model)))


def processed(r: redis.Redis, keys: Keys) -> int:
    return int(stats(r, keys).get("pairs_processed", 0))


def two_versions(
    name: str, pairs: list[Pair], params: dict[str, object], first: int, then: int
) -> tuple[CrossModalModel, CrossModalModel]:
    """Two checkpointed versions of one learner, as a server loads them: after ``pairs[:first]``
    and after ``then`` more."""
    learner = StreamLearner(name, len(pairs[0].img), len(pairs[0].txt), params, seed=0)
    versions = []
    for part in (pairs[:first], pairs[first : first + then]):
        learner.learn(part)
        learner.flush()
        versions.append(StreamLearner.from_state(*learner.state()).model)
    return versions[0], versions[1]


def latest(settings: Settings, r: redis.Redis) -> StreamLearner:
    ckpt = open_store(settings, r).load_latest("cmos")
    assert ckpt is not None
    return StreamLearner.from_state(ckpt.arrays, ckpt.meta)


def WorkerProcess(env: dict[str, str], model: str = "cmos") -> Child:
    """``streamxm worker`` as a child process whose output is watched (fail points, leases)."""
    return Child("worker", "--model", model, env=env, watch=True)
