"""FP8 KV caches on the fa3 backend (sm_90a; skipped elsewhere): the loader
widens each tile of codes into the 16-bit tile the wgmma reads. Paged prefill
(gathered pages of 1 and 16 slots, TMA boxes at 64, NHD and HND), causal
ragged prefill with tensor scales and the soft-cap, single prefill (split
across CTAs) against float64 attention over the dequantised cache within their
profiles; fa3 against fa2 on the same inputs within the sum of both profiles;
a captured paged prefill replayed with new scale tensors; batch-invariant
mode's chunk fold. `backend="auto"` runs fa3 for all of them on sm_90a."""

from __future__ import annotations

import itertools
import math
import os

import pytest
import torch

import flashjit
from flashjit.reference import ragged_reference
from flashjit.spec import FA3_FP8_HEAD_DIMS, canonical_dtype
from sweep import FP8_KV_DTYPES, FP8_Q_DTYPES, build_for_gpu, fa3_runs_here, spec_for
from test_gpu_attention import poison_allocator, randn
from test_gpu_fp8 import (K_SCALE, V_SCALE, Fp8PagedBatch, check_fp8, check_fp8_ragged_prefill_tensor_scales,
                          check_fp8_single_prefill, codes, f32, fp8_id, paged_prefill_reference,
                          replay_with_new_scales)
from test_gpu_paged import indptr_of, workspace

pytestmark = pytest.mark.gpu

# Requests (query tokens, keys): one key, a partial tile, whole tiles, none, and
# one long enough that the code slots and the ring wrap many times.
PREFILL = [(1, 1), (37, 300), (128, 128), (16, 1000), (70, 70), (0, 5), (5, 0), (200, 2100)]
PAGE_SIZES = [1, 16, 64]  # gathered, gathered, TMA boxes of 64 slots
# FLASHJIT_TEST_HEAD_DIMS (a comma list, as tests/test_gpu_head_dims.py reads it) keeps those of fa3's.
HEAD_DIMS = [d for d in FA3_FP8_HEAD_DIMS if not os.environ.get("FLASHJIT_TEST_HEAD_DIMS")
             or d in {int(x) for x in os.environ["FLASHJIT_TEST_HEAD_DIMS"].split(",")}]
# (op, causal) the tests plan, at every head dim, q and KV dtype.
OPS = [("batch_prefill_paged", False), ("batch_prefill_paged", True), ("batch_prefill_ragged", True),
       ("single_prefill", False)]


def fa3_spec(op: str, q_dtype, kv_dtype, head_dim: int, causal: bool = False, variant: str = "plain",
             backend: str = "fa3"):
    return spec_for(op, q_dtype, head_dim, causal, variant, tensor_cores=True, backend=backend).replace(
        dtype_kv=canonical_dtype(kv_dtype))


def _specs() -> list:
    specs = [fa3_spec(op, q, kv, d, causal) for q, kv, d, (op, causal)
             in itertools.product(FP8_Q_DTYPES, FP8_KV_DTYPES, HEAD_DIMS, OPS)]
    specs += [fa3_spec("batch_prefill_ragged", torch.bfloat16, kv, 128, True, "softcap") for kv in FP8_KV_DTYPES]
    specs += [fa3_spec("batch_prefill_paged", q, kv, d, True, backend="fa2") for q, kv, d
              in itertools.product(FP8_Q_DTYPES, FP8_KV_DTYPES, HEAD_DIMS)]
    return specs


@pytest.fixture(scope="module")
def built():
    if torch.cuda.is_available() and not fa3_runs_here():
        pytest.skip("fa3 runs on sm_90a GPUs only")
    return build_for_gpu(_specs())


def paged_prefill(batch, q, qo_lens, num_qo, num_kv, head_dim, page_size, causal, q_dtype, kv_dtype,
                  backend="auto", layout="NHD", **run_kw):
    wrapper = flashjit.BatchPrefillWithPagedKVCacheWrapper(workspace(), layout, backend=backend)
    wrapper.plan(torch.tensor(indptr_of(qo_lens), dtype=torch.int32, device="cuda"), batch.indptr, batch.indices,
                 batch.last, num_qo, num_kv, head_dim, page_size, causal=causal, q_data_type=q_dtype,
                 kv_data_type=kv_dtype)
    poison_allocator()
    out, lse = wrapper.run(q, batch.cache, return_lse=True, **run_kw)
    torch.cuda.synchronize()
    return wrapper, out, lse


