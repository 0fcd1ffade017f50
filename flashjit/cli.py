"""The `flashjit` command: prewarm the cache, inspect it, describe this machine."""

from __future__ import annotations

import argparse
import itertools
import logging
import os
import sys
import time

from .arch import choose_backend
from .spec import DECODE_OPS, DTYPES, HEAD_DIMS, OPS, PLANNED_OPS, UTILITY_OPS, KernelSpec, canonical_dtype

# Ops whose wrapper always loads the LSE variant (it writes LSE only when asked).
ALWAYS_LSE = {"batch_prefill_ragged", "batch_prefill_paged", "batch_decode_paged"}
# Ops with no causal variant (one query token sees every key).
NO_CAUSAL = set(DECODE_OPS)

PRESETS = {
    "default": dict(ops=list(OPS), dtypes=["float16", "bfloat16", "float32"], head_dims=list(HEAD_DIMS)),
    "minimal": dict(ops=list(OPS), dtypes=["bfloat16"], head_dims=[128]),
}


def _switch(value: str) -> list:
    """on / off / both; auto (--tensor-cores only) is None: what the ops' auto choice takes."""
    return {"on": [True], "off": [False], "both": [False, True], "auto": [None]}[value]


def specs_from_args(args) -> list[KernelSpec]:
    preset = PRESETS[args.preset]
    ops = args.op or preset["ops"]
    dtypes = [canonical_dtype(d) for d in (args.dtype or preset["dtypes"])]
    head_dims = args.head_dim or preset["head_dims"]
    specs = []
    for op, dtype, head_dim, backend, tc, causal, window, cap, lse in itertools.product(
            ops, dtypes, head_dims, args.backend, _switch(args.tensor_cores), _switch(args.causal),
            _switch(args.window), _switch(args.soft_cap), _switch(args.lse)):
        if tc is None:
            tc = False if op in UTILITY_OPS else choose_backend(op, dtype, None, backend)[1]
        if tc and dtype == "float32":
            continue  # fp32 has no tensor-core kernel; "both" means the ones that exist
        if causal and op in NO_CAUSAL:
            continue
        if op in UTILITY_OPS and (tc or causal or window or cap or lse):
            continue  # a copy has one configuration per dtype and head_dim
        spec = KernelSpec.make(op, dtype, head_dim, backend=backend, use_tensor_cores=tc, causal=causal,
                               sliding_window=window, soft_cap=cap, return_lse=lse or op in ALWAYS_LSE)
        specs.append(spec.validate())
    return list(dict.fromkeys(specs))


def _tolerance_text(spec: KernelSpec) -> str:
    from .error_model import tolerance

    t = tolerance(spec, kv_len=4096, v_absmax=1.0)
    return f"rtol {t.rtol:.1e} atol {t.atol:.1e}*max|v|"


def cmd_prewarm(args) -> int:
    from . import jit

    try:
        specs = specs_from_args(args)
    except ValueError as exc:
        print(f"flashjit prewarm: {exc}", file=sys.stderr)
        return 2
    if not specs:
        print("flashjit prewarm: the selection is empty", file=sys.stderr)
        return 2
    print(f"flashjit prewarm: {len(specs)} configuration(s)", file=sys.stderr)
    started = time.monotonic()
    results = jit.build_many(specs, arches=args.arch, jobs=args.jobs, raise_first=False,
                             progress=lambda line: print(f"  {line}", file=sys.stderr, flush=True))
    rows = [("configuration", "built", "seconds", "tolerance (kv_len 4096)", "cache path")]
    failed = 0
    for r in results:
        if r.error is not None:
            failed += 1
            rows.append((r.spec.name, "FAILED", f"{r.seconds:.1f}", "-", "-"))
        else:
            rows.append((r.spec.name, "yes" if r.built else "cached", f"{r.seconds:.1f}", _tolerance_text(r.spec),
                         str(r.entry.path)))
    widths = [max(len(row[i]) for row in rows) for i in range(len(rows[0]))]
    for row in rows:
        print("  ".join(cell.ljust(w) for cell, w in zip(row, widths)).rstrip())
    print(f"{len(results) - failed} ready, {failed} failed, {time.monotonic() - started:.1f} s", file=sys.stderr)
    for r in results:
        if r.error is not None:
            print(f"\n{r.error}", file=sys.stderr)
    return 1 if failed else 0


