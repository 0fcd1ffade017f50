"""The cache under stress: racing processes, a builder killed mid-compile,
corrupted, unsafe, read-only and full caches. No GPU; most tests need nvcc."""

from __future__ import annotations

import errno
import json
import os
import shutil
import signal
import stat
import subprocess
import sys
import time
from pathlib import Path

import pytest

from flashjit import cache, jit, loader
from flashjit.errors import CacheError, FlashjitError
from flashjit.spec import KernelSpec
from helpers_cache import fresh_cache  # noqa: F401 (fixture)
from helpers_cache import (REPO, SMALL_SPEC, compile_count, copy_cache, entry_dirs, flip_byte, have_nvcc,
                           manifest_of, needs_nvcc, nvcc_wrapper, refuse_writes, run_cli, set_cache_env,
                           subprocess_env, tmp_dirs, truncate)

IS_ROOT = os.geteuid() == 0

# A child that builds SMALL_SPEC (or the spec given as JSON) when the go file appears.
BUILDER = r"""
import json, logging, sys, time
from pathlib import Path
logging.basicConfig(level=logging.INFO, format="%(message)s")
from flashjit import cache, jit, loader
from flashjit.spec import KernelSpec
spec = KernelSpec(**json.loads(sys.argv[1]))
ready, go = Path(sys.argv[2]), Path(sys.argv[3])
ready.touch()
while not go.exists():
    time.sleep(0.002)
started = time.monotonic()
result = jit.build_many([spec])[0]
module = loader.load_library(spec, result.entry.artifact, result.entry.manifest)
print(json.dumps({"built": result.built, "path": str(result.entry.path), "rows": module.rows_per_cta,
                  "sha": cache.sha256_file(result.entry.artifact),
                  "manifest_sha": result.entry.manifest["artifact_sha256"],
                  "seconds": time.monotonic() - started}))
"""


def start_builder(tmp: Path, index: int, env: dict, spec: KernelSpec = SMALL_SPEC) -> tuple[subprocess.Popen, Path]:
    ready = tmp / f"ready-{index}"
    proc = subprocess.Popen([sys.executable, "-c", BUILDER, json.dumps(spec.as_dict()), str(ready),
                             str(tmp / "go")], cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True, start_new_session=True)
    return proc, ready


def wait_for(predicate, timeout: float, what: str) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout} s waiting for {what}")
        time.sleep(0.01)


def kill_group(proc: subprocess.Popen, counter: Path | None = None) -> None:
    """Ends what a builder we started left running: its process group (python,
    ninja) and, since ninja starts each command in a process group of its own,
    the groups of the nvcc wrappers it ran (their pids are in the counter file),
    if they are still in the builder's session."""
    pids = [int(x) for x in counter.read_text().split()] if counter is not None and counter.exists() else []
    for pid in pids:
        try:
            if os.getsid(pid) == proc.pid:
                os.killpg(os.getpgid(pid), signal.SIGKILL)
        except ProcessLookupError:
            pass
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except ProcessLookupError:
        pass


@pytest.fixture(scope="module")
def golden(tmp_path_factory):
    """One real entry (SMALL_SPEC for sm_80), built once; tests work on copies."""
    if not have_nvcc():
        pytest.skip("needs nvcc")
    base = tmp_path_factory.mktemp("golden")
    with pytest.MonkeyPatch.context() as m:
        set_cache_env(m, base / "cache")
        result = jit.build_many([SMALL_SPEC])[0]
    assert result.built and result.entry is not None
    return base / "cache"


@pytest.fixture
def cache_copy(golden, tmp_path, monkeypatch) -> Path:
    """A private copy of the golden cache, as FLASHJIT_CACHE_DIR."""
    root = copy_cache(golden, tmp_path / "cache")
    return set_cache_env(monkeypatch, root)


def the_entry(root: Path) -> Path:
    (entry,) = entry_dirs(root)
    return entry


# ---------------------------------------------------------------------------
# Concurrency


