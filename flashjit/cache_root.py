"""The cache root the commands use (`flashjit prewarm`, `cache`, `info`,
`numerics`): cache.default_root(), refused if it is a file or a symlink, and
with `create`, made and checked writable. Its own module so that the CLI and
flashjit.numerics both import it without importing each other."""

from __future__ import annotations

import os
import tempfile
from pathlib import Path

from .errors import CacheError, SettingError


def cache_root(create: bool) -> Path:
    """The cache root, refused if it is a file or a symlink (loads refuse those
    too); with `create`, made (private to the user) and checked writable."""
    from . import cache

    root = cache.default_root()
    name = "FLASHJIT_CACHE_DIR" if os.environ.get("FLASHJIT_CACHE_DIR") else \
        "the cache directory (FLASHJIT_CACHE_DIR unset)"
    fix = "set FLASHJIT_CACHE_DIR to a directory of your own (it is created if missing)"
    if root.is_symlink() or (root.exists() and not root.is_dir()):
        what = "a symlink" if root.is_symlink() else "a regular file" if root.is_file() else "not a directory"
        raise SettingError(f"{name}: expected a directory, got {what}: {root}; {fix}")
    if create:
        cache.ensure_root(root)
        try:
            fd, probe = tempfile.mkstemp(prefix=".write-probe-", dir=root)
            os.close(fd)
            os.unlink(probe)
        except OSError as exc:
            raise CacheError(f"{name}: cannot write {root} ({exc.strerror or exc}); {fix}, or prewarm the cache "
                             f"where it is writable") from None
    return root
