"""The container's conditions without Docker: the package built as a wheel and installed into a
fresh virtual environment whose site-packages nobody may write, the worker, the indexer and the
API run as an unprivileged user (``nobody``) whose home cannot be written, from a working
directory it cannot write either; then pairs pushed through the API are learned and searched.

As root the processes run in a user namespace that maps ``nobody`` onto root's files without
root's capabilities (``unshare --user``), so they may read the build but write nothing that is
read-only, as ``nobody`` in the image may not. As any other user they run as that user.
"""

from __future__ import annotations

import os
import shutil
import stat
import subprocess
import sys
import sysconfig
from collections.abc import Iterator
from pathlib import Path

import httpx
import numpy as np
import pytest
import redis

from streamxm.client import Client, StreamxmError
from streamxm.config import Settings
from streamxm.stream.keys import Keys
from tests.conftest import ROOT, free_port, wait_for

pytestmark = pytest.mark.slow


def _read_only(tree: Path) -> None:
    for path in [tree, *tree.rglob("*")]:
        if not path.is_symlink():
            path.chmod(path.stat().st_mode & ~(stat.S_IWUSR | stat.S_IWGRP | stat.S_IWOTH))


def _unprivileged() -> list[str]:
    """The command prefix that runs a process as ``nobody`` without root's capabilities."""
    if os.geteuid() != 0:
        return []
    unshare = shutil.which("unshare")
    if unshare is None:
        pytest.skip("running as root without `unshare` to drop root's capabilities")
    probe = subprocess.run(
        [unshare, "--user", "--map-user=65534", "--map-group=65534", "id", "-u"],
        capture_output=True,
        text=True,
    )
    if probe.returncode != 0 or probe.stdout.strip() != "65534":
        pytest.skip(f"user namespaces are not available here: {probe.stderr.strip()}")
    return [unshare, "--user", "--map-user=65534", "--map-group=65534"]


