"""``streamxm worker``: the learner worker process (the loop lives in :mod:`streamxm.worker`)."""

from streamxm.run import run_worker

__all__ = ["run_worker"]
