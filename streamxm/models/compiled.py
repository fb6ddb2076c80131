"""numba's ``njit`` with its on-disk cache wherever this process may keep one.

numba's ``cache=True`` looks for a writable ``__pycache__`` beside the source, then a writable
user cache under ``$HOME``, and raises at import when it finds neither. A container's process
has neither: it runs as an unprivileged user (``nobody``, HOME ``/nonexistent``) over a
site-packages that root installed. :func:`njit` therefore tries numba's own places first
(``NUMBA_CACHE_DIR`` when set, then the two above), then a directory of this user's own under
the system's temporary directory, and compiles without a cache, once per process, when even
that cannot be had.

The fallback directory is created ``0700`` and used only when this user owns it and nobody else
may write to it: numba's cache index is a pickle, and a directory another user could have made
first (``/tmp`` is shared) would let them hand this process code to load.
"""

from __future__ import annotations

import logging
import os
import stat
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import Any, TypeVar

import numba
from numba.core import config as _numba_config

__all__ = ["fallback_cache_dir", "njit"]

F = TypeVar("F", bound=Callable[..., Any])

log = logging.getLogger(__name__)

# numba reads its settings as module attributes that it sets from the environment at import.
numba_config: Any = _numba_config

#: The fallback cache's directory name under the temporary directory, one per user id.
FALLBACK_CACHE_NAME = "streamxm-numba-{uid}"


def fallback_cache_dir() -> Path | None:
    """This user's own cache directory under the temporary directory, or None when it cannot
    be created or is not safely this user's (owned by another user, or writable by others)."""
    uid = os.getuid() if hasattr(os, "getuid") else 0
    path = Path(tempfile.gettempdir()) / FALLBACK_CACHE_NAME.format(uid=uid)
    try:
        path.mkdir(mode=0o700, exist_ok=True)
        info = path.lstat()
    except OSError:
        return None
    if (
        not stat.S_ISDIR(info.st_mode)
        or info.st_uid != uid
        or info.st_mode & (stat.S_IWGRP | stat.S_IWOTH)
        or not os.access(path, os.W_OK)
    ):
        return None
    return path


def njit(**options: Any) -> Callable[[F], F]:
    """``numba.njit(cache=True, **options)`` that never fails for want of a cache directory:
    numba's own locators first, then :func:`fallback_cache_dir`, then no cache."""

    def decorate(func: F) -> F:
        try:
            return numba.njit(cache=True, **options)(func)  # type: ignore[no-any-return]
        except RuntimeError as error:  # "cannot cache function ...: no locator available"
            reason = str(error)
        where = fallback_cache_dir()
        if where is not None:
            # numba reads CACHE_DIR when the dispatcher finds its locator, which then keeps the
            # path: set it for this one decoration only, so no other library's cache moves.
            previous = numba_config.CACHE_DIR
            numba_config.CACHE_DIR = str(where)
            try:
                return numba.njit(cache=True, **options)(func)  # type: ignore[no-any-return]
            except RuntimeError as error:
                reason = str(error)
            finally:
                numba_config.CACHE_DIR = previous
        _warn_uncached(reason)
        return numba.njit(cache=False, **options)(func)  # type: ignore[no-any-return]

    return decorate


_warned: list[str] = []


def _warn_uncached(reason: str) -> None:
    if not _warned:
        _warned.append(reason)
        log.warning(
            "numba: no writable cache directory (%s); compiled functions are compiled "
            "again in every process (set NUMBA_CACHE_DIR to a writable directory)",
            reason,
        )
