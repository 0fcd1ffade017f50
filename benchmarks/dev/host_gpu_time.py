"""The host rows of `flashjit bench --only host` (flashjit.bench.host's cases and
measure: the mean of 3000 back-to-back calls, and the GPU time of the same loop
from CUDA events around it; where the GPU's exceeds the host's, the kernels fell
behind and the row measures them, not the host: host.table), with
each round's host time, for an A/B of two trees: it runs against whichever
flashjit PYTHONPATH finds (run it once per tree, alternating, each with its own
FLASHJIT_CACHE_DIR).

Usage: python benchmarks/dev/host_gpu_time.py [--rounds 3] [--label NAME] [--json FILE] [--only TEXT]
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch

from flashjit.bench import host


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--calls", type=int, default=host.CALLS)
    parser.add_argument("--rounds", type=int, default=3, help="median of this many rounds per row")
    parser.add_argument("--label", default="", help="names the tree in the output")
    parser.add_argument("--json", help="append the rows as one JSON line to this file")
    parser.add_argument("--only", metavar="TEXT", help="the rows whose label contains TEXT (their kernels alone built)")
    args = parser.parse_args()
    torch.manual_seed(0)
    fns = host.cases("cuda", only=args.only)
    timer = (torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True))
    samples: dict[str, list] = {label: [] for label in fns}
    for _ in range(args.rounds):
        for label in fns:
            samples[label].append(host.measure(fns[label], args.calls, torch.cuda.synchronize, gpu_timer=timer))
    rows = []
    print(f"| call ({args.label}) | host us | GPU us | rounds (host) |\n|---|---|---|---|")
    for label in fns:
        hosts = sorted(s[0] for s in samples[label])
        gpus = sorted(s[1] for s in samples[label])
        rows.append({"op": label, "us": hosts[len(hosts) // 2], "gpu_us": gpus[len(gpus) // 2],
                     "rounds_us": [s[0] for s in samples[label]]})
        print(f"| {label} | {rows[-1]['us']:.2f} | {rows[-1]['gpu_us']:.2f} | "
              f"{' '.join(f'{s[0]:.2f}' for s in samples[label])} |")
    if args.json:
        with Path(args.json).open("a") as f:
            f.write(json.dumps({"label": args.label, "device": torch.cuda.get_device_name(), "rows": rows}) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
