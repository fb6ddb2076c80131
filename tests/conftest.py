"""Fixtures: a real redis-server (the embedded binary) for the whole session, a namespace per
test, and helpers to run the worker and the API for real."""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import threading
import time
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import numpy as np
import pytest
import redis
from numpy.typing import NDArray

from streamxm.config import Settings
from streamxm.learning.stream_learner import StreamLearner
from streamxm.models import CrossModalModel
from streamxm.service import build_worker, open_store
from streamxm.serving.httpserver import server_options
from streamxm.stream.keys import Keys
from streamxm.stream.messages import Pair, make_pair
from streamxm.stream.producer import StreamProducer
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


def local_settings(redis_url: str, namespace: str, tmp_path: Path, **changes: Any) -> Settings:
    """A test's settings: its own data folder under ``tmp_path``, checkpoints every 0.2 s,
    50 ms reads and a 1 s lease (so a killed worker's successor takes over quickly), and no
    ``.env`` file; ``changes`` set other fields or replace these."""
    fields: dict[str, Any] = {
        "redis_url": redis_url,
        "namespace": namespace,
        "data_dir": tmp_path / "data",
        "checkpoint_every_seconds": 0.2,
        "block_ms": 50,
        "lease_ttl_ms": 1000,
        **changes,
    }
    return Settings(_env_file=None, **fields)  # type: ignore[call-arg]


@pytest.fixture
def settings(redis_url: str, namespace: str, tmp_path: Path) -> Settings:
    return local_settings(redis_url, namespace, tmp_path, checkpoint_dir=tmp_path / "ckpt")


def checkpoints_every(settings: Settings, pairs: int, **changes: Any) -> Settings:
    """``settings`` with a checkpoint every ``pairs`` pairs and none held back after a slow
    write (``checkpoint_max_share`` 1), so a test knows where they fall; ``changes`` set more."""
    return settings.model_copy(
        update={"checkpoint_every_pairs": pairs, "checkpoint_max_share": 1.0, **changes}
    )


@pytest.fixture
def r(settings: Settings) -> redis.Redis:
    return connect(settings)


@pytest.fixture
def keys(settings: Settings) -> Keys:
    """The keys of the test's namespace."""
    return Keys(settings.namespace)


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


def run_cli(
    *args: str,
    env: dict[str, str] | None = None,
    timeout: float | None = 60,
    cwd: Path | None = None,
) -> subprocess.CompletedProcess[str]:
    """``streamxm ARGS`` as a child process, as a user runs it; its output captured as text
    (``env`` None: this process's environment; ``timeout`` None: no limit)."""
    return subprocess.run(
        [*PY, *args], env=env, capture_output=True, text=True, timeout=timeout, cwd=cwd
    )


def cli_json(
    *args: str, env: dict[str, str] | None = None, timeout: float = 60, cwd: Path | None = None
) -> Any:
    """What ``streamxm ARGS`` printed as JSON; the command must succeed."""
    out = run_cli(*args, env=env, timeout=timeout, cwd=cwd)
    assert out.returncode == 0, out.stderr[-3000:]
    return json.loads(out.stdout)


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

    def wait_ready(self) -> None:
        """Until ``/readyz`` answers 200: a model is loaded and served."""
        wait_for(lambda: httpx.get(f"{self.url}/readyz").status_code == 200, 30, "ready")


def serve_cmos(r: redis.Redis, settings: Settings, n: int = 200) -> None:
    """``n`` labelled pairs (8 + 4 dimensions) pushed and learned by CMOS to a checkpoint: a
    model and a gallery for an API to serve."""
    StreamProducer(r, settings.namespace).push_pairs(class_stream(n, 8, 4, seed=1))
    build_worker(settings, r, "cmos").run(until_idle=True)


@pytest.fixture
def api(r: redis.Redis, settings: Settings) -> Iterator[ApiServer]:
    """The real API, ready, serving the CMOS model of :func:`serve_cmos`."""
    serve_cmos(r, settings)
    with ApiServer(settings) as server:
        server.wait_ready()
        yield server


def wait_gallery_items(http: httpx.Client, n: int, what: str, timeout: float = 30) -> None:
    """Until the first model the API lists serves a gallery of ``n`` items."""
    wait_for(
        lambda: http.get("/v1/models").json()["models"][0]["gallery_items"] == n, timeout, what
    )


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