@needs_nvcc
@pytest.mark.nvcc
@pytest.mark.slow
def test_eight_processes_race_and_exactly_one_compiles(tmp_path):
    root = tmp_path / "cache"
    wrapper, counter = nvcc_wrapper(tmp_path / "bin", delay=3.0)  # a long compile: everyone arrives during it
    env = subprocess_env(root, FLASHJIT_NVCC=str(wrapper))
    procs = [start_builder(tmp_path, i, env) for i in range(8)]
    try:
        wait_for(lambda: all(ready.exists() for _, ready in procs), 120, "8 builders to start")
        (tmp_path / "go").touch()
        outs = [proc.communicate(timeout=180) for proc, _ in procs]
    finally:
        for proc, _ in procs:
            kill_group(proc, counter)
    results = []
    for (proc, _), (stdout, stderr) in zip(procs, outs):
        assert proc.returncode == 0, stderr
        results.append((json.loads(stdout.splitlines()[-1]), stderr))
    built = [r for r, _ in results if r["built"]]
    assert len(built) == 1, f"{len(built)} processes built the configuration"
    assert compile_count(counter) == 1, "nvcc ran more than once"
    assert len({r["path"] for r, _ in results}) == 1
    assert len({r["sha"] for r, _ in results}) == 1 and results[0][0]["sha"] == results[0][0]["manifest_sha"]
    assert all(r["rows"] > 0 for r, _ in results)
    waiters = [err for r, err in results if not r["built"]]
    assert all("waiting for another process building" in err for err in waiters), \
        "a process that found the build in progress did not say it was waiting"
    assert "compiling 1 configuration(s)" in [err for r, err in results if r["built"]][0]
    assert len(entry_dirs(root)) == 1 and tmp_dirs(root) == []
    _, problems = cache.verify_entry(entry_dirs(root)[0])
    assert problems == []


@needs_nvcc
@pytest.mark.nvcc
@pytest.mark.slow
@pytest.mark.parametrize("victim", ["builder", "process_group"])
def test_builder_killed_mid_compile_leaves_no_lock_and_no_tmp(tmp_path, victim):
    """SIGKILL a builder while nvcc runs (only the python process, whose ninja
    and nvcc then die too, or its whole process group): the next build proceeds at once."""
    import filelock

    root = tmp_path / "cache"
    wrapper, counter = nvcc_wrapper(tmp_path / "bin", delay=300)  # never finishes on its own
    started_marker = tmp_path / "nvcc-started"
    env = subprocess_env(root, FLASHJIT_NVCC=str(wrapper), FLASHJIT_TEST_NVCC_STARTED=str(started_marker))
    proc, ready = start_builder(tmp_path, 0, env)
    (tmp_path / "go").touch()
    try:
        wait_for(started_marker.exists, 120, "the builder to start nvcc")
        assert len(tmp_dirs(root)) == 1, "the builder compiles in a private .tmp-* directory"
        (lock_path,) = (root / SMALL_SPEC.name).glob("*.lock")
        probe = filelock.UnixFileLock(str(lock_path))
        with pytest.raises(filelock.Timeout):
            probe.acquire(timeout=0)  # held by the builder
        if victim == "builder":
            os.kill(proc.pid, signal.SIGKILL)
        else:
            os.killpg(proc.pid, signal.SIGKILL)
        proc.wait(timeout=30)
        assert proc.returncode == -signal.SIGKILL
        probe.acquire(timeout=5)  # the kernel dropped the dead builder's flock
        probe.release()
        # The next build (real nvcc) is not blocked and cleans up after the dead one.
        started = time.monotonic()
        after = subprocess.run([sys.executable, "-c", BUILDER, json.dumps(SMALL_SPEC.as_dict()),
                                str(tmp_path / "ready-next"), str(tmp_path / "go")], cwd=REPO,
                               env=subprocess_env(root), capture_output=True, text=True, timeout=180)
        elapsed = time.monotonic() - started
    finally:
        kill_group(proc, counter)
    assert after.returncode == 0, after.stderr
    result = json.loads(after.stdout.splitlines()[-1])
    assert result["built"] is True
    assert elapsed < 90, f"the build after a killed builder took {elapsed:.0f} s"
    assert "waiting for another process" not in after.stderr
    assert tmp_dirs(root) == [], f"left over: {tmp_dirs(root)}"
    entry, problems = cache.verify_entry(Path(result["path"]))
    assert problems == [] and entry is not None
    assert compile_count(counter) == 1  # the killed one; the rebuild used the real nvcc


# ---------------------------------------------------------------------------
# Corrupted entries


@pytest.mark.nvcc
@pytest.mark.slow
@pytest.mark.parametrize("corrupt", [truncate, flip_byte], ids=["truncated", "altered"])
def test_corrupt_artifact_is_detected_and_rebuilt(cache_copy, corrupt):
    root = cache_copy
    entry_dir = the_entry(root)
    artifact = entry_dir / manifest_of(entry_dir)["artifact"]
    corrupt(artifact)
    entry, problems = cache.verify_entry(entry_dir)
    assert entry is None and any("does not match its sha256" in p for p in problems)
    bad = run_cli("cache", "verify", root=root)
    assert bad.returncode == 1
    assert f"BAD  {entry_dir}" in bad.stdout and "0 of 1 entries verified" in bad.stdout
    result = jit.build_many([SMALL_SPEC])[0]
    assert result.built is True and result.entry.path == entry_dir
    entry, problems = cache.verify_entry(entry_dir)
    assert problems == [] and entry is not None
    assert loader.load_library(SMALL_SPEC, entry.artifact, entry.manifest).rows_per_cta > 0
    good = run_cli("cache", "verify", root=root)
    assert good.returncode == 0, good.stdout + good.stderr
    assert "1 of 1 entries verified" in good.stdout
    assert tmp_dirs(root) == [] and not list((root / SMALL_SPEC.name).glob(".trash-*"))


