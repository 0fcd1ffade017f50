"""`flashjit numerics` and `flashjit.numerics.measure()`: every selected
configuration on many fresh random inputs, hard ones included (peaked softmax,
V outliers, long contexts, skewed batches, near-empty rows), against the
float64 reference, each call within the configuration's own tolerance profile.

Soundness is every row's max err/bound <= 1; tightness is each configuration's
worst row above 1/20 (docs/numerics.md, "Measuring it"). An FP8 KV-cache
configuration (--kv-dtype; MLA's too) is measured against float64 over its
dequantised cache, and reports beside it its end-to-end error against the
unquantised K/V (runner.py); one that is not generated yet is a skipped row saying so.

Importing this package imports no torch (the CLI builds its parser from
catalog.CASES); measure() and run() load the GPU parts.
"""

from __future__ import annotations

import sys
import time
from pathlib import Path

from .catalog import CASES, DEFAULT_CASES, describe, not_generated


HELP = "every selected configuration against the float64 reference on hard inputs, on this GPU"
DESCRIPTION = ("Runs the selected configurations (prewarm's selectors; backends: this GPU's) on --seeds fresh random "
               "draws of each case, against the float64 reference, and reports per configuration and case max, "
               "p99.9 and mean |err| and max err/bound. Cases: " + "; ".join(f"{k}: {v}" for k, v in CASES.items())
               + ". With --kv-dtype, FP8 KV-cache configurations: the error against float64 over the dequantised "
               "cache (within the profile) and, beside it, against the unquantised K/V (what FP8 costs); those not "
               "generated yet are skipped. Exit 1 where a case exceeded its bound or failed, 2 for a bad flag or "
               "where no GPU is visible.")


def add_arguments(parser, positive_int) -> None:
    """The flags of `flashjit numerics` beside prewarm's selectors."""
    parser.add_argument("--cases", nargs="+", choices=list(CASES), metavar="CASE",
                        help=f"the cases to run: {', '.join(CASES)} (default: {' '.join(DEFAULT_CASES)})")
    parser.add_argument("--seeds", type=positive_int, default=3, help="fresh random draws per case (default 3)")
    parser.add_argument("--seed", type=int, default=0, help="base of the draws' seeds (default 0)")
    parser.add_argument("--long", action="store_true", help="add the 128k-context case (long128k)")
    parser.add_argument("--json", metavar="FILE", help="every row as JSON")
    parser.add_argument("--plot", metavar="FILE.png", help="observed error against bound (needs matplotlib)")
    parser.add_argument("--out", metavar="FILE.md", help="the markdown report (also printed)")
    parser.add_argument("--jobs", type=positive_int,
                        help="parallel nvcc jobs (default: $FLASHJIT_JOBS, else by cores/memory)")


def case_list(cases=None, long: bool = False) -> list[str]:
    """The cases to run, in catalog order; `long` adds the 128k-context one."""
    chosen = list(cases) if cases else list(DEFAULT_CASES)
    unknown = [c for c in chosen if c not in CASES]
    if unknown:
        raise ValueError(f"case: expected some of {', '.join(CASES)}, got {', '.join(map(repr, unknown))}")
    if long and "long128k" not in chosen:
        chosen.append("long128k")
    return [c for c in CASES if c in chosen]


def measure(specs, cases=None, seeds: int = 3, *, long: bool = False, seed: int = 0, progress=None) -> list[dict]:
    """Measures each KernelSpec on `seeds` fresh draws of each case (default:
    every case but the 128k one, which `long` adds) on the current GPU.

    Returns one row per (configuration, case): max, p99.9 and mean |err|, max
    err/bound (and LSE err/bound where the op returns LSE), NaN count, the
    bound and error at the element closest to its bound; status "ok" or "over".
    A configuration the ops cannot run exactly here (strict: fa3 off sm_90a) is
    one row with status "skipped", as is an FP8 KV-cache configuration that is
    not generated yet; a case that raised, status "error". FP8 rows also hold
    e2e_max_err, e2e_p999_err and e2e_mean_err: the errors against float64 over
    the unquantised K/V (MLA: ckv / kpe). progress(line) is called once per
    configuration."""
    import torch

    from ..spec import UTILITY_OPS
    from . import runner

    if not torch.cuda.is_available():
        raise RuntimeError("flashjit.numerics.measure needs a CUDA GPU (none is visible)")
    if not isinstance(seeds, int) or seeds < 1:
        raise ValueError(f"seeds: expected a positive int, got {seeds!r}")
    chosen = case_list(cases, long)
    workspace = torch.empty(runner.WORKSPACE_BYTES, dtype=torch.uint8, device="cuda")
    rows: list[dict] = []
    for spec in specs:
        skipped = not_generated_row(spec)  # validates the spec: any other refusal raises
        if skipped is not None:
            spec_rows = [skipped]
        elif spec.op in UTILITY_OPS:
            spec_rows = [{**describe(spec), "case": "-", "status": "skipped",
                          "reason": f"{spec.op} copies K/V exactly: no error to measure"}]
        else:
            spec_rows = runner.measure_spec(spec, chosen, seeds, seed, workspace)
        rows += spec_rows
        if progress is not None:
            progress(_progress_line(spec.name, spec_rows))
    return rows


