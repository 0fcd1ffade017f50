"""What `flashjit numerics` writes from its rows: the markdown table and its
summary, JSON, a PNG of observed error against bound (where matplotlib is
installed), and the exit status. Plain Python: the CPU tests render synthetic rows."""

from __future__ import annotations

import json
from pathlib import Path

from ..bench.report import MATPLOTLIB_MISSING, version_text

# A bound is tight when the worst error observed reaches this fraction of it (within 20x).
TIGHT = 1 / 20
SHORT_DTYPE = {"float16": "fp16", "bfloat16": "bf16", "float32": "fp32"}


def _num(x, digits: int = 2) -> str:
    return "-" if x is None else f"{x:.{digits}e}"


def _ratio(x) -> str:
    return "-" if x is None else f"{x:.3f}"


def _status(row: dict) -> str:
    if row["status"] in ("ok", "over"):
        return "OVER" if row["status"] == "over" else "ok"
    return f"{row['status']}: {row.get('reason', '')}".replace("|", "/").replace("\n", " ")


def measured(rows: list[dict]) -> list[dict]:
    return [r for r in rows if r["status"] in ("ok", "over")]


def over(rows: list[dict]) -> list[dict]:
    return [r for r in rows if r["status"] == "over"]


def failed(rows: list[dict]) -> list[dict]:
    return [r for r in rows if r["status"] == "error"]


def worst_by_config(rows: list[dict]) -> dict[str, dict]:
    """Each measured configuration's row closest to its bound (output, not LSE)."""
    worst: dict[str, dict] = {}
    for r in measured(rows):
        if r["config"] not in worst or r["ratio"] > worst[r["config"]]["ratio"]:
            worst[r["config"]] = r
    return worst


def loose(rows: list[dict]) -> list[dict]:
    """Configurations whose bound stayed more than 20x above every error observed on any case."""
    return [r for r in worst_by_config(rows).values() if r["ratio"] < TIGHT]


def by_dtype_path(rows: list[dict]) -> dict[str, tuple[float, float]]:
    """'bf16 fa2' -> (worst ratio, the loosest configuration's worst ratio)."""
    groups: dict[str, list[float]] = {}
    for r in worst_by_config(rows).values():
        groups.setdefault(f"{SHORT_DTYPE.get(r['dtype'], r['dtype'])} {r['path']}", []).append(r["ratio"])
    return {k: (max(v), min(v)) for k, v in sorted(groups.items())}


