"""Issue-45 speed tables in one run on one GPU: prefill and paged decode at the
head dims models serve beyond 64/128/256, beside their peers, and what
attention sinks cost on the rows of benchmarks/prefill.py and benchmarks/decode.py.

Prefill (--prefill-head-dims, default 96 and 192/128): prefill.py's rows (16k
tokens, 2048 // head_dim_qk heads, 1k-16k per request, causal and not), bf16,
TFLOP/s = 2·B·H·S²·(D_qk + D_vo), halved when causal; flashjit fa2 and fa3 (fa3
cells n/a where it does not generate the shape), SDPA flash and cuDNN,
FlashInfer fa2 and fa3 (prefill.implementations()).

Decode (--decode-head-dims, default 96 and 192): the B64 L4k GQA 32/8 row of
decode.py, flashjit on CUDA cores and tensor cores, FlashInfer both, each output
checked against float32 attention; µs and the fraction of the copy bandwidth
(the issue's target: >= 90%) and of the read bandwidth.

Sinks (--sink-head-dims, default prefill.py's): each prefill.py row with
flashjit fa2 and fa3 with and without a sink per head; each decode.py row
(head_dim 128) on CUDA cores and tensor cores with and without (the with-sinks
output checked against the reference with the sinks). Cost: the extra time with
sinks (target <= 3%). --graphs: every sinks cell replays a CUDA graph of one call,
so that the cost is the kernel's alone, not the host's (a call with sinks takes
the wrapper's full run() path, one without its fast slot).

Usage: python benchmarks/dev/head_dims_sinks.py [--only prefill decode sinks] [--prefill-head-dims 96 192/128]
       [--decode-head-dims 96 192] [--sink-head-dims 64 128 256] [--graphs] [--rounds 3] [--reps 30]
       [--out FILE] [--json FILE]
"""

from __future__ import annotations

import argparse
import json
import os
import sys

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

import torch  # noqa: E402
from common import emit  # noqa: E402

from flashjit import jit  # noqa: E402
from flashjit.bench import decode as dec  # noqa: E402
from flashjit.bench import prefill as pre  # noqa: E402
from flashjit.bench.timing import time_us  # noqa: E402
from flashjit.kernels import fa3  # noqa: E402
from flashjit.spec import KernelSpec  # noqa: E402

DECODE_ROW = dec.ROWS[0]  # ("GQA 64x4k 32/8", 64, 4096, 32, 8)


def graphed(make):
    """A maker whose call replays a CUDA graph of one call of make's (captured at
    the first call, after one eager call that builds and checks everything)."""
    def make_graphed(*args, **kwargs):
        fn, graphs = make(*args, **kwargs), []

        def run(q, k, v):
            if not graphs:
                fn(q, k, v)
                torch.cuda.synchronize()
                graphs.append(torch.cuda.CUDAGraph())
                with torch.cuda.graph(graphs[0]):
                    fn(q, k, v)
            graphs[0].replay()
        return run
    return make_graphed


def dims(text: str) -> tuple[int, int | None]:
    """'192/128' -> (192, 128); '96' -> (96, None)."""
    qk, _, vo = text.partition("/")
    return int(qk), int(vo) if vo else None


def prefill_rows(head_dims, seqlens=(1024, 4096, 16384)) -> list[dict]:
    out = []
    for qk, vo in head_dims:
        h = 2048 // qk
        for s in seqlens:
            b = 16384 // s
            for causal in (False, True):
                out.append(dict(qk=qk, vo=vo, label=f"{b} x {s}", causal=causal, heads=h, lens=[s] * b,
                                flops=pre.attention_flops(b, h, s, qk, causal, vo), reps=15 if s == 16384 else 10))
    return out


# FlashInfer 0.7.2 at head dim 96 (fa2 and fa3 prefill, tensor-core decode): an illegal
# memory access on an H100, which ends the process's CUDA context; its cells there are n/a.
FLASHINFER_FA3_DIMS = {(64, None), (128, None), (256, None), (192, 128)}
FLASHINFER_FAILS = {96}


def prefill_section(rows, impls, rounds, title) -> tuple[list[str], list[dict]]:
    lines = [title, "", "| head_dim | batch x S | causal | " + " | ".join(impls) + " |",
             "|---|---|---|" + "---|" * len(impls)]
    records = []
    for row in rows:
        runs = {name: make for name, make in impls.items()
                if not name.startswith("flashinfer") or (row["qk"] not in FLASHINFER_FAILS and (
                    name != "flashinfer-fa3" or (row["qk"], row["vo"]) in FLASHINFER_FA3_DIMS))}
        res = pre.run_row(runs, row["lens"], row["lens"], row["heads"], row["qk"], row["causal"], row["flops"],
                          reps=row["reps"], rounds=rounds, head_dim_vo=row["vo"])
        res["values"] = {name: res["values"].get(name) for name in impls}
        name = f"{row['qk']}/{row['vo']}" if row["vo"] else str(row["qk"])
        cells = [f"{v:.0f}" if v is not None else "n/a" for v in res["values"].values()]
        lines.append(f"| {name} | {row['label']} | {row['causal']} | " + " | ".join(cells) + " |")
        print(lines[-1], flush=True)
        records.append({**{k: row[k] for k in ("qk", "vo", "label", "causal", "heads")}, **res})
        torch.cuda.empty_cache()
    return lines, records


