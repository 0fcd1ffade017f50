"""The cache and the build under faults, with a stand-in nvcc (a shell script:
no compiler, no GPU): a read-only cache, a full disk, a build killed or
interrupted, a corrupt entry's warning, and the progress events."""

from __future__ import annotations

import errno
import json
import logging
import os
import signal
import stat
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

from flashjit import build, cache, jit
from flashjit.errors import BuildError, CacheError
from flashjit.spec import KernelSpec
from helpers_cache import REPO, entry_dirs, flip_byte, manifest_of, set_cache_env, subprocess_env, tmp_dirs

SPECS = [KernelSpec.make("single_decode", "float16", d) for d in (64, 128, 256)]
NVCC_VERSION_LINE = "Cuda compilation tools, release 13.0, V13.0.88"


def fake_nvcc(directory: Path, body: str) -> Path:
    """A shell script standing in for nvcc: `--version` answers 13.0; otherwise
    $out is the -o argument and `body` runs in the build directory."""
    directory.mkdir(parents=True, exist_ok=True)
    script = directory / "nvcc"
    script.write_text("#!/bin/sh\n" + textwrap.dedent(f"""\
        if [ "$1" = "--version" ]; then echo "{NVCC_VERSION_LINE}"; exit 0; fi
        out=""; prev=""
        for a in "$@"; do [ "$prev" = "-o" ] && out="$a"; prev="$a"; done
        """) + textwrap.dedent(body))
    script.chmod(0o755)
    return script


COMPILES = """\
    sleep 0.2
    echo "ptxas info    : Used 32 registers"
    printf 'not a real library' > "$out"
    """


@pytest.fixture
def fake_cache(monkeypatch, tmp_path) -> Path:
    """A private cache (not yet created) built by a stand-in nvcc that succeeds."""
    root = set_cache_env(monkeypatch, tmp_path / "cache")
    monkeypatch.setenv("FLASHJIT_NVCC", str(fake_nvcc(tmp_path / "bin", COMPILES)))
    return root


def use_nvcc(monkeypatch, tmp_path: Path, body: str, name: str = "other") -> Path:
    script = fake_nvcc(tmp_path / name, body)
    monkeypatch.setenv("FLASHJIT_NVCC", str(script))
    return script


def snapshot(root: Path) -> dict:
    """Every path under root with its mode, size and mtime: any write changes it."""
    found = {}
    for path in [root, *root.rglob("*")]:
        st = os.lstat(path)
        found[str(path)] = (st.st_mode, st.st_size, st.st_mtime_ns)
    return found


# ---------------------------------------------------------------------------
# A read-only cache serves its hits and refuses its misses


@pytest.mark.parametrize("mode", [0o555, 0o500])
def test_read_only_root_serves_hits_and_refuses_misses(fake_cache, mode):
    assert all(r.built for r in jit.build_many(SPECS[:2]))
    for lock in fake_cache.glob("*/*.lock"):
        lock.unlink()  # a hit must not need a lock file
    os.chmod(fake_cache, mode)
    before = snapshot(fake_cache)

    results = jit.build_many(SPECS[:2])
    assert [r.built for r in results] == [False, False] and all(r.entry is not None for r in results)
    assert snapshot(fake_cache) == before, "a hit wrote into the read-only cache"

    with pytest.raises(CacheError) as info:
        jit.build_many(SPECS)
    message = str(info.value)
    assert "\n" not in message
    assert f"cannot build {SPECS[2].name}: the cache is read-only (FLASHJIT_CACHE_DIR={fake_cache}" in message
    assert f"mode {mode:04o}" in message
    assert "it serves the configurations it holds but takes no new ones" in message
    assert "set FLASHJIT_CACHE_DIR to a writable directory" in message and f"chmod u+w {fake_cache}" in message
    assert snapshot(fake_cache) == before, "a refused miss wrote into the read-only cache"
    assert stat.S_IMODE(os.stat(fake_cache).st_mode) == mode


def test_read_only_default_location_is_named_as_such(monkeypatch, tmp_path):
    root = tmp_path / "xdg" / "flashjit"
    root.mkdir(parents=True, mode=0o555)
    monkeypatch.delenv("FLASHJIT_CACHE_DIR", raising=False)
    monkeypatch.setattr(cache, "default_root", lambda: root)
    with pytest.raises(CacheError, match=rf"the cache is read-only \(the default cache directory {root} "
                                         rf"\(FLASHJIT_CACHE_DIR unset\); mode 0555"):
        cache.require_writable(root, "build x")


