"""`flashjit bench`: the prefill and paged-decode benchmarks on the visible GPU,
flashjit beside whichever peers import (PyTorch SDPA always, FlashInfer when
installed), and the host time per call of every op (host.py), written as
markdown, JSON and a PNG.

Importing this package imports neither torch nor the benchmarks (the CLI reads
BENCHMARKS and PEERS to build its parser); run() loads them. benchmarks/prefill.py
and benchmarks/decode.py call these modules, so their tables and these are
the same tables, timed the same way (timing.py).
"""

from __future__ import annotations

import datetime
import sys
import traceback
from pathlib import Path

from ..selectors import check_head_dims
from ..spec import FA3_HEAD_DIMS, head_dims_text
from .decode_fp8 import kv_dtype_arg, kv_dtypes_of

# MLA runs from benchmarks/mla.py (not yet part of `flashjit bench`).
BENCHMARKS = ("prefill", "decode", "host")
# The prefill table's head dims unless --head-dim names others (prefill.rows).
PREFILL_HEAD_DIMS = (64, 128, 256)
PEERS = ("sdpa", "flashinfer")
HELP = "prefill and paged-decode benchmarks on this GPU, beside the peers that import; host time per call"
DESCRIPTION = ("Times flashjit beside PyTorch SDPA and FlashInfer (where importable) on the visible GPU, and the host "
               "time of a call of each op; writes bench.md, bench.json and bench.png (with matplotlib) to --out and "
               "prints the tables. Exit 1 where a flashjit output was wrong or a benchmark failed, 2 where no GPU is "
               "visible.")


def add_arguments(parser, positive_int) -> None:
    """`flashjit bench`'s options (positive_int: the CLI's argument type)."""
    parser.add_argument("--quick", action="store_true",
                        help="about a minute once the kernels are cached: prefill head_dim 128 at 1k and 4k tokens, "
                             "decode GQA 64x4k and 1x32k, no append rows")
    parser.add_argument("--out", default="flashjit-bench", help="folder for the reports (default: ./flashjit-bench)")
    parser.add_argument("--only", nargs="+", choices=BENCHMARKS, metavar="BENCHMARK",
                        help=f"the benchmarks to run: {', '.join(BENCHMARKS)} (default: all)")
    parser.add_argument("--peers", nargs="*", choices=PEERS, metavar="PEER",
                        help=f"the other libraries to time, of {', '.join(PEERS)} (default: every one that imports; "
                             f"--peers alone: flashjit alone); decode has no SDPA column (SDPA reads no paged cache)")
    parser.add_argument("--rounds", type=positive_int, default=3,
                        help="prefill: passes of reps samples per cell, every cell once a pass in shuffled order")
    parser.add_argument("--reps", type=positive_int, default=50, help="decode: timed samples per cell (median)")
    parser.add_argument("--head-dim", nargs="+", metavar="D",
                        help=f"prefill: the head dims of its rows (default: {', '.join(map(str, PREFILL_HEAD_DIMS))}; "
                             f"--quick: 128), each {head_dims_text()}; flashjit fa3 cells where fa3 generates "
                             f"it ({', '.join(map(str, FA3_HEAD_DIMS))}); the skewed batch, the decode rows and "
                             f"the host cases stay at 128")
    parser.add_argument("--kv-dtype", nargs="+", type=kv_dtype_arg, metavar="KV_DTYPE",
                        help="decode: the KV caches of each row, of bf16, e4m3, e5m2 (also fp8_e4m3, float8_e4m3fn, "
                             "...; default: bf16); an FP8 cache is the bf16 one quantised per tensor")


def no_gpu_reason() -> str | None:
    """Why the benchmarks cannot run here, or None."""
    try:
        import torch
    except ImportError:
        return "torch is not installed"
    if not torch.cuda.is_available():
        return "no CUDA GPU is visible (torch.cuda.is_available() is False)"
    return None


