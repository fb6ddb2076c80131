"""One setting for every thread pool a process computes with: ``STREAMXM_THREADS``.

A learner, a rank, the indexer and the API each run numpy's BLAS (OpenBLAS or MKL) and, for
SAM, PyTorch. Left alone, each library starts a pool of one thread per core in every process,
and several processes on one machine (the way the service is deployed: workers, indexer and API
side by side) then fight for the cores: PyTorch's pool in particular collapses when a core is
taken (a SAM learner beside one busy process takes several times as long, beside another
learner many times longer still). So each process sizes every pool from one setting, applied at
start-up before the libraries spin their pools up, and the same in child processes (through the
environment).

The default, 1, is the measured choice for processes that share a machine; a lone learner on a
machine of its own may set it to its cores.
"""

from __future__ import annotations

import logging
import os
import sys

from threadpoolctl import threadpool_info, threadpool_limits

__all__ = ["THREAD_VARIABLES", "apply_threads", "thread_report"]

log = logging.getLogger(__name__)

#: Environment variables the numeric libraries read when they load (and pass to children).
THREAD_VARIABLES = (
    "OMP_NUM_THREADS",
    "OPENBLAS_NUM_THREADS",
    "MKL_NUM_THREADS",
    "VECLIB_MAXIMUM_THREADS",
    "NUMEXPR_NUM_THREADS",
)


def apply_threads(threads: int) -> None:
    """Size every pool of this process (and of the processes it starts) to ``threads``: the
    environment for libraries not loaded yet, threadpoolctl for the BLAS already loaded, and
    PyTorch's intra-op pool if PyTorch is loaded (it reads ``OMP_NUM_THREADS`` otherwise)."""
    if threads < 1:
        raise ValueError(f"threads must be >= 1, got {threads}")
    for name in THREAD_VARIABLES:
        os.environ[name] = str(threads)
    threadpool_limits(limits=threads)
    torch = sys.modules.get("torch")
    if torch is not None:
        torch.set_num_threads(threads)


def thread_report() -> dict[str, int]:
    """The most threads any loaded pool of each kind (``blas``, ``openmp``, ``torch``) runs:
    what a process computes with now."""
    out: dict[str, int] = {}
    for info in threadpool_info():
        kind = str(info["user_api"])
        out[kind] = max(out.get(kind, 0), int(info["num_threads"]))
    torch = sys.modules.get("torch")
    if torch is not None:
        out["torch"] = int(torch.get_num_threads())
    return out
