"""One MLA paged-decode call of benchmarks/mla.py's rows, for a profiler: flashjit's
wrapper (fa2 or fa3) or FlashInfer's, planned once and run --calls times.
With --kernels, the calls run under torch.profiler, which prints each kernel's
mean GPU time per call (attention, merge); with --back-to-back too, without a
sync between the calls, and each kernel's period and gap from the one before.

Usage: python benchmarks/dev/profile_mla.py [--row 1] [--lib flashjit|flashinfer] [--backend fa3] [--calls 3]
       [--kernels [--back-to-back]]
"""

from __future__ import annotations

import argparse
import statistics
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
import mla  # noqa: E402 (benchmarks/ on the path first)


def kernel_times(call, calls: int, label: str, back_to_back: bool = False) -> None:
    """Each kernel's mean GPU time per call over `calls` calls (a sync after
    each). Under programmatic dependent launch a kernel starts while the one
    before runs, so its time here includes that wait. back_to_back: no sync
    between the calls (as in benchmarks/mla.py's samples), and per kernel also
    the median period (its end to the next one's end) and the median gap from
    the previous kernel's end to its start (negative: it started first)."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(calls):
            call()
            if not back_to_back:
                torch.cuda.synchronize()
        torch.cuda.synchronize()
    kernels = sorted(((e.time_range.start, e.time_range.end, e.name) for e in prof.events()
                      if e.device_type == torch.autograd.DeviceType.CUDA), key=lambda k: k[0])
    per_name, last_end = {}, {}
    for i, (start, end, name) in enumerate(kernels):
        rec = per_name.setdefault(name, {"time": [], "period": [], "gap": []})
        rec["time"].append(end - start)
        if name in last_end:
            rec["period"].append(end - last_end[name])
        last_end[name] = end
        if i > 0:
            rec["gap"].append(start - kernels[i - 1][1])
    print(f"{label}: {calls} calls{' back to back' if back_to_back else ''}")
    for name, rec in per_name.items():
        line = f"  {len(rec['time']) / calls:.0f}x {statistics.mean(rec['time']):8.1f} us"
        if back_to_back and rec["period"]:
            line += (f"  median {statistics.median(rec['time']):.1f} us,"
                     f" period {statistics.median(rec['period']):.1f} us,"
                     f" gap from the kernel before {statistics.median(rec['gap']):.1f} us")
        print(line + f"  {name[:110]}")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--row", type=int, default=1, help="index into benchmarks/mla.py's ROWS")
    parser.add_argument("--lib", choices=("flashjit", "flashinfer"), default="flashjit")
    parser.add_argument("--backend", default="fa3")
    parser.add_argument("--calls", type=int, default=3)
    parser.add_argument("--kernels", action="store_true", help="time each kernel with torch.profiler")
    parser.add_argument("--back-to-back", action="store_true",
                        help="with --kernels: no sync between the calls; each kernel's period and gap too")
    args = parser.parse_args()
    label, batch, kv_len, heads, page_size = mla.ROWS[args.row]
    lib = __import__(args.lib)
    r = mla.make_row(batch, kv_len, heads, page_size)
    call = mla.runner(lib, args.backend, r, heads, page_size)
    out = call()
    torch.cuda.synchronize()
    if args.kernels:
        kernel_times(call, args.calls, f"{args.lib} {args.backend} {label}", args.back_to_back)
    else:
        for _ in range(args.calls):
            out = call()
        torch.cuda.synchronize()
    mla.check(out, r, kv_len, f"{args.lib} {args.backend} {label}", args.backend)
    print(f"{args.lib} {args.backend} {label}: checked")
    return 0


if __name__ == "__main__":
    sys.exit(main())
