"""The cache root the commands use (`flashjit prewarm`, `cache`, `info`,
`numerics`): cache.default_root(), refused if it is a file or a symlink, and
with `create`, made if missing. A root that exists is not written here: a
read-only one serves its hits, and build_many refuses a miss in it with one
line (cache.require_writable). Its own module so that the CLI and
flashjit.numerics both import it without importing each other."""

from __future__ import annotations

import os
from pathlib import Path

from .errors import SettingError


def cache_root(create: bool) -> Path:
    """The cache root, refused if it is a file or a symlink (loads refuse those
    too); with `create`, made private to the user where missing (an existing
    one keeps its mode but for group and other write bits: cache.ensure_root)."""
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
    return root
