"""Helpers and fixtures shared by the CPU-side cache, build and CLI tests.

Import the fixtures you need into a test module (``from helpers_cache import
fresh_cache``); pytest picks fixtures up from the module namespace. Nothing
here needs a GPU; the fixtures that compile need nvcc.
"""

from __future__ import annotations

import contextlib
import errno
import io
import json
import os
import shutil
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from flashjit import arch, build, jit, render
from flashjit.spec import KernelSpec

REPO = Path(__file__).resolve().parent.parent

# The cheapest configuration to compile (decode, fp16, head_dim 64): used where
# a test needs *an* entry, not a particular one.
SMALL_SPEC = KernelSpec.make("single_decode", "float16", 64)
SMALL_ARCH = "sm_80"


def have_nvcc() -> bool:
    return arch.find_nvcc() is not None


needs_nvcc = pytest.mark.skipif(not have_nvcc(), reason="needs nvcc")


# ---------------------------------------------------------------------------
# Environment


def set_cache_env(monkeypatch, root: Path, arches: str | None = SMALL_ARCH, xdg: Path | None = None) -> Path:
    """Points flashjit at a private cache (and nvcc-version memo) for one test."""
    monkeypatch.setenv("FLASHJIT_CACHE_DIR", str(root))
    if arches is None:
        monkeypatch.delenv("FLASHJIT_CUDA_ARCH_LIST", raising=False)
    else:
        monkeypatch.setenv("FLASHJIT_CUDA_ARCH_LIST", arches)
    monkeypatch.setenv("XDG_CACHE_HOME", str(xdg or root.parent / "xdg"))
    monkeypatch.delenv("FLASHJIT_DISABLE_JIT", raising=False)
    monkeypatch.delenv("FLASHJIT_JOBS", raising=False)
    return root


@pytest.fixture
def fresh_cache(monkeypatch, tmp_path) -> Path:
    """An empty, not yet created cache directory private to this test (FLASHJIT_CACHE_DIR),
    compiling for sm_80 only (FLASHJIT_CUDA_ARCH_LIST)."""
    return set_cache_env(monkeypatch, tmp_path / "cache")


@pytest.fixture
def no_compile(monkeypatch, tmp_path):
    """Any attempt to build or load a kernel fails the test; the cache stays
    empty. For tests of bad input, which must be rejected before either."""
    root = set_cache_env(monkeypatch, tmp_path / "cache")

    def forbidden(*args, **kwargs):
        raise AssertionError("a kernel was built or loaded for a bad input")

    monkeypatch.setattr(jit, "build_many", forbidden)
    monkeypatch.setattr(jit, "get_module", forbidden)
    monkeypatch.setattr(build, "run_builds", forbidden)
    yield root
    assert is_empty(root), f"the cache {root} was written: {list(root.rglob('*'))}"


def subprocess_env(root: Path | None = None, arches: str | None = SMALL_ARCH, **extra: str) -> dict:
    """Environment for a child python that imports this checkout's flashjit."""
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join([str(REPO), env.get("PYTHONPATH", "")]).rstrip(os.pathsep)
    for name in ("FLASHJIT_DISABLE_JIT", "FLASHJIT_JOBS", "FLASHJIT_LOG_LEVEL"):
        env.pop(name, None)
    if root is not None:
        env["FLASHJIT_CACHE_DIR"] = str(root)
        env["XDG_CACHE_HOME"] = str(Path(root).parent / "xdg")
    if arches is None:
        env.pop("FLASHJIT_CUDA_ARCH_LIST", None)
    else:
        env["FLASHJIT_CUDA_ARCH_LIST"] = arches
    env.update(extra)
    return env


def run_cli(*args: str, root: Path, timeout: float = 300, **extra_env: str) -> subprocess.CompletedProcess:
    """`python -m flashjit ARGS` against the cache at root."""
    return subprocess.run([sys.executable, "-m", "flashjit", *args], cwd=REPO, env=subprocess_env(root, **extra_env),
                          capture_output=True, text=True, timeout=timeout)


# ---------------------------------------------------------------------------
# Cache inspection


def entry_dirs(root: Path) -> list[Path]:
    """Published entry directories (<root>/<name>/<key>), whatever their state."""
    if not root.is_dir():
        return []
    return sorted(p for config in root.iterdir() if config.is_dir() and not config.name.startswith(".")
                  for p in config.iterdir() if p.is_dir() and not p.name.startswith("."))


def tmp_dirs(root: Path) -> list[Path]:
    """Private build directories left in the cache (.tmp-<key>-<pid>-*)."""
    return sorted(root.glob("*/.tmp-*")) if root.is_dir() else []


def is_empty(root: Path) -> bool:
    return not root.exists() or not any(root.iterdir())


def flip_byte(path: Path, offset: int | None = None) -> None:
    data = bytearray(path.read_bytes())
    i = len(data) // 2 if offset is None else offset
    data[i] ^= 0xFF
    path.write_bytes(bytes(data))


