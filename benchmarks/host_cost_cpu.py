"""The Python side of each op's host cost per call, measured on a machine without
a GPU: flashjit.bench.host's cases (mean of 3000 calls, tiny inputs) with the
kernel launch stubbed out.

What is real: every argument check, the signature lookups, output allocation
(on the CPU), packing the parameters, the ctypes call into a library that
loader.load_library loads and verifies as any other. What is stubbed, inside
this process only: the library is built by nvcc from
templates/include/flashjit/common/exports.cuh around a launch() that does
nothing; tensors live on the CPU and the check that they are CUDA tensors
passes; torch's device and raw-stream getters (CUDA-only) are replaced by C
builtins of like cost. What a GPU adds (the driver's launch, CUDA allocations)
only benchmarks/bench_jit.py or `flashjit bench --only host` measures.

Usage: python benchmarks/host_cost_cpu.py [--calls N] [--json FILE] [--out FILE]
"""

from __future__ import annotations

import argparse
import contextlib
import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

from common import emit
from flashjit import arch, jit, loader, render
from flashjit.bench import host
from flashjit.ops import _batch, _calls, _checks, decode, prefill

STUB_SOURCE = r"""
#include <cuda_runtime.h>
#include "flashjit/common/attention_params.cuh"
namespace flashjit_generated {
constexpr int kRowsPerCta = 64;
constexpr int kSplitAlign = 64;
inline int launch(const FlashjitAttentionParams&, cudaStream_t) { return 0; }
inline int ctas_per_sm() { return 2; }
}  // namespace flashjit_generated
#include "flashjit/common/exports.cuh"
"""


def build_stub(folder: Path) -> Path:
    """The stub attention library (host code only, so any nvcc builds it without a GPU)."""
    nvcc = arch.find_nvcc()
    if nvcc is None:
        raise SystemExit("host_cost_cpu.py: needs nvcc (FLASHJIT_NVCC or PATH) to build the stub library")
    source, lib = folder / "stub.cu", folder / "libflashjit_stub.so"
    source.write_text(STUB_SOURCE)
    subprocess.run([str(nvcc), "-shared", "-Xcompiler", "-fPIC", "-I", str(render.templates_dir() / "include"),
                    "-o", str(lib), str(source)], check=True)
    return lib


class _ClaimsCuda(torch.Tensor):
    """A CPU workspace that reads as a CUDA tensor, for the wrappers' constructor."""

    @property
    def device(self):
        return torch.device("cuda", 0)


def _workspace(nbytes: int) -> torch.Tensor:
    return torch.Tensor._make_subclass(_ClaimsCuda, torch.empty(nbytes, dtype=torch.uint8))


@contextlib.contextmanager
def stubbed(lib: Path):
    """flashjit with the stub library and CPU tensors, restored on exit."""
    modules = {}

    def get_module(spec):
        if spec not in modules:
            modules[spec] = loader.load_library(spec, lib, {"tolerance": {}})
        return modules[spec]

    init = _batch.BatchAttention.__init__

    def cpu_wrapper(self, *args, **kwargs):
        init(self, *args, **kwargs)
        self._device = torch.device("cpu")  # plans keep their metadata on the host

    patches = [(jit, "get_module", get_module), (_calls, "resident_ctas", lambda module, device: 264),
               (_batch, "resident_ctas", lambda module, device: 264), (_checks, "check_device", lambda *a: None),
               (_batch.BatchAttention, "__init__", cpu_wrapper),
               # C builtins where torch's CUDA getters were: CPU tensors' device index is None.
               (_calls, "_current_device", type(None)), (_calls, "_raw_stream", hash)]
    saved = [(obj, name, getattr(obj, name)) for obj, name, _ in patches]
    try:
        for obj, name, value in patches:
            setattr(obj, name, value)
        yield
    finally:
        for obj, name, value in saved:
            setattr(obj, name, value)
        for cache in (prefill._prepared, decode._prepared):  # their calls launch the stub: none may outlive it
            cache.reset()


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--calls", type=int, default=host.CALLS)
    parser.add_argument("--rounds", type=int, default=5, help="median of this many rounds per call")
    parser.add_argument("--wall", action="store_true",
                        help="time by the wall clock (default: this thread's CPU time, which other processes on a "
                             "shared machine leave alone)")
    parser.add_argument("--json", help="write the section as JSON to this file")
    parser.add_argument("--out", help="append the markdown table to this file")
    args = parser.parse_args()
    torch.manual_seed(0)
    with tempfile.TemporaryDirectory() as folder, stubbed(build_stub(Path(folder))):
        section = host.run(args.calls, device="cpu", workspace=_workspace, rounds=args.rounds,
                           clock=time.perf_counter if args.wall else time.thread_time)
    section["device"] = f"CPU, launch stubbed, {'wall' if args.wall else 'thread CPU'} time"
    emit(host.table(section), args.out)
    if args.json:
        Path(args.json).write_text(json.dumps(section, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