def sink_cost_lines(records) -> list[str]:
    """Per flashjit backend: the worst and median extra time with sinks over the rows both cells ran."""
    out = []
    for backend in ("fa2", "fa3"):
        base, with_sinks = f"flashjit {backend}", f"flashjit {backend} +sinks"
        costs = sorted(r["values"][base] / r["values"][with_sinks] - 1 for r in records
                       if r["values"].get(base) and r["values"].get(with_sinks))
        if costs:
            out.append(f"{base}: sinks cost median {costs[len(costs) // 2]:+.1%}, worst {costs[-1]:+.1%} "
                       f"over {len(costs)} rows (+ = slower with sinks)")
    return out


def decode_cells(libs, ws, row, head_dim, reps, baselines, sinks: bool) -> dict:
    """{label: record} for each library and core kind (and, with sinks, flashjit with a sink per head)."""
    label, batch, kv_len, qo_heads, kv_heads = row
    torch.manual_seed(0)
    cache, indptr, indices, last = dec.paged_cache(batch, kv_len, kv_heads, head_dim=head_dim)
    q = torch.randn(batch, qo_heads, head_dim, dtype=dec.BF16, device="cuda")
    sink = torch.randn(qo_heads, dtype=torch.float32, device="cuda") * 2
    nbytes = batch * kv_len * kv_heads * head_dim * 2 * cache.element_size()
    ref = dec.reference(q, cache, indices, kv_len)
    ref_sinks = dec.reference(q, cache, indices, kv_len, sinks=sink) if sinks else None
    cells = {}
    for lib_name, lib in libs.items():
        if lib_name == "flashinfer" and head_dim in FLASHINFER_FAILS:
            cells.update({f"flashinfer {k}": {"error": "n/a: FlashInfer 0.7.2 faults at this head dim"}
                          for k in ("cc", "tc")})
            continue
        for tc in (False, True):
            variants = [("", {}, ref)] + ([(" +sinks", {"sinks": sink}, ref_sinks)]
                                          if sinks and lib_name == "flashjit" else [])
            for suffix, extra, expected in variants:
                name = f"{lib_name} {'tc' if tc else 'cc'}{suffix}"
                try:
                    w = lib.BatchDecodeWithPagedKVCacheWrapper(ws[lib_name], kv_layout="NHD", use_tensor_cores=tc)
                    w.plan(indptr, indices, last, qo_heads, kv_heads, head_dim, dec.PAGE, q_data_type=dec.BF16)
                    fn = (lambda w=w, extra=extra: w.run(q, cache, **extra))
                    ok, max_err, rel = dec.check(fn(), expected)
                    if not ok:
                        cells[name] = {"error": f"FAIL max err {max_err:.3g}, rel {rel:.3g}"}
                        print(f"FAIL {name} d{head_dim} {label}", file=sys.stderr, flush=True)
                        continue
                    us = time_us(fn, reps)[0]
                    gbps = nbytes / us / 1e3
                    cells[name] = {"us": us, "gbps": gbps, "copy": gbps / baselines["copy"],
                                   "read": gbps / baselines["read"]}
                except Exception as exc:
                    cells[name] = {"error": f"{type(exc).__name__}: {str(exc).splitlines()[0][:120]}"}
                    print(f"{name} d{head_dim} {label}: {cells[name]['error']}", file=sys.stderr, flush=True)
    del cache, q, ref, ref_sinks
    torch.cuda.empty_cache()
    return cells