def table(rows: list[dict]) -> str:
    lines = ["| configuration | case | calls | max err | p99.9 err | mean err | max err/bound | LSE err/bound | |",
             "|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        if r["status"] in ("ok", "over"):
            lines.append(f"| {r['config']} | {r['case']} | {r['calls']} | {_num(r['max_err'])} | "
                         f"{_num(r['p999_err'])} | {_num(r['mean_err'])} | {_ratio(r['ratio'])} | "
                         f"{_ratio(r.get('lse_ratio'))} | {_status(r)} |")
        else:
            lines.append(f"| {r['config']} | {r['case']} | - | - | - | - | - | - | {_status(r)} |")
    return "\n".join(lines)


def summary(rows: list[dict]) -> list[str]:
    configs = {r["config"] for r in rows}
    skipped = {r["config"] for r in rows if r["status"] == "skipped"}
    lines = [f"{len(configs)} configuration(s), {len(measured(rows))} (configuration, case) rows measured, "
             f"{len(skipped)} configuration(s) skipped, {len(failed(rows))} error(s); "
             f"over the bound: {len(over(rows))}; looser than 20x (worst err/bound < {TIGHT:g} on every case): "
             f"{len(loose(rows))}"]
    groups = by_dtype_path(rows)
    if groups:
        lines.append("worst err/bound by dtype and path (worst; loosest configuration's worst): "
                     + ", ".join(f"{k} {a:.3f}; {b:.3f}" for k, (a, b) in groups.items()))
    lines += [f"OVER  {r['config']} {r['case']}: max err/bound {_ratio(r['ratio'])}, LSE {_ratio(r.get('lse_ratio'))}"
              + (f", data-dependent {_ratio(r['data_ratio'])}" if "data_ratio" in r else "")
              + (f", its LSE {_ratio(r['data_lse_ratio'])}" if "data_lse_ratio" in r else "")
              + f", {r['nan']} NaN" for r in over(rows)]
    lines += [f"ERROR {r['config']} {r['case']}: {r.get('reason', '')}" for r in failed(rows)]
    lines += [f"LOOSE {r['config']}: worst err/bound {r['ratio']:.3f} ({r['case']})" for r in loose(rows)]
    return lines


def data_rows(rows: list[dict]) -> list[dict]:
    """Measured rows also checked against the data-dependent bound (CUDA-core configurations)."""
    return [r for r in measured(rows) if "data_ratio" in r]


def data_section(rows: list[dict]) -> list[str]:
    """The CUDA-core rows against error_bound.py's per-element bound, and each
    dtype's worst and loosest configuration; [] where no row has it."""
    chosen = data_rows(rows)
    if not chosen:
        return []
    lines = ["## CUDA cores: the data-dependent bound", "",
             "err/bound against the sound per-element bound computed from each call's own inputs "
             "(flashjit.error_bound; docs/numerics-fp32.md)", "",
             "| configuration | case | max err/bound | LSE err/bound |", "|---|---|---|---|"]
    lines += [f"| {r['config']} | {r['case']} | {_ratio(r['data_ratio'])} | {_ratio(r.get('data_lse_ratio'))} |"
              for r in chosen]
    worst: dict[str, float] = {}
    for r in chosen:
        worst[r["config"]] = max(worst.get(r["config"], 0.0), r["data_ratio"])
    by_dtype: dict[str, list[float]] = {}
    for r in chosen:
        by_dtype.setdefault(SHORT_DTYPE.get(r["dtype"], r["dtype"]), []).append(worst[r["config"]])
    loose = sorted(c for c, w in worst.items() if w < TIGHT)
    lines += ["", "worst err/bound by dtype (worst; loosest configuration's worst): "
              + ", ".join(f"{d} {max(v):.3f}; {min(v):.3f}" for d, v in sorted(by_dtype.items()))
              + f"; looser than 20x on every case: {len(loose)}"]
    return lines + [f"LOOSE {c}: worst err/bound {worst[c]:.3f}" for c in loose]


def markdown(results: dict) -> str:
    meta = results.get("meta", {})
    # flashjit's version with its commit where known (bench.report.git_commit), then the rest.
    head = "; ".join(version_text(meta) if k == "flashjit" else f"{k} {v}" for k, v in meta.items()
                     if k not in ("argv", "commit") and v is not None)
    data = data_section(results["rows"])
    return "\n".join(["# flashjit numerics", "", head, "",
                      "err: |out - ref| elementwise against the float64 reference; bound: atol + rtol*|ref| of the "
                      "configuration's profile for each call's inputs; calls: seeds x calls per case", "",
                      table(results["rows"]), "", *summary(results["rows"]), *([""] + data if data else []), ""])


def write_json(results: dict, path: Path) -> None:
    # An error that is NaN or infinite stays so: json writes Infinity / NaN and reads them back.
    Path(path).write_text(json.dumps(results, indent=1) + "\n")


def read_json(path: Path) -> dict:
    return json.loads(Path(path).read_text())


def exit_code(rows: list[dict]) -> int:
    """1 where any case exceeded its bound or failed to run; 0 otherwise (skipped ones are no failure)."""
    return 1 if over(rows) or failed(rows) else 0


def plot_points(rows: list[dict]) -> dict[str, dict[str, list[tuple[float, float]]]]:
    """dtype -> path -> (bound, error) at each row's element closest to its bound;
    errors of 0 are left out (a log scale has no place for them)."""
    panels: dict[str, dict[str, list[tuple[float, float]]]] = {}
    for r in measured(rows):
        if r.get("worst_bound") and r.get("worst_err"):
            panels.setdefault(SHORT_DTYPE.get(r["dtype"], r["dtype"]), {}).setdefault(r["path"], []).append(
                (r["worst_bound"], r["worst_err"]))
    return panels


def write_png(rows: list[dict], path: Path, title: str = "flashjit numerics") -> str | None:
    """Observed error against bound, a panel per dtype, a series per path; the
    line err = bound (nothing may lie above it) and err = bound/20 (tight above it).
    Returns why nothing was written, or None."""
    panels = plot_points(rows)
    if not panels:
        return "nothing to plot (no case measured a nonzero error)"
    try:
        import matplotlib
    except ImportError:
        return MATPLOTLIB_MISSING
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, len(panels), figsize=(5.2 * len(panels), 4.6), squeeze=False)
    for ax, (dtype, series) in zip(axes[0], sorted(panels.items())):
        bounds = [b for points in series.values() for b, _ in points]
        lo, hi = min(bounds) / 2, max(bounds) * 2
        ax.plot([lo, hi], [lo, hi], color="black", linewidth=1, label="err = bound")
        ax.plot([lo, hi], [lo * TIGHT, hi * TIGHT], color="gray", linestyle="--", linewidth=1, label="err = bound/20")
        for path_name, points in sorted(series.items()):
            ax.scatter([b for b, _ in points], [e for _, e in points], s=14, label=path_name)
        ax.set_xscale("log")
        ax.set_yscale("log")
        ax.set_xlabel("bound at the worst element")
        ax.set_ylabel("|out - ref| there")
        ax.set_title(dtype, fontsize=10)
        ax.legend(fontsize=7)
    fig.suptitle(title, fontsize=11)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return None
