"""One MLA paged-decode call of benchmarks/mla.py's rows, for a profiler: flashjit's
wrapper (fa2 or fa3) or FlashInfer's, planned once and run --calls times.
With --kernels, the calls run under torch.profiler, which prints each kernel's
mean GPU time per call (attention, merge).

Usage: python benchmarks/dev/profile_mla.py [--row 1] [--lib flashjit|flashinfer] [--backend fa3] [--calls 3]
       [--kernels]
"""

from __future__ import annotations

import argparse
import statistics
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
import mla  # noqa: E402 (benchmarks/ on the path first)


def kernel_times(call, calls: int, label: str) -> None:
    """Each kernel's mean GPU time per call over `calls` calls (a sync after
    each). Under programmatic dependent launch a kernel starts while the one
    before runs, so its time here includes that wait."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(calls):
            call()
            torch.cuda.synchronize()
    per_name = {}
    for e in prof.events():
        if e.device_type == torch.autograd.DeviceType.CUDA:
            per_name.setdefault(e.name, []).append(e.time_range.end - e.time_range.start)
    print(f"{label}: {calls} calls")
    for name, times in per_name.items():
        print(f"  {len(times) / calls:.0f}x {statistics.mean(times):8.1f} us  {name[:110]}")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--row", type=int, default=1, help="index into benchmarks/mla.py's ROWS")
    parser.add_argument("--lib", choices=("flashjit", "flashinfer"), default="flashjit")
    parser.add_argument("--backend", default="fa3")
    parser.add_argument("--calls", type=int, default=3)
    parser.add_argument("--kernels", action="store_true", help="time each kernel with torch.profiler")
    args = parser.parse_args()
    label, batch, kv_len, heads, page_size = mla.ROWS[args.row]
    lib = __import__(args.lib)
    r = mla.make_row(batch, kv_len, heads, page_size)
    call = mla.runner(lib, args.backend, r, heads, page_size)
    out = call()
    torch.cuda.synchronize()
    if args.kernels:
        kernel_times(call, args.calls, f"{args.lib} {args.backend} {label}")
    else:
        for _ in range(args.calls):
            out = call()
        torch.cuda.synchronize()
    mla.check(out, r, kv_len, f"{args.lib} {args.backend} {label}", args.backend)
    print(f"{args.lib} {args.backend} {label}: checked")
    return 0


if __name__ == "__main__":
    sys.exit(main())
