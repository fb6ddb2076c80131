"""Every ``streamxm bench`` JSON line carries the ``machine`` it ran on."""

from __future__ import annotations

import argparse
import ast
import importlib
import inspect
import json
import os
import subprocess
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from streamxm import cli
from streamxm.tools.machine import ENV_VARS, FLAGS, cpuinfo, machine, with_machine
from tests.conftest import PY

KEYS = {
    "cpu",
    "logical_cpus",
    "usable_cpus",
    "affinity",
    "flags",
    "blas",
    "env",
    "torch",
    "torch_cpu_capability",
    "scan_backend",
    "python",
    "numpy",
    "platform",
}
CPUINFO = Path("/proc/cpuinfo")


def _bench_parsers() -> dict[str, argparse.ArgumentParser]:
    """``streamxm bench``'s subcommands, as the console script parses them."""

    def subcommands(parser: argparse.ArgumentParser) -> dict[str, argparse.ArgumentParser]:
        actions = [a for a in parser._actions if isinstance(a, argparse._SubParsersAction)]
        return dict(actions[0].choices)

    return subcommands(subcommands(cli.build_parser())["bench"])


BENCHES = sorted(_bench_parsers())


def _proc_flags() -> set[str]:
    for line in CPUINFO.read_text().splitlines():
        if line.startswith("flags"):
            return set(line.split(":", 1)[1].split())
    raise AssertionError("no flags line in /proc/cpuinfo")


def test_machine_has_its_keys_with_their_types() -> None:
    found = machine()
    assert set(found) == KEYS
    assert isinstance(found["cpu"], str) and found["cpu"]
    assert isinstance(found["logical_cpus"], int) and found["logical_cpus"] >= 1
    assert found["usable_cpus"] == len(os.sched_getaffinity(0)) <= found["logical_cpus"]
    assert isinstance(found["affinity"], str)
    assert set(found["flags"]) == {*FLAGS, "amx"}
    assert all(isinstance(v, bool) for v in found["flags"].values())
    # numpy's own BLAS is loaded: threadpoolctl reports its kernels and pool.
    assert found["blas"], "no BLAS library found"
    for lib in found["blas"]:
        assert {"internal_api", "version", "architecture", "num_threads"} <= set(lib)
        assert isinstance(lib["internal_api"], str) and isinstance(lib["num_threads"], int)
    assert found["env"] == {var: os.environ.get(var) for var in ENV_VARS}
    assert found["scan_backend"] in ("int8", "bfloat16", "float32")
    assert found["numpy"] == np.__version__ and found["python"].count(".") == 2
    try:
        import torch
    except ImportError:
        assert found["torch"] is None and found["torch_cpu_capability"] is None
        assert found["scan_backend"] == "float32"
    else:
        assert found["torch"] == str(torch.__version__)
        assert found["torch_cpu_capability"] == torch.backends.cpu.get_cpu_capability()
    json.dumps(found)  # JSON as it is


@pytest.mark.skipif(not CPUINFO.exists(), reason="no /proc/cpuinfo (not Linux)")
def test_flags_and_model_name_agree_with_proc_cpuinfo() -> None:
    flags = _proc_flags()
    found = machine()
    for name in FLAGS:
        assert found["flags"][name] == (name in flags), name
    assert found["flags"]["amx"] == bool(flags & {"amx_tile", "amx_bf16", "amx_int8"})
    names = [
        line.split(":", 1)[1].strip()
        for line in CPUINFO.read_text().splitlines()
        if line.startswith("model name")
    ]
    assert found["cpu"] == (names[0] if names else found["cpu"])


def test_cpuinfo_without_the_file_says_it_does_not_know(tmp_path: Path) -> None:
    assert cpuinfo(tmp_path / "absent") == (None, None)
    sample = tmp_path / "cpuinfo"
    sample.write_text(
        "processor\t: 0\nmodel name\t: Some CPU\nflags\t\t: fpu avx2 amx_int8\n\n"
        "processor\t: 1\nmodel name\t: Some CPU\nflags\t\t: fpu avx2 amx_int8\n"
    )
    assert cpuinfo(sample) == ("Some CPU", {"fpu", "avx2", "amx_int8"})


def test_with_machine_adds_it_and_keeps_the_result() -> None:
    result = {"benchmark": "x", "figure": 1.5}
    out = with_machine(result)
    assert out["benchmark"] == "x" and out["figure"] == 1.5 and set(out["machine"]) == KEYS
    assert "machine" not in result