def _replace_artifact_with_symlink(entry_dir: Path) -> None:
    artifact = entry_dir / manifest_of(entry_dir)["artifact"]
    real = entry_dir.parent.parent.parent / "elsewhere.so"
    shutil.move(artifact, real)
    artifact.symlink_to(real)


def _rewrite_manifest(entry_dir: Path, **changes) -> None:
    m = manifest_of(entry_dir)
    m.update(changes)
    (entry_dir / "manifest.json").write_text(json.dumps(m))


CORRUPTIONS = [
    pytest.param(lambda e: (e / "manifest.json").unlink(), "no manifest", id="manifest-missing"),
    pytest.param(lambda e: (e / "manifest.json").write_text("{ not json"), "unreadable manifest",
                 id="manifest-garbage"),
    pytest.param(lambda e: _rewrite_manifest(e, format=99), "manifest format", id="manifest-format"),
    pytest.param(lambda e: _rewrite_manifest(e, key="0" * 24), "does not match directory", id="manifest-key"),
    pytest.param(lambda e: _rewrite_manifest(e, key_inputs={"nvcc_version": "0.0"}),
                 "does not match its recorded inputs", id="key-inputs-edited"),
    pytest.param(lambda e: (e / manifest_of(e)["artifact"]).unlink(), "artifact missing", id="artifact-missing"),
    pytest.param(lambda e: truncate(e / manifest_of(e)["artifact"]), "sha256",
                 id="artifact-truncated"),
    pytest.param(_replace_artifact_with_symlink, "not a regular file", id="artifact-symlink"),
    pytest.param(lambda e: os.chmod(e, 0o770), "others can write it", id="entry-group-writable"),
    pytest.param(lambda e: os.chmod(e, 0o707), "others can write it", id="entry-world-writable"),
]


@pytest.mark.nvcc
@pytest.mark.parametrize("damage,problem", CORRUPTIONS)
def test_damaged_entry_is_a_miss_and_reported(cache_copy, monkeypatch, damage, problem):
    root = cache_copy
    entry_dir = the_entry(root)
    damage(entry_dir)
    entry, problems = cache.verify_entry(entry_dir)
    assert entry is None and any(problem in p for p in problems), problems
    key = entry_dir.name
    assert cache.find_entry(root, SMALL_SPEC.name, key) is None
    listed = {path: problems for path, entry, problems in cache.iter_entries(root)}
    assert listed[entry_dir] and any(problem in p for p in listed[entry_dir])
    # With the JIT off, a damaged entry is a miss, never loaded.
    monkeypatch.setenv("FLASHJIT_DISABLE_JIT", "1")
    with pytest.raises(FlashjitError, match="flashjit prewarm"):
        jit.build_many([SMALL_SPEC])


@pytest.mark.nvcc
@pytest.mark.skipif(not IS_ROOT, reason="chown to another user needs root")
def test_entry_owned_by_another_user_is_refused(cache_copy):
    entry_dir = the_entry(cache_copy)
    os.chown(entry_dir, 65534, 65534)
    entry, problems = cache.verify_entry(entry_dir)
    assert entry is None and any("owned by uid 65534" in p for p in problems)


@pytest.mark.nvcc
def test_symlinked_entry_is_refused(cache_copy, tmp_path, monkeypatch):
    entry_dir = the_entry(cache_copy)
    moved = tmp_path / "outside" / entry_dir.name
    moved.parent.mkdir()
    shutil.move(entry_dir, moved)
    entry_dir.symlink_to(moved, target_is_directory=True)
    entry, problems = cache.verify_entry(entry_dir)
    assert entry is None and any("symlink" in p for p in problems)
    assert cache.find_entry(cache_copy, SMALL_SPEC.name, entry_dir.name) is None
    monkeypatch.setenv("FLASHJIT_DISABLE_JIT", "1")
    with pytest.raises(FlashjitError, match="flashjit prewarm"):
        jit.build_many([SMALL_SPEC])


