"""Head dim 512 on a GPU, beside test_gpu_head_dims.py's sweep (which runs it
in single and paged decode on both cores and in fa2's paged prefill): FP8 KV
caches (e4m3, e5m2) in paged decode on CUDA and tensor cores and in paged
prefill on fa2, pages of 1 and 16 tokens; sinks in fa2's decode and paged
prefill, whose column-split kernel (fa2/fa2_column_split.cuh) folds them in
its own epilogue, random, dominant, and -inf bit for bit none; `auto` on
paged prefill, fa2 (fa3 does not generate 512), bit for bit the explicit call;
batch-invariant decode, bit for bit the causal paged prefill of the same rows
across a chunk boundary. Against float64 within each profile, into poisoned
outputs, on fresh random inputs; GQA 8/2. Runs where FLASHJIT_TEST_HEAD_DIMS
is unset or names 512."""

from __future__ import annotations

import pytest
import torch

import flashjit
from flashjit.ops import _invariant
from flashjit.spec import KernelSpec, canonical_dtype
from sweep import FP8_KV_DTYPES, build_for_gpu
from test_gpu_attention import poison_allocator, randn
from test_gpu_batch_invariant import Request, assert_same, check_reference, paged_decode, paged_prefill
from test_gpu_fp8 import K_SCALE, V_SCALE, Fp8PagedBatch, check_fp8, fp8_id, paged_prefill_reference, reference
from test_gpu_fp8_tc import PREFILL
from test_gpu_head_dims import NEW_HEAD_DIMS
from test_gpu_paged import DECODE_LENS, PREFILL_KV, PREFILL_QO, indptr_of, prefill_case, workspace
from test_gpu_sinks import Case, make_sinks, run_and_check

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(512 not in NEW_HEAD_DIMS, reason="FLASHJIT_TEST_HEAD_DIMS leaves 512 out")]

D = 512
BF16 = torch.bfloat16
HEADS = (8, 2)
# (op, path) of the sinks cases: tc / fa2 are the column-split kernel, cc CUDA-core decode.
SINK_CASES = [("batch_decode_paged", "tc"), ("batch_decode_paged", "cc"), ("batch_prefill_paged", "fa2")]


def fp8_spec(op: str, kv_dtype, tensor_cores: bool, causal: bool = False) -> KernelSpec:
    return KernelSpec.make(op, BF16, D, dtype_kv=canonical_dtype(kv_dtype), use_tensor_cores=tensor_cores,
                           causal=causal, return_lse=True)


def used_specs() -> list[KernelSpec]:
    specs = [fp8_spec("batch_decode_paged", kv, tc) for kv in FP8_KV_DTYPES for tc in (False, True)]
    specs += [fp8_spec("batch_prefill_paged", kv, True, causal) for kv in FP8_KV_DTYPES for causal in (False, True)]
    specs += [KernelSpec.make(op, BF16, D, use_tensor_cores=path != "cc", causal=causal and op != "batch_decode_paged",
                              return_lse=True) for op, path in SINK_CASES for causal in (False, True)]
    specs += [KernelSpec.make(op, BF16, D, use_tensor_cores=True, causal=True, return_lse=True)
              for op in ("batch_decode_paged", "batch_prefill_paged")]  # batch-invariant mode's and `auto`'s
    return list(dict.fromkeys(specs))


@pytest.fixture(scope="module")
def built():
    return build_for_gpu(used_specs())


@pytest.mark.parametrize("page_size", [1, 16], ids=lambda p: f"page{p}")
@pytest.mark.parametrize("tensor_cores", [False, True], ids=["cc", "tc"])
@pytest.mark.parametrize("kv_dtype", FP8_KV_DTYPES, ids=fp8_id)
def test_fp8_paged_decode(built, error_report, kv_dtype, tensor_cores, page_size):
    num_qo, num_kv = HEADS
    batch = Fp8PagedBatch(DECODE_LENS, page_size, num_kv, D, kv_dtype)
    q = randn(len(DECODE_LENS), num_qo, D, dtype=BF16)
    wrapper = flashjit.BatchDecodeWithPagedKVCacheWrapper(workspace(), "NHD", use_tensor_cores=tensor_cores)
    wrapper.plan(batch.indptr, batch.indices, batch.last, num_qo, num_kv, D, page_size, q_data_type=BF16,
                 kv_data_type=kv_dtype)
    spec = fp8_spec("batch_decode_paged", kv_dtype, tensor_cores)
    assert wrapper._plan.module.spec == spec
    poison_allocator()
    out, lse = wrapper.run(q, batch.cache, k_scale=K_SCALE, v_scale=V_SCALE, return_lse=True)
    torch.cuda.synchronize()
    ref, ref_lse = reference(q, batch.k, batch.v, DECODE_LENS)
    check_fp8(spec, out, ref, q, batch.k, batch.v, max(DECODE_LENS), error_report,
              f"fp8_decode_512_{'tc' if tensor_cores else 'cc'}", lse=lse, ref_lse=ref_lse,
              shape=f"mixed-page{page_size}", heads=HEADS)
    empty = DECODE_LENS.index(0)
    assert (out[empty] == 0).all() and torch.isneginf(lse[empty]).all()


