"""Draws the prefill table of a results file (benchmarks/prefill.py's markdown)
as grouped bars: TFLOP/s per row, one bar per implementation.

Usage: python benchmarks/dev/plot_prefill.py RESULTS.md OUT.png
"""

from __future__ import annotations

import sys


def parse(path: str):
    header, rows = None, []
    for line in open(path):
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if line.startswith("| head_dim"):
            header = cells[3:]
        elif header and line.startswith("| ") and not line.startswith("|---") and len(cells) == len(header) + 3:
            label = f"d{cells[0]} {cells[1]}{' causal' if cells[2] == 'True' else ''}"
            rows.append((label, [float(c) if c.replace('.', '', 1).isdigit() else 0.0 for c in cells[3:]]))
    return header, rows


def main() -> int:
    try:
        import matplotlib
    except ImportError:
        print("plot_prefill.py: needs matplotlib (pip install matplotlib); `flashjit bench` writes its tables "
              "without it", file=sys.stderr)
        return 2

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    header, rows = parse(sys.argv[1])
    width = 0.8 / len(header)
    fig, ax = plt.subplots(figsize=(max(8, len(rows) * 1.1), 4.5))
    for i, name in enumerate(header):
        ax.bar([r + i * width for r in range(len(rows))], [vals[i] for _, vals in rows], width, label=name)
    ax.set_xticks([r + 0.4 - width / 2 for r in range(len(rows))])
    ax.set_xticklabels([label for label, _ in rows], rotation=30, ha="right", fontsize=8)
    ax.set_ylabel("TFLOP/s (bf16)")
    ax.set_title("Prefill throughput, one H200, one run (0 = not applicable)")
    ax.legend(fontsize=8, loc="upper left", bbox_to_anchor=(1.0, 1.0))
    fig.tight_layout()
    fig.savefig(sys.argv[2], dpi=110)
    return 0


if __name__ == "__main__":
    sys.exit(main())
