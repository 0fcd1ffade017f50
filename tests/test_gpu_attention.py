"""The numerical sweep on a GPU: every op against float64 within its own
tolerance profile, on fresh random inputs, with poisoned outputs."""

from __future__ import annotations

import math

import pytest
import torch

import flashjit
from flashjit.reference import attention_reference, ragged_reference
from flashjit.error_model import evaluate_lse, measure, profile
from flashjit.ops import _plan
from sweep import (CAUSAL, DTYPE_CORES, DTYPE_PATHS, DTYPES, HEAD_DIMS, HEADS, VARIANTS, cores_id, fa3_runs_here,
                   path_id, path_kwargs, spec_for, spec_path, variant_kwargs)

pytestmark = pytest.mark.gpu


def poison_allocator(nbytes: int = 1 << 26) -> None:
    """Fills a block with NaN and frees it, so the next outputs the caching
    allocator hands out start as NaN: an element a kernel forgets stays NaN."""
    torch.full((nbytes // 4,), float("nan"), device="cuda").data_ptr()
    torch.cuda.synchronize()


def skip_unless_runs(path: str) -> None:
    if path == "fa3" and not fa3_runs_here():
        pytest.skip("fa3 runs on sm_90a GPUs only")


def randn(*shape, dtype, scale=1.0):
    return (torch.randn(*shape, device="cuda", dtype=torch.float32) * scale).to(dtype)


def check(spec, out, ref, q, k, v, kv_len, sm_scale, report, what, lse=None, ref_lse=None, **info):
    tol = flashjit.tolerance(spec, q=q, k=k, v=v, kv_len=max(kv_len, 1), sm_scale=sm_scale)
    assert not torch.isnan(out).any(), f"{what}: NaN in the output (unwritten or invalid)"
    ratio = tol.assert_close(out, ref, what)
    row = {"config": spec.name, "what": what, "ratio": ratio, "rtol": tol.rtol, "atol": tol.atol,
           "max_err": float((out.double() - ref).abs().max()) if out.numel() else 0.0, **info}
    if lse is not None:
        _, logit_absmax = measure(q, k, v, sm_scale)
        lse_tol = evaluate_lse(profile(spec), kv_len=max(kv_len, 1), logit_absmax=logit_absmax)
        row["lse_ratio"] = lse_tol.assert_close(lse, ref_lse, f"{what} LSE")
    report.append(row)


@pytest.mark.parametrize("variant", VARIANTS)
@pytest.mark.parametrize("heads", HEADS, ids=lambda h: f"h{h[0]}kv{h[1]}")
@pytest.mark.parametrize("causal", CAUSAL, ids=["full", "causal"])
@pytest.mark.parametrize("head_dim", HEAD_DIMS)
@pytest.mark.parametrize("dtype,path", DTYPE_PATHS, ids=[path_id(p) for p in DTYPE_PATHS])
@pytest.mark.parametrize("qo_len,kv_len", [(1, 1), (37, 300), (128, 128), (300, 1000), (513, 77), (16, 5000)])
def test_single_prefill(prewarmed, error_report, dtype, path, head_dim, causal, heads, variant, qo_len, kv_len):
    skip_unless_runs(path)
    num_qo, num_kv = heads
    q = randn(qo_len, num_qo, head_dim, dtype=dtype)
    k = randn(kv_len, num_kv, head_dim, dtype=dtype)
    v = randn(kv_len, num_kv, head_dim, dtype=dtype)
    kw = variant_kwargs(variant)
    poison_allocator()
    result = flashjit.single_prefill_with_kv_cache(q, k, v, causal=causal, **path_kwargs(path), **kw)
    torch.cuda.synchronize()
    out, lse = result if kw.get("return_lse") else (result, None)
    ref, ref_lse = attention_reference(q, k, v, causal=causal, window_left=kw.get("window_left", -1),
                                       logits_soft_cap=kw.get("logits_soft_cap"))
    spec = spec_for("single_prefill", dtype, head_dim, causal, variant, **spec_path(path))
    check(spec, out, ref, q, k, v, kv_len, 1 / math.sqrt(head_dim), error_report, "single_prefill",
          lse=lse, ref_lse=ref_lse if lse is not None else None, shape=f"{qo_len}x{kv_len}", heads=heads)


@pytest.mark.parametrize("variant", ["plain", "window", "softcap", "lse"])
@pytest.mark.parametrize("heads", HEADS, ids=lambda h: f"h{h[0]}kv{h[1]}")
@pytest.mark.parametrize("head_dim", HEAD_DIMS)
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("kv_len,layout", [(1, "NHD"), (255, "NHD"), (4097, "HND"), (33, "HND")])
def test_single_decode(prewarmed, error_report, dtype, head_dim, heads, variant, kv_len, layout):
    num_qo, num_kv = heads
    q = randn(num_qo, head_dim, dtype=dtype)
    k_nhd = randn(kv_len, num_kv, head_dim, dtype=dtype)
    v_nhd = randn(kv_len, num_kv, head_dim, dtype=dtype)
    k, v = (k_nhd, v_nhd) if layout == "NHD" else (k_nhd.transpose(0, 1).contiguous(),
                                                    v_nhd.transpose(0, 1).contiguous())
    kw = variant_kwargs(variant)
    poison_allocator()
    result = flashjit.single_decode_with_kv_cache(q, k, v, kv_layout=layout, **kw)
    torch.cuda.synchronize()
    out, lse = result if kw.get("return_lse") else (result, None)
    ref, ref_lse = attention_reference(q[None], k_nhd, v_nhd, window_left=kw.get("window_left", -1),
                                       logits_soft_cap=kw.get("logits_soft_cap"))
    spec = spec_for("single_decode", dtype, head_dim, False, variant)
    check(spec, out, ref[0], q, k_nhd, v_nhd, kv_len, 1 / math.sqrt(head_dim), error_report, "single_decode",
          lse=lse, ref_lse=ref_lse[0] if lse is not None else None, shape=f"1x{kv_len}", heads=heads)


RAGGED_BATCHES = {
    "mixed": ([1, 37, 128, 300, 5], [1, 300, 128, 1000, 700]),
    "empty_kv": ([3, 16, 1], [0, 40, 0]),
    "skewed": ([2000] + [100] * 6, [2000] + [100] * 6),
    "decode_like": ([1] * 9, [5, 17, 64, 1000, 1, 2, 3, 4, 333]),
}


@pytest.mark.parametrize("batch", sorted(RAGGED_BATCHES))
@pytest.mark.parametrize("heads", HEADS, ids=lambda h: f"h{h[0]}kv{h[1]}")
@pytest.mark.parametrize("causal", CAUSAL, ids=["full", "causal"])
@pytest.mark.parametrize("head_dim", HEAD_DIMS)
@pytest.mark.parametrize("dtype,path", DTYPE_PATHS, ids=[path_id(p) for p in DTYPE_PATHS])
def test_batch_prefill_ragged(prewarmed, error_report, dtype, path, head_dim, causal, heads, batch):
    skip_unless_runs(path)
    num_qo, num_kv = heads
    qo_lens, kv_lens = RAGGED_BATCHES[batch]
    qo_indptr = torch.tensor([0] + qo_lens, dtype=torch.int32).cumsum(0, dtype=torch.int32)
    kv_indptr = torch.tensor([0] + kv_lens, dtype=torch.int32).cumsum(0, dtype=torch.int32)
    q = randn(int(qo_indptr[-1]), num_qo, head_dim, dtype=dtype)
    k = randn(int(kv_indptr[-1]), num_kv, head_dim, dtype=dtype)
    v = randn(int(kv_indptr[-1]), num_kv, head_dim, dtype=dtype)
    workspace = torch.empty(1 << 20, dtype=torch.uint8, device="cuda")
    wrapper = flashjit.BatchPrefillWithRaggedKVCacheWrapper(workspace, backend=path_kwargs(path)["backend"])
    wrapper.plan(qo_indptr, kv_indptr, num_qo, num_kv, head_dim, causal=causal, q_data_type=dtype,
                 use_tensor_cores=path != "cc")
    out = torch.full_like(q, float("nan"))
    lse = torch.full((q.shape[0], num_qo), float("nan"), device="cuda")
    wrapper.run(q, k, v, out=out, lse=lse, return_lse=True)
    torch.cuda.synchronize()
    ref, ref_lse = ragged_reference(q, k, v, qo_indptr.tolist(), kv_indptr.tolist(), causal=causal)
    spec = spec_for("batch_prefill_ragged", dtype, head_dim, causal, **spec_path(path))
    check(spec, out, ref, q, k, v, max(kv_lens), 1 / math.sqrt(head_dim), error_report, "batch_prefill_ragged",
          lse=lse, ref_lse=ref_lse, shape=batch, heads=heads)
    # Running again without LSE through the same plan gives the same output bit for bit.
    again = wrapper.run(q, k, v)
    assert torch.equal(again, out)


@pytest.mark.parametrize("band_items", [1, 3, 7])
@pytest.mark.parametrize("heads", [(8, 4), (6, 2)], ids=lambda h: f"h{h[0]}kv{h[1]}")
@pytest.mark.parametrize("dtype,path", DTYPE_PATHS, ids=[path_id(p) for p in DTYPE_PATHS])
def test_launch_bands_change_only_the_order(prewarmed, error_report, monkeypatch, dtype, path, heads, band_items):
    """Any launch band width (work.cuh) runs every (work slot, KV head) CTA
    exactly once, ragged last band included: batched and single-request outputs
    match the one-band launch bit for bit, and the float64 reference. A group of
    three query heads per KV head takes the packed-row division's general path
    (work.cuh's FastDivmod), two its power-of-two path."""
    skip_unless_runs(path)
    (num_qo, num_kv), head_dim = heads, 128
    qo_lens, kv_lens = [300, 77, 1000, 5], [300, 90, 1000, 5]
    qo_indptr = torch.tensor([0] + qo_lens, dtype=torch.int32).cumsum(0, dtype=torch.int32)
    kv_indptr = torch.tensor([0] + kv_lens, dtype=torch.int32).cumsum(0, dtype=torch.int32)
    q = randn(sum(qo_lens), num_qo, head_dim, dtype=dtype)
    k, v = (randn(sum(kv_lens), num_kv, head_dim, dtype=dtype) for _ in range(2))

    def run(bands: int):
        monkeypatch.setattr(_plan, "choose_band_items", lambda costs, heads, slots, shared: bands)
        _plan.single_request_band_items.cache_clear()
        wrapper = flashjit.BatchPrefillWithRaggedKVCacheWrapper(torch.empty(1 << 20, dtype=torch.uint8, device="cuda"),
                                                                backend=path_kwargs(path)["backend"])
        wrapper.plan(qo_indptr, kv_indptr, num_qo, num_kv, head_dim, causal=True, q_data_type=dtype,
                     use_tensor_cores=path != "cc")
        assert wrapper._plan.work.band_items == bands
        out = wrapper.run(q, k, v, out=torch.full_like(q, float("nan")))
        single = flashjit.single_prefill_with_kv_cache(q[300:1300], k[300:1390], v[300:1390], causal=True,
                                                       **path_kwargs(path))
        torch.cuda.synchronize()
        return out, single

    out, single = run(band_items)
    _plan.single_request_band_items.cache_clear()
    monkeypatch.undo()
    one_band, one_band_single = run(0)
    _plan.single_request_band_items.cache_clear()
    assert torch.equal(out, one_band) and torch.equal(single, one_band_single)
    ref, _ = ragged_reference(q, k, v, qo_indptr.tolist(), kv_indptr.tolist(), causal=True)
    spec = spec_for("batch_prefill_ragged", dtype, head_dim, True, **spec_path(path))
    check(spec, out, ref, q, k, v, max(kv_lens), 1 / math.sqrt(head_dim), error_report, "launch_bands",
          bands=band_items)


@pytest.mark.parametrize("head_dim", [d for d in HEAD_DIMS if d in (64, 96, 128)])  # fa3's persistent grids
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=str)
def test_fa3_walk_changes_only_the_order(prewarmed, error_report, monkeypatch, dtype, head_dim):
    """A plan's walk (ops._plan.deal_positions, work.cuh CtaWalk) runs every
    launch position once: forced on a causal GQA batch of 286 positions (more
    than a grid of one CTA per SM), the output matches the kernel's own rounds
    bit for bit, and the float64 reference within the profile."""
    skip_unless_runs("fa3")
    num_qo, num_kv = 8, 2
    lens = [2048, 1500, 700, 300]
    indptr = torch.tensor([0] + lens, dtype=torch.int32).cumsum(0, dtype=torch.int32)
    q = randn(sum(lens), num_qo, head_dim, dtype=dtype)
    k, v = (randn(sum(lens), num_kv, head_dim, dtype=dtype) for _ in range(2))

    def run(slack: float):
        monkeypatch.setattr(_plan, "_DEAL_SLACK", slack)
        wrapper = flashjit.BatchPrefillWithRaggedKVCacheWrapper(torch.empty(1 << 20, dtype=torch.uint8, device="cuda"),
                                                                backend="fa3")
        wrapper.plan(indptr, indptr, num_qo, num_kv, head_dim, causal=True, q_data_type=dtype)
        out = wrapper.run(q, k, v, out=torch.full_like(q, float("nan")))
        torch.cuda.synchronize()
        return out, wrapper._plan.walk

    walked, walk = run(-1.0)  # a walk whatever the rounds' balance
    rounds, no_walk = run(float("inf"))
    assert walk != 0 and no_walk == 0
    assert torch.equal(walked, rounds)
    ref, _ = ragged_reference(q, k, v, indptr.tolist(), indptr.tolist(), causal=True)
    spec = spec_for("batch_prefill_ragged", dtype, head_dim, True, **spec_path("fa3"))
    check(spec, walked, ref, q, k, v, max(lens), 1 / math.sqrt(head_dim), error_report, "fa3_walk")


@pytest.mark.parametrize("head_dim", HEAD_DIMS)
@pytest.mark.parametrize("dtype,path", DTYPE_PATHS, ids=[path_id(p) for p in DTYPE_PATHS])
def test_extreme_inputs_stay_finite(prewarmed, error_report, dtype, path, head_dim):
    """Peaked softmax (q x8), V outliers (1% x20), huge logits and all-masked rows:
    within the profile where the reference is finite, never NaN."""
    skip_unless_runs(path)
    qo_len, kv_len = 200, 600
    q = randn(qo_len, 4, head_dim, dtype=dtype, scale=8.0)
    k = randn(kv_len, 4, head_dim, dtype=dtype)
    v = randn(kv_len, 4, head_dim, dtype=dtype)
    outliers = torch.rand(kv_len, 4, 1, device="cuda") < 0.01
    v = torch.where(outliers, v.float() * 20, v.float()).to(dtype)
    out = flashjit.single_prefill_with_kv_cache(q, k, v, causal=True, **path_kwargs(path))
    ref, _ = attention_reference(q, k, v, causal=True)
    check(spec_for("single_prefill", dtype, head_dim, True, **spec_path(path)), out, ref, q, k, v, kv_len,
          1 / math.sqrt(head_dim), error_report, "peaked+outliers", shape=f"{qo_len}x{kv_len}", heads=(4, 4))
    # qo_len > kv_len with causal: the first rows see no key at all -> 0 and LSE -inf.
    big_q = randn(50, 4, head_dim, dtype=dtype, scale=300.0 if dtype != torch.float16 else 30.0)
    out, lse = flashjit.single_prefill_with_kv_cache(big_q, k[:20], v[:20], causal=True, return_lse=True,
                                                     **path_kwargs(path))
    assert torch.isfinite(out).all()
    assert (out[:30] == 0).all() and torch.isneginf(lse[:30]).all() and torch.isfinite(lse[30:]).all()


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_noncontiguous_strided_inputs(prewarmed, dtype):
    """Slices of a fused QKV tensor (head strides, not packed) give the same result as copies."""
    qkv = randn(300, 3 * 4, 128, dtype=dtype)
    q, k, v = qkv[:, :4], qkv[:, 4:8], qkv[:, 8:]
    out = flashjit.single_prefill_with_kv_cache(q, k, v, causal=True)
    same = flashjit.single_prefill_with_kv_cache(q.contiguous(), k.contiguous(), v.contiguous(), causal=True)
    assert torch.equal(out, same)


def test_bad_runtime_input_on_gpu(prewarmed):
    """Errors that need CUDA tensors: indptr past the tensors' end, plan mismatch, misaligned K."""
    q = randn(10, 4, 128, dtype=torch.float16)
    k = randn(10, 4, 128, dtype=torch.float16)
    wrapper = flashjit.BatchPrefillWithRaggedKVCacheWrapper(torch.empty(1024, dtype=torch.uint8, device="cuda"))
    wrapper.plan(torch.tensor([0, 5, 12]), torch.tensor([0, 5, 10]), 4, 4, 128, causal=True,
                 q_data_type=torch.float16)
    with pytest.raises(ValueError, match="qo_indptr"):
        wrapper.run(q, k, k)
    wrapper.plan(torch.tensor([0, 5, 10]), torch.tensor([0, 5, 11]), 4, 4, 128, causal=True,
                 q_data_type=torch.float16)
    with pytest.raises(ValueError, match="kv_indptr"):
        wrapper.run(q, k, k)
    with pytest.raises(ValueError, match="q: expected dtype"):
        wrapper.run(q.bfloat16(), k.bfloat16(), k.bfloat16())
    with pytest.raises(ValueError, match="qo heads"):
        wrapper.run(q[:, :2], k[:, :2], k[:, :2])
    misaligned = torch.empty(10 * 4 * 128 + 1, dtype=torch.float16, device="cuda")[1:].view(10, 4, 128)
    with pytest.raises(ValueError, match="k: expected a 16-byte aligned"):
        flashjit.single_prefill_with_kv_cache(q, misaligned, k)
    with pytest.raises(ValueError, match="k: expected a CUDA tensor"):
        flashjit.single_prefill_with_kv_cache(q, k.cpu(), k)


@pytest.mark.parametrize("paths", [("fa2", "cc"), ("fa3", "cc"), ("fa3", "fa2")], ids="-vs-".join)
@pytest.mark.parametrize("causal", CAUSAL, ids=["full", "causal"])
@pytest.mark.parametrize("head_dim", HEAD_DIMS)
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=str)
def test_paths_agree_within_their_profiles(prewarmed, error_report, dtype, head_dim, causal, paths):
    """Two paths users compare (tensor cores against CUDA cores, fa3 against
    fa2) on the same inputs: within the sum of their two profiles."""
    for path in paths:
        skip_unless_runs(path)
    q = randn(300, 8, head_dim, dtype=dtype)
    k = randn(2000, 2, head_dim, dtype=dtype)
    v = randn(2000, 2, head_dim, dtype=dtype)
    a, b = (flashjit.single_prefill_with_kv_cache(q, k, v, causal=causal, **path_kwargs(path)) for path in paths)
    ref, _ = attention_reference(q, k, v, causal=causal)
    sm_scale = 1 / math.sqrt(head_dim)
    tol_a, tol_b = (flashjit.tolerance(spec_for("single_prefill", dtype, head_dim, causal, **spec_path(path)), q=q,
                                       k=k, v=v, kv_len=2000, sm_scale=sm_scale) for path in paths)
    bound = tol_a + tol_b
    diff = (a.double() - b.double()).abs()
    ratio = float((diff / bound.bound(ref)).max())
    assert ratio <= 1.0, f"{paths[0]} and {paths[1]} outputs differ by {float(diff.max()):.3e}, past the sum of bounds"
    short = {torch.float16: "f16", torch.bfloat16: "bf16"}[dtype]
    label = "_vs_".join(p if p != "fa2" or "cc" not in paths else "tc" for p in paths)
    error_report.append({"config": f"{label}_{short}_d{head_dim}{'_causal' if causal else ''}", "what": label,
                         "ratio": ratio, "max_err": float(diff.max()), "mean_err": float(diff.mean()),
                         "rtol": bound.rtol, "atol": bound.atol})


def test_auto_runs_fa3_on_sm90a_and_fa2_elsewhere(prewarmed):
    """The default tensor-core prefill is fa3 where every target has wgmma:
    bit for bit the explicit backend's output."""
    q = randn(300, 8, 128, dtype=torch.bfloat16)
    k, v = (randn(700, 2, 128, dtype=torch.bfloat16) for _ in range(2))
    chosen = "fa3" if fa3_runs_here() else "fa2"
    auto = flashjit.single_prefill_with_kv_cache(q, k, v, causal=True)
    explicit = flashjit.single_prefill_with_kv_cache(q, k, v, causal=True, backend=chosen, use_tensor_cores=True)
    assert torch.equal(auto, explicit)
