"""Compiling rendered sources with nvcc through one generated ninja file.

Every configuration builds in its own directory with a relative command line
(`nvcc ... -Iinclude -o lib<name>.so <name>.cu`), so the command that enters the
cache key is the same wherever the cache lives. Many configurations share one
ninja run, with parallel jobs capped for memory. ninja and every compile run
under build_guard.py, so that none of them outlives the calling process.

Errors: `run_builds` raises ToolchainError if ninja is missing, CacheError if
the batch directory cannot be written (full disk included) and SettingError
for a FLASHJIT_JOBS it cannot use (`default_jobs` raises that too); failures
of a configuration are returned per job, not raised, so that a prewarm reports
all of them: a BuildError for a compiler error, a CacheError naming the space
needed when the disk filled up. BuildTerminated (a BaseException) is raised by
a SIGTERM under `sigterm_unwinds`, which then terminates the process.
"""

from __future__ import annotations

import contextlib
import fcntl
import logging
import os
import re
import shlex
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

from . import cache
from .arch import gencode_flags
from .errors import BuildError, FlashjitError, SettingError, ToolchainError

log = logging.getLogger("flashjit")

# Hidden visibility and no GNU-unique symbols: two libraries whose kernels share
# template arguments must not share their statics once both are loaded.
NVCC_FLAGS = ["-O3", "-std=c++17", "-shared", "-Xcompiler=-fPIC,-fvisibility=hidden,-fno-gnu-unique",
              "-DNDEBUG", "-Xptxas=-v", "-Iinclude"]
_ERROR_LINE = re.compile(r"error|Error|ERROR")
GUARD = Path(__file__).with_name("build_guard.py")
# ninja prints this status before an edge's description when the edge finishes
# (its output being no terminal); set explicitly so that the format is known.
NINJA_STATUS = "[%f/%t] "
_STATUS_LINE = re.compile(r"^\[\d+/\d+\] nvcc (\S+)$")
_NO_SPACE = "No space left on device"
# Free space one configuration needs to build (docs/cache.md, "Disk space"):
# its entry (1.4-1.7 MB measured, whatever the arch count) and nvcc's
# temporary files, at most about 5 MB per target arch.
ENTRY_BYTES = 2 * 2**20
TEMP_BYTES_PER_ARCH = 5 * 2**20


def entry_bytes_estimate(n_arches: int) -> int:
    """The free space one configuration needs to build and publish (an estimate)."""
    return ENTRY_BYTES + TEMP_BYTES_PER_ARCH * max(1, n_arches)


@dataclass(frozen=True)
class BuildProgress:
    """One configuration finished: built (ok), failed (not ok) or, from
    jit.build_many, found in the cache (cached, seconds 0). done counts 1..total."""

    done: int
    total: int
    name: str
    seconds: float
    ok: bool
    cached: bool = False

    def __str__(self) -> str:
        what = "cached" if self.cached else "nvcc"
        return f"[{self.done}/{self.total}] {what} {self.name}" + ("" if self.ok else " FAILED")


def nvcc_args(arches, source_name: str, output_name: str) -> list[str]:
    """The command line after the nvcc executable; it is part of the cache key."""
    return [*NVCC_FLAGS, *gencode_flags(arches), "-o", output_name, source_name]


