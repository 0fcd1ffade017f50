"""Host time per call: what each public op's eager entry point costs the CPU
(argument checks, output allocation, packing the parameters, the launch), the
mean over CALLS back-to-back calls with tiny inputs, chosen so that each kernel
takes less GPU time than the host spends queueing the next: the loop then
measures the host, not the GPU.

Target: under 10 us per call on an H200 host. `flashjit bench`
reports these rows in its `host` section, benchmarks/bench_jit.py beside the JIT
costs, and benchmarks/host_cost_cpu.py measures the same cases on a CPU with the
kernel launch stubbed out (the Python side alone).
"""

from __future__ import annotations

import functools
import time

CALLS = 3000
ROUNDS = 3
WARMUP = 100
TARGET_US = 10.0

# (label, note): the rows in the order measured; `cases` builds a call for each.
CASES = (
    ("single_prefill_with_kv_cache", "16 queries x 64 keys, 8/2 heads, d128, causal"),
    ("single_decode_with_kv_cache", "8/8 heads, 16 keys, d128"),
    ("BatchPrefillWithRaggedKVCacheWrapper.run", "2 requests x 8 queries x 32 keys, 8/2 heads, d128, causal"),
    ("BatchPrefillWithPagedKVCacheWrapper.run", "2 requests x 8 queries x 32 keys, page 16, 8/2 heads, 5-D cache"),
    ("BatchDecodeWithPagedKVCacheWrapper.run", "64 requests x 16 keys, 32/8 heads, d128, tensor cores, 5-D cache"),
    ("BatchDecodeWithPagedKVCacheWrapper.run(out=)", "as above, into a given out"),
    ("torch.ops.flashjit.batch_decode_paged_run", "as above, the operator a compiled graph calls"),
    ("BatchMLAPagedAttentionWrapper.run", "4 requests x 64 keys, 16 heads, page 64"),
    ("BatchMLAPagedAttentionWrapper.run (128 heads)",
     "as above, 128 heads (two CTAs a request)"),
)


def specs() -> list:
    """The configurations the cases load, as the ops select them on this machine's
    targets: `flashjit bench` builds them with the others before timing."""
    import torch

    from ..ops._launch import select_spec
    from ..spec import MLA_HEAD_DIM_CKV, MLA_HEAD_DIM_KPE

    bf16 = torch.bfloat16
    plain = dict(backend="auto", window=False, soft_cap=False)
    return [select_spec("single_prefill", bf16, 128, use_tensor_cores=None, causal=True, return_lse=False, **plain),
            select_spec("single_decode", bf16, 128, use_tensor_cores=False, causal=False, return_lse=False, **plain),
            # The wrappers load the LSE variant whether or not run() asks for LSE.
            select_spec("batch_prefill_ragged", bf16, 128, use_tensor_cores=None, causal=True, return_lse=True,
                        **plain),
            select_spec("batch_prefill_paged", bf16, 128, use_tensor_cores=None, causal=True, return_lse=True,
                        **plain),
            select_spec("batch_decode_paged", bf16, 128, use_tensor_cores=True, causal=False, return_lse=True,
                        **plain),
            select_spec("mla_paged", bf16, MLA_HEAD_DIM_CKV + MLA_HEAD_DIM_KPE, use_tensor_cores=None, causal=False,
                        return_lse=True, head_dim_vo=MLA_HEAD_DIM_CKV, **plain)]


def cases(device: str = "cuda", workspace=None, only: str | None = None) -> dict:
    """{label: zero-argument call} for every row of CASES, inputs on `device`
    (only: the rows whose label contains it, and only their kernels loaded).
    workspace(nbytes) makes a wrapper's float workspace (default: torch.empty on device)."""
    import torch

    import flashjit

    bf16 = torch.bfloat16
    workspace = workspace or (lambda n: torch.empty(n, dtype=torch.uint8, device=device))

    def randn(*shape):
        return torch.randn(*shape, device=device).to(bf16)

    def i32(values):
        return torch.tensor(values, dtype=torch.int32, device=device)

    def want(*labels):
        return only is None or any(only in label for label in labels)

    calls = {}
    q, k, v = randn(16, 8, 128), randn(64, 2, 128), randn(64, 2, 128)
    if want("single_prefill_with_kv_cache"):
        calls["single_prefill_with_kv_cache"] = lambda: flashjit.single_prefill_with_kv_cache(q, k, v, causal=True)
    q1, k1, v1 = randn(8, 128), randn(16, 8, 128), randn(16, 8, 128)
    if want("single_decode_with_kv_cache"):
        calls["single_decode_with_kv_cache"] = lambda: flashjit.single_decode_with_kv_cache(q1, k1, v1)

    if want("BatchPrefillWithRaggedKVCacheWrapper.run"):
        ragged = flashjit.BatchPrefillWithRaggedKVCacheWrapper(workspace(16 << 20))
        ragged.plan([0, 8, 16], [0, 32, 64], 8, 2, 128, causal=True, q_data_type=bf16)
        calls["BatchPrefillWithRaggedKVCacheWrapper.run"] = lambda: ragged.run(q, k, v)

    if want("BatchPrefillWithPagedKVCacheWrapper.run"):
        cache = randn(4, 2, 16, 2, 128)
        paged = flashjit.BatchPrefillWithPagedKVCacheWrapper(workspace(16 << 20))
        paged.plan(i32([0, 8, 16]), i32([0, 2, 4]), i32([3, 1, 0, 2]), i32([16, 16]), 8, 2, 128, 16, causal=True,
                   q_data_type=bf16)
        calls["BatchPrefillWithPagedKVCacheWrapper.run"] = lambda: paged.run(q, cache)

    decode_labels = ("BatchDecodeWithPagedKVCacheWrapper.run", "BatchDecodeWithPagedKVCacheWrapper.run(out=)",
                     "torch.ops.flashjit.batch_decode_paged_run")
    if want(*decode_labels):
        batch, page, qo_heads, kv_heads = 64, 16, 32, 8
        decode_cache = randn(batch, 2, page, kv_heads, 128)
        qd, out = randn(batch, qo_heads, 128), randn(batch, qo_heads, 128)
        decode = flashjit.BatchDecodeWithPagedKVCacheWrapper(workspace(64 << 20), use_tensor_cores=True)
        decode.plan(torch.arange(batch + 1, dtype=torch.int32), i32(list(range(batch))),
                    torch.full((batch,), page, dtype=torch.int32), qo_heads, kv_heads, 128, page, q_data_type=bf16)
        op = torch.ops.flashjit.batch_decode_paged_run.default
        decode_calls = (lambda: decode.run(qd, decode_cache), lambda: decode.run(qd, decode_cache, out=out),
                        lambda: op(decode._handle, qd, decode_cache, None, False, None))
        calls.update((label, fn) for label, fn in zip(decode_labels, decode_calls) if want(label))

    ckv, kpe = randn(4, 64, 512), randn(4, 64, 64)
    mla_rows = (("BatchMLAPagedAttentionWrapper.run", 16), ("BatchMLAPagedAttentionWrapper.run (128 heads)", 128))
    for label, heads in mla_rows:
        if want(label):
            mla = flashjit.BatchMLAPagedAttentionWrapper(workspace(16 << 20))
            mla.plan(i32([0, 1, 2, 3, 4]), i32([0, 1, 2, 3, 4]), i32([2, 0, 3, 1]), i32([64] * 4), heads, 512, 64, 64,
                     False, 1 / 192 ** 0.5, bf16, bf16)
            q_nope, q_pe = randn(4, heads, 512), randn(4, heads, 64)
            calls[label] = functools.partial(mla.run, q_nope, q_pe, ckv, kpe)
    assert list(calls) == [label for label, _ in CASES if want(label)]
    return calls


