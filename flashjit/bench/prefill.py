"""Prefill throughput, side by side in one run on one GPU: flashjit against
PyTorch SDPA (flash and cuDNN backends) and FlashInfer (fa2, fa3) when importable.

batch * seqlen = 16k tokens, heads * head_dim = 2048, bf16, TFLOP/s =
4*B*H*S^2*D / t (halved when causal). Batches run through the ragged wrappers
(flashjit, FlashInfer) and SDPA's batched call. A skewed ragged batch (one long
request among many short ones) and a long-context single decode close the table.

Each row's implementations are timed sample by sample, in `rounds` x reps
passes that take one sample of each in a fresh random order; a cell is the
median of its samples (timing.shuffled_ms: timed as whole cells, a kernel's
time depended on its place and on the kernel before it; docs/bench.md, "What
it does").
"""

from __future__ import annotations

import statistics
import sys

import torch

import flashjit

from . import PREFILL_HEAD_DIMS
from .timing import bench_ms, shuffled_ms

SKEWED_LABEL = "skewed 1x16k + 64x100"
SINGLE_DECODE_KV = 32768


def attention_flops(b: int, h: int, s: int, d: int, causal: bool, head_dim_vo: int | None = None) -> float:
    """2·B·H·S²·(D_qk + D_vo) for b requests of s tokens (queries and keys), halved when causal."""
    return 2 * b * h * s * s * (d + (head_dim_vo or d)) / (2 if causal else 1)


def indptr(lengths) -> torch.Tensor:
    return torch.tensor([0, *lengths], dtype=torch.int32).cumsum(0, dtype=torch.int32)


def flashjit_ragged(backend="auto", sinks: bool = False):
    """sinks: each call passes a sink logit per head (random, drawn at plan time)."""
    # An fa3 column times fa3 or nothing: strict, a head dim fa3 does not generate
    # is an n/a cell naming why, not fa2's time under fa3's name.
    strict = True if backend == "fa3" else None

    def make(qo_lens, kv_lens, h, d, causal, dtype, use_tensor_cores=None, head_dim_vo=None):
        w = flashjit.BatchPrefillWithRaggedKVCacheWrapper(torch.empty(1 << 20, dtype=torch.uint8, device="cuda"),
                                                          backend=backend, strict=strict)
        w.plan(indptr(qo_lens), indptr(kv_lens), h, h, d, head_dim_vo, causal=causal, q_data_type=dtype,
               use_tensor_cores=use_tensor_cores)
        if not sinks:
            return w.run
        sink = torch.randn(h, device="cuda", dtype=torch.float32)
        return lambda q, k, v: w.run(q, k, v, sinks=sink)
    return make


def flashinfer_ragged(backend):
    import flashinfer

    def make(qo_lens, kv_lens, h, d, causal, dtype, head_dim_vo=None):
        ws = torch.empty(256 << 20, dtype=torch.uint8, device="cuda")
        w = flashinfer.BatchPrefillWithRaggedKVCacheWrapper(ws, "NHD", backend=backend)
        w.plan(indptr(qo_lens).cuda(), indptr(kv_lens).cuda(), h, h, d, head_dim_vo, causal=causal, q_data_type=dtype)
        return w.run
    return make


def sdpa(backend):
    from torch.nn.attention import sdpa_kernel

    def make(qo_lens, kv_lens, h, d, causal, dtype, head_dim_vo=None):
        if len(set(qo_lens)) != 1 or qo_lens != kv_lens:
            raise NotImplementedError("SDPA takes equal-length batches only")
        b, s = len(qo_lens), qo_lens[0]

        def run(q, k, v):
            with sdpa_kernel(backend):
                return torch.nn.functional.scaled_dot_product_attention(
                    *(t.view(b, s, h, t.shape[-1]).transpose(1, 2) for t in (q, k, v)), is_causal=causal)
        return run
    return make


def implementations(only=None, peers=None) -> dict:
    """Every implementation this GPU runs (flashjit fa3 on sm_90a alone), or
    those named in `only`; `peers` (None: all) limits the other libraries to
    those named ("sdpa", "flashinfer")."""
    from torch.nn.attention import SDPBackend

    from flashjit import arch

    impls = {"flashjit fa2": flashjit_ragged("fa2")}
    if arch.device_arch() == "sm_90a":
        impls["flashjit fa3"] = flashjit_ragged("fa3")
    if peers is None or "sdpa" in peers:
        impls.update({"sdpa-flash": sdpa(SDPBackend.FLASH_ATTENTION),
                      "sdpa-cudnn": sdpa(SDPBackend.CUDNN_ATTENTION)})
    wants_flashinfer = only is None or any(name.startswith("flashinfer") for name in only)
    if wants_flashinfer and (peers is None or "flashinfer" in peers):
        try:
            import flashinfer  # noqa: F401

            impls["flashinfer-fa2"] = flashinfer_ragged("fa2")
            impls["flashinfer-fa3"] = flashinfer_ragged("fa3")
        except Exception as exc:  # not installed, or no kernels for this GPU
            print(f"flashinfer not available: {type(exc).__name__}: {exc}", file=sys.stderr)
    return {name: make for name, make in impls.items() if only is None or name in only}


