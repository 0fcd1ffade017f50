"""Regenerates README.md's performance table from the indexed results.

Each line of the table compares one flashjit kernel with one peer over a group of
rows of a comparison results file (benchmarks/results/): the speed ratio
flashjit / peer of each row (throughput over throughput, or the peer's time over
flashjit's), its range over the group, and on how many rows flashjit is ahead.
Device and date come from the file's line in benchmarks/results/README.md, so a
file that is not indexed is an error. The table goes between the perf-table
markers of README.md.

Usage: python benchmarks/summary.py [--check] [--readme README.md]
  --check: write nothing; exit 1 when README.md's table differs from the generated one.
"""

from __future__ import annotations

import argparse
import re
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

REPO = Path(__file__).resolve().parents[1]
RESULTS = REPO / "benchmarks" / "results"
BEGIN = "<!-- perf-table:begin -->"
END = "<!-- perf-table:end -->"
NUMBER = re.compile(r"[-+]?\d+(?:\.\d+)?")

PREFILL = "2026-11-24-h200-prefill-fa3-vs-peers.md"
DECODE = "2026-12-07-h200-paged-decode-bf16-fp8-vs-flashinfer.md"
MLA = "2026-11-27-h200-mla-pairs-producer.md"


@dataclass(frozen=True)
class Comparison:
    """Lines of the table from one results table: `flashjit` against each of `peers`."""

    file: str
    header: tuple[str, ...]  # the results table's leading header cells, which pick it in the file
    benchmark: str
    where: Callable[[dict], bool]
    flashjit: str  # the results table's column of the flashjit kernel
    label: str  # that kernel's name in the README table
    peers: tuple[tuple[str, str], ...]  # (column, name in the README table)
    higher_is_better: bool


def head_dim(value: str) -> Callable[[dict], bool]:
    return lambda row: row["head_dim"] == value and not row["batch x S"].startswith("skewed")


PREFILL_HEADER = ("head_dim", "batch x S", "causal", "flashjit fa2", "flashjit fa3")
PREFILL_PEERS = (("sdpa-cudnn", "SDPA cuDNN"), ("flashinfer-fa3", "FlashInfer fa3"))
DECODE_HEADER = ("row (B x kv_len, qo/kv heads)", "KV", "K+V MiB")
MLA_HEADER = ("row", "flashjit fa3", "FlashInfer fa3", "flashjit fa2", "FlashInfer fa2")


def every_row(row: dict) -> bool:
    return True


def bf16_cache(row: dict) -> bool:
    """The decode rows of a bf16 cache (the FP8 rows beside them are compared in docs/fp8.md)."""
    return row["KV"] == "bf16"


COMPARISONS = (
    *(Comparison(PREFILL, PREFILL_HEADER, f"ragged prefill, head_dim {d}", head_dim(d), "flashjit fa3", "fa3",
                 PREFILL_PEERS, True) for d in ("64", "128", "256")),
    Comparison(PREFILL, PREFILL_HEADER, "ragged prefill, skewed batch", lambda row: row["batch x S"].startswith("skewed"),
               "flashjit fa3", "fa3", PREFILL_PEERS[1:], True),  # SDPA takes no ragged batch
    Comparison(PREFILL, PREFILL_HEADER, "ragged prefill, every row", every_row, "flashjit fa2", "fa2",
               (("flashinfer-fa2", "FlashInfer fa2"),), True),
    Comparison(DECODE, DECODE_HEADER, "paged decode", bf16_cache, "flashjit tc=True",
               "tensor cores", (("flashinfer tc=True", "FlashInfer tensor cores"),), False),
    Comparison(DECODE, DECODE_HEADER, "paged decode", bf16_cache, "flashjit tc=False",
               "CUDA cores", (("flashinfer tc=False", "FlashInfer CUDA cores"),), False),
    Comparison(DECODE, ("append (NHD, page 16, d128)",), "append_paged_kv_cache", every_row, "flashjit",
               "append", (("flashinfer", "FlashInfer"),), False),
    Comparison(MLA, MLA_HEADER, "MLA paged decode", every_row, "flashjit fa3", "fa3",
               (("FlashInfer fa3", "FlashInfer fa3"),), False),
    Comparison(MLA, MLA_HEADER, "MLA paged decode", every_row, "flashjit fa2", "fa2",
               (("FlashInfer fa2", "FlashInfer fa2"),), False),
)