def _run(*argv: str) -> dict[str, Any]:
    out = subprocess.run(
        [*PY, "bench", *argv, "--json"], capture_output=True, text=True, timeout=120
    )
    assert out.returncode == 0, out.stderr[-3000:]
    lines = out.stdout.strip().splitlines()
    assert len(lines) == 1, out.stdout[-2000:]  # one line of JSON
    result: dict[str, Any] = json.loads(lines[0])
    return result


def test_bench_scan_json_carries_the_machine() -> None:
    result = _run(
        "scan",
        "--rows",
        "2000",
        "--dims",
        "16,32",
        "--queries",
        "4",
        "--candidates",
        "10",
        "--repeats",
        "1",
    )
    assert result["benchmark"] == "scan" and set(result["machine"]) == KEYS
    found = result["machine"]
    # The backend it names is one the scan timed (int8 and bfloat16 only with PyTorch).
    assert found["scan_backend"] in result["dims"]["32"]
    assert found["env"] == {var: os.environ.get(var) for var in ENV_VARS}


def test_bench_throughput_json_carries_the_machine() -> None:
    result = _run(
        "throughput",
        "--model",
        "cmos",
        "--img-dim",
        "16",
        "--txt-dim",
        "8",
        "--pairs",
        "50",
        "--baseline-pairs",
        "10",
        "--repeats",
        "1",
    )
    assert result["pairs_per_s"] > 0 and set(result["machine"]) == KEYS
    assert result["machine"]["cpu"] == machine()["cpu"]


#: The function each benchmark outside ``cli._LOAD_BENCHES`` runs, and its required options.
_DIRECT: dict[str, tuple[str, str, list[str]]] = {
    "quality": ("streamxm.tools.bench", "quality", ["--dataset", "wiki", "--model", "cmos"]),
    "order": ("streamxm.tools.bench", "stream_order", ["--dataset", "wiki"]),
    "database": (
        "streamxm.tools.bench",
        "database_split",
        ["--dataset", "wiki", "--model", "sdsrl"],
    ),
    "throughput": ("streamxm.tools.throughput", "throughput", []),
    "distributed": ("streamxm.tools.bench_ranks", "distributed", []),
}


@pytest.mark.parametrize("name", BENCHES)
def test_every_bench_prints_its_json_with_the_machine(
    name: str, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """Each subcommand run as the console script runs it, its benchmark replaced by one that
    returns at once: the line printed is the benchmark's result plus ``machine``."""
    argv: list[str] = []
    if name in cli._LOAD_BENCHES:
        load = cli._LOAD_BENCHES[name]
        module, function = f"streamxm.tools.{load.module}", load.function
    else:
        assert name in _DIRECT, f"bench {name}: name the function it runs in _DIRECT"
        module, function, argv = _DIRECT[name]
    calls: list[dict[str, Any]] = []

    def bench(*args: Any, **kwargs: Any) -> dict[str, Any]:
        calls.append(kwargs)
        return {"benchmark": name, "figure": 1.0}

    monkeypatch.setattr(importlib.import_module(module), function, bench)
    assert cli.main(["bench", name, *argv, "--json"]) == 0
    assert len(calls) == 1, f"bench {name} did not run {module}.{function}"
    result = json.loads(capsys.readouterr().out)
    assert result["benchmark"] == name and result["figure"] == 1.0
    assert set(result["machine"]) == KEYS


def test_every_bench_command_prints_through_the_shared_helper() -> None:
    """Structurally: every bench subcommand's handler is a ``_cmd_bench_*`` function that
    prints JSON only through ``_print_bench``, and that helper adds the machine."""
    handlers = {name: parser.get_default("func") for name, parser in _bench_parsers().items()}
    tree = ast.parse(inspect.getsource(cli))
    functions = {node.name: node for node in ast.walk(tree) if isinstance(node, ast.FunctionDef)}
    for name, handler in handlers.items():
        assert handler is not None and handler.__name__.startswith("_cmd_bench_"), name
        calls = [
            node for node in ast.walk(functions[handler.__name__]) if isinstance(node, ast.Call)
        ]
        called = {ast.unparse(node.func) for node in calls}
        assert "json.dumps" not in called, f"{handler.__name__} prints JSON itself"
        assert "_print_bench" in called, f"{handler.__name__} does not use _print_bench"
    helper = {
        ast.unparse(node.func)
        for node in ast.walk(functions["_print_bench"])
        if isinstance(node, ast.Call)
    }
    assert "with_machine" in helper
