"""Warp-stall samples per SASS opcode, side by side for several kernels, from
ncu source exports (`ncu -i X.ncu-rep --page source --csv --print-source sass`,
as benchmarks/dev/ncu_prefill.sh writes them): for each opcode its samples and the
four largest stall reasons, then each kernel's total per reason. Samples sit on
the instruction a warp waits to issue, so `wait` on an HMMA is the fixed stall
the instruction before it asked for, and `short_sb` the wait for an ldmatrix,
shuffle or MUFU result.

Usage: python benchmarks/dev/ncu_ops.py A.sass.csv [B.sass.csv ...] [--top N]
"""

from __future__ import annotations

import argparse
import collections
import csv
import re
import sys
from pathlib import Path

REASONS = ("wait", "short_sb", "long_sb", "math", "barrier", "selected", "not_selected", "dispatch", "mio", "no_inst",
           "branch_resolving", "lg")


def opcode_samples(path: Path) -> dict:
    """opcode -> Counter of 'all' and each stall reason, summed over the kernel's instructions."""
    rows = list(csv.reader(path.open()))
    header = rows[1]
    col = {name: i for i, name in enumerate(header)}
    by_op: dict = collections.defaultdict(collections.Counter)
    for row in rows[2:]:
        if len(row) != len(header):
            continue
        words = re.sub(r"^@!?U?P\w+\s+", "", row[col["Source"]].strip()).split()
        op = words[0].split(".")[0] if words else "?"
        by_op[op]["all"] += int(row[col["Warp Stall Sampling (All Samples)"]] or 0)
        for reason in REASONS:
            by_op[op][reason] += int(row[col["stall_" + reason]] or 0)
    return by_op


def table(paths: list[Path], top: int) -> str:
    data = {path.name.removesuffix(".sass.csv"): opcode_samples(path) for path in paths}
    names = list(data)
    ops = sorted({op for d in data.values() for op in d}, key=lambda op: -max(d[op]["all"] for d in data.values()))
    lines = ["| opcode | " + " | ".join(f"{n} samples" for n in names) + " | "
             + " | ".join(f"{n} largest stalls" for n in names) + " |", "|---|" + "---|" * (2 * len(names))]
    for op in ops[:top]:
        largest = [" ".join(f"{r}={d[op][r]}" for r in sorted(REASONS, key=lambda r: -d[op][r])[:4])
                   for d in data.values()]
        lines.append(f"| {op} | " + " | ".join(str(d[op]["all"]) for d in data.values()) + " | "
                     + " | ".join(largest) + " |")
    lines += ["", "| reason | " + " | ".join(names) + " |", "|---|" + "---|" * len(names)]
    for reason in ("all",) + REASONS:
        lines.append(f"| {reason} | " + " | ".join(str(sum(c[reason] for c in d.values())) for d in data.values())
                     + " |")
    return "\n".join(lines)


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("csv", type=Path, nargs="+")
    parser.add_argument("--top", type=int, default=16)
    args = parser.parse_args()
    print(table(args.csv, args.top))
    return 0


if __name__ == "__main__":
    sys.exit(main())