@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
@pytest.mark.parametrize("page_size", PAGE_SIZES, ids=lambda p: f"page{p}")
@pytest.mark.parametrize("head_dim", HEAD_DIMS)
@pytest.mark.parametrize("kv_dtype", FP8_KV_DTYPES, ids=fp8_id)
@pytest.mark.parametrize("q_dtype", FP8_Q_DTYPES, ids=str)
def test_fa3_fp8_paged_prefill(built, error_report, q_dtype, kv_dtype, head_dim, page_size, causal):
    num_qo, num_kv = 8, 2
    qo_lens, kv_lens = zip(*PREFILL)
    batch = Fp8PagedBatch(kv_lens, page_size, num_kv, head_dim, kv_dtype)
    q = randn(sum(qo_lens), num_qo, head_dim, dtype=q_dtype)
    wrapper, out, lse = paged_prefill(batch, q, qo_lens, num_qo, num_kv, head_dim, page_size, causal, q_dtype,
                                      kv_dtype, k_scale=K_SCALE, v_scale=V_SCALE)
    spec = fa3_spec("batch_prefill_paged", q_dtype, kv_dtype, head_dim, causal)
    assert wrapper._plan.module.spec == spec  # auto: fa3 on sm_90a
    ref, ref_lse = paged_prefill_reference(q, batch, qo_lens, causal)
    check_fp8(spec, out, ref, q, batch.k, batch.v, max(kv_lens), error_report, "fa3_fp8_paged_prefill", lse=lse,
              ref_lse=ref_lse, shape=f"mixed-page{page_size}", heads=(num_qo, num_kv))


@pytest.mark.parametrize("page_size", [16, 64], ids=lambda p: f"page{p}")
@pytest.mark.parametrize("form", ["5d", "tuple"])
@pytest.mark.parametrize("kv_dtype", FP8_KV_DTYPES, ids=fp8_id)
def test_fa3_fp8_paged_prefill_hnd(built, error_report, kv_dtype, form, page_size):
    """HND pages (heads outermost in a page: the tensor maps swap their middle dimensions), as one
    tensor or a (K, V) tuple; MHA, so that every KV head has its own rows."""
    q_dtype, head_dim, (num_qo, num_kv), causal = torch.bfloat16, 128, (4, 4), True
    qo_lens, kv_lens = zip(*PREFILL)
    batch = Fp8PagedBatch(kv_lens, page_size, num_kv, head_dim, kv_dtype, layout="HND", form=form)
    q = randn(sum(qo_lens), num_qo, head_dim, dtype=q_dtype)
    wrapper, out, lse = paged_prefill(batch, q, qo_lens, num_qo, num_kv, head_dim, page_size, causal, q_dtype,
                                      kv_dtype, layout="HND", k_scale=K_SCALE, v_scale=V_SCALE)
    spec = fa3_spec("batch_prefill_paged", q_dtype, kv_dtype, head_dim, causal)
    assert wrapper._plan.module.spec == spec
    ref, ref_lse = paged_prefill_reference(q, batch, qo_lens, causal)
    check_fp8(spec, out, ref, q, batch.k, batch.v, max(kv_lens), error_report, f"fa3_fp8_paged_prefill_hnd_{form}",
              lse=lse, ref_lse=ref_lse, shape=f"mixed-page{page_size}", heads=(num_qo, num_kv))


RAGGED_CASES = [(q, head_dim, "plain") for q in FP8_Q_DTYPES for head_dim in HEAD_DIMS] + \
    [(torch.bfloat16, 128, "softcap")]


