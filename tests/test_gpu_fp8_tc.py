"""FP8 KV caches on tensor cores (the fa2 kernels, which widen each landed tile
of codes to q's dtype in shared memory): paged, ragged and single prefill
against float64 attention over the dequantised cache within their profiles
(paged decode: test_gpu_fp8.py, both cores); decode against paged prefill of the same requests within the sum of
both profiles; the soft-cap; a captured decode that reads new scale tensors at
each replay. The prefill calls name backend="fa2": on sm_90a `auto` runs fa3
for them (test_gpu_fp8_fa3.py)."""

from __future__ import annotations

import math

import pytest
import torch

import flashjit
from flashjit.spec import canonical_dtype
from sweep import FP8_KV_DTYPES, FP8_PAGE_SIZES, FP8_Q_DTYPES, HEAD_DIMS, spec_for
from test_gpu_attention import poison_allocator, randn
from test_gpu_fp8 import (K_SCALE, V_SCALE, Fp8PagedBatch, check_fp8, check_fp8_ragged_prefill_tensor_scales,
                          check_fp8_single_prefill, f32, fp8_id, paged_prefill_reference, reference,
                          replay_with_new_scales)
from test_gpu_paged import indptr_of, workspace

pytestmark = pytest.mark.gpu

# Prefill requests: (query tokens, keys); one with no keys, one query longer than its keys' tile.
PREFILL = [(1, 1), (37, 300), (128, 128), (16, 1000), (70, 70), (0, 5), (5, 0)]


def tc_spec(op: str, q_dtype, kv_dtype, head_dim: int, causal: bool = False, variant: str = "plain"):
    return spec_for(op, q_dtype, head_dim, causal, variant, tensor_cores=True).replace(
        dtype_kv=canonical_dtype(kv_dtype))


@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
@pytest.mark.parametrize("page_size", FP8_PAGE_SIZES, ids=lambda p: f"page{p}")
@pytest.mark.parametrize("head_dim", HEAD_DIMS)
@pytest.mark.parametrize("kv_dtype", FP8_KV_DTYPES, ids=fp8_id)
@pytest.mark.parametrize("q_dtype", FP8_Q_DTYPES, ids=str)
def test_fp8_paged_prefill(prewarmed, error_report, q_dtype, kv_dtype, head_dim, page_size, causal):
    (num_qo, num_kv) = (8, 2)
    qo_lens, kv_lens = zip(*PREFILL)
    batch = Fp8PagedBatch(kv_lens, page_size, num_kv, head_dim, kv_dtype)
    q = randn(sum(qo_lens), num_qo, head_dim, dtype=q_dtype)
    qo_indptr = torch.tensor(indptr_of(qo_lens), dtype=torch.int32, device="cuda")
    wrapper = flashjit.BatchPrefillWithPagedKVCacheWrapper(workspace(), "NHD", backend="fa2")
    wrapper.plan(qo_indptr, batch.indptr, batch.indices, batch.last, num_qo, num_kv, head_dim, page_size,
                 causal=causal, q_data_type=q_dtype, kv_data_type=kv_dtype)
    spec = tc_spec("batch_prefill_paged", q_dtype, kv_dtype, head_dim, causal)
    assert wrapper._plan.module.spec == spec
    poison_allocator()
    out, lse = wrapper.run(q, batch.cache, k_scale=K_SCALE, v_scale=V_SCALE, return_lse=True)
    torch.cuda.synchronize()
    ref, ref_lse = paged_prefill_reference(q, batch, qo_lens, causal)
    check_fp8(spec, out, ref, q, batch.k, batch.v, max(kv_lens), error_report, "fp8_paged_prefill", lse=lse,
              ref_lse=ref_lse, shape=f"mixed-page{page_size}", heads=(num_qo, num_kv))


# Every head dim and dtype plain, and the soft-cap at d128 bf16 (sweep.fp8_tensor_core_specs).
RAGGED_CASES = [(q, head_dim, "plain") for q in FP8_Q_DTYPES for head_dim in HEAD_DIMS] + \
    [(torch.bfloat16, 128, "softcap")]


@pytest.mark.parametrize("q_dtype,head_dim,variant", RAGGED_CASES, ids=lambda x: str(x).removeprefix("torch."))
@pytest.mark.parametrize("kv_dtype", FP8_KV_DTYPES, ids=fp8_id)
def test_fp8_ragged_prefill_tensor_scales(prewarmed, error_report, kv_dtype, q_dtype, head_dim, variant):
    """Causal ragged prefill over FP8 K/V, scales as one-element float32 tensors."""
    wrapper = flashjit.BatchPrefillWithRaggedKVCacheWrapper(workspace(), "NHD", backend="fa2")
    spec = tc_spec("batch_prefill_ragged", q_dtype, kv_dtype, head_dim, True, variant)
    check_fp8_ragged_prefill_tensor_scales(wrapper, spec, q_dtype, kv_dtype, head_dim, variant, PREFILL, error_report,
                                           f"fp8_ragged_prefill_{variant}")