def test_read_only_root_keeps_an_old_fingerprint_and_warns_once(fake_cache, caplog):
    (result,) = jit.build_many(SPECS[:1])
    manifest = manifest_of(result.entry.path)
    manifest["fingerprint"] = "an older generator"
    (result.entry.path / "manifest.json").write_text(json.dumps(manifest))
    os.chmod(fake_cache, 0o555)
    before = snapshot(fake_cache)
    with caplog.at_level(logging.WARNING, logger="flashjit"):
        for _ in range(3):
            (again,) = jit.build_many(SPECS[:1])
            assert again.built is False and again.entry.path == result.entry.path
    assert snapshot(fake_cache) == before
    warnings = [r.getMessage() for r in caplog.records if "records another fingerprint" in r.getMessage()]
    assert len(warnings) == 1 and "read-only (mode 0555" in warnings[0]


def test_missing_root_is_not_created_by_a_hit_in_a_layer(fake_cache, monkeypatch, tmp_path):
    layer = tmp_path / "layer"
    set_cache_env(monkeypatch, layer)
    jit.build_many(SPECS[:1])
    os.chmod(layer, 0o555)
    set_cache_env(monkeypatch, fake_cache)
    monkeypatch.setenv("FLASHJIT_CACHE_READONLY", str(layer))
    (result,) = jit.build_many(SPECS[:1])
    assert result.built is False and result.entry.path.parent.parent == layer
    assert not fake_cache.exists(), "a hit created the writable cache"


# ---------------------------------------------------------------------------
# A full disk


def test_compiler_out_of_space_is_a_cache_error_and_leaves_nothing(fake_cache, monkeypatch, tmp_path):
    monkeypatch.setenv("FLASHJIT_CUDA_ARCH_LIST", "sm_80 sm_89")
    use_nvcc(monkeypatch, tmp_path, """\
        echo "/usr/bin/ld: final link failed: No space left on device" >&2
        printf 'partial' > "$out.tmp"
        exit 1
        """)
    with pytest.raises(CacheError) as info:
        jit.build_many(SPECS[:1])
    message = str(info.value)
    assert "\n" not in message
    assert f"cannot build {SPECS[0].name} in {fake_cache / SPECS[0].name}/.tmp-" in message
    assert "no space left on device (/usr/bin/ld: final link failed: No space left on device)" in message
    needed = build.entry_bytes_estimate(2) / 2**20  # two arches
    assert needed > build.entry_bytes_estimate(1) / 2**20
    assert f"it needs about {needed:.1f} MB free there" in message
    assert "free space on that file system or set FLASHJIT_CACHE_DIR" in message
    assert tmp_dirs(fake_cache) == [] and entry_dirs(fake_cache) == []
    assert not list(fake_cache.glob(".batch-*"))
    # A prewarm gets every configuration's error instead of the first.
    results = jit.build_many(SPECS, raise_first=False)
    assert all(isinstance(r.error, CacheError) and "no space left" in str(r.error) for r in results)
    assert tmp_dirs(fake_cache) == []


def test_publish_out_of_space_removes_the_build(fake_cache, monkeypatch):
    real_open = open

    def full_disk_for_manifests(file, mode="r", *args, **kwargs):
        if "w" in mode and os.fspath(file).endswith(cache.MANIFEST):
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), os.fspath(file))
        return real_open(file, mode, *args, **kwargs)

    monkeypatch.setattr(cache, "open", full_disk_for_manifests, raising=False)
    results = jit.build_many(SPECS[:2], raise_first=False)
    for r in results:
        message = str(r.error)
        assert isinstance(r.error, CacheError) and r.entry is None
        assert f"cannot write {fake_cache / r.spec.name}/.tmp-" in message and cache.MANIFEST in message
        assert "no space left on device" in message and "it needs about" in message
    assert tmp_dirs(fake_cache) == [] and entry_dirs(fake_cache) == []


# ---------------------------------------------------------------------------
# A killed or interrupted build leaves no compiler running

SLOW = """\
    echo $$ >> "$FLASHJIT_TEST_PIDS"
    ( while :; do echo x >> still-writing.txt; sleep 0.05; done ) &
    echo $! >> "$FLASHJIT_TEST_PIDS"
    wait
    """


def alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] not in ("Z", "X")
    except OSError:
        return False