def rows(quick: bool = False, head_dims=None, seqlens=None, skewed: bool = True) -> list[dict]:
    """The rows to time, in table order; each names itself in `label`."""
    head_dims = head_dims or ([128] if quick else list(PREFILL_HEAD_DIMS))
    seqlens = seqlens or ([1024, 4096] if quick else [1024, 4096, 16384])
    plan = []
    for d in head_dims:
        h = 2048 // d
        for s in seqlens:
            b = 16384 // s
            for causal in (False, True):
                plan.append(dict(head_dim=d, label=f"{b} x {s}", causal=causal, heads=h, qo_lens=[s] * b,
                                 flops=attention_flops(b, h, s, d, causal), reps=15 if s == 16384 else 10))
    if skewed:
        # One 16k request among 64 of 100 tokens, causal, head_dim 128.
        qo_lens = [16384] + [100] * 64
        plan.append(dict(head_dim=128, label=SKEWED_LABEL, causal=True, heads=16, qo_lens=qo_lens,
                         flops=sum(attention_flops(1, 16, n, 128, True) for n in qo_lens), reps=5))
        plan.append(dict(head_dim=128, label="single_decode", kv_len=SINGLE_DECODE_KV))
    return plan


def run_row(impls, qo_lens, kv_lens, h, d, causal, flops, reps, rounds, head_dim_vo=None) -> dict:
    """{'values': {impl: median TFLOP/s or None}, 'samples': {impl: [TFLOP/s per
    sample]}, 'errors': {impl: why its cell is empty}}. head_dim_vo: V narrower
    than Q and K (d); each maker then gets it as a keyword."""
    dtype = torch.bfloat16
    q = torch.randn(sum(qo_lens), h, d, device="cuda", dtype=dtype)
    k = torch.randn(sum(kv_lens), h, d, device="cuda", dtype=dtype)
    v = torch.randn(sum(kv_lens), h, head_dim_vo or d, device="cuda", dtype=dtype)
    vo = {"head_dim_vo": head_dim_vo} if head_dim_vo else {}
    fns, rates, errors = {}, {}, {}

    def failed(name, exc):  # the cell reads n/a; the reason goes to stderr and the JSON
        fns.pop(name, None)
        errors[name] = f"{type(exc).__name__}: {str(exc)[:200]}"
        print(f"{name} d={d} {len(qo_lens)}x{qo_lens[0]}: {errors[name]}", file=sys.stderr)

    for name, make in impls.items():
        try:
            fns[name] = make(qo_lens, kv_lens, h, d, causal, dtype, **vo)
            fns[name](q, k, v)  # fails here, not in the middle of the timing
            torch.cuda.synchronize()
        except Exception as exc:
            failed(name, exc)
    samples = shuffled_ms({name: (lambda fn=fn: fn(q, k, v)) for name, fn in fns.items()}, reps * rounds)
    for name, ms in samples.items():
        rates[name] = [flops / t / 1e9 for t in ms]
    values = {name: flops / statistics.median(samples[name]) / 1e9 if name in fns else None for name in impls}
    return {"values": values, "samples": {name: rates.get(name, []) for name in impls}, "errors": errors}


def single_decode(kv_len: int = SINGLE_DECODE_KV) -> dict:
    """Long-context decode on CUDA cores (split-KV): 32 qo / 8 kv heads, head_dim 128."""
    q = torch.randn(32, 128, device="cuda", dtype=torch.bfloat16)
    k, v = (torch.randn(kv_len, 8, 128, device="cuda", dtype=torch.bfloat16) for _ in range(2))
    ms = bench_ms(lambda: flashjit.single_decode_with_kv_cache(q, k, v))
    return {"kv_len": kv_len, "us": ms * 1e3, "gbps": 2 * k.numel() * 2 / ms / 1e6}


def specs(plan: list[dict], impls) -> list:
    """The flashjit configurations `plan` runs, to build in one parallel run before timing
    (fa3 at the head dims it generates: its other cells are n/a)."""
    from flashjit.spec import FA3_HEAD_DIMS, KernelSpec

    backends = [name.split()[1] for name in impls if name.startswith("flashjit ")]
    out = []
    for row in plan:
        if row["label"] == "single_decode":
            out.append(KernelSpec.make("single_decode", "bfloat16", row["head_dim"]))
            continue
        out += [KernelSpec.make("batch_prefill_ragged", "bfloat16", row["head_dim"], backend=b, use_tensor_cores=True,
                                causal=row["causal"], return_lse=True) for b in backends
                if b != "fa3" or row["head_dim"] in FA3_HEAD_DIMS]
    return list(dict.fromkeys(out))


def run(plan: list[dict], impls: dict, rounds: int = 3, progress=None, on_row=None) -> dict:
    """Times `plan` (rows()) over `impls` (implementations()); returns the section
    report.prefill_table() renders. progress(label) after each row; on_row(section,
    row) too, for callers that print rows as they come."""
    torch.manual_seed(0)
    section = {"kind": "prefill", "device": torch.cuda.get_device_name(), "dtype": "bfloat16", "unit": "TFLOP/s",
               "rounds": rounds, "impls": list(impls), "rows": [], "single_decode": None}
    for row in plan:
        if row["label"] == "single_decode":
            section["single_decode"] = single_decode(row["kv_len"])
        else:
            result = run_row(impls, row["qo_lens"], row["qo_lens"], row["heads"], row["head_dim"], row["causal"],
                             row["flops"], reps=row["reps"], rounds=rounds)
            section["rows"].append({"head_dim": row["head_dim"], "label": row["label"], "causal": row["causal"],
                                    "heads": row["heads"], **result})
            if on_row:
                on_row(section, section["rows"][-1])
        if progress:
            progress(f"prefill d{row['head_dim']} {row['label']}{' causal' if row.get('causal') else ''}")
    return section