def _meta(quick: bool, flashinfer_version) -> dict:
    import torch

    from .._version import __version__
    from .report import git_commit

    return {"device": torch.cuda.get_device_name(), "date": datetime.datetime.now().isoformat(timespec="seconds"),
            "commit": git_commit(), "flashjit": __version__, "torch": torch.__version__,
            "cuda": torch.version.cuda, "flashinfer": flashinfer_version, "quick": quick, "argv": sys.argv[1:]}


def run(args) -> int:
    """The `flashjit bench` command (cli.py parses its arguments). Exit 2 where
    no GPU is visible; 1 where a benchmark failed or a flashjit output was
    wrong (the reports are written either way); 0 otherwise."""
    # --head-dim in its own words first, before torch is imported or a GPU probed (a SelectionError: exit 2).
    head_dims = check_head_dims(args.head_dim, ["batch_prefill_ragged"]) if getattr(args, "head_dim", None) else None
    reason = no_gpu_reason()
    if reason:
        print(f"flashjit bench: {reason}; the benchmarks need an NVIDIA GPU (SM80 or newer)", file=sys.stderr)
        return 2
    if Path(args.out).exists() and not Path(args.out).is_dir():  # before anything is built or timed
        print(f"flashjit bench: --out: expected a folder (made if missing), got the file {args.out}", file=sys.stderr)
        return 2
    import torch

    from flashjit import jit

    from . import decode, host, prefill
    from .report import Progress, markdown, write_all

    only = args.only or list(BENCHMARKS)
    plans, specs = {}, []
    if "prefill" in only:
        impls = prefill.implementations(peers=args.peers)
        rows = prefill.rows(quick=args.quick, head_dims=head_dims)
        plans["prefill"] = (rows, impls)
        specs += prefill.specs(rows, impls)
    if "decode" in only:
        rows = decode.rows(quick=args.quick)
        plans["decode"] = (rows, decode.libraries(peers=args.peers))
        specs += decode.specs(rows, kv_dtypes_of(args.kv_dtype))
    if "host" in only:
        plans["host"] = (host.CASES, None)
        specs += host.specs()
    specs = list(dict.fromkeys(specs))  # the host cases share configurations with the others
    # Every configuration in one parallel build, so that no row waits for nvcc
    # (and a cache miss under FLASHJIT_DISABLE_JIT stops here, naming the prewarm).
    print(f"flashjit bench: {', '.join(plans)} on {torch.cuda.get_device_name()}; building or loading "
          f"{len(specs)} configuration(s)", file=sys.stderr, flush=True)
    from ..cli_output import BuildProgressLine

    build_progress = BuildProgressLine(sys.stderr)
    try:
        jit.build_many(specs, progress=build_progress)
    finally:
        build_progress.finish()
    progress = Progress(sum(len(rows) for rows, _ in plans.values()))
    sections, status = {}, 0
    for name, (rows, peers) in plans.items():
        try:
            if name == "prefill":
                sections[name] = prefill.run(rows, peers, rounds=args.rounds, progress=progress)
            elif name == "host":
                sections[name] = host.run(progress=progress)
            else:
                sections[name] = decode.run(rows, peers, reps=args.reps, progress=progress,
                                            kv_dtypes=kv_dtypes_of(args.kv_dtype))
                status |= bool(sections[name]["failures"])
        except Exception as exc:  # the other benchmark still runs and the reports are still written
            traceback.print_exc()
            sections[name] = {"error": f"{type(exc).__name__}: {exc}"}
            status = 1
    flashinfer = sys.modules.get("flashinfer")  # imported above where a peer
    results = {"meta": _meta(args.quick, getattr(flashinfer, "__version__", None)), "sections": sections}
    print(markdown(results))
    for line in write_all(results, Path(args.out)):
        print(f"flashjit bench: {line}", file=sys.stderr)
    return 1 if status else 0