@pytest.mark.parametrize("q_dtype,head_dim,variant", RAGGED_CASES, ids=lambda x: str(x).removeprefix("torch."))
@pytest.mark.parametrize("kv_dtype", FP8_KV_DTYPES, ids=fp8_id)
def test_fa3_fp8_ragged_prefill_tensor_scales(built, error_report, kv_dtype, q_dtype, head_dim, variant):
    """A batch's partial tiles are copied (its tensor maps run on into the next request); scales as tensors."""
    wrapper = flashjit.BatchPrefillWithRaggedKVCacheWrapper(workspace(), "NHD")
    spec = fa3_spec("batch_prefill_ragged", q_dtype, kv_dtype, head_dim, True, variant)
    check_fp8_ragged_prefill_tensor_scales(wrapper, spec, q_dtype, kv_dtype, head_dim, variant, PREFILL, error_report,
                                           f"fa3_fp8_ragged_prefill_{variant}")


@pytest.mark.parametrize("qo_len,kv_len", [(1, 1), (37, 300), (300, 1000), (16, 5000)])
@pytest.mark.parametrize("head_dim", HEAD_DIMS)
@pytest.mark.parametrize("kv_dtype", FP8_KV_DTYPES, ids=fp8_id)
@pytest.mark.parametrize("q_dtype", FP8_Q_DTYPES, ids=str)
def test_fa3_fp8_single_prefill(built, error_report, q_dtype, kv_dtype, head_dim, qo_len, kv_len):
    """One request's maps end with its keys: a partial tile comes by TMA, zero-filled; 5000 keys split."""
    check_fp8_single_prefill(fa3_spec("single_prefill", q_dtype, kv_dtype, head_dim), q_dtype, kv_dtype, head_dim,
                             qo_len, kv_len, error_report, "fa3_fp8_single_prefill", backend="fa3", strict=True)


@pytest.mark.parametrize("page_size", [16, 64], ids=lambda p: f"page{p}")
@pytest.mark.parametrize("head_dim", HEAD_DIMS)
@pytest.mark.parametrize("kv_dtype", FP8_KV_DTYPES, ids=fp8_id)
@pytest.mark.parametrize("q_dtype", FP8_Q_DTYPES, ids=str)
def test_fa3_fp8_matches_fa2_fp8(built, q_dtype, kv_dtype, head_dim, page_size):
    """The same causal paged prefill on fa3 and on fa2: within the sum of their profiles of each other."""
    num_qo, num_kv = 8, 2
    qo_lens, kv_lens = zip(*PREFILL)
    batch = Fp8PagedBatch(kv_lens, page_size, num_kv, head_dim, kv_dtype)
    q = randn(sum(qo_lens), num_qo, head_dim, dtype=q_dtype)
    outs, tols = [], []
    for backend in ("fa3", "fa2"):
        wrapper, out, _ = paged_prefill(batch, q, qo_lens, num_qo, num_kv, head_dim, page_size, True, q_dtype, kv_dtype,
                                        backend=backend, k_scale=K_SCALE, v_scale=V_SCALE)
        assert wrapper._plan.module.spec.backend == backend
        assert not torch.isnan(out).any(), backend
        k, v = batch.k.double() * f32(K_SCALE), batch.v.double() * f32(V_SCALE)
        tols.append(flashjit.tolerance(wrapper._plan.module.spec, q=q, k=k, v=v, kv_len=max(kv_lens),
                                       sm_scale=1 / math.sqrt(head_dim)))
        outs.append(out)
    ref, _ = paged_prefill_reference(q, batch, qo_lens, True)
    bound = sum(t.atol for t in tols) + sum(t.rtol for t in tols) * ref.abs()
    gap = (outs[0].double() - outs[1].double()).abs()
    assert bool((gap <= bound).all()), f"fa3 and fa2 differ by {float((gap - bound).max()):.3g} past the bound"