@pytest.mark.parametrize("qo_len,kv_len", [(1, 1), (37, 300), (300, 1000), (16, 5000)])
@pytest.mark.parametrize("head_dim", HEAD_DIMS)
@pytest.mark.parametrize("kv_dtype", FP8_KV_DTYPES, ids=fp8_id)
@pytest.mark.parametrize("q_dtype", FP8_Q_DTYPES, ids=str)
def test_fp8_single_prefill(prewarmed, error_report, q_dtype, kv_dtype, head_dim, qo_len, kv_len):
    """FlashInfer's scale_k / scale_v; 5000 keys split across CTAs and merged."""
    check_fp8_single_prefill(tc_spec("single_prefill", q_dtype, kv_dtype, head_dim), q_dtype, kv_dtype, head_dim,
                             qo_len, kv_len, error_report, "fp8_single_prefill", backend="fa2")


@pytest.mark.parametrize("kv_dtype", FP8_KV_DTYPES, ids=fp8_id)
def test_fp8_decode_matches_paged_prefill(prewarmed, kv_dtype):
    """One query token per request through tensor-core decode and through paged
    prefill of the same pages: within the sum of their profiles of each other."""
    q_dtype, head_dim, (num_qo, num_kv), page_size = torch.bfloat16, 128, (8, 2), 16
    lens = [1, 300, 2000, 77]
    batch = Fp8PagedBatch(lens, page_size, num_kv, head_dim, kv_dtype)
    q = randn(len(lens), num_qo, head_dim, dtype=q_dtype)
    decode = flashjit.BatchDecodeWithPagedKVCacheWrapper(workspace(), "NHD", use_tensor_cores=True)
    decode.plan(batch.indptr, batch.indices, batch.last, num_qo, num_kv, head_dim, page_size, q_data_type=q_dtype,
                kv_data_type=kv_dtype)
    prefill = flashjit.BatchPrefillWithPagedKVCacheWrapper(workspace(), "NHD", backend="fa2")
    prefill.plan(torch.arange(len(lens) + 1, dtype=torch.int32, device="cuda"), batch.indptr, batch.indices,
                 batch.last, num_qo, num_kv, head_dim, page_size, q_data_type=q_dtype, kv_data_type=kv_dtype)
    a = decode.run(q, batch.cache, k_scale=K_SCALE, v_scale=V_SCALE)
    b = prefill.run(q, batch.cache, k_scale=K_SCALE, v_scale=V_SCALE)
    torch.cuda.synchronize()
    ref, _ = reference(q, batch.k, batch.v, lens)
    k, v = batch.k.double() * f32(K_SCALE), batch.v.double() * f32(V_SCALE)
    tols = [flashjit.tolerance(w._plan.module.spec, q=q, k=k, v=v, kv_len=max(lens), sm_scale=1 / math.sqrt(head_dim))
            for w in (decode, prefill)]
    bound = sum(t.atol for t in tols) + sum(t.rtol for t in tols) * ref.abs()
    gap = (a.double() - b.double()).abs()
    assert bool((gap <= bound).all()), f"decode and prefill differ by {float((gap - bound).max()):.3g} past the bound"


@pytest.mark.parametrize("kv_dtype", FP8_KV_DTYPES, ids=fp8_id)
def test_fp8_tensor_core_decode_graph_replays_with_new_scales(prewarmed, error_report, kv_dtype):
    q_dtype, head_dim, (num_qo, num_kv), page_size = torch.float16, 128, (16, 4), 16
    kv_lens = [100, 7, 3000, 64]
    batch = Fp8PagedBatch(kv_lens, page_size, num_kv, head_dim, kv_dtype)
    page_buf = torch.zeros(batch.num_pages, dtype=torch.int32, device="cuda")
    wrapper = flashjit.BatchDecodeWithPagedKVCacheWrapper(workspace(), use_cuda_graph=True, use_tensor_cores=True,
                                                          paged_kv_indices_buffer=page_buf)
    wrapper.plan(batch.indptr, batch.indices, batch.last, num_qo, num_kv, head_dim, page_size, q_data_type=q_dtype,
                 kv_data_type=kv_dtype)
    q = randn(len(kv_lens), num_qo, head_dim, dtype=q_dtype)
    out = torch.empty_like(q)
    spec = tc_spec("batch_decode_paged", q_dtype, kv_dtype, head_dim)

    def check_replay(ks, vs):
        ref, _ = reference(q, batch.k, batch.v, kv_lens, ks, vs)
        check_fp8(spec, out, ref, q, batch.k, batch.v, max(kv_lens), error_report, "fp8_tc_graph_replay",
                  k_scale=ks, v_scale=vs, shape=str(kv_lens), heads=(num_qo, num_kv))

    replay_with_new_scales(wrapper, q, batch.cache, out, check_replay)