@pytest.mark.parametrize("page_size", [1, 16], ids=lambda p: f"page{p}")
@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
@pytest.mark.parametrize("kv_dtype", FP8_KV_DTYPES, ids=fp8_id)
def test_fp8_paged_prefill(built, error_report, kv_dtype, causal, page_size):
    num_qo, num_kv = HEADS
    qo_lens, kv_lens = zip(*PREFILL)
    batch = Fp8PagedBatch(kv_lens, page_size, num_kv, D, kv_dtype)
    q = randn(sum(qo_lens), num_qo, D, dtype=BF16)
    wrapper = flashjit.BatchPrefillWithPagedKVCacheWrapper(workspace(), "NHD")
    wrapper.plan(torch.tensor(indptr_of(qo_lens), dtype=torch.int32, device="cuda"), batch.indptr, batch.indices,
                 batch.last, num_qo, num_kv, D, page_size, causal=causal, q_data_type=BF16, kv_data_type=kv_dtype)
    spec = fp8_spec("batch_prefill_paged", kv_dtype, True, causal)
    assert wrapper._plan.module.spec == spec
    poison_allocator()
    out, lse = wrapper.run(q, batch.cache, k_scale=K_SCALE, v_scale=V_SCALE, return_lse=True)
    torch.cuda.synchronize()
    ref, ref_lse = paged_prefill_reference(q, batch, qo_lens, causal)
    check_fp8(spec, out, ref, q, batch.k, batch.v, max(kv_lens), error_report, "fp8_paged_prefill_512", lse=lse,
              ref_lse=ref_lse, shape=f"mixed-page{page_size}", heads=HEADS)


@pytest.mark.parametrize("op,path", SINK_CASES, ids=lambda x: x)
def test_sinks(built, error_report, op, path):
    """Random sinks and sinks that dominate every row within the profile; sinks of -inf bit for bit none."""
    qo_lens, kv_lens = ([1] * len(DECODE_LENS), DECODE_LENS) if op == "batch_decode_paged" else \
        ([1, 37, 128, 5, 300], [1, 300, 128, 1000, 16])
    case = Case(op, path, D, qo_lens, kv_lens, causal=op == "batch_prefill_paged")
    for kind in ("randn", "dominant"):
        run_and_check(case, kind, error_report, f"{op}_sinks_512", shape=path)
    out, lse = case.run(None)
    out_inf, lse_inf = case.run(make_sinks("none"))
    assert torch.equal(out_inf, out) and torch.equal(lse_inf, lse)


def test_auto_runs_fa2_for_paged_prefill(built):
    """fa3 does not generate 512: `auto` runs fa2 (on sm_90a too), bit for bit backend='fa2'."""
    runs = []
    for path in ("auto", "fa2"):
        torch.manual_seed(D)  # the same inputs for both
        runs.append(prefill_case(PREFILL_QO, PREFILL_KV, BF16, path, D, HEADS, True))
    for auto, explicit, what in zip(runs[0][2:4], runs[1][2:4], ("out", "lse")):
        assert_same(auto, explicit, f"auto against fa2: {what}")


def test_batch_invariant_decode_equals_paged_prefill(built):
    """Decode rows of a prompt past the split-KV chunk, among other requests,
    bit for bit its causal paged prefill (the same fa2 kernel and key tiles)."""
    torch.manual_seed(D)
    n = _invariant.CHUNK_KEYS + 300
    prompt = Request(n, n, HEADS, D, BF16)
    prefill = paged_prefill([prompt], 16, "auto")[0]
    check_reference(*prefill, prompt, BF16, D, "prefill 512")
    others = [Request(1, 90, HEADS, D, BF16), Request(1, _invariant.CHUNK_KEYS + 7, HEADS, D, BF16)]
    for j in (0, _invariant.CHUNK_KEYS - 1, _invariant.CHUNK_KEYS, n - 1):
        for page_size in (1, 16):
            step = paged_decode([prompt.step(j), *others], page_size, "auto", tensor_cores=True)[0]
            assert_same(step[0], prefill[0][j:j + 1], f"decode row {j}, pages of {page_size}")
            assert_same(step[1], prefill[1][j:j + 1], f"decode row {j}, pages of {page_size}: lse")