@pytest.mark.nvcc
def test_symlinked_configuration_directory_is_refused(cache_copy, tmp_path):
    config_dir = cache_copy / SMALL_SPEC.name
    moved = tmp_path / "outside"
    shutil.move(config_dir, moved)
    config_dir.symlink_to(moved, target_is_directory=True)
    entry_dir = the_entry(cache_copy)
    entry, problems = cache.verify_entry(entry_dir)
    assert entry is None, "an entry was accepted through a symlinked directory"


@pytest.mark.nvcc
def test_world_writable_configuration_directory_is_refused(cache_copy):
    os.chmod(cache_copy / SMALL_SPEC.name, 0o777)
    entry, problems = cache.verify_entry(the_entry(cache_copy))
    assert entry is None, "an entry was accepted from a directory others can write"


@pytest.mark.nvcc
@pytest.mark.slow
def test_entry_that_verifies_but_does_not_load_is_rebuilt_once(cache_copy, monkeypatch):
    entry_dir = the_entry(cache_copy)
    m = manifest_of(entry_dir)
    artifact = entry_dir / m["artifact"]
    artifact.write_bytes(b"this is not an ELF shared object")
    garbage_sha = cache.sha256_file(artifact)
    _rewrite_manifest(entry_dir, artifact_sha256=garbage_sha)
    assert cache.verify_entry(entry_dir)[1] == []  # verifies, yet cannot be loaded
    monkeypatch.setattr(jit, "_modules", {})
    module = jit.get_module(SMALL_SPEC)
    assert module.rows_per_cta > 0
    entry, problems = cache.verify_entry(Path(module.path).parent)
    assert problems == [] and entry.manifest["artifact_sha256"] != garbage_sha
    assert Path(module.path).read_bytes()[:4] == b"\x7fELF"
    # An entry that still does not load after the rebuild is an error, not a loop.
    monkeypatch.setattr(jit, "_modules", {})

    def never_loads(spec, path, manifest):
        raise FlashjitError(f"cannot load {path}")

    monkeypatch.setattr(jit, "load_library", never_loads)
    with pytest.raises(CacheError, match="does not load after a rebuild"):
        jit.get_module(SMALL_SPEC)


# ---------------------------------------------------------------------------
# Unwritable, full and unsafe cache directories (no compile)


def test_cache_path_under_a_file_is_a_cache_error(monkeypatch, tmp_path):
    blocker = tmp_path / "not-a-directory"
    blocker.write_text("")
    root = set_cache_env(monkeypatch, blocker / "cache")
    with pytest.raises(CacheError) as info:
        jit.build_many([SMALL_SPEC])
    assert str(root) in str(info.value) and "FLASHJIT_CACHE_DIR" in str(info.value)


def test_read_only_file_system_new_cache(monkeypatch, tmp_path):
    root = set_cache_env(monkeypatch, tmp_path / "ro" / "cache")
    (tmp_path / "ro").mkdir()
    with refuse_writes(tmp_path / "ro"), pytest.raises(CacheError) as info:
        jit.build_many([SMALL_SPEC])
    message = str(info.value)
    assert str(root) in message and "read-only" in message.lower()
    assert not root.exists()


@needs_nvcc
def test_read_only_file_system_on_a_miss(monkeypatch, tmp_path):
    root = set_cache_env(monkeypatch, tmp_path / "cache")
    cache.ensure_root()
    with refuse_writes(root), pytest.raises(CacheError) as info:
        jit.build_many([SMALL_SPEC])
    message = str(info.value)
    assert str(root / SMALL_SPEC.name) in message and "read-only" in message.lower()
    assert list(root.iterdir()) == []


@pytest.mark.nvcc
def test_read_only_prewarmed_cache_still_serves_hits(cache_copy, monkeypatch):
    """A cache prewarmed into a read-only image: hits need no write."""
    with refuse_writes(cache_copy):
        result = jit.build_many([SMALL_SPEC])[0]
        assert result.built is False
        monkeypatch.setattr(jit, "_modules", {})
        assert jit.get_module(SMALL_SPEC).rows_per_cta > 0


@pytest.mark.nvcc
@pytest.mark.parametrize("mode", [0o555, 0o500])
def test_root_made_read_only_loads_its_entries_and_stays_read_only(cache_copy, monkeypatch, mode):
    """A root its owner made read-only serves and loads its entries without a
    lock file and without writing (every write would fail), and keeps its mode."""
    for lock in cache_copy.glob("*/*.lock"):
        lock.unlink()
    os.chmod(cache_copy, mode)
    before = sorted(str(p) for p in cache_copy.rglob("*"))
    with refuse_writes(cache_copy):
        assert jit.build_many([SMALL_SPEC])[0].built is False
        monkeypatch.setattr(jit, "_modules", {})
        assert jit.get_module(SMALL_SPEC).rows_per_cta > 0
    assert stat.S_IMODE(os.stat(cache_copy).st_mode) == mode
    assert sorted(str(p) for p in cache_copy.rglob("*")) == before


