"""``python -m streamxm ...`` as a child process: one helper for the demo, the load benchmarks
and the fault tests, which start workers and APIs exactly as a user does.

Output goes to a log file, or is read line by line (``watch=True``) so a caller can wait for a
line (a fail point reached, a lease lost). :meth:`Child.stop` sends SIGTERM (a worker then
finishes its batch and checkpoints) and kills after a grace period; leaving the ``with`` block
stops the child whatever happened.
"""

from __future__ import annotations

import ctypes
import signal
import subprocess
import sys
import threading
from pathlib import Path
from types import TracebackType

__all__ = ["Child"]

_PR_SET_PDEATHSIG = 1


def _terminate_with_parent() -> None:
    """In the child, before ``exec``: ask Linux for SIGTERM when the parent dies."""
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        libc.prctl(_PR_SET_PDEATHSIG, signal.SIGTERM)
    except (OSError, AttributeError):  # not Linux: the parent's cleanup must do
        pass


class Child:
    """One ``streamxm`` command running as a child process.

    Examples
    --------
    >>> import os
    >>> with Child("redis", "status", env=dict(os.environ), watch=True) as child:
    ...     code = child.proc.wait(timeout=60)
    >>> code
    0
    """

    def __init__(
        self,
        *args: str,
        env: dict[str, str],
        log: Path | None = None,
        watch: bool = False,
        die_with_parent: bool = False,
    ) -> None:
        self.args = args
        self.lines: list[str] = []
        command = [sys.executable, "-m", "streamxm", *args]
        # die_with_parent: SIGTERM when the process that started this one dies, even by
        # SIGKILL (Linux; the starting *thread* must outlive the child: the main thread).
        preexec = _terminate_with_parent if die_with_parent else None
        if watch:
            self.proc = subprocess.Popen(
                command,
                env=env,
                stdin=subprocess.DEVNULL,
                stdout=subprocess.DEVNULL,
                stderr=subprocess.PIPE,
                preexec_fn=preexec,
            )
            self._reader = threading.Thread(target=self._read, daemon=True)
            self._reader.start()
        else:
            with open(log or "/dev/null", "ab") as out:
                self.proc = subprocess.Popen(
                    command,
                    env=env,
                    stdin=subprocess.DEVNULL,
                    stdout=out,
                    stderr=subprocess.STDOUT,
                    preexec_fn=preexec,
                )

    def _read(self) -> None:
        assert self.proc.stderr is not None
        for line in self.proc.stderr:
            self.lines.append(line.decode(errors="replace"))

    @property
    def pid(self) -> int:
        return self.proc.pid

    def alive(self) -> bool:
        return self.proc.poll() is None

    def saw(self, text: str) -> bool:
        """Whether a line of the child's output (``watch=True``) contains ``text``."""
        return any(text in line for line in self.lines)

    def tail(self, n: int = 20) -> str:
        return "".join(self.lines[-n:])

    def kill(self) -> None:
        """SIGKILL: no checkpoint, no goodbye."""
        self.proc.send_signal(signal.SIGKILL)
        self.proc.wait()

    def stop(self, timeout: float = 60.0) -> int:
        """SIGTERM, then SIGKILL after ``timeout`` seconds; the exit code."""
        if self.alive():
            self.proc.send_signal(signal.SIGTERM)
        try:
            return self.proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            return self.proc.wait()

    def __enter__(self) -> Child:
        return self

    def __exit__(
        self, kind: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        if self.alive():
            self.stop(timeout=30)
