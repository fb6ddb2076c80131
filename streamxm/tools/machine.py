"""The machine a benchmark ran on: the ``machine`` object of every ``streamxm bench`` JSON line.

Figures come from machines that differ in what decides them: one CPU has AVX-512 with VNNI and
BF16 and scans the search index in int8, another has AVX2 only and scans it in float32, and
``OPENBLAS_CORETYPE=Haswell`` keeps numpy's OpenBLAS on its AVX2 kernels even where the CPU has
AVX-512. :func:`machine` records those facts beside each result (:func:`with_machine`), so a
figure says where it came from.
"""

from __future__ import annotations

import os
import platform
import sys
from pathlib import Path
from typing import Any

import numpy as np
from threadpoolctl import threadpool_info

__all__ = ["ENV_VARS", "FLAGS", "cpuinfo", "machine", "with_machine"]

CPUINFO = Path("/proc/cpuinfo")
#: The instruction-set flags that decide which kernels run, as ``/proc/cpuinfo`` names them.
FLAGS = ("avx2", "avx512f", "avx512_vnni", "avx512_bf16")
#: Any of these is reported as ``amx``.
AMX_FLAGS = ("amx_tile", "amx_bf16", "amx_int8")
#: Environment variables that choose BLAS kernels, reported as set (``None`` where unset).
ENV_VARS = ("OPENBLAS_CORETYPE", "OPENBLAS_L2_SIZE")


def cpuinfo(path: Path = CPUINFO) -> tuple[str | None, set[str] | None]:
    """The first processor's model name and flags in ``/proc/cpuinfo``; ``None`` for what it
    does not say (or where there is no such file: not Linux)."""
    try:
        text = path.read_text()
    except OSError:
        return None, None
    name: str | None = None
    flags: set[str] | None = None
    for line in text.splitlines():
        key, sep, value = line.partition(":")
        if not sep:
            continue
        key = key.strip()
        if key == "model name" and name is None:
            name = value.strip()
        elif key == "flags" and flags is None:
            flags = set(value.split())
    return name, flags


def _flags(flags: set[str] | None) -> dict[str, bool | None]:
    """The flags that matter as booleans (all ``None`` where the CPU's flags are unknown)."""
    if flags is None:
        return {name: None for name in (*FLAGS, "amx")}
    found: dict[str, bool | None] = {name: name in flags for name in FLAGS}
    found["amx"] = any(name in flags for name in AMX_FLAGS)
    return found


def _ranges(cpus: set[int]) -> str:
    """``{0, 1, 2, 5}`` -> ``"0-2,5"`` (as ``taskset -c`` and ``/sys`` write CPU lists)."""
    runs: list[list[int]] = []
    for cpu in sorted(cpus):
        if runs and cpu == runs[-1][1] + 1:
            runs[-1][1] = cpu
        else:
            runs.append([cpu, cpu])
    return ",".join(str(a) if a == b else f"{a}-{b}" for a, b in runs)


def _blas() -> list[dict[str, Any]]:
    """The BLAS libraries loaded in this process, as threadpoolctl finds them (numpy's is loaded
    by the import above): their kernel architecture and thread pool size now."""
    return [
        {
            "internal_api": info.get("internal_api"),
            "prefix": info.get("prefix"),
            "version": info.get("version"),
            "architecture": info.get("architecture"),
            "threading_layer": info.get("threading_layer"),
            "num_threads": info.get("num_threads"),
        }
        for info in threadpool_info()
        if info.get("user_api") == "blas"
    ]


def _torch() -> tuple[str | None, str | None]:
    """PyTorch's version and CPU capability (the widest kernels it dispatches to: ``AVX512``,
    ``AVX2``, ...), or ``None`` where it is not installed or cannot tell."""
    from streamxm.serving.index import torch  # imports PyTorch only if it is installed

    if torch is None:
        return None, None
    try:
        capability = str(torch.backends.cpu.get_cpu_capability())
    except (AttributeError, RuntimeError):  # an older PyTorch without the probe
        capability = None
    return str(torch.__version__), capability


def _scan_backend() -> str:
    """The precision the search's candidate scan uses here: what
    :func:`~streamxm.serving.index.index_block` makes of rows when it chooses (``"auto"``)."""
    from streamxm.serving.index import Bf16Block, Int8Block, index_block

    block = index_block(np.eye(1, 64, dtype=np.float32))
    if isinstance(block, Int8Block):
        return "int8"
    if isinstance(block, Bf16Block):
        return "bfloat16"
    return "float32"


def machine() -> dict[str, Any]:
    """What decides a benchmark's figures on this machine, as one JSON-ready object.

    - ``cpu``: the model name in ``/proc/cpuinfo`` (``platform.processor()`` elsewhere);
      ``logical_cpus``: ``os.cpu_count()``; ``usable_cpus`` and ``affinity``: the CPUs this
      process may run on (``os.sched_getaffinity``; a container or ``taskset`` narrows them),
      their count and list (``"0-3"``).
    - ``flags``: ``avx2``, ``avx512f``, ``avx512_vnni``, ``avx512_bf16`` and ``amx`` (any of
      ``amx_tile``, ``amx_bf16``, ``amx_int8``) as booleans, ``None`` where unknown.
    - ``blas``: each loaded BLAS library (threadpoolctl): ``internal_api`` (``openblas``,
      ``mkl``), ``version``, ``architecture`` (the kernels OpenBLAS chose: ``Haswell`` is
      AVX2), ``num_threads``.
    - ``env``: ``OPENBLAS_CORETYPE`` and ``OPENBLAS_L2_SIZE`` as set, ``None`` where unset.
    - ``torch`` and ``torch_cpu_capability``: PyTorch's version and
      ``torch.backends.cpu.get_cpu_capability()``, ``None`` without PyTorch.
    - ``scan_backend``: ``int8``, ``bfloat16`` or ``float32``, the search's candidate scan here
      (:func:`~streamxm.serving.index.index_block`; the rows an embedding kind keeps as float32,
      :meth:`~streamxm.models.embedding.EmbeddingKind.scans_float32`, are scanned so whatever
      it is).
    - ``python`` and ``numpy``: their versions.
    """
    name, flags = cpuinfo()
    affinity = getattr(os, "sched_getaffinity", None)
    usable: set[int] | None = set(affinity(0)) if affinity is not None else None
    torch_version, capability = _torch()
    return {
        "cpu": name or platform.processor() or None,
        "logical_cpus": os.cpu_count(),
        "usable_cpus": len(usable) if usable is not None else None,
        "affinity": _ranges(usable) if usable is not None else None,
        "flags": _flags(flags),
        "blas": _blas(),
        "env": {var: os.environ.get(var) for var in ENV_VARS},
        "torch": torch_version,
        "torch_cpu_capability": capability,
        "scan_backend": _scan_backend(),
        "python": platform.python_version(),
        "numpy": np.__version__,
        "platform": sys.platform,
    }


def with_machine(result: dict[str, Any]) -> dict[str, Any]:
    """A benchmark's result with the ``machine`` it ran on, measured as it is printed."""
    return {**result, "machine": machine()}