def descendants(pid: int) -> set[int]:
    children: dict[int, list[int]] = {}
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                ppid = int((entry / "stat").read_text().rsplit(")", 1)[1].split()[1])
            except (OSError, IndexError, ValueError):
                continue
            children.setdefault(ppid, []).append(int(entry.name))
    found, todo = set(), [pid]
    while todo:
        for child in children.get(todo.pop(), []):
            found.add(child)
            todo.append(child)
    return found


def wait_until(predicate, timeout: float, what: str) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout} s waiting for {what}")
        time.sleep(0.02)


def start_slow_build(tmp_path: Path) -> tuple[subprocess.Popen, Path, Path]:
    root, pids = tmp_path / "cache", tmp_path / "pids"
    nvcc = fake_nvcc(tmp_path / "bin", SLOW)
    env = subprocess_env(root, FLASHJIT_NVCC=str(nvcc), FLASHJIT_JOBS="2", FLASHJIT_TEST_PIDS=str(pids))
    code = f"from flashjit import jit, spec; jit.build_many([spec.KernelSpec.make('single_decode', 'float16', d) " \
           f"for d in (64, 128)])"
    proc = subprocess.Popen([sys.executable, "-c", code], cwd=REPO, env=env, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)
    try:
        wait_until(lambda: proc.poll() is not None or (pids.exists() and len(pids.read_text().split()) >= 4), 120,
                   "two stand-in compiles to start")
    except AssertionError as exc:
        proc.kill()
        logs = {str(p): p.read_text(errors="replace") for p in root.glob("*/.tmp-*/build.log")}
        raise AssertionError(f"{exc}; pids {pids.read_text() if pids.exists() else None!r}, logs {logs}, "
                             f"output {proc.communicate()}") from None
    assert proc.poll() is None, f"the build ended early: {proc.communicate()}"
    return proc, root, pids


@pytest.mark.parametrize("sig", [signal.SIGKILL, signal.SIGTERM])
def test_killed_build_leaves_no_compiler_running(tmp_path, sig):
    proc, root, pids = start_slow_build(tmp_path)
    started = {int(p) for p in pids.read_text().split()}
    tree = descendants(proc.pid)  # the guards, ninja, the shells, the compiles
    assert started <= tree and len(tree) >= 8
    try:
        os.kill(proc.pid, sig)
        proc.wait(timeout=30)
        wait_until(lambda: not any(alive(p) for p in tree), 5, "every process of the build to end")
    finally:
        for pid in tree:
            if alive(pid):
                os.kill(pid, signal.SIGKILL)
    assert proc.returncode == -sig
    settled = snapshot(root)
    time.sleep(0.5)
    assert snapshot(root) == settled, "something still writes into the cache"
    if sig == signal.SIGTERM:  # the build unwound: no partial directory, no batch
        assert tmp_dirs(root) == [] and not list(root.glob(".batch-*")), proc.stderr.read()


def test_interrupted_build_kills_its_compilers_and_removes_its_directories(fake_cache, monkeypatch, tmp_path):
    pids = tmp_path / "pids"
    use_nvcc(monkeypatch, tmp_path, 'case "$out" in *d64*) printf x > "$out"; exit 0;; esac\n' + SLOW)
    monkeypatch.setenv("FLASHJIT_TEST_PIDS", str(pids))
    monkeypatch.setenv("FLASHJIT_JOBS", "3")
    events = []

    def interrupt_after_the_first(event):
        events.append(event)
        wait_until(lambda: pids.exists() and len(pids.read_text().split()) == 4, 60, "the slow compiles to start")
        raise KeyboardInterrupt

    with pytest.raises(KeyboardInterrupt):
        jit.build_many(SPECS, progress=interrupt_after_the_first)
    assert [e.name for e in events] == [SPECS[0].name]
    slow = [int(p) for p in pids.read_text().split()]
    assert not any(alive(p) for p in slow), "a compile outlived the interrupted build"
    assert tmp_dirs(fake_cache) == [] and entry_dirs(fake_cache) == [] and not list(fake_cache.glob(".batch-*"))
    use_nvcc(monkeypatch, tmp_path, COMPILES, name="again")
    assert all(r.built for r in jit.build_many(SPECS)), "the locks of the interrupted build were not released"