def cells(line: str) -> list[str]:
    return [cell.strip() for cell in line.strip().strip("|").split("|")]


def markdown_tables(text: str) -> list[tuple[list[str], list[list[str]]]]:
    """Every table of a markdown text as (header, rows of cells)."""
    tables, lines = [], text.splitlines()
    for i, line in enumerate(lines[:-1]):
        if line.startswith("|") and re.fullmatch(r"\|(\s*:?-+:?\s*\|)+", lines[i + 1].strip()):
            rows = []
            for row in lines[i + 2:]:
                if not row.startswith("|"):
                    break
                rows.append(cells(row))
            tables.append((cells(line), rows))
    return tables


def results_table(file: str, header: tuple[str, ...]) -> list[dict]:
    """The rows of the first table of a results file whose header starts with `header`."""
    for head, rows in markdown_tables((RESULTS / file).read_text()):
        if tuple(head[:len(header)]) == header:
            return [dict(zip(head, row)) for row in rows]
    raise SystemExit(f"summary.py: {file} has no table whose header starts with {' | '.join(header)}")


def value(cell: str) -> float | None:
    """A cell's first number (TFLOP/s, or µs before the GB/s), None for n/a or an error."""
    cell = cell.replace("*", "").strip()
    if not cell or cell.startswith(("n/a", "error", "-")):
        return None
    match = NUMBER.match(cell)
    return float(match.group()) if match else None


def index() -> dict[str, tuple[str, str]]:
    """Results file -> (device, date), from the index's table."""
    found = {}
    for head, rows in markdown_tables((RESULTS / "README.md").read_text()):
        if head[:2] == ["claim", "file"]:
            for row in rows:
                row = dict(zip(head, row))
                for name in re.findall(r"`([^`]+)`", row["file"]):
                    found[name] = (row["device"], row["date"])
    return found


def ratio_cell(ratios: list[float]) -> str:
    low, high = min(ratios), max(ratios)
    return f"{low:.2f}x" if f"{low:.2f}" == f"{high:.2f}" else f"{low:.2f}-{high:.2f}x"


def table() -> str:
    indexed = index()
    lines = [
        "| benchmark | flashjit | peer | speed, flashjit / peer | ahead on | device | date | results |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for comparison in COMPARISONS:
        if comparison.file not in indexed:
            raise SystemExit(f"summary.py: {comparison.file} is not indexed in benchmarks/results/README.md")
        device, date = indexed[comparison.file]
        rows = [row for row in results_table(comparison.file, comparison.header) if comparison.where(row)]
        for column, peer in comparison.peers:
            ratios = []
            for row in rows:
                ours, theirs = value(row[comparison.flashjit]), value(row[column])
                if ours and theirs:
                    ratios.append(ours / theirs if comparison.higher_is_better else theirs / ours)
            if not ratios:
                raise SystemExit(f"summary.py: no {comparison.flashjit} / {column} pair in {comparison.file}")
            ahead = sum(r > 1 for r in ratios)
            lines.append(f"| {comparison.benchmark} | {comparison.label} | {peer} | {ratio_cell(ratios)} "
                         f"| {ahead} of {len(ratios)} rows | {device} | {date} | [{comparison.file}] |")
    files = dict.fromkeys(comparison.file for comparison in COMPARISONS)  # link targets, in table order
    lines += ["", *(f"[{file}]: benchmarks/results/{file}" for file in files)]
    return "\n".join(lines) + "\n"


def replaced(readme: str, generated: str) -> str:
    if readme.count(BEGIN) != 1 or readme.count(END) != 1 or readme.index(BEGIN) > readme.index(END):
        raise SystemExit(f"summary.py: README.md needs one {BEGIN} line before one {END} line")
    head, rest = readme.split(BEGIN, 1)
    _, tail = rest.split(END, 1)
    return f"{head}{BEGIN}\n{generated}{END}{tail}"


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--check", action="store_true", help="exit 1 when README.md's table is not the generated one")
    parser.add_argument("--readme", type=Path, default=REPO / "README.md")
    args = parser.parse_args()
    readme = args.readme.read_text()
    updated = replaced(readme, table())
    if args.check:
        if updated != readme:
            print(f"summary.py: the performance table in {args.readme} differs from the indexed results; "
                  "run python benchmarks/summary.py", file=sys.stderr)
            return 1
        return 0
    if updated != readme:
        args.readme.write_text(updated)
        print(f"summary.py: wrote the performance table to {args.readme}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
