"""The CacheError messages of the cache: what failed, on which path, why, and
the fix in the words of the setting to change (docs/cache.md, "Failure
behaviour"). Re-exported by flashjit.cache."""

from __future__ import annotations

import errno
import os
import shutil
import tempfile
from pathlib import Path

from .errors import CacheError


def root_setting(root: Path, default_root: Path) -> str:
    """Where root came from, in the words of the setting to change
    (`default_root`: cache.default_root(), where it is when nothing is set)."""
    env = os.environ.get("FLASHJIT_CACHE_DIR")
    if env and Path(env).expanduser() == Path(root):
        return f"FLASHJIT_CACHE_DIR={root}"
    if not env and Path(root) == Path(default_root):
        return f"the default cache directory {root} (FLASHJIT_CACHE_DIR unset)"
    return f"the cache directory {root}"


def _mib(n_bytes: float) -> str:
    return f"{n_bytes / 2**20:.1f} MB"


def no_space_error(action: str, path: Path, needed: int | None, detail: str) -> CacheError:
    """A full disk: the path, the space needed (an estimate), what is free and the fix."""
    def free(where: Path) -> str:
        try:
            return _mib(shutil.disk_usage(where).free)
        except OSError:
            return "unknown"

    where = next((p for p in (Path(path), *Path(path).parents) if p.exists()), Path(path))
    need = f"it needs about {_mib(needed)} free there" if needed else "it needs more free space there"
    tmp = Path(tempfile.gettempdir())
    tmp_note = "" if tmp.exists() and os.stat(tmp).st_dev == os.stat(where).st_dev else \
        f" (nvcc also writes temporaries to {tmp}: {free(tmp)} free)"
    return CacheError(f"cannot {action} {path}: no space left on device ({detail}); {need}, {free(where)} free"
                      f"{tmp_note}; free space on that file system or set FLASHJIT_CACHE_DIR to a directory "
                      f"on another one")


def os_error(action: str, path: Path, exc: OSError, needed: int | None = None) -> CacheError:
    """The CacheError for an OSError while touching the cache: the path and the fix."""
    fix = "set FLASHJIT_CACHE_DIR to a private directory you can write"
    if exc.errno == errno.ENOSPC:
        return no_space_error(action, path, needed, exc.strerror or str(exc))
    if exc.errno in (errno.EROFS, errno.EACCES, errno.EPERM):
        fix = "the cache directory is read-only; " + fix + ", or prewarm it where it is writable"
    return CacheError(f"cannot {action} {path}: {exc.strerror or exc}; {fix}")