@pytest.mark.parametrize("kv_dtype", FP8_KV_DTYPES, ids=fp8_id)
def test_fa3_fp8_paged_prefill_graph_replays_with_new_scales(built, error_report, kv_dtype):
    """Scales as tensors, which the kernel reads: each replay of one capture takes the values they hold then."""
    q_dtype, head_dim, (num_qo, num_kv), page_size, causal = torch.float16, 128, (16, 4), 16, True
    qo_lens, kv_lens = [3, 100, 1, 64], [100, 107, 3000, 64]
    batch = Fp8PagedBatch(kv_lens, page_size, num_kv, head_dim, kv_dtype)
    page_buf = torch.zeros(batch.num_pages, dtype=torch.int32, device="cuda")
    wrapper = flashjit.BatchPrefillWithPagedKVCacheWrapper(workspace(), "NHD", use_cuda_graph=True,
                                                           paged_kv_indices_buf=page_buf)
    wrapper.plan(torch.tensor(indptr_of(qo_lens), dtype=torch.int32, device="cuda"), batch.indptr, batch.indices,
                 batch.last, num_qo, num_kv, head_dim, page_size, causal=causal, q_data_type=q_dtype,
                 kv_data_type=kv_dtype)
    spec = fa3_spec("batch_prefill_paged", q_dtype, kv_dtype, head_dim, causal)
    assert wrapper._plan.module.spec == spec
    q = randn(sum(qo_lens), num_qo, head_dim, dtype=q_dtype)
    out = torch.empty_like(q)

    def check_replay(ks, vs):
        ref, _ = paged_prefill_reference(q, batch, qo_lens, causal, ks, vs)
        check_fp8(spec, out, ref, q, batch.k, batch.v, max(kv_lens), error_report, "fa3_fp8_graph_replay",
                  k_scale=ks, v_scale=vs, shape=str(kv_lens), heads=(num_qo, num_kv))

    replay_with_new_scales(wrapper, q, batch.cache, out, check_replay)


@pytest.mark.parametrize("head_dim", [128, 256])
def test_fa3_fp8_batch_invariant_chunk_fold(built, error_report, head_dim):
    """Batch-invariant mode's fold kernel (a CTA's keys span several chunks; v_scale applied once the chunks
    are merged): a long request alone and among others gives the same bits, within its profile."""
    q_dtype, kv_dtype, (num_qo, num_kv) = torch.bfloat16, torch.float8_e4m3fn, (8, 2)
    lens = [(300, 5000), (1, 1), (64, 2100), (7, 30)]
    data = [(randn(qo, num_qo, head_dim, dtype=q_dtype), codes(kv, num_kv, head_dim, kv_dtype=kv_dtype, scale=K_SCALE),
             codes(kv, num_kv, head_dim, kv_dtype=kv_dtype, scale=V_SCALE)) for qo, kv in lens]

    def run(parts):
        wrapper = flashjit.BatchPrefillWithRaggedKVCacheWrapper(workspace(), "NHD")
        wrapper.plan(torch.tensor(indptr_of([p[0].shape[0] for p in parts]), dtype=torch.int32, device="cuda"),
                     torch.tensor(indptr_of([p[1].shape[0] for p in parts]), dtype=torch.int32, device="cuda"),
                     num_qo, num_kv, head_dim, causal=True, q_data_type=q_dtype, kv_data_type=kv_dtype,
                     batch_invariant=True)
        assert wrapper._plan.module.spec.backend == "fa3"
        out = wrapper.run(torch.cat([p[0] for p in parts]), torch.cat([p[1] for p in parts]).to(kv_dtype),
                          torch.cat([p[2] for p in parts]).to(kv_dtype), k_scale=K_SCALE, v_scale=V_SCALE)
        torch.cuda.synchronize()
        return wrapper, out

    _, alone = run(data[:1])
    wrapper, together = run(data)
    assert torch.equal(alone.view(torch.int16), together[:lens[0][0]].view(torch.int16)), "batch-dependent bits"
    q, k, v = data[0]
    ref, _ = ragged_reference(q, k, v, [0, lens[0][0]], [0, lens[0][1]], causal=True, k_scale=f32(K_SCALE),
                              v_scale=f32(V_SCALE))
    check_fp8(wrapper._plan.module.spec, alone, ref, q, k, v, lens[0][1], error_report, "fa3_fp8_batch_invariant",
              shape="300x5000", heads=(num_qo, num_kv))