def decode_cell(c: dict) -> str:
    if "error" in c:
        return c["error"].replace("|", "/")
    return f"{c['us']:.1f} · {c['gbps']:.0f} · copy {c['copy']:.0%} · read {c['read']:.0%}"


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--only", nargs="+", choices=("prefill", "decode", "sinks"),
                        default=["prefill", "decode", "sinks"])
    parser.add_argument("--prefill-head-dims", nargs="+", default=["96", "192/128"])
    parser.add_argument("--decode-head-dims", type=int, nargs="+", default=[96, 192])
    parser.add_argument("--sink-head-dims", type=int, nargs="+", default=None)
    parser.add_argument("--fa3-tiling", action="append", default=[], metavar="D=Fa3Tiling(...)",
                        help="replaces kernels.fa3.FA3_TILINGS[D] for this run (an A/B of a tiling, one process each)")
    parser.add_argument("--impls", nargs="+", help="the prefill table's implementations (default: all available)")
    parser.add_argument("--graphs", action="store_true",
                        help="time the sinks table's cells as CUDA graph replays (the kernel's cost alone)")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--reps", type=int, default=30)
    parser.add_argument("--out")
    parser.add_argument("--json")
    args = parser.parse_args()
    for text in args.fa3_tiling:
        d, _, expr = text.partition("=")
        fa3.FA3_TILINGS[int(d)] = eval(expr, {"Fa3Tiling": fa3.Fa3Tiling})
    prefill_dims = [dims(d) for d in args.prefill_head_dims]
    sink_rows = pre.rows(head_dims=args.sink_head_dims, skewed=False)
    specs = []
    if "prefill" in args.only:
        for row in prefill_rows(prefill_dims):
            specs += [KernelSpec.make("batch_prefill_ragged", "bfloat16", row["qk"], head_dim_vo=row["vo"],
                                      use_tensor_cores=True, causal=row["causal"], return_lse=True)]
    if "sinks" in args.only:
        specs += pre.specs(sink_rows, {"flashjit fa2": None, "flashjit fa3": None})
    decode_dims = (args.decode_head_dims if "decode" in args.only else []) + ([dec.D] if "sinks" in args.only else [])
    specs += [KernelSpec.make("batch_decode_paged", "bfloat16", d, use_tensor_cores=tc, return_lse=True)
              for d in dict.fromkeys(decode_dims) for tc in (False, True)]
    jit.build_many(list(dict.fromkeys(specs)))  # one parallel build before any timing
    lines, records = [f"device: {torch.cuda.get_device_name()}, bf16, torch {torch.__version__}"], {}
    if "decode" in args.only or "sinks" in args.only:
        read, copy = dec.bandwidth_baselines(10)
        torch.cuda.empty_cache()
        baselines = {"read": max(read.values()), "copy": copy}
        libs = dec.libraries()
        ws = {name: torch.zeros(256 << 20, dtype=torch.uint8, device="cuda") for name in libs}
        lines += ["", f"read bandwidth {baselines['read']:.0f} GB/s, copy bandwidth {copy:.0f} GB/s"]
    if "decode" in args.only:
        row = DECODE_ROW
        cells = {d: decode_cells(libs, ws, row, d, args.reps, baselines, sinks=False) for d in args.decode_head_dims}
        names = list(next(iter(cells.values())))
        lines += ["", f"## Paged decode {row[0]} at other head dims (µs · GB/s of K+V · fraction of copy and read "
                      "bandwidth; target copy >= 90%)", "",
                  "| head_dim | " + " | ".join(names) + " |", "|---|" + "---|" * len(names)]
        lines += [f"| {d} | " + " | ".join(decode_cell(c[n]) for n in names) + " |" for d, c in cells.items()]
        records["decode"] = {str(d): c for d, c in cells.items()}
    if "prefill" in args.only:
        impls = pre.implementations(only=args.impls)
        part, records["prefill"] = prefill_section(
            prefill_rows(prefill_dims), impls, args.rounds,
            "## Prefill at other head dims (TFLOP/s, median of rounds x reps samples, shuffled passes)")
        lines += ["", *part]
    if "sinks" in args.only:
        impls = {name: pre.flashjit_ragged(b, sinks=s) for b in ("fa2", "fa3") for s in (False, True)
                 for name in [f"flashjit {b}{' +sinks' if s else ''}"]}
        if args.graphs:
            impls = {name: graphed(make) for name, make in impls.items()}
        sink_prefill = [dict(qk=r["head_dim"], vo=None, lens=r["qo_lens"], **{k: r[k] for k in
                             ("label", "causal", "heads", "flops", "reps")}) for r in sink_rows]
        part, records["sinks_prefill"] = prefill_section(sink_prefill, impls, args.rounds,
                                                         "## Sinks on prefill.py's rows (TFLOP/s"
                                                         + (", CUDA graph replays)" if args.graphs else ")"))
        lines += ["", *part, "", *sink_cost_lines(records["sinks_prefill"])]
        lines += ["", "## Sinks on decode.py's rows (head_dim 128; µs · GB/s · fraction of copy and read bandwidth)",
                  ""]
        flashjit_only = {"flashjit": libs["flashjit"]}
        rows = {row[0]: decode_cells(flashjit_only, ws, row, dec.D, args.reps, baselines, sinks=True)
                for row in dec.ROWS}
        names = list(next(iter(rows.values())))
        lines += ["| row | " + " | ".join(names) + " | cost cc | cost tc |", "|---|" + "---|" * (len(names) + 2)]
        for label, c in rows.items():
            cost = [f"{c[f'flashjit {k} +sinks']['us'] / c[f'flashjit {k}']['us'] - 1:+.1%}"
                    if "us" in c[f"flashjit {k} +sinks"] and "us" in c[f"flashjit {k}"] else "n/a" for k in ("cc", "tc")]
            lines.append(f"| {label} | " + " | ".join(decode_cell(c[n]) for n in names) + " | " + " | ".join(cost) + " |")
            print(lines[-1], flush=True)
        records["sinks_decode"] = rows
    emit("\n".join(lines), args.out)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(records, f, indent=1, default=str)
    return 0


if __name__ == "__main__":
    sys.exit(main())