def truncate(path: Path) -> None:
    data = path.read_bytes()
    path.write_bytes(data[: len(data) // 2])


def copy_cache(src: Path, dst: Path) -> Path:
    """A copy of a whole cache (modes kept; keys do not depend on the location)."""
    shutil.copytree(src, dst, symlinks=True)
    return dst


# ---------------------------------------------------------------------------
# A counting nvcc


def real_nvcc() -> str:
    nvcc = arch.find_nvcc()
    assert nvcc is not None, "needs nvcc"
    return str(Path(nvcc).resolve())


def nvcc_wrapper(directory: Path, delay: float = 0.0) -> tuple[Path, Path]:
    """A shell script standing in for nvcc (point FLASHJIT_NVCC at it): every
    compile appends a line to the returned counter file and, if
    $FLASHJIT_TEST_NVCC_STARTED is set, creates that file, then sleeps `delay`
    seconds and runs the real nvcc. `--version` is passed straight through."""
    directory.mkdir(parents=True, exist_ok=True)
    script, counter = directory / "nvcc", directory / "nvcc-calls.txt"
    script.write_text(textwrap.dedent(f"""\
        #!/bin/sh
        if [ "$1" = "--version" ]; then exec "{real_nvcc()}" "$@"; fi
        echo "$$" >> "{counter}"
        if [ -n "$FLASHJIT_TEST_NVCC_STARTED" ]; then : > "$FLASHJIT_TEST_NVCC_STARTED"; fi
        sleep {delay}
        exec "{real_nvcc()}" "$@"
        """))
    script.chmod(0o755)
    return script, counter


def compile_count(counter: Path) -> int:
    return len(counter.read_text().splitlines()) if counter.exists() else 0


# ---------------------------------------------------------------------------
# Templates


def _render_caches() -> list:
    # Everything render memoises from the templates directory.
    return [fn for fn in (getattr(render, "environment", None), getattr(render, "generator_digest", None))
            if fn is not None and hasattr(fn, "cache_clear")]


@contextlib.contextmanager
def templates_copy_ctx(directory: Path):
    """Points flashjit's renderer at a private copy of templates/ (edit it freely)."""
    copy = directory / "templates"
    shutil.copytree(render.templates_dir(), copy)
    for fn in _render_caches():
        fn.cache_clear()
    try:
        with pytest.MonkeyPatch.context() as m:
            m.setattr(render, "templates_dir", lambda: copy)
            yield copy
    finally:
        for fn in _render_caches():
            fn.cache_clear()


@pytest.fixture
def templates_copy(tmp_path):
    with templates_copy_ctx(tmp_path) as copy:
        yield copy


# ---------------------------------------------------------------------------
# A file system that refuses writes under one directory


@contextlib.contextmanager
def refuse_writes(under: Path, err: int = errno.EROFS):
    """Makes every creation or modification of a file or directory under `under`
    fail with OSError(err), the way a read-only mount (EROFS) or a full disk
    (ENOSPC) does; running as root, permissions cannot simulate it."""
    under = Path(under).resolve()
    real_mkdir, real_open, real_os_open = os.mkdir, open, os.open
    real_rename, real_chmod, real_replace = os.rename, os.chmod, os.replace
    import builtins

    def inside(path) -> bool:
        try:
            p = Path(os.fsdecode(path)).absolute()
        except TypeError:
            return False
        return p == under or under in p.parents

    def fail(path):
        raise OSError(err, os.strerror(err), os.fsdecode(path))

    def mkdir(path, mode=0o777, *, dir_fd=None):
        if inside(path):
            if os.path.lexists(path):
                raise FileExistsError(errno.EEXIST, os.strerror(errno.EEXIST), os.fsdecode(path))
            fail(path)
        return real_mkdir(path, mode) if dir_fd is None else real_mkdir(path, mode, dir_fd=dir_fd)

    def open_(file, mode="r", *args, **kwargs):
        if isinstance(file, (str, bytes, os.PathLike)) and inside(file) and any(c in mode for c in "wax+"):
            fail(file)
        return real_open(file, mode, *args, **kwargs)

    def os_open(path, flags, mode=0o777, *, dir_fd=None):
        writes = flags & (os.O_WRONLY | os.O_RDWR | os.O_CREAT | os.O_TRUNC | os.O_APPEND)
        if writes and inside(path):
            fail(path)
        return real_os_open(path, flags, mode) if dir_fd is None else real_os_open(path, flags, mode, dir_fd=dir_fd)

    def two(real):
        def wrapped(src, dst, *args, **kwargs):
            if inside(src) or inside(dst):
                fail(dst)
            return real(src, dst, *args, **kwargs)
        return wrapped

    def chmod(path, mode, *args, **kwargs):
        if isinstance(path, (str, bytes, os.PathLike)) and inside(path):
            fail(path)
        return real_chmod(path, mode, *args, **kwargs)

    with pytest.MonkeyPatch.context() as m:
        m.setattr(os, "mkdir", mkdir)
        m.setattr(os, "open", os_open)
        m.setattr(os, "rename", two(real_rename))
        m.setattr(os, "replace", two(real_replace))
        m.setattr(os, "chmod", chmod)
        m.setattr(builtins, "open", open_)
        m.setattr(io, "open", open_)
        yield


def manifest_of(entry_dir: Path) -> dict:
    return json.loads((entry_dir / "manifest.json").read_text())