def measure(fn, calls: int = CALLS, sync=None, clock=time.perf_counter, gpu_timer=None) -> tuple:
    """(host us, GPU us or None) per call: the mean over `calls` back-to-back
    calls, after WARMUP calls (the first compiles or loads the kernel and
    prepares the call). gpu_timer: a pair of CUDA events recorded around the
    loop, whose elapsed time per call is the GPU's (see table())."""
    for _ in range(WARMUP):
        fn()
    if sync:
        sync()
    if gpu_timer:
        gpu_timer[0].record()
    start = clock()
    for _ in range(calls):
        fn()
    elapsed = clock() - start
    if gpu_timer:
        gpu_timer[1].record()
    if sync:
        sync()
    gpu_us = gpu_timer[0].elapsed_time(gpu_timer[1]) / calls * 1e3 if gpu_timer else None
    return elapsed / calls * 1e6, gpu_us


def run(calls: int = CALLS, device: str = "cuda", workspace=None, progress=None, sync=None,
        rounds: int = ROUNDS, clock=time.perf_counter) -> dict:
    """The `host` section: {device, calls, rounds, target_us, rows: [{op, us,
    gpu_us, rounds_us, note}]}, us (and gpu_us, None off CUDA) the median over
    `rounds` rounds (each case once per round, in turn) of the mean of `calls`
    calls: a busy host slows one round, not the row. clock: wall time (default);
    a shared machine's thread CPU time leaves out other processes."""
    import torch

    gpu_timer = None
    if device == "cuda":
        sync = sync or torch.cuda.synchronize
        gpu_timer = (torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True))
    fns = cases(device, workspace)
    samples: dict[str, list[tuple]] = {label: [] for label, _ in CASES}
    for _ in range(rounds):
        for label, _ in CASES:
            samples[label].append(measure(fns[label], calls, sync, clock, gpu_timer))
    rows = []
    for label, note in CASES:
        hosts = sorted(h for h, _ in samples[label])
        gpus = sorted(g for _, g in samples[label] if g is not None)
        rows.append({"op": label, "us": hosts[len(hosts) // 2], "gpu_us": gpus[len(gpus) // 2] if gpus else None,
                     "rounds_us": [h for h, _ in samples[label]], "note": note})
        if progress:
            progress(f"host {label}")
    name = torch.cuda.get_device_name() if device == "cuda" else device
    return {"device": name, "calls": calls, "rounds": rounds, "target_us": TARGET_US, "rows": rows}


def table(section: dict) -> str:
    """The markdown rows: one per call, its mean host time against the target,
    and the GPU's time per call in the same loop where it was measured. The two
    agree when the host paces the loop (the GPU idles between kernels); a GPU
    time above the host's means kernels were still queued when the host was
    done: they fell behind, and the row measures them, not the host."""
    lines = [f"## Host time per call ({section['device']}, bf16, tiny inputs; median of {section['rounds']} rounds, "
             f"each the mean of {section['calls']} calls)", "",
             "| call | host us per call | target | GPU us per call | note |", "|---|---|---|---|---|"]
    for row in section["rows"]:
        mark = "" if row["us"] < section["target_us"] else " (over)"
        gpu = row.get("gpu_us")
        gpu_cell = "-" if gpu is None else f"{gpu:.1f}" + (" (kernel-paced)" if gpu > 1.02 * row["us"] else "")
        lines.append(f"| {row['op']} | {row['us']:.1f}{mark} | < {section['target_us']:.0f} us | {gpu_cell} | "
                     f"{row['note']} |")
    return "\n".join(lines)
