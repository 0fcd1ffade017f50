"""Prefill throughput, side by side in one run on one GPU: flashjit against
PyTorch SDPA (flash and cuDNN backends) and FlashInfer when importable.

batch * seqlen = 16k tokens, heads * head_dim = 2048, TFLOP/s = 4*B*H*S^2*D / t
(halved when causal). Also a single-decode row (GB/s of K/V read).

Usage: python benchmarks/prefill.py [--quick] [--out results.md]
"""

from __future__ import annotations

import argparse
import sys

import torch

import flashjit


def bench_ms(fn, reps: int = 10) -> float:
    """Median of `reps` timed runs (CUDA events) after two warm-ups."""
    for _ in range(2):
        fn()
    times = []
    for _ in range(reps):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end))
    return sorted(times)[len(times) // 2]


def sdpa(backend):
    from torch.nn.attention import sdpa_kernel

    def run(q, k, v, causal):  # q/k/v [B, S, H, D] -> SDPA wants [B, H, S, D]
        with sdpa_kernel(backend):
            return torch.nn.functional.scaled_dot_product_attention(
                q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), is_causal=causal)
    return run


def flashjit_prefill(q, k, v, causal):
    b, s, h, d = q.shape
    if b == 1:
        return flashjit.single_prefill_with_kv_cache(q[0], k[0], v[0], causal=causal)
    wrapper = _wrappers.setdefault((b, s, h, d, causal), _plan(b, s, h, d, causal, q.dtype))
    return wrapper.run(q.view(b * s, h, d), k.view(b * s, h, d), v.view(b * s, h, d))


_wrappers: dict = {}


def _plan(b, s, h, d, causal, dtype):
    w = flashjit.BatchPrefillWithRaggedKVCacheWrapper(torch.empty(1 << 20, dtype=torch.uint8, device="cuda"))
    indptr = torch.arange(b + 1, dtype=torch.int32) * s
    w.plan(indptr, indptr, h, h, d, causal=causal, q_data_type=dtype)
    return w


def peers():
    from torch.nn.attention import SDPBackend

    out = {"flashjit (auto)": flashjit_prefill, "sdpa-flash": sdpa(SDPBackend.FLASH_ATTENTION),
           "sdpa-cudnn": sdpa(SDPBackend.CUDNN_ATTENTION)}
    try:
        import flashinfer

        def fi(backend):
            def run(q, k, v, causal):
                b, s, h, d = q.shape
                outs = [flashinfer.single_prefill_with_kv_cache(q[i], k[i], v[i], causal=causal, backend=backend)
                        for i in range(b)]
                return outs
            return run
        out["flashinfer-fa2"] = fi("fa2")
        out["flashinfer-fa3"] = fi("fa3")
    except Exception as exc:  # not installed, or no kernels for this GPU
        print(f"flashinfer not available: {exc}", file=sys.stderr)
    return out


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--quick", action="store_true", help="head_dim 128, S = 1k and 4k only")
    parser.add_argument("--out")
    args = parser.parse_args()
    torch.manual_seed(0)
    dev = torch.cuda.get_device_name()
    head_dims = [128] if args.quick else [64, 128, 256]
    seqlens = [1024, 4096] if args.quick else [1024, 4096, 16384]
    impls = peers()
    lines = [f"device: {dev}", "", "| head_dim | S | causal | " + " | ".join(impls) + " |",
             "|---|---|---|" + "---|" * len(impls)]
    for d in head_dims:
        h = 2048 // d
        for s in seqlens:
            b = 16384 // s
            q, k, v = (torch.randn(b, s, h, d, device="cuda", dtype=torch.bfloat16) for _ in range(3))
            for causal in (False, True):
                flops = 4 * b * h * s * s * d / (2 if causal else 1)
                cells = []
                for name, fn in impls.items():
                    try:
                        ms = bench_ms(lambda: fn(q, k, v, causal), reps=5 if s == 16384 else 10)
                        cells.append(f"{flops / ms / 1e9:.0f}")
                    except Exception as exc:
                        cells.append("n/a")
                        print(f"{name} d={d} S={s}: {type(exc).__name__}: {exc}", file=sys.stderr)
                lines.append(f"| {d} | {s} | {causal} | " + " | ".join(cells) + " |")
                print(lines[-1], flush=True)
    # Decode bandwidth: one request, 32 qo / 8 kv heads, head_dim 128, kv_len 32k.
    kv_len = 32768
    q = torch.randn(32, 128, device="cuda", dtype=torch.bfloat16)
    k, v = (torch.randn(kv_len, 8, 128, device="cuda", dtype=torch.bfloat16) for _ in range(2))
    ms = bench_ms(lambda: flashjit.single_decode_with_kv_cache(q, k, v))
    lines += ["", f"single_decode bf16 d128 32/8 heads kv_len {kv_len}: {ms * 1e3:.1f} us, "
                  f"{2 * k.numel() * 2 / ms / 1e6:.0f} GB/s of K/V read"]
    text = "\n".join(lines)
    print(text)
    if args.out:
        with open(args.out, "a") as f:
            f.write(text + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
