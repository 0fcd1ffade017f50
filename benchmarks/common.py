"""Shared by the benchmark scripts (run as `python benchmarks/<script>.py`) and by the
instruments in benchmarks/dev/, which put benchmarks/ on sys.path to import it.
The timing itself lives in flashjit.bench.timing, where `flashjit bench` uses it too."""

from __future__ import annotations

import contextlib

from flashjit.bench.timing import event_ms, round_orders  # noqa: F401 (the scripts import them from here)


def emit(text: str, out: str | None) -> None:
    """Prints a result table and appends it to `out` when given."""
    print(text)
    if out:
        with open(out, "a") as f:
            f.write(text + "\n")


def _profile(fn, calls: int):
    """torch.profiler's record of `calls` back-to-back calls of fn (after one unrecorded)."""
    import torch

    fn()
    torch.cuda.synchronize()
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
        for _ in range(calls):
            fn()
        torch.cuda.synchronize()
    return prof


def kernel_times(fn, calls: int = 20) -> dict[str, float]:
    """Mean µs per call of each CUDA kernel that fn launches (torch.profiler)."""
    from collections import defaultdict

    times = defaultdict(float)
    for event in _profile(fn, calls).key_averages():
        if event.device_time_total > 0:
            times[event.key] += event.device_time_total / calls
    return dict(times)


def kernel_spans(fn, calls: int = 20) -> list[tuple[str, float, float]]:
    """Every CUDA kernel that `calls` back-to-back calls of fn launch, as (name,
    start µs, end µs) from torch.profiler, in start order."""
    import torch

    spans = [(e.name, e.time_range.start, e.time_range.end) for e in _profile(fn, calls).events()
             if e.device_type == torch.autograd.DeviceType.CUDA]
    return sorted(spans, key=lambda s: s[1])


def use_templates(folder) -> None:
    """Renders kernels from `folder` (a copy of another templates/ folder, e.g.
    from `git archive`), or from the package's own when None, so that a kernel
    change is measured against the sources before it in the same run."""
    from flashjit import render

    if not hasattr(use_templates, "own"):
        use_templates.own = render.templates_dir
    render.templates_dir = (lambda: folder) if folder else use_templates.own
    render.environment.cache_clear()
    render.generator_digest.cache_clear()


@contextlib.contextmanager
def rendered_from(folder):
    """Plans made inside load flashjit's kernels rendered from `folder` (None:
    the package's own); the process's module memo is dropped on the way in and
    out, so that a wrapper planned inside keeps the kernel of those sources."""
    from flashjit import jit

    if folder is None:
        yield
        return
    use_templates(folder)
    jit._modules.clear()
    try:
        yield
    finally:
        use_templates(None)
        jit._modules.clear()


def parse_fa3_mla_tiling(text: str):
    """The kernels.fa3.Fa3MlaTiling a command line names, e.g.
    'Fa3MlaTiling(stages=2, key_groups=1)'."""
    from flashjit.kernels.fa3 import Fa3MlaTiling

    return eval(text, {"Fa3MlaTiling": Fa3MlaTiling})


@contextlib.contextmanager
def fa3_mla_tiling(tiling):
    """Plans made inside load fa3 MLA kernels of `tiling` (a
    kernels.fa3.Fa3MlaTiling; None: the shipped one), built into a cache of
    their own (one per tiling, kept for the next process in the temporary
    folder): the cached-load fast path finds entries by the generator's files,
    which a tiling set at run time does not change. The module memo is dropped
    on the way in and out, as in rendered_from."""
    import hashlib
    import os
    import tempfile

    from flashjit import jit, kernels

    if tiling is None:
        yield
        return
    shipped, cache_dir = kernels.fa3.MLA_TILING, os.environ.get("FLASHJIT_CACHE_DIR")
    kernels.fa3.MLA_TILING = tiling
    digest = hashlib.sha256(repr(tiling).encode()).hexdigest()[:12]
    os.environ["FLASHJIT_CACHE_DIR"] = os.path.join(tempfile.gettempdir(), f"flashjit-fa3-mla-tiling-{digest}")
    jit._modules.clear()
    try:
        yield
    finally:
        kernels.fa3.MLA_TILING = shipped
        if cache_dir is None:
            os.environ.pop("FLASHJIT_CACHE_DIR", None)
        else:
            os.environ["FLASHJIT_CACHE_DIR"] = cache_dir
        jit._modules.clear()


def insert_probes(text: str, probes) -> str:
    """`text` with each probe's code put at the first occurrence of its anchor:
    probes are (anchor, code, where), where "before", "after", or
    "after_first_line" (a multi-line anchor that only places the code: after
    its first line)."""
    for anchor, code, where in probes:
        assert anchor in text, anchor
        if where == "after_first_line":
            first = anchor.split("\n")[0] + "\n"
            text = text.replace(anchor, first + code + anchor[len(first):], 1)
        else:
            text = text.replace(anchor, code + anchor if where == "before" else anchor + code, 1)
    return text


def instrumented_templates(header: str, probes, source=None, prefix: str = "instrumented-"):
    """A copy of a templates/ folder (default: the package's) in a temporary
    folder, with `probes` inserted into `header` (a path inside it): the
    instruments' kernels, the shipped sources untouched. Returns the copy."""
    import shutil
    import tempfile
    from pathlib import Path

    from flashjit import render

    folder = Path(tempfile.mkdtemp(prefix=prefix)) / "templates"
    shutil.copytree(source or render.templates_dir(), folder)
    path = folder / header
    path.write_text(insert_probes(path.read_text(), probes))
    return folder


