"""Compiling rendered sources with nvcc through one generated ninja file.

Every configuration builds in its own directory with a relative command line
(`nvcc ... -Iinclude -o lib<name>.so <name>.cu`), so the command that enters the
cache key is the same wherever the cache lives. Many configurations share one
ninja run, with parallel jobs capped for memory.

Errors: `run_builds` raises ToolchainError if ninja is missing, CacheError if
the batch directory cannot be written and SettingError for a FLASHJIT_JOBS it
cannot use; compiler failures are returned per job (BuildError instances) so
that a prewarm reports all of them.
"""

from __future__ import annotations

import logging
import os
import re
import shlex
import shutil
import subprocess
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

from .arch import gencode_flags
from .errors import BuildError, CacheError, SettingError, ToolchainError

log = logging.getLogger("flashjit")

# Hidden visibility and no GNU-unique symbols: two libraries whose kernels share
# template arguments must not share their statics once both are loaded.
NVCC_FLAGS = ["-O3", "-std=c++17", "-shared", "-Xcompiler=-fPIC,-fvisibility=hidden,-fno-gnu-unique",
              "-DNDEBUG", "-Xptxas=-v", "-Iinclude"]
_ERROR_LINE = re.compile(r"error|Error|ERROR")


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
    error: BuildError | None = field(default=None)

    @property
    def log_path(self) -> Path:
        return self.build_dir / "build.log"


def _ninja_escape(text: str) -> str:
    return text.replace("$", "$$").replace(" ", "$ ").replace(":", "$:").replace("\n", "$\n")


def _write_ninja(path: Path, jobs: list[BuildJob]) -> None:
    lines = ["ninja_required_version = 1.3",
             "rule nvcc",
             "  command = cd $dir && $cmd > build.log 2>&1",
             "  description = nvcc $name", ""]
    for job in jobs:
        out = _ninja_escape(str(job.build_dir / job.output))
        src = _ninja_escape(str(job.build_dir / job.args[-1]))
        cmd = " ".join(shlex.quote(a) for a in [job.nvcc, *job.args])
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


def run_builds(jobs: list[BuildJob], scratch: Path, n_jobs: int | None = None,
               progress: Callable[[str], None] | None = None) -> list[BuildJob]:
    """Compiles all jobs in one ninja run; fills job.seconds and job.error."""
    if not jobs:
        return jobs
    n_jobs = n_jobs or default_jobs()
    ninja = ninja_executable()
    try:
        for stale in scratch.glob(".batch-*"):  # left by killed builders; a live batch is minutes old
            if time.time() - stale.stat().st_mtime > 6 * 3600:
                shutil.rmtree(stale, ignore_errors=True)
        batch_dir = Path(tempfile.mkdtemp(prefix=".batch-", dir=scratch))
        _write_ninja(batch_dir / "build.ninja", jobs)
    except OSError as exc:
        raise CacheError(f"cannot write the build batch in {scratch}: {exc}") from exc
    # The count at INFO; the names (thousands of characters for a preset) at DEBUG, one per line.
    log.info("flashjit: compiling %d configuration(s) with %d parallel nvcc job(s)", len(jobs), n_jobs)
    if log.isEnabledFor(logging.DEBUG):
        for job in jobs:
            log.debug("flashjit: to compile: %s", job.name)
    started = time.monotonic()
    proc = subprocess.Popen([ninja, "-C", str(batch_dir), "-j", str(n_jobs), "-k", "0"],
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    for line in proc.stdout:
        if progress is not None and line.startswith("["):
            progress(line.rstrip())
    proc.wait()
    times = _edge_seconds(batch_dir / ".ninja_log")
    for job in jobs:
        job.seconds = times.get(str(job.build_dir / job.output), 0.0)
        if (job.build_dir / job.output).is_file():
            log.info("flashjit: compiled %s in %.1f s", job.name, job.seconds)
            continue
        try:
            text = job.log_path.read_text(errors="replace")
        except OSError:
            text = "(no compiler output was captured)"
        command = " ".join(shlex.quote(a) for a in [job.nvcc, *job.args])
        job.error = BuildError(f"nvcc failed for configuration {job.name}\n  command (in {job.build_dir}): "
                               f"{command}\n  first errors:\n{_first_errors(text)}\n  full log: {job.log_path}")
    shutil.rmtree(batch_dir, ignore_errors=True)
    log.info("flashjit: build batch of %d finished in %.1f s", len(jobs), time.monotonic() - started)
    return jobs


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
