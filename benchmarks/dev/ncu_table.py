"""A markdown table of the metrics that locate a kernel's limit, from ncu raw CSV
exports (`ncu -i X.ncu-rep --page raw --csv`), one column per profiled kernel: time, issue-slot use, the tensor and shared-memory pipes, L2 and
DRAM throughput, and the warp stall reasons (warps stalled per issued instruction).

Usage: python benchmarks/dev/ncu_table.py A.raw.csv [B.raw.csv ...]
"""

from __future__ import annotations

import csv
import re
import sys
from pathlib import Path

METRICS = {
    "time": "gpu__time_duration.sum",
    "SM clock": "smsp__cycles_elapsed.avg.per_second",
    "registers": "launch__registers_per_thread",
    "grid size": "launch__grid_size",
    "SM active cycles %": "sm__cycles_active.avg.pct_of_peak_sustained_elapsed",
    "achieved warps / SM": "sm__warps_active.avg.per_cycle_active",
    "issue slots busy %": "smsp__issue_active.avg.pct_of_peak_sustained_active",
    "eligible warps / scheduler": "smsp__warps_eligible.avg.per_cycle_active",
    "tensor pipe %": "sm__pipe_tensor_op_hmma_cycles_active.avg.pct_of_peak_sustained_active",
    "ldmatrix instructions": "smsp__inst_executed_op_ldsm.sum",
    "instructions": "smsp__inst_executed.sum",
    "shared memory wavefronts %": "l1tex__data_pipe_lsu_wavefronts_mem_shared.sum.pct_of_peak_sustained_elapsed",
    "shared bank conflicts": "l1tex__data_bank_conflicts_pipe_lsu_mem_shared.sum",
    "L1 throughput %": "l1tex__throughput.avg.pct_of_peak_sustained_active",
    "L2 throughput %": "lts__throughput.avg.pct_of_peak_sustained_elapsed",
    "L2 hit rate %": "lts__t_sector_hit_rate.pct",
    "DRAM throughput %": "dram__throughput.avg.pct_of_peak_sustained_elapsed",
}
STALL = re.compile(r"smsp__average_warps_issue_stalled_(\w+)_per_issue_active\.ratio$")


def kernels_of(path: Path) -> list[dict[str, str]]:
    """Metric -> value (with its unit), per profiled kernel of the export."""
    with open(path, newline="") as f:
        rows = [r for r in csv.reader(f) if r]
    header, units = rows[0], rows[1]
    return [{name: f"{value} {unit}".strip() if unit and unit != "%" else value
             for name, value, unit in zip(header, data, units)}
            for data in rows[2:] if len(data) == len(header)]


def number(text: str) -> float | None:
    try:
        return float(text.split()[0].replace(",", "")) if text else None
    except ValueError:
        return None


def main(paths: list[str]) -> int:
    if not paths:
        print(__doc__)
        return 2
    kernels = {}
    for p in paths:
        found = kernels_of(Path(p))
        for i, k in enumerate(found):
            kernels[Path(p).name.removesuffix(".raw.csv") + (f"#{i}" if len(found) > 1 else "")] = k
    names = list(kernels)
    lines = ["| metric | " + " | ".join(names) + " |", "|---" * (len(names) + 1) + "|"]
    lines.append("| kernel | " + " | ".join(k.get("Kernel Name", "?")[:40] for k in kernels.values()) + " |")
    for label, metric in METRICS.items():
        cells = [kernels[n].get(metric, "n/a") for n in names]
        lines.append(f"| {label} | " + " | ".join(cells) + " |")
    stalls = sorted({m.group(1) for k in kernels.values() for name in k if (m := STALL.match(name))})
    for reason in stalls:
        metric = f"smsp__average_warps_issue_stalled_{reason}_per_issue_active.ratio"
        values = [number(kernels[n].get(metric, "")) for n in names]
        if any(v is not None and v >= 0.05 for v in values):
            lines.append(f"| stall: {reason} | " + " | ".join("n/a" if v is None else f"{v:.2f}" for v in values)
                         + " |")
    print("\n".join(lines))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
