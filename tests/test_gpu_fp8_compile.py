"""FP8 caches under torch.compile(fullgraph=True) on a GPU: paged decode
(CUDA cores) and single decode with k_scale / v_scale in one-element CUDA
tensors, and MLA with ckv_scale / kpe_scale in them. The graph is compiled
once; each call after new values are written into the same tensors reads those
values: its outputs are within the profile of float64 attention over the cache
dequantised with them, and bit-identical to eager calls. (The operators'
schemas and tracing on the CPU: test_torch_ops_fp8.py, test_torch_ops_mla_fp8.py.)"""

from __future__ import annotations

import pytest
import torch
import torch._dynamo
import torch._dynamo.testing

import flashjit
from flashjit.spec import canonical_dtype, mla_spec
from test_gpu_attention import poison_allocator, randn
from test_gpu_fp8 import DECODE_LENS, K_SCALE, V_SCALE, Fp8PagedBatch, check_fp8, codes, fp8_id, fp8_spec, reference
from test_gpu_mla import mla_wrapper
from test_gpu_mla_fp8 import FP8_MLA_BACKENDS, Fp8MlaBatch
from sweep import FP8_KV_DTYPES, build_for_gpu
from test_gpu_paged import workspace

pytestmark = pytest.mark.gpu

SINGLE_KV_LEN = 3000  # long enough for the single decode to split across CTAs and merge
SCALES = ((K_SCALE, V_SCALE), (0.05, 3.0), (1.5, 0.25))


@pytest.mark.parametrize("backend", ["aot_eager", "inductor"])
@pytest.mark.parametrize("kv_dtype", FP8_KV_DTYPES, ids=fp8_id)
def test_fp8_decode_compiled_reads_new_scale_tensors(prewarmed, error_report, kv_dtype, backend):
    q_dtype, head_dim, (num_qo, num_kv), page_size = torch.bfloat16, 128, (8, 2), 16
    batch = Fp8PagedBatch(DECODE_LENS, page_size, num_kv, head_dim, kv_dtype)
    wrapper = flashjit.BatchDecodeWithPagedKVCacheWrapper(workspace(), "NHD", use_tensor_cores=False)
    wrapper.plan(batch.indptr, batch.indices, batch.last, num_qo, num_kv, head_dim, page_size, q_data_type=q_dtype,
                 kv_data_type=kv_dtype)
    q = randn(len(DECODE_LENS), num_qo, head_dim, dtype=q_dtype)
    single_q = randn(num_qo, head_dim, dtype=q_dtype)
    single_k = codes(SINGLE_KV_LEN, num_kv, head_dim, kv_dtype=kv_dtype, scale=K_SCALE)  # float32 codes
    single_v = codes(SINGLE_KV_LEN, num_kv, head_dim, kv_dtype=kv_dtype, scale=V_SCALE)
    k_scale = torch.tensor([K_SCALE], device="cuda")
    v_scale = torch.tensor([V_SCALE], device="cuda")

    def step(q, cache, single_q, single_k, single_v, k_scale, v_scale):
        out, lse = wrapper.run(q, cache, k_scale=k_scale, v_scale=v_scale, return_lse=True)
        single = flashjit.single_decode_with_kv_cache(single_q, single_k, single_v, k_scale=k_scale, v_scale=v_scale)
        return out, lse, single

    args = (q, batch.cache, single_q, single_k.to(kv_dtype), single_v.to(kv_dtype), k_scale, v_scale)
    spec = fp8_spec("batch_decode_paged", q_dtype, kv_dtype, head_dim, True)
    single_spec = fp8_spec("single_decode", q_dtype, kv_dtype, head_dim, False)
    torch._dynamo.reset()
    counter = torch._dynamo.testing.CompileCounterWithBackend(backend)
    compiled = torch.compile(step, fullgraph=True, backend=counter)
    for ks, vs in SCALES:
        k_scale.fill_(ks)
        v_scale.fill_(vs)
        poison_allocator()
        out, lse, single = compiled(*args)
        torch.cuda.synchronize()
        assert wrapper._plan.module.spec == spec
        ref, ref_lse = reference(q, batch.k, batch.v, DECODE_LENS, ks, vs)
        check_fp8(spec, out, ref, q, batch.k, batch.v, max(DECODE_LENS), error_report, f"fp8_compiled_decode_{backend}",
                  k_scale=ks, v_scale=vs, lse=lse, ref_lse=ref_lse, shape="mixed", heads=(num_qo, num_kv))
        ref1, _ = reference(single_q[None], single_k, single_v, [SINGLE_KV_LEN], ks, vs)
        check_fp8(single_spec, single, ref1[0], single_q, single_k, single_v, SINGLE_KV_LEN, error_report,
                  f"fp8_compiled_single_decode_{backend}", k_scale=ks, v_scale=vs, shape=f"1x{SINGLE_KV_LEN}",
                  heads=(num_qo, num_kv))
        eager = step(*args)
        assert all(torch.equal(a, b) for a, b in zip(eager, (out, lse, single), strict=True)), (ks, vs)
    assert counter.frame_count == 1, "a new value in the scale tensors recompiled the graph"


@pytest.mark.parametrize("backend", ["aot_eager", "inductor"])
@pytest.mark.parametrize("mla_backend", FP8_MLA_BACKENDS)
def test_fp8_mla_compiled_reads_new_scale_tensors(error_report, mla_backend, backend):
    kv_dtype, q_dtype = torch.float8_e4m3fn, torch.bfloat16
    build_for_gpu([mla_spec(q_dtype, backend=mla_backend, dtype_kv=canonical_dtype(kv_dtype))])
    batch = Fp8MlaBatch([1, 1, 1], [40, 700, 65], 64, 16, q_dtype, kv_dtype)
    wrapper = mla_wrapper(mla_backend)
    batch.plan(wrapper, False)
    ckv_scale, kpe_scale = (torch.tensor([s], device="cuda") for s in (batch.ckv_scale, batch.kpe_scale))

    def step(q_nope, q_pe, ckv, kpe, ckv_scale, kpe_scale):
        out, lse = wrapper.run(q_nope, q_pe, ckv, kpe, ckv_scale=ckv_scale, kpe_scale=kpe_scale, return_lse=True)
        into = torch.empty_like(q_nope)
        wrapper.run(q_nope, q_pe, ckv, kpe, out=into, ckv_scale=ckv_scale, kpe_scale=kpe_scale)
        return out, lse, into

    args = (batch.q_nope, batch.q_pe, batch.ckv, batch.kpe, ckv_scale, kpe_scale)
    torch._dynamo.reset()
    counter = torch._dynamo.testing.CompileCounterWithBackend(backend)
    compiled = torch.compile(step, fullgraph=True, backend=counter)
    for scales in ((batch.ckv_scale, batch.kpe_scale), (0.125, 4.0), (1.5, 0.25)):
        batch.ckv_scale, batch.kpe_scale = scales
        ckv_scale.fill_(scales[0])
        kpe_scale.fill_(scales[1])
        poison_allocator()
        out, lse, into = compiled(*args)
        batch.check(out, lse, False, error_report, f"fp8_mla_compiled_{backend}", mla_backend, scales=str(scales))
        eager = step(*args)
        assert all(torch.equal(a, b) for a, b in zip(eager, (out, lse, into), strict=True)), scales
    assert counter.frame_count == 1, "a new value in the scale tensors recompiled the graph"