# The start of the stand-alone copy probes' sources (gather_ceiling.py,
# smem_fill_rate.py): error checks, the global timer, and a sink that keeps
# landed data live.
PROBE_HELPERS = r"""
#include <cstdio>
#include <cstdlib>
#include <cuda_runtime.h>

#define CHECK(x) do { cudaError_t e_ = (x); if (e_ != cudaSuccess) { \
  std::fprintf(stderr, "%s:%d %s\n", __FILE__, __LINE__, cudaGetErrorString(e_)); std::exit(1); } } while (0)

__device__ __forceinline__ unsigned long long globaltimer() {
  unsigned long long t;
  asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t));
  return t;
}

// Reads a landed value so that no copy is dead (never true for these inputs).
__device__ __forceinline__ void acc_sink(float* sink, float v) {
  if (v == 1.2345f) sink[threadIdx.x] = v;
}
"""


def build_cuda_program(name: str, source: str, folder, flags=()):
    """The stand-alone CUDA programs of dev/ (no flashjit kernel, no torch):
    writes `source` to folder/name.cu and builds folder/name with nvcc for
    sm_90a, with `flags` added. Returns the executable's path."""
    import subprocess
    from pathlib import Path

    from flashjit import arch

    nvcc = arch.find_nvcc()
    if nvcc is None:
        raise SystemExit(f"{name}: nvcc not found (set FLASHJIT_NVCC or CUDA_HOME, or put it on PATH)")
    folder = Path(folder)
    (folder / f"{name}.cu").write_text(source)
    exe = folder / name
    subprocess.run([nvcc, "-O3", "-gencode", "arch=compute_90a,code=sm_90a", *flags, "-o", str(exe),
                    str(folder / f"{name}.cu")], check=True)
    return exe


def standalone_program(name: str, source: str, doc: str, flags=(), add_args=None):
    """The command line every stand-alone program of dev/ shares: parses
    --build-only, --out (the program's folder and its logs; default a temporary
    one) and what add_args(parser) adds, then builds `source` there
    (build_cuda_program). Returns (args, executable or None with --build-only,
    folder)."""
    import argparse
    import tempfile
    from pathlib import Path

    parser = argparse.ArgumentParser(description=doc.split("\n\n")[0])
    parser.add_argument("--build-only", action="store_true", help="compile, run nothing (no GPU needed)")
    if add_args is not None:
        add_args(parser)
    parser.add_argument("--out", type=Path, help="folder for the program and its logs (default: a temporary one)")
    args = parser.parse_args()
    folder = args.out or Path(tempfile.mkdtemp(prefix=name.replace("_", "-") + "-"))
    folder.mkdir(parents=True, exist_ok=True)
    exe = build_cuda_program(name, source, folder, flags)
    print(f"built {exe}")
    return args, None if args.build_only else exe, folder


def run_standalone(name: str, source: str, doc: str, flags=(), reps: int | None = None,
                   reps_help: str = "launches a row") -> int:
    """standalone_program, then the program itself (not with --build-only):
    its exit code. With `reps`, the command line also takes --reps (that
    default), passed to the program as its one argument."""
    import subprocess

    def add_reps(parser):
        parser.add_argument("--reps", type=int, default=reps, help=reps_help)

    args, exe, _ = standalone_program(name, source, doc, flags, None if reps is None else add_reps)
    if exe is None:
        return 0
    return subprocess.run([str(exe)] + ([] if reps is None else [str(args.reps)])).returncode


def run_racecheck(name: str, source: str, doc: str, add_args, runs) -> int:
    """standalone_program with line info, then racecheck_runs over runs(args),
    the (label, argv) pairs of the parsed command line (nothing with
    --build-only): 1 if any run exited non-zero."""
    args, exe, folder = standalone_program(name, source, doc, ["-lineinfo"], add_args)
    return 0 if exe is None else racecheck_runs(exe, runs(args), folder)


def racecheck_runs(exe, runs, folder) -> int:
    """Each (label, argv) of `runs`: `exe` with argv under compute-sanitizer's
    racecheck (--racecheck-report all), its output in folder/racecheck_LABEL.log;
    prints the exit code, the summary lines and the first source lines racecheck
    names. Returns 1 if any run exited non-zero."""
    import subprocess
    from pathlib import Path

    status = 0
    for label, argv in runs:
        log = Path(folder) / f"racecheck_{label}.log"
        run = subprocess.run(["compute-sanitizer", "--tool", "racecheck", "--racecheck-report", "all", str(exe),
                              *map(str, argv)], capture_output=True, text=True, timeout=300)
        text = run.stdout + run.stderr
        log.write_text(text)
        summary = [line for line in text.splitlines() if "SUMMARY" in line or "wrong" in line]
        print(f"{label}: exit {run.returncode}; " + "; ".join(summary) + f" ({log})")
        for line in sorted({line.strip() for line in text.splitlines() if ".cu:" in line})[:6]:
            print(f"    {line}")
        status |= run.returncode != 0
    return status
