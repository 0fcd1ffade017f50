"""What `flashjit numerics` writes from its rows: the markdown table and its
summary, JSON, a PNG of observed error against bound (where matplotlib is
installed), and the exit status. Plain Python: the CPU tests render synthetic rows."""

from __future__ import annotations

import json
from pathlib import Path

from ..bench.report import MATPLOTLIB_MISSING, version_text

# A bound is tight when the worst error observed reaches this fraction of it (within 20x).
TIGHT = 1 / 20
SHORT_DTYPE = {"float16": "fp16", "bfloat16": "bf16", "float32": "fp32", "float8_e4m3fn": "e4m3", "float8_e5m2": "e5m2"}


def _num(x, digits: int = 2) -> str:
    return "-" if x is None else f"{x:.{digits}e}"


def _ratio(x) -> str:
    return "-" if x is None else f"{x:.3f}"


def _status(row: dict) -> str:
    if row["status"] in ("ok", "over"):
        return "OVER" if row["status"] == "over" else "ok"
    return f"{row['status']}: {row.get('reason', '')}".replace("|", "/").replace("\n", " ")


def dtype_label(row: dict) -> str:
    """q's dtype, and an FP8 cache's after a slash: 'bf16', 'bf16/e4m3'."""
    q, kv = row["dtype"], row.get("kv_dtype", row["dtype"])
    return SHORT_DTYPE.get(q, q) + ("" if kv == q else "/" + SHORT_DTYPE.get(kv, kv))


def fp8_rows(rows: list[dict]) -> list[dict]:
    """Measured rows of FP8 KV-cache configurations (they carry the end-to-end errors)."""
    return [r for r in measured(rows) if "e2e_max_err" in r]


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
        groups.setdefault(f"{dtype_label(r)} {r['path']}", []).append(r["ratio"])
    return {k: (max(v), min(v)) for k, v in sorted(groups.items())}


def table(rows: list[dict]) -> str:
    """A row per (configuration, case); where any FP8 row was measured, a column of
    the end-to-end max error against the unquantised K/V, MLA's ckv / kpe ('-' for other rows)."""
    fp8 = bool(fp8_rows(rows))
    lines = ["| configuration | case | calls | max err | p99.9 err | mean err | max err/bound | LSE err/bound | "
             + ("FP8: max err vs unquantised K/V | " if fp8 else "") + "|",
             "|---|---|---|---|---|---|---|---|" + ("---|" if fp8 else "") + "|"]
    for r in rows:
        e2e = f" {_num(r.get('e2e_max_err'))} |" if fp8 else ""
        if r["status"] in ("ok", "over"):
            lines.append(f"| {r['config']} | {r['case']} | {r['calls']} | {_num(r['max_err'])} | "
                         f"{_num(r['p999_err'])} | {_num(r['mean_err'])} | {_ratio(r['ratio'])} | "
                         f"{_ratio(r.get('lse_ratio'))} |{e2e} {_status(r)} |")
        else:
            lines.append(f"| {r['config']} | {r['case']} | - | - | - | - | - | - |{e2e} {_status(r)} |")
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
    cost = fp8_cost(rows)
    if cost:
        lines.append("FP8 end to end (max err against float64 over the unquantised K/V, no bound; worst per dtype "
                     "and path, and that row's max err over the dequantised cache): "
                     + ", ".join(f"{k} {e2e:.2e} ({kernel:.2e})" for k, (e2e, kernel) in cost.items()))
    lines += [f"OVER  {r['config']} {r['case']}: max err/bound {_ratio(r['ratio'])}, LSE {_ratio(r.get('lse_ratio'))}"
              + (f", data-dependent {_ratio(r['data_ratio'])}" if "data_ratio" in r else "")
              + (f", its LSE {_ratio(r['data_lse_ratio'])}" if "data_lse_ratio" in r else "")
              + f", {r['nan']} NaN" for r in over(rows)]
    lines += [f"ERROR {r['config']} {r['case']}: {r.get('reason', '')}" for r in failed(rows)]
    lines += [f"LOOSE {r['config']}: worst err/bound {r['ratio']:.3f} ({r['case']})" for r in loose(rows)]
    return lines


def fp8_cost(rows: list[dict]) -> dict[str, tuple[float, float]]:
    """'bf16/e4m3 cc' -> (the worst end-to-end max error, that row's kernel max error)."""
    worst: dict[str, dict] = {}
    for r in fp8_rows(rows):
        key = f"{dtype_label(r)} {r['path']}"
        if key not in worst or r["e2e_max_err"] > worst[key]["e2e_max_err"]:
            worst[key] = r
    return {k: (r["e2e_max_err"], r["max_err"]) for k, r in sorted(worst.items())}


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
    fp8 = (". FP8 KV caches: ref is over the dequantised cache (codes times k_scale / v_scale; MLA: ckv_scale / "
           "kpe_scale), which the bound covers; the FP8 column is against float64 over the unquantised K/V (MLA: "
           "ckv / kpe) instead (what FP8 costs; no bound)." if fp8_rows(results["rows"]) else "")
    return "\n".join(["# flashjit numerics", "", head, "",
                      "err: |out - ref| elementwise against the float64 reference; bound: atol + rtol*|ref| of the "
                      "configuration's profile for each call's inputs; calls: seeds x calls per case" + fp8, "",
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
            panels.setdefault(dtype_label(r), {}).setdefault(r["path"], []).append(
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