def test_batches_of_dead_builders_are_removed(tmp_path):
    import fcntl

    scratch = tmp_path / "scratch"
    live, dead, old, young = (scratch / f".batch-{n}" for n in ("live", "dead", "old", "young"))
    for d in (live, dead, old, young):
        d.mkdir(parents=True)
    (dead / "batch.lock").touch()
    fd = os.open(live / "batch.lock", os.O_WRONLY | os.O_CREAT)
    fcntl.flock(fd, fcntl.LOCK_EX)
    os.utime(old, (time.time() - 7200, time.time() - 7200))
    try:
        build._remove_stale_batches(scratch)
    finally:
        os.close(fd)
    assert sorted(p.name for p in scratch.iterdir()) == [".batch-live", ".batch-young"]


# ---------------------------------------------------------------------------
# Warnings once, progress events


def test_invalid_entry_warns_once_per_prewarm(fake_cache, caplog):
    (result,) = jit.build_many(SPECS[:1])
    flip_byte(result.entry.artifact)
    with caplog.at_level(logging.WARNING, logger="flashjit"):
        (rebuilt,) = jit.build_many(SPECS[:1])
        assert rebuilt.built and rebuilt.entry.path == result.entry.path
        assert jit.build_many(SPECS[:1])[0].built is False
        flip_byte(rebuilt.entry.artifact)  # the new entry goes bad too: that is news
        assert jit.build_many(SPECS[:1])[0].built
    invalid = [r.getMessage() for r in caplog.records if "is invalid" in r.getMessage()]
    assert len(invalid) == 2 and all("it will be rebuilt" in m for m in invalid)


def test_progress_reports_each_configuration_as_it_finishes(fake_cache, monkeypatch, tmp_path, caplog):
    jit.build_many(SPECS[:1])  # cached
    use_nvcc(monkeypatch, tmp_path, """\
        case "$out" in *d256*) sleep 2.5; echo "error: a compile error" >&2; exit 1;; esac
        sleep 0.2
        printf x > "$out"
        """)
    monkeypatch.setenv("FLASHJIT_JOBS", "2")
    events = []
    with caplog.at_level(logging.INFO, logger="flashjit"):
        started = time.monotonic()
        results = jit.build_many([*SPECS, SPECS[1]], raise_first=False,
                                 progress=lambda e: events.append((time.monotonic() - started, e)))
        elapsed = time.monotonic() - started
    assert all(isinstance(e, build.BuildProgress) for _, e in events)
    assert [(e.done, e.total, e.name, e.ok, e.cached) for _, e in events] == [
        (1, 3, SPECS[0].name, True, True), (2, 3, SPECS[1].name, True, False), (3, 3, SPECS[2].name, False, False)]
    assert events[0][1].seconds == 0.0
    assert 0.15 < events[1][1].seconds < 2.0 and events[2][1].seconds > 2.0
    assert events[1][0] < elapsed - 1.5, "a finished compile was reported only at the end of the batch"
    assert str(events[1][1]) == f"[2/3] nvcc {SPECS[1].name}"
    assert isinstance(results[2].error, BuildError) and "a compile error" in str(results[2].error)
    info = [r.getMessage() for r in caplog.records]
    assert not [m for m in info if m.startswith("flashjit: compiled ")], "per-configuration lines at INFO"
    assert any(m.startswith("flashjit: compiling 2 configuration(s)") for m in info)


def test_default_arches_are_logged_at_debug(monkeypatch, caplog):
    monkeypatch.delenv("FLASHJIT_CUDA_ARCH_LIST", raising=False)
    monkeypatch.setattr(jit.arch_mod, "device_arch", lambda: None)
    with caplog.at_level(logging.DEBUG, logger="flashjit"):
        assert jit.resolve_arches(None) == jit.arch_mod.DEFAULT_ARCHES
    (record,) = [r for r in caplog.records if "no GPU visible" in r.getMessage()]
    assert record.levelno == logging.DEBUG


def test_import_into_a_read_only_root_is_refused(fake_cache, tmp_path):
    from flashjit import cache_ship

    jit.build_many(SPECS[:1])
    archive = tmp_path / "entries.tar"
    cache_ship.export_cache(fake_cache, archive)
    target = tmp_path / "target"
    target.mkdir(mode=0o555)
    with pytest.raises(CacheError, match=rf"^cannot import {archive}: the cache is read-only \(the cache directory "
                                         rf"{target}; mode 0555"):
        cache_ship.import_cache(archive, target)
    assert list(target.iterdir()) == []