@pytest.mark.skipif(IS_ROOT, reason="root ignores directory permissions (see the read-only simulations)")
def test_permission_denied_cache(monkeypatch, tmp_path):
    root = set_cache_env(monkeypatch, tmp_path / "cache")
    cache.ensure_root()
    os.chmod(root, 0o500)
    try:
        with pytest.raises(CacheError) as info:
            jit.build_many([SMALL_SPEC])
        assert str(root) in str(info.value) and "read-only" in str(info.value)
    finally:
        os.chmod(root, 0o700)


@needs_nvcc
def test_full_disk_is_a_cache_error_mentioning_space(monkeypatch, tmp_path):
    root = set_cache_env(monkeypatch, tmp_path / "cache")
    real_open = open

    def full_disk_open(file, mode="r", *args, **kwargs):
        if "w" in mode and str(root) in os.fsdecode(file):
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), os.fsdecode(file))
        return real_open(file, mode, *args, **kwargs)

    monkeypatch.setattr(cache, "open", full_disk_open, raising=False)
    with pytest.raises(CacheError) as info:
        jit.build_many([SMALL_SPEC])
    message = str(info.value)
    assert "No space left on device" in message and "free space" in message
    assert str(root / SMALL_SPEC.name) in message
    assert entry_dirs(root) == [], "nothing may be published from a failed write"


@needs_nvcc
def test_full_disk_everywhere_is_a_cache_error(monkeypatch, tmp_path):
    root = set_cache_env(monkeypatch, tmp_path / "cache")
    cache.ensure_root()
    with refuse_writes(root, errno.ENOSPC), pytest.raises(CacheError, match="free space"):
        jit.build_many([SMALL_SPEC])


def test_new_cache_is_private(fresh_cache):
    root = cache.ensure_root()
    assert root == fresh_cache
    assert stat.S_IMODE(os.stat(root).st_mode) == 0o700


@pytest.mark.parametrize("mode, made", [(0o775, 0o755), (0o777, 0o755), (0o757, 0o755), (0o571, 0o551),
                                        (0o555, 0o555), (0o500, 0o500), (0o750, 0o750)])
def test_cache_root_loses_only_group_and_other_write_bits(fresh_cache, mode, made):
    """Group/other write bits are removed (others could plant code); nothing is
    added, so a root its owner made read-only stays read-only."""
    fresh_cache.mkdir()
    os.chmod(fresh_cache, mode)
    cache.ensure_root()
    assert stat.S_IMODE(os.stat(fresh_cache).st_mode) == made


@pytest.mark.skipif(not IS_ROOT, reason="chown to another user needs root")
def test_cache_root_of_another_user_is_refused(fresh_cache):
    fresh_cache.mkdir()
    os.chmod(fresh_cache, 0o777)
    os.chown(fresh_cache, 65534, 65534)
    with pytest.raises(CacheError, match=r"owned by uid 65534, not by you"):
        jit.build_many([SMALL_SPEC])


def test_symlinked_cache_root_is_refused(monkeypatch, tmp_path):
    real = tmp_path / "real"
    real.mkdir(mode=0o700)
    link = tmp_path / "link"
    link.symlink_to(real, target_is_directory=True)
    set_cache_env(monkeypatch, link)
    with pytest.raises(CacheError, match="symlink"):
        jit.build_many([SMALL_SPEC])


@pytest.mark.nvcc
def test_lock_files_and_directories_are_private(golden):
    config_dir = golden / SMALL_SPEC.name
    assert stat.S_IMODE(os.stat(config_dir).st_mode) == 0o700
    (lock,) = config_dir.glob("*.lock")
    assert stat.S_IMODE(os.stat(lock).st_mode) & 0o077 == 0
    assert stat.S_IMODE(os.stat(the_entry(golden)).st_mode) == 0o700


@pytest.mark.nvcc
def test_remove_entry_and_clear(cache_copy):
    entry_dir = the_entry(cache_copy)
    entry, _ = cache.verify_entry(entry_dir)
    cache.remove_entry(cache_copy, entry)
    assert not entry_dir.exists() and entry_dirs(cache_copy) == []
    assert cache.clear(cache_copy) == 1 and list(cache_copy.iterdir()) == []
    assert cache.clear(cache_copy / "absent") == 0