def save_benchmark(
    path: Path,
    train: tuple[NDArray[Any], NDArray[Any], NDArray[Any]],
    test: tuple[NDArray[Any], NDArray[Any], NDArray[Any]],
) -> Path:
    """A benchmark file as ``load_dataset`` reads it: each split's images, texts and labels."""
    views = ("img", "txt", "y")
    splits = {"train": train, "test": test}
    np.savez(
        path,
        **{
            f"{view}_{split}": array
            for split, arrays in splits.items()
            for view, array in zip(views, arrays, strict=True)
        },
    )
    return path


def three_class_benchmark(path: Path, seed: int, n: int, n_train: int) -> Path:
    """A small benchmark of three well separated classes (8-d images, 5-d texts leaning to the
    same per-class centre), the first ``n_train`` of its ``n`` rows the training split."""
    rng = np.random.default_rng(seed)
    centres = rng.normal(size=(3, 8))
    y = rng.integers(3, size=n)
    img = centres[y] + 0.5 * rng.normal(size=(n, 8))
    txt = centres[y, :5] + 0.5 * rng.normal(size=(n, 5))
    return save_benchmark(
        path,
        (img[:n_train], txt[:n_train], y[:n_train]),
        (img[n_train:], txt[n_train:], y[n_train:]),
    )


def whole_and_cut(
    model: str,
    img_dim: int,
    txt_dim: int,
    params: dict[str, Any],
    pairs: list[Pair],
    cut: int,
    seed: int,
) -> tuple[StreamLearner, StreamLearner]:
    """Two learners of ``model`` made alike: one has learned every pair, the other the pairs
    before ``cut`` (its state is the checkpoint a test resumes from)."""
    whole = StreamLearner(model, img_dim, txt_dim, params, seed=seed)
    whole.learn(pairs)
    first = StreamLearner(model, img_dim, txt_dim, params, seed=seed)
    first.learn(pairs[:cut])
    return whole, first


def assert_same_scores(
    got: CrossModalModel, want: CrossModalModel, img_dim: int, txt_dim: int
) -> tuple[NDArray[np.float64], NDArray[np.float64]]:
    """The two models score fixed random probes (5 images, 7 texts) the same to the bit;
    returns the probes."""
    probe_i = np.random.default_rng(0).random((5, img_dim))
    probe_t = np.random.default_rng(1).random((7, txt_dim))
    assert np.array_equal(got.similarity(probe_i, probe_t), want.similarity(probe_i, probe_t))
    return probe_i, probe_t


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


def latest(settings: Settings, r: redis.Redis, model: str = "cmos") -> StreamLearner:
    """The learner of ``model``'s newest checkpoint (there must be one)."""
    ckpt = open_store(settings, r).load_latest(model)
    assert ckpt is not None
    return StreamLearner.from_state(ckpt.arrays, ckpt.meta)


def WorkerProcess(env: dict[str, str], model: str = "cmos") -> Child:
    """``streamxm worker`` as a child process whose output is watched (fail points, leases)."""
    return Child("worker", "--model", model, env=env, watch=True)


def push_slowly(
    client: StreamProducer, pairs: list[Pair], chunk: int = 100, pause: float = 0.02
) -> threading.Thread:
    """``pairs`` pushed from a thread, ``chunk`` at a time with ``pause`` s between: a stream
    that goes on arriving while workers are killed."""

    def run() -> None:
        for start in range(0, len(pairs), chunk):
            client.push_pairs(pairs[start : start + chunk])
            time.sleep(pause)

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    return thread


def kill_at_progress(
    env: dict[str, str],
    r: redis.Redis,
    keys: Keys,
    learned: int,
    rng: np.random.Generator,
    most_delay: float,
    what: str,
) -> None:
    """A worker SIGKILLed once ``learned`` pairs are learned, after a random delay of up to
    ``most_delay`` s (so in the middle of a batch)."""
    worker = WorkerProcess(env)
    wait_for(lambda: processed(r, keys) >= learned, 60, what)
    time.sleep(float(rng.uniform(0, most_delay)))
    worker.kill()


def frozen_worker(env: dict[str, str], point: str, what: str) -> Child:
    """A worker paused (for 30 s) at the fail point ``point``, once it is there."""
    worker = WorkerProcess({**env, "STREAMXM_FAULT_PAUSE": f"{point}:30"})
    wait_for(lambda: worker.saw("fail point"), 60, what)
    return worker


@contextlib.contextmanager
def last_worker(env: dict[str, str], r: redis.Redis, keys: Keys, n: int) -> Iterator[Child]:
    """After the kills, a worker that learns the stream's ``n`` pairs (the ``with`` body waits
    for what else must follow) and then exits cleanly."""
    final = WorkerProcess(env)
    try:
        wait_for(lambda: processed(r, keys) == n, 120, "all pairs")
        yield final
    finally:
        assert final.stop() == 0, final.tail()