def not_generated_row(spec) -> dict | None:
    """The skipped row of a configuration that is not generated yet (an FP8 KV cache
    on an op or backend that does not read one); None for any other."""
    try:
        spec.validate()
    except ValueError as exc:
        reason = not_generated(exc)
        if reason is not None:
            return {**describe(spec), "case": "-", "status": "skipped", "reason": reason}
        raise
    return None


def fp8_left_out(args, arches, selected) -> list[dict]:
    """Skipped rows for the FP8 KV-cache configurations the selectors name but the
    selection leaves out because they are not generated yet: each fp16/bf16
    configuration of the same selectors with each --kv-dtype, where
    KernelSpec.validate() says "not yet generated"."""
    import copy

    from ..selection import SelectionError, specs_from_args
    from ..spec import TENSOR_CORE_DTYPES, UTILITY_OPS

    if not getattr(args, "kv_dtype", None):
        return []
    plain_args = copy.copy(args)
    plain_args.kv_dtype = None
    try:
        plain = specs_from_args(plain_args, arches)
    except SelectionError:
        return []
    rows = {}
    for spec in plain:
        if spec.dtype_q not in TENSOR_CORE_DTYPES or spec.op in UTILITY_OPS:
            continue
        for kv_dtype in args.kv_dtype:
            fp8 = spec.replace(dtype_kv=kv_dtype)
            if fp8 not in selected and fp8.name not in rows:
                row = not_generated_row(fp8)
                if row is not None:
                    rows[fp8.name] = row
    return list(rows.values())


def _progress_line(name: str, rows: list[dict]) -> str:
    done = [r for r in rows if r["status"] in ("ok", "over")]
    if not done:
        return f"{name}: {rows[0]['status'] if rows else 'no case applies'}"
    worst = max(done, key=lambda r: r["ratio"])
    flag = {"over": "  OVER"}.get(worst["status"], "")
    errors = sum(r["status"] == "error" for r in rows)
    return (f"{name}: worst err/bound {worst['ratio']:.3f} ({worst['case']}){flag}"
            + (f", {errors} case(s) failed" if errors else ""))


def _meta(args, seeds: int) -> dict:
    import datetime

    import torch

    from .._version import __version__
    from ..bench.report import git_commit

    return {"device": torch.cuda.get_device_name(), "date": datetime.datetime.now().isoformat(timespec="seconds"),
            "commit": git_commit(), "flashjit": __version__, "torch": torch.__version__, "cuda": torch.version.cuda,
            "seeds": seeds, "seed": args.seed, "argv": sys.argv[1:]}