def default_jobs() -> int:
    """FLASHJIT_JOBS, else one job per core, at most one per 2 GiB of available memory."""
    env = os.environ.get("FLASHJIT_JOBS")
    if env:
        try:
            jobs = int(env)
        except ValueError:
            jobs = 0
        if jobs < 1:
            raise SettingError(f"FLASHJIT_JOBS: expected a positive integer, got {env!r}; set it to the number of "
                               f"parallel nvcc jobs (e.g. FLASHJIT_JOBS=8), or unset it for one per core and per "
                               f"2 GiB of free memory")
        return jobs
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
    try:
        avail_kib = next(int(line.split()[1]) for line in open("/proc/meminfo")
                         if line.startswith("MemAvailable:"))
        by_memory = max(1, avail_kib // (2 * 1024 * 1024))
    except (OSError, StopIteration, ValueError):
        by_memory = cores
    return max(1, min(cores, by_memory))


def ninja_executable() -> str:
    try:
        import ninja

        path = Path(ninja.BIN_DIR) / "ninja"
        if path.is_file():
            return str(path)
    except ImportError:
        pass
    found = shutil.which("ninja")
    if not found:
        raise ToolchainError("ninja not found: pip install ninja")
    return found


@dataclass
class BuildJob:
    name: str
    build_dir: Path
    nvcc: str
    args: list[str]
    output: str
    seconds: float = 0.0
    error: FlashjitError | None = field(default=None)  # BuildError, or CacheError (full disk)

    @property
    def log_path(self) -> Path:
        return self.build_dir / "build.log"


def _ninja_escape(text: str) -> str:
    return text.replace("$", "$$").replace(" ", "$ ").replace(":", "$:").replace("\n", "$\n")


def _guarded(mode: str, *args: str) -> list[str]:
    """A command line run under build_guard.py (see there why), watching this process."""
    if not sys.executable:  # an embedded interpreter: no way to start the guard
        return list(args[args.index("--") + 1:])
    return [sys.executable, "-S", "-I", str(GUARD), mode, str(os.getpid()), *args]


def _write_ninja(path: Path, jobs: list[BuildJob], times_dir: Path) -> None:
    lines = ["ninja_required_version = 1.3",
             "rule nvcc",
             "  command = cd $dir && $cmd > build.log 2>&1",
             "  description = nvcc $name", ""]
    for index, job in enumerate(jobs):
        out = _ninja_escape(str(job.build_dir / job.output))
        src = _ninja_escape(str(job.build_dir / job.args[-1]))
        argv = _guarded("edge", str(times_dir / str(index)), "--", job.nvcc, *job.args)
        cmd = " ".join(shlex.quote(a) for a in argv)
        lines += [f"build {out}: nvcc {src}",
                  f"  dir = {shlex.quote(str(job.build_dir)).replace('$', '$$')}",
                  f"  cmd = {cmd.replace('$', '$$')}",
                  f"  name = {job.name}", ""]
    path.write_text("\n".join(lines))


def _first_errors(log_text: str, limit: int = 15) -> str:
    lines = log_text.splitlines()
    picked = [ln for ln in lines if _ERROR_LINE.search(ln)][:limit]
    return "\n".join(picked or lines[:limit])


def _edge_seconds(ninja_log: Path) -> dict[str, float]:
    """Per-output wall time from ninja's own log (start/end in ms)."""
    times: dict[str, float] = {}
    try:
        for line in ninja_log.read_text().splitlines()[1:]:
            start, end, _mtime, output, *_ = line.split("\t")
            times[output] = (int(end) - int(start)) / 1000.0
    except (OSError, ValueError):
        pass
    return times


def _edge_record(times_file: Path) -> tuple[float, int] | None:
    """(seconds, exit code) that the edge's guard wrote when its command ended."""
    try:
        seconds, code = times_file.read_text().split()
        return float(seconds), int(code)
    except (OSError, ValueError):
        return None


def _remove_stale_batches(scratch: Path) -> None:
    """Removes .batch-* directories of builders that died: a live batch holds the
    flock of its batch.lock; one without that file is judged by its age."""
    for stale in scratch.glob(".batch-*"):
        try:
            fd = os.open(stale / "batch.lock", os.O_RDONLY)
        except FileNotFoundError:
            with contextlib.suppress(OSError):
                if time.time() - stale.stat().st_mtime > 3600:
                    shutil.rmtree(stale, ignore_errors=True)
            continue
        except OSError:
            continue  # not ours to judge
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            shutil.rmtree(stale, ignore_errors=True)
        except BlockingIOError:
            pass
        finally:
            os.close(fd)


def _stop(proc, times_dir: Path, wait_seconds: float = 5.0) -> None:
    """Kills ninja's process group and the process group of every running edge
    (each edge's guard wrote its group id), then waits until they are gone, so
    that nothing writes into the build directories once this returns."""
    groups = set()
    for pgid_file in times_dir.glob("*.pgid"):
        try:
            groups.add(int(pgid_file.read_text()))
        except (OSError, ValueError):
            pass
    groups -= {0, 1, os.getpgrp()}
    for group in (proc.pid, *groups):
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(group, signal.SIGKILL)
    proc.wait()
    deadline = time.monotonic() + wait_seconds
    while groups and time.monotonic() < deadline:
        for group in list(groups):
            try:
                os.killpg(group, 0)
            except (ProcessLookupError, PermissionError):
                groups.discard(group)
        time.sleep(0.02)


@contextlib.contextmanager
def sigterm_unwinds():
    """While a build runs in the main thread of a process that left SIGTERM at
    its default, SIGTERM raises inside the build, so that its cleanup runs (ninja
    and its compilers killed, partial directories removed, locks released), and
    then terminates the process as SIGTERM would have."""
    if threading.current_thread() is not threading.main_thread() or \
            signal.getsignal(signal.SIGTERM) is not signal.SIG_DFL:
        yield
        return

    def terminate(signum, frame):
        raise BuildTerminated("SIGTERM during a build")

    signal.signal(signal.SIGTERM, terminate)
    try:
        yield
    except BuildTerminated:
        signal.signal(signal.SIGTERM, signal.SIG_DFL)
        os.kill(os.getpid(), signal.SIGTERM)
        raise
    finally:
        if signal.getsignal(signal.SIGTERM) is terminate:
            signal.signal(signal.SIGTERM, signal.SIG_DFL)


class BuildTerminated(BaseException):
    """SIGTERM arrived during a build (see sigterm_unwinds)."""


def _job_error(job: BuildJob, ninja_output: str) -> FlashjitError:
    """The error of a job that produced no artifact: a CacheError if the disk was
    full (its partial directory removed), else a BuildError with the first errors."""
    try:
        text = job.log_path.read_text(errors="replace")
    except OSError:
        text = ""
    full = [ln.strip() for ln in (text + "\n" + ninja_output).splitlines() if _NO_SPACE in ln]
    if full:
        needed = entry_bytes_estimate(sum(a.startswith("-gencode") for a in job.args))
        shutil.rmtree(job.build_dir, ignore_errors=True)
        return cache.no_space_error(f"build {job.name} in", job.build_dir, needed, full[0])
    command = " ".join(shlex.quote(a) for a in [job.nvcc, *job.args])
    text = text or ninja_output or "(no compiler output was captured)"
    return BuildError(f"nvcc failed for configuration {job.name}\n  command (in {job.build_dir}): "
                      f"{command}\n  first errors:\n{_first_errors(text)}\n  full log: {job.log_path}")


def run_builds(jobs: list[BuildJob], scratch: Path, n_jobs: int | None = None,
               progress: Callable[[BuildProgress], None] | None = None) -> list[BuildJob]:
    """Compiles all jobs in one ninja run; fills job.seconds and job.error (a
    BuildError, or a CacheError for a full disk). progress(BuildProgress) is
    called as each job finishes, done counting 1..len(jobs). An exception in
    here (Ctrl-C, SIGTERM under sigterm_unwinds, progress raising) kills ninja
    and its compilers before it propagates."""
    if not jobs:
        return jobs
    n_jobs = n_jobs or default_jobs()
    ninja = ninja_executable()
    try:
        _remove_stale_batches(scratch)
        batch_dir = Path(tempfile.mkdtemp(prefix=".batch-", dir=scratch))
        lock_fd = os.open(batch_dir / "batch.lock", os.O_WRONLY | os.O_CREAT, 0o600)
    except OSError as exc:
        raise cache.os_error("write the build batch in", scratch, exc) from exc
    try:
        fcntl.flock(lock_fd, fcntl.LOCK_EX)
        times_dir = batch_dir / "times"
        try:
            times_dir.mkdir()
            _write_ninja(batch_dir / "build.ninja", jobs, times_dir)
        except OSError as exc:
            raise cache.os_error("write the build batch in", batch_dir, exc) from exc
        _run_ninja(ninja, batch_dir, times_dir, jobs, n_jobs, progress)
    finally:
        os.close(lock_fd)
        shutil.rmtree(batch_dir, ignore_errors=True)
    return jobs


def _run_ninja(ninja: str, batch_dir: Path, times_dir: Path, jobs: list[BuildJob], n_jobs: int,
               progress: Callable[[BuildProgress], None] | None) -> None:
    log.info("flashjit: compiling %d configuration(s) with %d parallel nvcc job(s)", len(jobs), n_jobs)
    if log.isEnabledFor(logging.DEBUG):
        for job in jobs:
            log.debug("flashjit: to compile: %s", job.name)
    started = time.monotonic()
    waiting: dict[str, list[int]] = {}
    for index, job in enumerate(jobs):
        waiting.setdefault(job.name, []).append(index)
    outputs: dict[int, list[str]] = {}
    finished: list[int] = []

    def finish(index: int) -> None:
        job = jobs[index]
        record = _edge_record(times_dir / str(index))
        job.seconds = record[0] if record else 0.0
        ok = (record is None or record[1] == 0) and (job.build_dir / job.output).is_file()
        finished.append(index)
        log.debug("flashjit: %s %s in %.1f s", "compiled" if ok else "failed to compile", job.name, job.seconds)
        if progress is not None:
            progress(BuildProgress(len(finished), len(jobs), job.name, job.seconds, ok))

    argv = _guarded("ninja", "--", ninja, "-C", str(batch_dir), "-j", str(n_jobs), "-k", "0")
    try:
        proc = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                                start_new_session=True, env={**os.environ, "NINJA_STATUS": NINJA_STATUS})
    except OSError as exc:
        raise ToolchainError(f"cannot start ninja ({' '.join(argv)}): {exc}; reinstall flashjit's ninja "
                             f"(pip install ninja)") from exc
    try:
        current = None
        for line in proc.stdout:
            status = _STATUS_LINE.match(line.rstrip("\n"))
            if status and waiting.get(status.group(1)):
                current = waiting[status.group(1)].pop(0)
                finish(current)
            elif current is not None:
                outputs.setdefault(current, []).append(line)
        proc.wait()
        for index in sorted(i for indices in waiting.values() for i in indices):
            finish(index)  # never reported by ninja (it failed to start, or died)
    except BaseException:
        _stop(proc, times_dir)
        raise
    times = _edge_seconds(batch_dir / ".ninja_log")
    for index, job in enumerate(jobs):
        job.seconds = job.seconds or times.get(str(job.build_dir / job.output), 0.0)
        record = _edge_record(times_dir / str(index))
        if (record is None or record[1] == 0) and (job.build_dir / job.output).is_file():
            continue
        job.error = _job_error(job, "".join(outputs.get(index, [])))
    log.info("flashjit: build batch of %d finished in %.1f s", len(jobs), time.monotonic() - started)


def resource_usage(log_text: str) -> list[dict]:
    """Registers, spills and shared memory per kernel and arch, from ptxas -v."""
    usage, arch, func = [], None, None
    for line in log_text.splitlines():
        if m := re.search(r"Compiling entry function '(\S+)' for '(\w+)'", line):
            func, arch = m.group(1), m.group(2)
        elif func and (m := re.search(r"(\d+) bytes stack frame, (\d+) bytes spill stores, (\d+) bytes spill loads",
                                      line)):
            usage.append({"kernel": func, "arch": arch, "stack": int(m.group(1)), "spill_stores": int(m.group(2)),
                          "spill_loads": int(m.group(3))})
        elif func and usage and (m := re.search(r"Used (\d+) registers", line)):
            usage[-1]["registers"] = int(m.group(1))
            if s := re.search(r"(\d+) bytes smem", line):
                usage[-1]["static_smem"] = int(s.group(1))
    return usage
