"""What the benchmarks write: markdown tables (those benchmarks/prefill.py and
benchmarks/decode.py print, so that their results files compare with these),
JSON with every number, a PNG of both (where matplotlib is installed), and the
progress lines on stderr. Plain Python: the CPU tests render synthetic results."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

from . import host
from .decode_fp8 import BF16_KV, COPY_TARGET, RATIO_ROW, RATIO_TARGET, impl_label, impl_labels, is_fp8, speed_ratios

MATPLOTLIB_MISSING = "matplotlib is not installed (pip install matplotlib); the markdown and JSON hold every number"


def git_commit() -> str | None:
    """flashjit's own commit: FLASHJIT_COMMIT when set (a copied tree may carry
    a stale .git), else HEAD of the git work tree this package's source is in,
    and only where that tree is flashjit's own (its flashjit/__init__.py is this
    package's and it holds templates/). None elsewhere: an installed copy inside
    another project's checkout does not name that project's commit."""
    if os.environ.get("FLASHJIT_COMMIT"):
        return os.environ["FLASHJIT_COMMIT"]
    package = Path(__file__).resolve().parent.parent

    def git(*args: str) -> str:
        return subprocess.run(["git", *args], cwd=package, capture_output=True, text=True, timeout=10,
                              check=True).stdout.strip()

    try:
        top = Path(git("rev-parse", "--show-toplevel"))
        own = (top / "flashjit" / "__init__.py").is_file() and (top / "templates").is_dir() and \
            os.path.samefile(top / "flashjit" / "__init__.py", package / "__init__.py")
        return (git("rev-parse", "--short", "HEAD") or None) if own else None
    except (OSError, subprocess.SubprocessError):
        return None


def version_text(meta: dict) -> str:
    """'flashjit 0.1.0 (commit abc1234)', or without the commit where it is not known."""
    commit = meta.get("commit")
    return f"flashjit {meta.get('flashjit')}" + (f" (commit {commit})" if commit else "")


class Progress:
    """One line per finished row on `stream`: count, what, elapsed and an
    estimate of the time left (the mean time per row so far, times the rows left)."""

    def __init__(self, total: int, stream=None, clock=time.monotonic):
        self.total, self.done, self.stream, self.clock = total, 0, stream or sys.stderr, clock
        self.start = clock()

    def __call__(self, label: str) -> None:
        self.done += 1
        elapsed = self.clock() - self.start
        left = elapsed / self.done * (self.total - self.done)
        width = len(str(self.total))
        print(f"[{self.done:>{width}}/{self.total}] {label}  ({elapsed:.0f} s elapsed, about {left:.0f} s left)",
              file=self.stream, flush=True)


# ---------------------------------------------------------------------------
# Prefill


def prefill_row_line(row: dict, impls: list[str]) -> str:
    cells = [f"{row['values'][name]:.0f}" if row["values"].get(name) is not None else "n/a" for name in impls]
    return f"| {row['head_dim']} | {row['label']} | {row['causal']} | " + " | ".join(cells) + " |"


def prefill_table(section: dict) -> str:
    impls = section["impls"]
    lines = [f"device: {section['device']}, bf16, TFLOP/s, median of {section['rounds']} x reps samples per cell, "
             f"taken in shuffled passes", "",
             "| head_dim | batch x S | causal | " + " | ".join(impls) + " |", "|---|---|---|" + "---|" * len(impls)]
    lines += [prefill_row_line(row, impls) for row in section["rows"]]
    sd = section.get("single_decode")
    if sd:
        lines += ["", f"single_decode bf16 d128 32/8 heads kv_len {sd['kv_len']} (CUDA cores, split-KV): "
                      f"{sd['us']:.1f} us, {sd['gbps']:.0f} GB/s of K/V read"]
    return "\n".join(lines)


# ---------------------------------------------------------------------------
# Decode


def short_error(error: str) -> str:
    """A table cell from 'Type: message': the message's first line (its tail, where FlashInfer's reason is)."""
    kind, _, msg = error.partition(": ")
    msg = msg.splitlines()[0] if msg else ""
    msg = msg if len(msg) <= 90 else "..." + msg[-80:]
    return f"error: {kind}: {msg}".replace("|", "/")


def decode_cell(rec: dict, kind: str) -> str:
    """µs · GB/s · % of the baseline bandwidth (read for bf16 decode, copy for FP8
    decode and for append), or why not."""
    if "skipped" in rec:
        return "skipped: not yet generated"
    if "error" in rec:
        return short_error(rec["error"])
    if not rec.get("ok"):
        return f"FAIL max err {rec['max_err']:.3g}, rel {rec['rel_err']:.3g}" if kind == "decode" \
            else "FAIL wrong slots"
    fp8 = kind == "decode" and is_fp8(rec.get("kv_dtype", BF16_KV))
    frac = rec["frac_read"] if kind == "decode" and not fp8 else rec["frac_copy"]
    cell = f"{rec['us']:.{1 if kind == 'decode' else 2}f} · {rec['gbps']:.0f} · {100 * frac:.0f}%"
    return cell + (" of copy" if fp8 else "") + ("" if rec.get("mode") == "graph" else " (eager)")


def _grouped(records: list[dict]) -> dict[str, list[dict]]:
    rows: dict[str, list[dict]] = {}
    for rec in records:
        rows.setdefault(rec["row"], []).append(rec)
    return rows


def fp8_kv_dtypes(section: dict) -> list[str]:
    """The FP8 KV dtypes a decode section ran (none in a section from before FP8)."""
    return [kv for kv in section.get("kv_dtypes", [BF16_KV]) if is_fp8(kv)]


def decode_columns(section: dict) -> list[str]:
    """The decode table's implementation columns: every label where bf16 alone ran,
    else one per library and cores, a row per KV dtype."""
    return impl_labels(section["libs"], [BF16_KV]) if fp8_kv_dtypes(section) else section["impls"]


def decode_row_lines(section: dict, label: str) -> list[str]:
    """The table lines of one row: one, or with FP8 KV dtypes one per KV dtype that ran."""
    for kind, digits in (("decode", 0), ("append", 2)):
        recs = _grouped(section[kind]).get(label)
        if not recs:
            continue
        by_impl = {rec["impl"]: rec for rec in recs}
        if kind == "append" or not fp8_kv_dtypes(section):
            names = section["impls"] if kind == "decode" else section["libs"]
            cells = [label, f"{recs[0]['bytes'] / 2**20:.{digits}f}"]
            cells += [decode_cell(by_impl[n], kind) if n in by_impl else "n/a" for n in names]
            return ["| " + " | ".join(cells) + " |"]
        lines = []
        for kv in section["kv_dtypes"]:
            first = next((rec for rec in recs if rec.get("kv_dtype", BF16_KV) == kv), None)
            if first is None:
                continue
            names = [impl_label(lib, tc, kv) for lib in section["libs"] for tc in (False, True)]
            cells = [label, kv, f"{first['bytes'] / 2**20:.0f}"]
            cells += [decode_cell(by_impl[n], kind) if n in by_impl else "n/a" for n in names]
            lines.append("| " + " | ".join(cells) + " |")
        return lines
    raise KeyError(label)


def decode_row_line(section: dict, label: str) -> str:
    """decode_row_lines as one string (several lines where FP8 KV dtypes ran), for callers that print rows."""
    return "\n".join(decode_row_lines(section, label))


def decode_header(section: dict) -> list[str]:
    read, best = section["read_all_gbps"], section["read_method"]
    all_read = ", ".join(f"{k} {v:.0f}" for k, v in read.items())
    columns, fp8 = decode_columns(section), fp8_kv_dtypes(section)
    title = "## Paged decode, bf16, head_dim 128, page 16, NHD, random page order"
    cells = "cells: µs · GB/s of K+V read · % of read bandwidth"
    if fp8:
        title = (f"## Paged decode, bf16 queries, KV cache {' / '.join(section['kv_dtypes'])}, head_dim 128, page 16, "
                 "NHD, random page order")
        cells = (f"bf16 rows: µs · GB/s of K+V read · % of read bandwidth; FP8 rows ({', '.join(fp8)}; the bf16 cache "
                 f"quantised per tensor, k_scale = v_scale = amax / FP8 max, checked against float32 attention over "
                 f"the dequantised cache): µs · GB/s of FP8 K+V read (1 byte an element) · % of copy bandwidth "
                 f"(target >= {100 * COPY_TARGET:.0f}%)")
    return [title, "",
            (f"GPU: {section['gpu']}; date {section['date']}; "
             + (f"commit {section['commit']}; " if section.get("commit") else "")
             + f"torch {section['torch']}; flashinfer {section['flashinfer'] or 'not available'}"),
            (f"read bandwidth {read[best]:.0f} GB/s ({best}; {all_read}); "
             f"copy bandwidth {section['copy_gbps']:.0f} GB/s (2 GiB copy_, read + write); from memory clock x bus "
             "width " + (f"{section['spec_gbps']:.0f} GB/s" if section.get("spec_gbps") else "unknown")),
            (f"{cells}; median of {section['reps']} samples, "
             "each a CUDA graph of N calls / N ('eager' where capture failed)"), "",
            "| row (B x kv_len, qo/kv heads) | " + ("KV | " if fp8 else "") + "K+V MiB | " + " | ".join(columns)
            + " |", "|---|---|" + ("---|" if fp8 else "") + "---|" * len(columns)]


def fp8_summary(section: dict) -> list[str]:
    """With FP8 KV dtypes: FP8 / bf16 requests per second on RATIO_ROW per implementation,
    and per FP8 cell column how many rows reach the copy-bandwidth target."""
    fp8 = fp8_kv_dtypes(section)
    if not fp8:
        return []
    columns = decode_columns(section)
    ratios = {(r["kv_dtype"], r["impl"]): r["ratio"] for r in speed_ratios(section)}
    lines = ["", f"FP8 / bf16 requests per second on {RATIO_ROW} (bf16 µs / FP8 µs; target >= {RATIO_TARGET}x)", "",
             "| KV | " + " | ".join(columns) + " |", "|---|" + "---|" * len(columns)]
    lines += ["| " + " | ".join([kv] + [f"{ratios[kv, c]:.2f}x" if (kv, c) in ratios else "n/a" for c in columns])
              + " |" for kv in fp8]
    lines.append("")
    for kv in fp8:
        counts = []
        for lib in section["libs"]:
            for tc in (False, True):
                recs = [r for r in section["decode"] if r["impl"] == impl_label(lib, tc, kv)]
                timed = [r for r in recs if r.get("frac_copy") is not None]
                hit = sum(r["frac_copy"] >= COPY_TARGET for r in timed)
                untimed = f" of {len(recs)}" if len(timed) < len(recs) else ""
                counts.append(f"{lib} tc={tc} {hit}/{len(timed)}{untimed}")
        lines.append(f"{kv} rows at >= {100 * COPY_TARGET:.0f}% of copy bandwidth (of those timed): "
                     + ", ".join(counts))
    return lines


def decode_table(section: dict) -> str:
    lines = decode_header(section)
    for label in _grouped(section["decode"]):
        lines += decode_row_lines(section, label)
    lines += fp8_summary(section)
    if section["append"]:
        libs = section["libs"]
        lines += ["", "cells: µs · GB/s of new K/V read + written · % of copy bandwidth", "",
                  "| append (NHD, page 16, d128) | MiB moved | " + " | ".join(libs) + " |",
                  "|---|---|" + "---|" * len(libs)]
        for label in _grouped(section["append"]):
            lines += decode_row_lines(section, label)
    failures, skipped = section["failures"], section.get("skipped", [])
    lines += [""] + [f"FAIL {f}" for f in failures] + [f"skipped (not yet generated): {s}" for s in skipped]
    lines.append(f"decode benchmark: {len(failures)} flashjit failure(s)"
                 + (f", {len(skipped)} skipped cell(s) (not yet generated)" if skipped else ""))
    return "\n".join(lines)


# ---------------------------------------------------------------------------
# The files `flashjit bench` writes

TABLES = {"prefill": prefill_table, "decode": decode_table, "host": host.table}


def markdown(results: dict) -> str:
    meta = results["meta"]
    lines = ["# flashjit bench", "",
             (f"{meta['device']}; {meta['date']}; {version_text(meta)}; "
              f"torch {meta['torch']}; flashinfer {meta['flashinfer'] or 'not available'}; "
              f"{'--quick' if meta['quick'] else 'full'} run"), ""]
    for name, section in results["sections"].items():
        if "error" in section:
            lines += [f"## {name}", "", f"failed: {section['error']}", ""]
            continue
        if name == "prefill":
            lines += ["## Prefill, bf16, TFLOP/s (higher is better)", ""]
        lines += [TABLES[name](section), ""]
    return "\n".join(lines)


def write_json(results: dict, path: Path) -> None:
    path.write_text(json.dumps(results, indent=1, default=str) + "\n")


def _bars(ax, labels: list[str], series: dict[str, list[float]], ylabel: str, title: str) -> None:
    width = 0.8 / max(len(series), 1)
    for i, (name, values) in enumerate(series.items()):
        ax.bar([r + i * width for r in range(len(labels))], values, width, label=name)
    ax.set_xticks([r + 0.4 - width / 2 for r in range(len(labels))])
    ax.set_xticklabels(labels, rotation=30, ha="right", fontsize=8)
    ax.set_ylabel(ylabel)
    ax.set_title(title, fontsize=10)
    ax.legend(fontsize=7, loc="upper left", bbox_to_anchor=(1.0, 1.0))


def plot_series(results: dict) -> list[tuple[str, list[str], dict[str, list[float]], str]]:
    """(title, row labels, {implementation: values, 0 where none}, y label) per panel."""
    panels = []
    pre = results["sections"].get("prefill")
    if pre and "error" not in pre and pre["rows"]:
        labels = [f"d{r['head_dim']} {r['label']}{' causal' if r['causal'] else ''}" for r in pre["rows"]]
        series = {n: [r["values"].get(n) or 0.0 for r in pre["rows"]] for n in pre["impls"]}
        panels.append(("Prefill (0 = not applicable)", labels, series, "TFLOP/s (bf16)"))
    dec = results["sections"].get("decode")
    if dec and "error" not in dec and dec["decode"]:
        rows = _grouped(dec["decode"])
        series = {n: [next((r.get("gbps") or 0.0 for r in recs if r["impl"] == n), 0.0) for recs in rows.values()]
                  for n in dec["impls"]}
        panels.append((f"Paged decode (read bandwidth {dec['read_gbps']:.0f} GB/s)", list(rows), series,
                       "GB/s of K+V read"))
    return panels


def write_png(results: dict, path: Path) -> str | None:
    """Draws every panel of plot_series; returns why nothing was written, or None."""
    panels = plot_series(results)
    if not panels:
        return "nothing to plot (no benchmark produced a row)"
    try:
        import matplotlib
    except ImportError:
        return MATPLOTLIB_MISSING
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    widest = max(len(labels) for _, labels, _, _ in panels)
    fig, axes = plt.subplots(len(panels), 1, figsize=(max(8, widest * 0.9), 4.2 * len(panels)), squeeze=False)
    for ax, (title, labels, series, ylabel) in zip(axes[:, 0], panels):
        _bars(ax, labels, series, ylabel, title)
    fig.suptitle(f"flashjit bench: {results['meta']['device']}, one run", fontsize=11)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return None


def write_all(results: dict, out_dir: Path) -> list[str]:
    """bench.md, bench.json and bench.png in out_dir; returns a line per file (written, or why not)."""
    out_dir.mkdir(parents=True, exist_ok=True)
    md, js, png = out_dir / "bench.md", out_dir / "bench.json", out_dir / "bench.png"
    md.write_text(markdown(results))
    write_json(results, js)
    lines = [f"markdown  {md}", f"json      {js}"]
    why_not = write_png(results, png)
    if why_not is not None and png.exists():
        png.unlink()  # a plot from an earlier run would pass for this one's
    lines.append(f"png       {png}" if why_not is None else f"png       not written: {why_not}")
    return lines