def run(args) -> int:
    """The `flashjit numerics` command (cli.py parses its arguments). Exit 2
    without a GPU or for a bad selection; 1 where a case exceeded its bound, a
    case failed or a build failed (the reports are written either way); 0 otherwise."""
    from ..selectors import check_selectors

    # The flags first, in their own words: no torch, no GPU probe (SelectionError: exit 2).
    check_selectors(args)
    from .. import arch, build, cache_ship, jit
    from ..bench import no_gpu_reason
    from ..cache_root import cache_root
    from ..cli_output import BuildProgressLine
    from ..selection import SelectionError, specs_from_args
    from ..spec import UTILITY_OPS
    from . import report

    try:
        cases = case_list(args.cases, args.long)
    except ValueError as exc:
        print(f"flashjit numerics: {exc}", file=sys.stderr)
        return 2
    for name in ("out", "json", "plot"):  # before anything is built or measured
        path = getattr(args, name)
        if path and (Path(path).is_dir() or not Path(path).resolve().parent.is_dir()):
            print(f"flashjit numerics: --{name}: expected a file in an existing folder, got {path}", file=sys.stderr)
            return 2
    reason = no_gpu_reason()
    if reason:
        print(f"flashjit numerics: {reason}; measuring needs an NVIDIA GPU (SM80 or newer)", file=sys.stderr)
        return 2
    # The settings the build reads, through the library's parsers, before anything is built (as prewarm).
    if args.jobs is None:
        build.default_jobs()
    jit.jit_disabled()
    arch.env_nvcc()
    cache_ship.readonly_roots()
    # The backends of this GPU: what the ops run here (name fa3 and fa2 to measure both).
    arches = (arch.device_arch(),)
    try:
        specs = specs_from_args(args, arches)
    except SelectionError as exc:
        # Only FP8 configurations that are not generated yet: skipped rows, not a bad selection.
        if not (str(exc).startswith("the selection is empty") and fp8_left_out(args, arches, [])):
            raise
        specs = []
    skipped = fp8_left_out(args, arches, specs)
    left_out = [s for s in specs if s.op in UTILITY_OPS]
    specs = [s for s in specs if s.op not in UTILITY_OPS]
    if not specs and not skipped:
        print("flashjit numerics: the selection has no configuration this command measures (attention ops and "
              "mla_paged; append_paged copies K/V exactly)", file=sys.stderr)
        return 2
    print(f"flashjit numerics: {len(specs)} configuration(s) on {arch.device_name()}, cases {', '.join(cases)}, "
          f"{args.seeds} seed(s)" + (f"; {len(left_out)} append_paged left out (an exact copy)" if left_out else "")
          + (f"; {len(skipped)} FP8 configuration(s) skipped (not generated yet)" if skipped else ""),
          file=sys.stderr, flush=True)
    built = []
    if specs:
        progress = BuildProgressLine(sys.stderr)
        try:
            built = jit.build_many(specs, jobs=args.jobs, root=cache_root(create=True), raise_first=False,
                                   progress=progress)
        finally:
            progress.finish()
    broken = {r.spec for r in built if r.error is not None}
    rows = skipped + [{**describe(r.spec), "case": "-", "status": "error", "reason": "build failed (see above)"}
                      for r in built if r.error is not None]
    for r in built:
        if r.error is not None:
            print(f"\n{r.error}", file=sys.stderr)
    from ..bench.report import Progress

    started = time.monotonic()
    rows += measure([s for s in specs if s not in broken], cases, args.seeds, seed=args.seed,
                    progress=Progress(len(specs) - len(broken)))
    results = {"meta": {**_meta(args, args.seeds), "seconds": round(time.monotonic() - started, 1)}, "rows": rows}
    text = report.markdown(results)
    print(text)
    if args.out:
        Path(args.out).write_text(text)
        print(f"flashjit numerics: markdown  {args.out}", file=sys.stderr)
    if args.json:
        report.write_json(results, Path(args.json))
        print(f"flashjit numerics: json      {args.json}", file=sys.stderr)
    if args.plot:
        why_not = report.write_png(rows, Path(args.plot), f"flashjit numerics: {results['meta']['device']}")
        print(f"flashjit numerics: png       {args.plot if why_not is None else 'not written: ' + why_not}",
              file=sys.stderr)
    return final_status(rows)


def final_status(rows: list[dict], stream=None) -> int:
    """The last line on stderr, and the exit status it goes with."""
    from . import report

    stream = stream or sys.stderr
    code = report.exit_code(rows)
    bad = report.over(rows) + report.failed(rows)
    if code:
        names = ", ".join(f"{r['config']} ({r['case']}, {r['status']})" for r in bad[:5])
        more = f" and {len(bad) - 5} more" if len(bad) > 5 else ""
        print(f"flashjit numerics: {len(report.over(rows))} case(s) over their bound, {len(report.failed(rows))} "
              f"failed: {names}{more}", file=stream)
    else:
        skipped = len({r["config"] for r in rows if r["status"] == "skipped"})
        print(f"flashjit numerics: every case within its bound ({len(report.measured(rows))} measured)"
              + (f"; {skipped} configuration(s) skipped" if skipped else ""), file=stream)
    return code

