"""What batch-invariant mode costs, on the rows of benchmarks/prefill.py and
benchmarks/decode.py, measured beside normal mode in one run on one GPU.

Prefill: the ragged wrapper, backend auto (fa3 on sm_90a), normal against
batch_invariant=True, TFLOP/s as prefill.py (median of its samples, taken in
shuffled passes). Decode: the paged decode wrapper with use_tensor_cores False and True
(normal) against batch_invariant=True, µs per call as decode.py (median of
CUDA-graph samples). The last column is the mode's time against the faster
normal cell, + meaning slower. --chunks times the mode at other split-KV chunk
sizes (ops._invariant.CHUNK_KEYS is the default); --split adds the first chunk
with every request's chunks split across CTAs and merged (fold_policy "never":
what the mode costs where the kernel does not fold them itself); --variant
LABEL=FOLDER adds the mode at the first chunk with kernels rendered from another
templates/ folder (prefill rows). Every batch-invariant output is first checked
against the normal one within the sum of their profiles, except the variants'
with --unchecked: cost attribution, variants that leave out part of the work on
purpose (their outputs are wrong).

--head-dims and --decode-head-dims pick the head dims of the prefill and
decode rows (decode.py's rows are head_dim 128 only), --rows the rows whose
label starts with one of the given strings.

Usage: python benchmarks/dev/batch_invariant_cost.py [--quick] [--chunks 4096] [--split] [--rounds 3] [--reps 30]
       [--only prefill decode] [--head-dims 64 128 256] [--decode-head-dims 128] [--rows LABEL ...]
       [--variant LABEL=FOLDER ...] [--unchecked] [--out FILE] [--json FILE]
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

import torch  # noqa: E402
from common import emit, rendered_from  # noqa: E402

import flashjit  # noqa: E402
from flashjit.bench import decode as dec  # noqa: E402
from flashjit.bench import prefill as pre  # noqa: E402
from flashjit.bench.timing import time_us  # noqa: E402
from flashjit.ops import _invariant  # noqa: E402
from flashjit.spec import KernelSpec  # noqa: E402


def ragged(batch_invariant: bool, variant, templates=None):
    def make(qo_lens, kv_lens, h, d, causal, dtype):
        w = flashjit.BatchPrefillWithRaggedKVCacheWrapper(torch.empty(1 << 20, dtype=torch.uint8, device="cuda"))
        with chunk_size(variant), rendered_from(templates):
            w.plan(pre.indptr(qo_lens), pre.indptr(kv_lens), h, h, d, causal=causal, q_data_type=dtype,
                   batch_invariant=batch_invariant)
        return w.run
    return make


class chunk_size:
    """The mode's default chunk and fold policy set for one plan(); variant:
    (chunk, policy)."""

    def __init__(self, variant):
        self.chunk, self.policy = variant

    def __enter__(self):
        self.saved = _invariant.CHUNK_KEYS, _invariant.fold_policy
        _invariant.CHUNK_KEYS, _invariant.fold_policy = self.chunk, self.policy

    def __exit__(self, *exc):
        _invariant.CHUNK_KEYS, _invariant.fold_policy = self.saved


def check(name, out, ref, spec, q, k, v, kv_len):
    """The mode's output against normal mode's, within the sum of their profiles (a wrong
    batch-invariant kernel would otherwise just look fast)."""
    tol = flashjit.tolerance(spec, q=q, k=k, v=v, kv_len=kv_len)
    (tol + tol).assert_close(out, ref.double(), name)


def prefill_rows(plan, chunks, rounds, results, variants=(), unchecked=False):
    """variants: (label, templates folder) of the mode at the first chunk."""
    first = chunks[next(iter(chunks))]
    for row in plan:
        if row["label"] == "single_decode":
            continue
        impls = {"normal": ragged(False, first)}
        impls.update({f"invariant {c}": ragged(True, v) for c, v in chunks.items()})
        impls.update({f"invariant {label}": ragged(True, first, folder) for label, folder in variants})
        columns = [*chunks, *(label for label, _ in variants)]
        h, d, lens = row["heads"], row["head_dim"], row["qo_lens"]
        torch.manual_seed(0)
        q = torch.randn(sum(lens), h, d, device="cuda", dtype=torch.bfloat16)
        k, v = (torch.randn(sum(lens), h, d, device="cuda", dtype=torch.bfloat16) for _ in range(2))
        ref = impls["normal"](lens, lens, h, d, row["causal"], torch.bfloat16)(q, k, v)
        spec = KernelSpec.make("batch_prefill_ragged", "bfloat16", d, use_tensor_cores=True, causal=row["causal"])
        for c in columns:
            if unchecked and c not in chunks:
                continue
            out = impls[f"invariant {c}"](lens, lens, h, d, row["causal"], torch.bfloat16)(q, k, v)
            check(f"prefill {row['label']} chunk {c}", out, ref, spec, q, k, v, max(lens))
        del q, k, v, ref
        res = pre.run_row(impls, lens, lens, h, d, row["causal"], row["flops"], reps=row["reps"], rounds=rounds)
        vals = res["values"]
        results.append({"kind": "prefill", "label": f"d{d} {row['label']}{' causal' if row['causal'] else ''}",
                        "unit": "TFLOP/s", "normal": vals["normal"],
                        "invariant": {c: vals[f"invariant {c}"] for c in columns}})
        print(line(results[-1]), flush=True)
        torch.cuda.empty_cache()


def decode_rows(rows, chunks, reps, results, head_dim):
    ws = torch.zeros(256 << 20, dtype=torch.uint8, device="cuda")
    for label, batch, kv_len, qo_heads, kv_heads in rows:
        torch.manual_seed(0)
        cache, indptr, indices, last = dec.paged_cache(batch, kv_len, kv_heads, head_dim=head_dim)
        q = torch.randn(batch, qo_heads, head_dim, dtype=dec.BF16, device="cuda")
        cells, outs = {}, {}
        first = chunks[next(iter(chunks))]
        for name, tc, bi, variant in [("normal cc", False, False, first), ("normal tc", True, False, first),
                                      *[(f"invariant {c}", False, True, v) for c, v in chunks.items()]]:
            w = flashjit.BatchDecodeWithPagedKVCacheWrapper(ws, "NHD", use_tensor_cores=tc)
            with chunk_size(variant):
                w.plan(indptr, indices, last, qo_heads, kv_heads, head_dim, dec.PAGE, q_data_type=dec.BF16,
                       batch_invariant=bi)
            outs[name] = w.run(q, cache)
            cells[name] = time_us(lambda w=w, q=q, cache=cache: w.run(q, cache), reps)[0]
        spec = KernelSpec.make("batch_decode_paged", "bfloat16", head_dim, use_tensor_cores=True)
        k_all = cache[:, 0].reshape(-1, kv_heads, head_dim)
        for c in chunks:
            check(f"decode {label} chunk {c}", outs[f"invariant {c}"], outs["normal tc"], spec, q, k_all,
                  cache[:, 1].reshape(-1, kv_heads, head_dim), kv_len)
        label = label if head_dim == dec.D else f"d{head_dim} {label}"
        results.append({"kind": "decode", "label": label, "unit": "us", "normal cc": cells["normal cc"],
                        "normal tc": cells["normal tc"], "normal": min(cells["normal cc"], cells["normal tc"]),
                        "invariant": {c: cells[f"invariant {c}"] for c in chunks}})
        print(line(results[-1]), flush=True)
        del cache, q, outs
        torch.cuda.empty_cache()


def slower(rec, c) -> float:
    """Fraction by which the mode is slower than the faster normal cell (time, not rate)."""
    normal, mode = rec["normal"], rec["invariant"][c]
    return normal / mode - 1 if rec["unit"] == "TFLOP/s" else mode / normal - 1


def line(rec) -> str:
    cells = " ".join(f"{c}: {rec['invariant'][c]:.1f} ({slower(rec, c):+.1%})" for c in rec["invariant"])
    return f"{rec['kind']} {rec['label']}: normal {rec['normal']:.1f} {rec['unit']}, invariant {cells}"


def table(results, chunks) -> str:
    head = "| benchmark | row | unit | normal | " + " | ".join(f"invariant, chunk {c} | cost" for c in chunks) + " |"
    out = [f"Batch-invariant cost on {torch.cuda.get_device_name()} (bf16; decode: normal = the faster of "
           "use_tensor_cores False/True; cost = extra time of the mode)", "", head,
           "|" + "---|" * (4 + 2 * len(chunks))]
    for rec in results:
        cells = " | ".join(f"{rec['invariant'][c]:.1f} | {slower(rec, c):+.1%}" for c in chunks)
        normal = f"{rec['normal']:.1f}" if rec["kind"] == "prefill" else \
            f"{rec['normal']:.1f} (cc {rec['normal cc']:.1f}, tc {rec['normal tc']:.1f})"
        out.append(f"| {rec['kind']} | {rec['label']} | {rec['unit']} | {normal} | {cells} |")
    worst = {c: max(slower(r, c) for r in results) for c in chunks}
    out += ["", "Worst row per chunk: " + ", ".join(f"{c}: {w:+.1%}" for c, w in worst.items())]
    return "\n".join(out)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="prefill d128 1k/4k, decode GQA 64x4k and 1x32k")
    parser.add_argument("--chunks", type=int, nargs="+", default=[_invariant.CHUNK_KEYS])
    parser.add_argument("--split", action="store_true", help="also the first chunk with every request split")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--reps", type=int, default=30)
    parser.add_argument("--only", nargs="+", choices=("prefill", "decode"), default=["prefill", "decode"])
    parser.add_argument("--head-dims", type=int, nargs="+", help="prefill rows' head dims (default prefill.py's)")
    parser.add_argument("--decode-head-dims", type=int, nargs="+", default=[dec.D])
    parser.add_argument("--rows", nargs="+", help="only the rows whose label starts with one of these")
    parser.add_argument("--variant", action="append", default=[], metavar="LABEL=FOLDER",
                        help="the mode at the first chunk, kernels rendered from a templates/ copy (prefill)")
    parser.add_argument("--unchecked", action="store_true", help="the variants' outputs are not checked")
    parser.add_argument("--out")
    parser.add_argument("--json")
    args = parser.parse_args()
    picked = (lambda label: not args.rows or any(label.startswith(r) for r in args.rows))
    plan = [r for r in pre.rows(args.quick, head_dims=args.head_dims) if picked(r["label"])] \
        if "prefill" in args.only else []
    decode = [r for r in dec.ROWS if (not args.quick or r[0] in dec.QUICK_ROWS) and picked(r[0])] \
        if "decode" in args.only else []
    chunks = {str(c): (c, "auto") for c in args.chunks}  # column label -> (chunk, fold policy)
    if args.split:
        chunks[f"{args.chunks[0]} split"] = (args.chunks[0], "never")
    variants = [(label, Path(folder).resolve()) for label, folder in (v.split("=", 1) for v in args.variant)]
    if variants and decode:
        parser.error("--variant: prefill rows only (--only prefill)")
    results = []
    prefill_rows(plan, chunks, args.rounds, results, variants, args.unchecked)
    for head_dim in args.decode_head_dims:
        decode_rows(decode, chunks, args.reps, results, head_dim)
    emit(table(results, [*chunks, *(label for label, _ in variants)]), args.out)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(results, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