@pytest.fixture(scope="module")
def installed_wheel(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A fresh venv with streamxm installed from a wheel, read-only; its dependencies are this
    venv's (a ``.pth`` line), so the test needs no network."""
    root = tmp_path_factory.mktemp("container")
    wheels = root / "wheels"
    # Built from a copy: a build in place leaves build/ in the checkout.
    source = root / "source"
    for name in ("pyproject.toml", "README.md"):
        source.mkdir(exist_ok=True)
        shutil.copy2(ROOT / name, source / name)
    for package in ("streamxm", "api", "workers"):
        shutil.copytree(
            ROOT / package, source / package, ignore=shutil.ignore_patterns("__pycache__", "*.pyc")
        )
    subprocess.run(
        [
            sys.executable,
            "-m",
            "pip",
            "wheel",
            "--quiet",
            "--no-deps",
            "--no-build-isolation",
            "--wheel-dir",
            str(wheels),
            str(source),
        ],
        check=True,
        cwd=root,
        timeout=300,
    )
    (wheel,) = wheels.glob("streamxm-*.whl")
    venv = root / "venv"
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(venv)], check=True)
    python = venv / "bin" / "python"
    subprocess.run(
        [
            sys.executable,
            "-m",
            "pip",
            "--python",
            str(python),
            "install",
            "--quiet",
            "--no-deps",
            str(wheel),
        ],
        check=True,
        timeout=300,
    )
    site = Path(
        subprocess.run(
            [str(python), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
            capture_output=True,
            text=True,
            check=True,
        ).stdout.strip()
    )
    (site / "dependencies.pth").write_text(sysconfig.get_paths()["purelib"] + "\n")
    _read_only(venv)
    return venv


@pytest.fixture
def home_and_workdir(tmp_path: Path) -> Iterator[tuple[Path, Path, Path]]:
    """An unwritable home, an unwritable working directory (the image's ``/app``), and the
    temporary directory the processes are given (a fresh one, so the test sees what they put
    there)."""
    home, workdir, tmp = tmp_path / "home", tmp_path / "app", tmp_path / "tmp"
    for path in (home, workdir, tmp):
        path.mkdir()
    home.chmod(0o555)
    workdir.chmod(0o555)
    tmp.chmod(0o1777)
    yield home, workdir, tmp
    for path in (home, workdir):
        path.chmod(0o755)


def test_worker_indexer_and_api_start_from_a_wheel_as_an_unprivileged_user(
    installed_wheel: Path,
    home_and_workdir: tuple[Path, Path, Path],
    settings: Settings,
    r: redis.Redis,
) -> None:
    home, workdir, tmp = home_and_workdir
    prefix = _unprivileged()
    python = installed_wheel / "bin" / "python"
    env = {
        "PATH": os.environ.get("PATH", "/usr/bin:/bin"),
        "HOME": str(home),
        "TMPDIR": str(tmp),
        "STREAMXM_REDIS_URL": str(settings.redis_url),
        "STREAMXM_NAMESPACE": settings.namespace,
        "STREAMXM_BLOCK_MS": "50",
        "STREAMXM_CHECKPOINT_EVERY_SECONDS": "0.2",
        "STREAMXM_THREADS": "1",
    }
    where = subprocess.run(
        [
            *prefix,
            str(python),
            "-c",
            "import streamxm, os; print(streamxm.__file__); print(os.getuid())",
        ],
        env=env,
        cwd=workdir,
        capture_output=True,
        text=True,
        check=True,
    )
    package, uid = where.stdout.split()
    assert package.startswith(str(installed_wheel)), "the wheel's package, not the checkout"
    assert os.geteuid() != 0 or uid == "65534"
    port = free_port()
    commands = {
        "worker": ["worker", "--model", "cmos"],
        "indexer": ["indexer"],
        "api": ["api", "--host", "127.0.0.1", "--port", str(port)],
    }
    logs = {name: open(tmp / f"{name}.log", "wb") for name in commands}  # noqa: SIM115
    procs = {
        name: subprocess.Popen(
            [*prefix, str(python), "-m", "streamxm", *args],
            env=env,
            cwd=workdir,
            stdout=logs[name],
            stderr=subprocess.STDOUT,
        )
        for name, args in commands.items()
    }

    def running() -> bool:
        for name, proc in procs.items():
            if proc.poll() is not None:
                logs[name].flush()
                tail = (tmp / f"{name}.log").read_text(errors="replace")[-3000:]
                raise AssertionError(f"{name} exited with {proc.returncode}:\n{tail}")
        return True

    try:
        rng = np.random.default_rng(0)
        pairs = [(f"pair-{i}", rng.random(16), rng.random(6), [i % 3]) for i in range(300)]
        with Client(f"http://127.0.0.1:{port}", timeout=10) as client:
            wait_for(
                lambda: running() and client.health(),
                120,
                "the API to answer",
                tolerate=(httpx.HTTPError, StreamxmError),
            )
            entry_ids = client.push(pairs)
            assert len(entry_ids) == len(pairs)
            wait_for(
                lambda: (
                    running() and client.models() and client.models()[0].pairs_seen == len(pairs)
                ),
                120,
                "the worker to learn every pair",
                tolerate=(StreamxmError,),
            )
            hits = client.search(pairs[7][1], modality="image", k=5)
            assert hits.model == "cmos" and len(hits.ids) == 5
            assert set(hits.ids) <= {p[0] for p in pairs}
        assert running()
    finally:
        for proc in procs.values():
            proc.terminate()
        for proc in procs.values():
            try:
                proc.wait(timeout=20)
            except subprocess.TimeoutExpired:
                proc.kill()
        for log in logs.values():
            log.close()
    output = {name: (tmp / f"{name}.log").read_text(errors="replace") for name in commands}
    for name, text in output.items():
        assert "cannot cache function" not in text, f"{name}: {text[-2000:]}"
        assert "Traceback" not in text, f"{name}: {text[-3000:]}"
    # numba keeps its compiled code in the user's own directory under TMPDIR, not in the home
    # or beside the read-only package.
    subprocess.run(
        [
            *prefix,
            str(python),
            "-c",
            "import numpy as np; "
            "from streamxm.models.optim import adagrad_step; "
            "adagrad_step(np.ones(3), np.zeros(3), np.ones(3), 0.1, 0.1)",
        ],
        env=env,
        cwd=workdir,
        check=True,
        timeout=120,
    )
    # The deploy documents' one way to push: `streamxm push` in a one-shot container.
    pushed = subprocess.run(
        [*prefix, str(python), "-m", "streamxm", "push", "--dataset", "wiki", "--limit", "40"],
        env={**env, "STREAMXM_NAMESPACE": settings.namespace + "-push"},
        cwd=workdir,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert pushed.returncode == 0, pushed.stderr[-3000:]
    assert r.xlen(Keys(settings.namespace + "-push").pairs) == 40
    cache = next(tmp.glob("streamxm-numba-*"))
    assert stat.S_IMODE(cache.stat().st_mode) == 0o700
    assert any(cache.rglob("*.nbi")), "numba's cache index under the fallback directory"
    assert not any(installed_wheel.rglob("*.nbi")) and not any(home.rglob("*"))


def test_the_fallback_cache_is_refused_when_others_could_have_written_it(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """numba's cache index is a pickle: a directory others may write is never used."""
    from streamxm.models.compiled import FALLBACK_CACHE_NAME, fallback_cache_dir

    monkeypatch.setenv("TMPDIR", str(tmp_path))
    monkeypatch.setattr("tempfile.tempdir", None)
    mine = fallback_cache_dir()
    assert mine == tmp_path / FALLBACK_CACHE_NAME.format(uid=os.getuid())
    assert stat.S_IMODE(mine.stat().st_mode) == 0o700
    mine.chmod(0o777)  # another user could have planted the index
    assert fallback_cache_dir() is None
    mine.rmdir()
    mine.symlink_to(tmp_path)  # a link to somewhere else
    assert fallback_cache_dir() is None