def cmd_cache(args) -> int:
    from . import cache

    root = cache.default_root()
    if args.action == "clear":
        print(f"removed {cache.clear(root)} configuration(s) from {root}")
        return 0
    bad = 0
    count = 0
    for path, entry, problems in cache.iter_entries(root):
        count += 1
        if entry is None:
            bad += 1
            print(f"BAD  {path}: {'; '.join(problems)}")
        elif args.action == "list":
            m = entry.manifest
            size = entry.artifact.stat().st_size
            print(f"ok   {m['name']}  {','.join(m['arches'])}  {size / 1e6:.1f} MB  {path}")
    if args.action == "verify":
        print(f"{count - bad} of {count} entries verified in {root}")
    return 1 if bad else 0


def cmd_info(args) -> int:
    from . import __version__, arch, cache, jit

    print(f"flashjit      {__version__}")
    print(f"python        {sys.version.split()[0]}")
    try:
        import torch

        print(f"torch         {torch.__version__} (CUDA {torch.version.cuda})")
    except ImportError:
        torch = None
        print("torch         not installed")
    nvcc = arch.find_nvcc()
    print(f"nvcc          {nvcc} ({arch.nvcc_version(nvcc)})" if nvcc else f"nvcc          not found: {arch.NVCC_HINT}")
    print(f"cache dir     {cache.default_root()}")
    print(f"arch list     {os.environ.get('FLASHJIT_CUDA_ARCH_LIST') or '(this GPU, else ' + ' '.join(arch.DEFAULT_ARCHES) + ')'}")
    print(f"jit           {'disabled (FLASHJIT_DISABLE_JIT)' if jit.jit_disabled() else 'enabled'}")
    if torch is not None and torch.cuda.is_available():
        idx = torch.cuda.current_device()
        major, minor = torch.cuda.get_device_capability(idx)
        print(f"gpu           {torch.cuda.get_device_name(idx)} (sm_{major}{minor})")
        backends = []
        if major >= 8:
            backends.append("fa2 (SM80+)")
        if (major, minor) == (9, 0):
            backends.append("fa3 (SM90a)")
        print(f"backends      {', '.join(backends) or 'none: flashjit needs SM80+'}")
    else:
        print("gpu           none visible")
    print(f"ops           {', '.join(OPS)} (planned: {', '.join(PLANNED_OPS)})")
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="flashjit", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)
    pre = sub.add_parser("prewarm", help="build the cache for a set of configurations, in parallel")
    pre.add_argument("--op", nargs="+", choices=list(OPS) + list(PLANNED_OPS))
    pre.add_argument("--dtype", nargs="+", help=f"of {', '.join(DTYPES)} (or fp16, bf16, fp32)")
    pre.add_argument("--head-dim", nargs="+", type=int)
    pre.add_argument("--backend", nargs="+", default=["fa2"], choices=["fa2", "fa3"])
    pre.add_argument("--tensor-cores", default="auto", choices=["auto", "on", "off", "both"],
                     help="auto (default): what the ops pick when not told: tensor cores for fp16/bf16 prefill")
    pre.add_argument("--causal", default="both", choices=["on", "off", "both"])
    pre.add_argument("--window", default="off", choices=["on", "off", "both"])
    pre.add_argument("--soft-cap", default="off", choices=["on", "off", "both"])
    pre.add_argument("--lse", default="off", choices=["on", "off", "both"])
    pre.add_argument("--arch", nargs="+", help="e.g. sm_80 sm_89 sm_90a (default: this GPU, else all three)")
    pre.add_argument("--jobs", type=int, help="parallel nvcc jobs (default: $FLASHJIT_JOBS, else by cores/memory)")
    pre.add_argument("--preset", default="default", choices=sorted(PRESETS))
    pre.set_defaults(func=cmd_prewarm)
    cac = sub.add_parser("cache", help="list, verify or clear the cache")
    cac.add_argument("action", choices=["list", "verify", "clear"])
    cac.set_defaults(func=cmd_cache)
    inf = sub.add_parser("info", help="versions, toolchain, GPU, cache directory")
    inf.set_defaults(func=cmd_info)
    return parser


def main(argv=None) -> int:
    logging.basicConfig(level=os.environ.get("FLASHJIT_LOG_LEVEL", "INFO"), format="%(message)s")
    args = build_parser().parse_args(argv)
    from .errors import FlashjitError

    try:
        return args.func(args)
    except FlashjitError as exc:
        print(f"flashjit {args.command}: {exc}", file=sys.stderr)
        return 1


if __name__ == "__main__":
    sys.exit(main())
