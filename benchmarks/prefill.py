"""Prefill throughput, side by side in one run on one GPU: flashjit against
PyTorch SDPA (flash and cuDNN backends) and FlashInfer (fa2, fa3) when importable.

batch * seqlen = 16k tokens, heads * head_dim = 2048, bf16, TFLOP/s =
4*B*H*S^2*D / t (halved when causal). Batches run through the ragged wrappers
(flashjit, FlashInfer) and SDPA's batched call. A skewed ragged batch (one long
request among many short ones) and a long-context single decode close the table.

Each row's implementations are timed in `--rounds` rounds, one after another
within a round and in reverse order every other round; a cell is the mean of
its rounds (why: common.round_orders; single timings of one kernel differed by
up to 9%, results/2026-11-22-h200-prefill-order.md).

Usage: python benchmarks/prefill.py [--quick] [--rounds 3] [--out results.md]
"""

from __future__ import annotations

import argparse
import sys

import torch
from common import emit, event_ms, round_orders

import flashjit


def bench_ms(fn, reps: int = 10, sample_ms: float = 2.0) -> float:
    """Median ms per call over `reps` samples (CUDA events) after two warm-ups.
    A sample times enough back-to-back calls to last about `sample_ms`, so that
    the host's launch work overlaps the GPU's as in a serving loop, instead of
    adding to a lone call's time."""
    for _ in range(2):
        fn()
    calls = max(1, min(50, int(sample_ms / max(event_ms(fn, 1), 1e-3))))
    times = sorted(event_ms(fn, calls) / calls for _ in range(reps))
    return times[len(times) // 2]


def attention_flops(b: int, h: int, s: int, d: int, causal: bool) -> float:
    """4·B·H·S²·D for b requests of s tokens (queries and keys), halved when causal."""
    return 4 * b * h * s * s * d / (2 if causal else 1)


def indptr(lengths) -> torch.Tensor:
    return torch.tensor([0, *lengths], dtype=torch.int32).cumsum(0, dtype=torch.int32)


def flashjit_ragged(backend="auto"):
    def make(qo_lens, kv_lens, h, d, causal, dtype, use_tensor_cores=None):
        w = flashjit.BatchPrefillWithRaggedKVCacheWrapper(torch.empty(1 << 20, dtype=torch.uint8, device="cuda"),
                                                          backend=backend)
        w.plan(indptr(qo_lens), indptr(kv_lens), h, h, d, causal=causal, q_data_type=dtype,
               use_tensor_cores=use_tensor_cores)
        return w.run
    return make


def flashinfer_ragged(backend):
    import flashinfer

    def make(qo_lens, kv_lens, h, d, causal, dtype):
        ws = torch.empty(256 << 20, dtype=torch.uint8, device="cuda")
        w = flashinfer.BatchPrefillWithRaggedKVCacheWrapper(ws, "NHD", backend=backend)
        w.plan(indptr(qo_lens).cuda(), indptr(kv_lens).cuda(), h, h, d, causal=causal, q_data_type=dtype)
        return w.run
    return make


def sdpa(backend):
    from torch.nn.attention import sdpa_kernel

    def make(qo_lens, kv_lens, h, d, causal, dtype):
        if len(set(qo_lens)) != 1 or qo_lens != kv_lens:
            raise NotImplementedError("SDPA takes equal-length batches only")
        b, s = len(qo_lens), qo_lens[0]

        def run(q, k, v):
            with sdpa_kernel(backend):
                return torch.nn.functional.scaled_dot_product_attention(
                    *(t.view(b, s, h, d).transpose(1, 2) for t in (q, k, v)), is_causal=causal)
        return run
    return make


def implementations(only=None) -> dict:
    """Every implementation this GPU runs (flashjit fa3 on sm_90a alone), or those named in `only`."""
    from torch.nn.attention import SDPBackend

    from flashjit import arch

    impls = {"flashjit fa2": flashjit_ragged("fa2")}
    if arch.device_arch() == "sm_90a":
        impls["flashjit fa3"] = flashjit_ragged("fa3")
    impls.update({"sdpa-flash": sdpa(SDPBackend.FLASH_ATTENTION), "sdpa-cudnn": sdpa(SDPBackend.CUDNN_ATTENTION)})
    if only is None or any(name.startswith("flashinfer") for name in only):
        try:
            import flashinfer  # noqa: F401

            impls["flashinfer-fa2"] = flashinfer_ragged("fa2")
            impls["flashinfer-fa3"] = flashinfer_ragged("fa3")
        except Exception as exc:  # not installed, or no kernels for this GPU
            print(f"flashinfer not available: {type(exc).__name__}: {exc}", file=sys.stderr)
    return {name: make for name, make in impls.items() if only is None or name in only}


def run_row(impls, qo_lens, kv_lens, h, d, causal, flops, reps, rounds) -> list[str]:
    dtype = torch.bfloat16
    q = torch.randn(sum(qo_lens), h, d, device="cuda", dtype=dtype)
    k, v = (torch.randn(sum(kv_lens), h, d, device="cuda", dtype=dtype) for _ in range(2))
    fns, rates = {}, {}

    def failed(name, exc):  # the cell reads n/a; the reason goes to stderr
        fns.pop(name, None)
        print(f"{name} d={d} {len(qo_lens)}x{qo_lens[0]}: {type(exc).__name__}: {str(exc)[:200]}", file=sys.stderr)

    for name, make in impls.items():
        try:
            fns[name] = make(qo_lens, kv_lens, h, d, causal, dtype)
            rates[name] = []
        except Exception as exc:
            failed(name, exc)
    for order in round_orders(list(fns), rounds):
        for name in (n for n in order if n in fns):
            try:
                rates[name].append(flops / bench_ms(lambda: fns[name](q, k, v), reps=reps) / 1e9)
            except Exception as exc:
                failed(name, exc)
    return [f"{sum(rates[name]) / len(rates[name]):.0f}" if name in fns else "n/a" for name in impls]


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--quick", action="store_true", help="head_dim 128, S = 1k and 4k only")
    parser.add_argument("--head-dims", type=int, nargs="+", help="override the head dims")
    parser.add_argument("--seqlens", type=int, nargs="+", help="override the sequence lengths")
    parser.add_argument("--rounds", type=int, default=3, help="interleaved timing rounds per row (see above)")
    parser.add_argument("--only", nargs="+", help="implementations to run (default: all available)")
    parser.add_argument("--no-skewed", action="store_true", help="leave out the skewed batch and the decode line")
    parser.add_argument("--out")
    args = parser.parse_args()
    torch.manual_seed(0)
    head_dims = args.head_dims or ([128] if args.quick else [64, 128, 256])
    seqlens = args.seqlens or ([1024, 4096] if args.quick else [1024, 4096, 16384])
    impls = implementations(args.only)
    lines = [f"device: {torch.cuda.get_device_name()}, bf16, TFLOP/s, mean of {args.rounds} interleaved rounds", "",
             "| head_dim | batch x S | causal | " + " | ".join(impls) + " |", "|---|---|---|" + "---|" * len(impls)]
    for d in head_dims:
        h = 2048 // d
        for s in seqlens:
            b = 16384 // s
            for causal in (False, True):
                flops = attention_flops(b, h, s, d, causal)
                cells = run_row(impls, [s] * b, [s] * b, h, d, causal, flops, reps=15 if s == 16384 else 10,
                                rounds=args.rounds)
                lines.append(f"| {d} | {b} x {s} | {causal} | " + " | ".join(cells) + " |")
                print(lines[-1], flush=True)
    if args.no_skewed:
        emit("\n".join(lines), args.out)
        return 0
    # Skewed: one 16k request among 64 of 100 tokens, causal, head_dim 128.
    qo_lens = [16384] + [100] * 64
    flops = sum(attention_flops(1, 16, n, 128, True) for n in qo_lens)
    cells = run_row(impls, qo_lens, qo_lens, 16, 128, True, flops, reps=5, rounds=args.rounds)
    lines.append("| 128 | skewed 1x16k + 64x100 | True | " + " | ".join(cells) + " |")
    # Long-context decode on CUDA cores (split-KV): 32 qo / 8 kv heads, head_dim 128, 32k keys.
    kv_len = 32768
    q = torch.randn(32, 128, device="cuda", dtype=torch.bfloat16)
    k, v = (torch.randn(kv_len, 8, 128, device="cuda", dtype=torch.bfloat16) for _ in range(2))
    ms = bench_ms(lambda: flashjit.single_decode_with_kv_cache(q, k, v))
    lines += ["", f"single_decode bf16 d128 32/8 heads kv_len {kv_len} (CUDA cores, split-KV): {ms * 1e3:.1f} us, "
                  f"{2 * k.numel() * 2 / ms / 1e6:.0f} GB/s of K/V read"]
    emit("\n".join(lines), args.out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
