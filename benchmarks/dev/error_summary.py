"""Summarises the GPU sweep's error report: per configuration, the worst
observed error as a fraction of its tolerance bound (must be <= 1; the bound is
tight when the fraction is >= 1/20).

Usage: python benchmarks/dev/error_summary.py error_report.json [--out summary.md]
"""

from __future__ import annotations

import argparse
import json
import sys
from collections import defaultdict


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("report")
    parser.add_argument("--out")
    args = parser.parse_args()
    all_rows = json.load(open(args.report))
    # Rows with a mean difference compare two computation paths with each other.
    rows = [r for r in all_rows if "mean_err" not in r]
    paths = [r for r in all_rows if "mean_err" in r]
    by_config = defaultdict(list)
    for row in rows:
        by_config[row["config"]].append(row)
    lines = ["| configuration | cases | worst err/bound | worst abs err | worst LSE err/bound |",
             "|---|---|---|---|---|"]
    by_dtype = defaultdict(float)
    for name in sorted(by_config):
        cases = by_config[name]
        worst = max(c["ratio"] for c in cases)
        lse = [c["lse_ratio"] for c in cases if "lse_ratio" in c]
        lines.append(f"| {name} | {len(cases)} | {worst:.3f} | {max(c['max_err'] for c in cases):.2e} | "
                     f"{max(lse):.3f} |" if lse else
                     f"| {name} | {len(cases)} | {worst:.3f} | {max(c['max_err'] for c in cases):.2e} | - |")
        dtype = next((t for t in name.split("_") if t in ("f16", "bf16", "f32")), "other")
        by_dtype[dtype] = max(by_dtype[dtype], worst)
    over = [n for n, c in by_config.items() if max(x["ratio"] for x in c) > 1]
    loose = [n for n, c in by_config.items() if max(x["ratio"] for x in c) < 0.05]
    lines += ["", f"{len(rows)} cases, {len(by_config)} configurations; over the bound: {len(over)}; "
                  f"looser than 20x (worst err/bound < 0.05): {len(loose)}"]
    lines += ["worst err/bound by dtype: " + ", ".join(f"{k} {v:.3f}" for k, v in sorted(by_dtype.items()))]
    if paths:
        lines += ["", "Two computation paths on the same inputs (bound: the sum of the two profiles):", "",
                  "| case | max diff | mean diff | max diff / bound |", "|---|---|---|---|"]
        lines += [f"| {r['config']} | {r['max_err']:.2e} | {r['mean_err']:.2e} | {r['ratio']:.3f} |"
                  for r in sorted(paths, key=lambda r: r["config"])]
        over += [r["config"] for r in paths if r["ratio"] > 1]
    text = "\n".join(lines)
    print(text)
    if args.out:
        open(args.out, "w").write(text + "\n")
    return 1 if over else 0


if __name__ == "__main__":
    sys.exit(main())
