"""Head dims beyond 64/128/256 on a GPU: single prefill and decode, ragged and
paged prefill, paged decode on CUDA cores (fp16, bf16, fp32) and on the fa2
tensor cores (fp16, bf16), prefill on fa3 (sm_90a) at the head dims it
generates (96, 192), causal and not, GQA 8/2, each against the float64 reference
within its own tolerance profile (LSE too), on fresh random inputs with
poisoned outputs; per head dim one sinks case, one soft-cap + sliding window
case, the `auto` choice and the KV append. V narrower than Q and K
(head_dim_qk 192, head_dim_vo 128, DeepSeek-V2/V3's prefill): single and
ragged prefill on the fa2 and fa3 tensor cores (fp16, bf16) and CUDA cores
(bf16, fp32), causal and not, GQA 8/2, with LSE, a split-KV batch whose merge
combines 128-wide states, sinks, and fa3's batch-invariant fold at 192, 192/128 and 96.
512 where generated (decode on both cores, paged prefill on fa2; also pages of
1 token and MQA 32/1); FP8 and batch-invariant mode at 512: test_gpu_head_dim_512.py.
tests/sweep.py keeps the main sweep at 64/128/256; these configurations are
built by their own prewarm, in one parallel build. FLASHJIT_TEST_HEAD_DIMS
(e.g. "48,96", or "512") runs a subset of the head dims where a GPU's time is short."""

from __future__ import annotations

import math
import os

import pytest
import torch

import flashjit
from flashjit.reference import attention_reference, ragged_reference
from flashjit.ops import _invariant
from flashjit.spec import FA3_AUTO_HEAD_DIMS, FA3_HEAD_DIMS, HEAD_DIMS, WIDE_HEAD_DIMS, KernelSpec, head_dims_for
from sweep import build_for_gpu, fa3_runs_here, path_kwargs, spec_for, spec_path
from test_gpu_attention import RAGGED_BATCHES, check, poison_allocator, randn
from test_gpu_paged import DECODE_LENS, PREFILL_KV, PREFILL_QO, decode_case, prefill_case
from test_gpu_sinks import Case, make_sinks, run_and_check
from test_gpu_sinks import Problem as SinkProblem, check as sink_check

pytestmark = pytest.mark.gpu

NEW_HEAD_DIMS = [32, 48, 80, 96, 112, 160, 192, 240, 512]
if os.environ.get("FLASHJIT_TEST_HEAD_DIMS"):
    NEW_HEAD_DIMS = [int(d) for d in os.environ["FLASHJIT_TEST_HEAD_DIMS"].split(",")]
# The new head dims every op takes (512 only some: dims_of).
PREFILL_DIMS = [d for d in NEW_HEAD_DIMS if d in HEAD_DIMS]
HEADS = (8, 2)
F16, BF16, F32 = torch.float16, torch.bfloat16, torch.float32
# (dtype, path) of prefill: CUDA cores ("cc") and the fa2 tensor cores; of decode: (dtype, tensor cores).
PREFILL_PATHS = [(F16, "cc"), (BF16, "cc"), (F32, "cc"), (F16, "fa2"), (BF16, "fa2")]
FA3_PATHS = [(F16, "fa3"), (BF16, "fa3")]
ON_FA3 = pytest.mark.skipif(not fa3_runs_here(), reason="fa3 needs an sm_90a GPU")
DECODE_PATHS = [(F16, False), (BF16, False), (F32, False), (F16, True), (BF16, True)]
CAUSAL = [False, True]
# Both caps together (the flag pair that presses hardest on registers).
CAP_WINDOW = {"window_left": 70, "logits_soft_cap": 30.0}
# head_dim_qk / head_dim_vo (spec.QK_VO_HEAD_DIMS) and the paths that take them.
QK, VO = 192, 128
VO_PATHS = [(F16, "fa2"), (BF16, "fa2"), (BF16, "cc"), (F32, "cc")]


def dims_of(op: str, tensor_cores: bool) -> list[int]:
    """The new head dims `op` takes on those cores."""
    return [d for d in NEW_HEAD_DIMS if d in head_dims_for(op, tensor_cores)]


def prefill_cases(op: str) -> list:
    """(dtype, path, head_dim) of op's prefill tests: every path at every new head
    dim it takes there, and fa3 (on sm_90a) at those of them it generates."""
    cases = [pytest.param(dtype, path, d, id=f"{prefill_id((dtype, path))}-{d}")
             for dtype, path in PREFILL_PATHS for d in dims_of(op, path != "cc")]
    return cases + [pytest.param(dtype, path, d, id=f"{prefill_id((dtype, path))}-{d}", marks=ON_FA3)
                    for dtype, path in FA3_PATHS for d in NEW_HEAD_DIMS if d in FA3_HEAD_DIMS]


def vo_cases() -> list:
    return [pytest.param(*p, id=prefill_id(p)) for p in VO_PATHS] + \
        [pytest.param(*p, id=prefill_id(p), marks=ON_FA3) for p in FA3_PATHS]


def prefill_id(pair) -> str:
    return f"{str(pair[0]).removeprefix('torch.')}-{pair[1]}"


def decode_id(pair) -> str:
    return f"{str(pair[0]).removeprefix('torch.')}-{'tc' if pair[1] else 'cc'}"


def cap_window_spec(head_dim: int) -> KernelSpec:
    return KernelSpec.make("single_prefill", BF16, head_dim, use_tensor_cores=True, causal=True, sliding_window=True,
                           soft_cap=True, return_lse=True)


def vo_spec(op: str, dtype, path: str, causal: bool) -> KernelSpec:
    """The configuration the ops pick for V 128 wide beside Q and K 192 wide."""
    return spec_for(op, dtype, QK, causal, "lse", **spec_path(path)).replace(head_dim_vo=VO)


def used_specs() -> list[KernelSpec]:
    """Every configuration these tests run (the sinks case and `auto` reuse the ragged and single-prefill ones)."""
    specs = []
    for d in NEW_HEAD_DIMS:
        for (dtype, path), causal in ((p, c) for p in PREFILL_PATHS for c in CAUSAL):
            specs += [spec_for(op, dtype, d, causal, "lse" if op == "single_prefill" else "plain", **spec_path(path))
                      for op in ("single_prefill", "batch_prefill_ragged", "batch_prefill_paged")
                      if d in dims_of(op, path != "cc")]
        specs += [spec_for(op, dtype, d, False, "lse" if op == "single_decode" else "plain", tensor_cores=tc)
                  for dtype, tc in DECODE_PATHS for op in ("single_decode", "batch_decode_paged")]
        specs += [cap_window_spec(d), KernelSpec.make("append_paged", BF16, d)] if d in HEAD_DIMS else []
    specs += [vo_spec(op, dtype, path, causal) for op in ("single_prefill", "batch_prefill_ragged")
              for dtype, path in VO_PATHS for causal in CAUSAL]
    if fa3_runs_here():
        specs += [spec_for(op, dtype, d, causal, "lse" if op == "single_prefill" else "plain", **spec_path(path))
                  for d in NEW_HEAD_DIMS if d in FA3_HEAD_DIMS for dtype, path in FA3_PATHS for causal in CAUSAL
                  for op in ("single_prefill", "batch_prefill_ragged", "batch_prefill_paged")]
        specs += [vo_spec(op, dtype, path, causal) for op in ("single_prefill", "batch_prefill_ragged")
                  for dtype, path in FA3_PATHS for causal in CAUSAL]
    return list(dict.fromkeys(specs))


@pytest.fixture(scope="module")
def built():
    """This file's configurations, in one parallel build."""
    return build_for_gpu(used_specs())


@pytest.mark.parametrize("causal", CAUSAL, ids=["full", "causal"])
@pytest.mark.parametrize("dtype,path,head_dim", prefill_cases("single_prefill"))
def test_single_prefill(built, error_report, dtype, path, head_dim, causal):
    """(513, 77) causal: rows that see no key (o = 0, LSE -inf); (16, 5000): split keys."""
    num_qo, num_kv = HEADS
    spec = spec_for("single_prefill", dtype, head_dim, causal, "lse", **spec_path(path))
    for qo_len, kv_len in [(1, 1), (37, 300), (513, 77), (16, 5000)]:
        q = randn(qo_len, num_qo, head_dim, dtype=dtype)
        k, v = (randn(kv_len, num_kv, head_dim, dtype=dtype) for _ in range(2))
        poison_allocator()
        out, lse = flashjit.single_prefill_with_kv_cache(q, k, v, causal=causal, return_lse=True,
                                                         **path_kwargs(path))
        torch.cuda.synchronize()
        ref, ref_lse = attention_reference(q, k, v, causal=causal)
        check(spec, out, ref, q, k, v, kv_len, 1 / math.sqrt(head_dim), error_report, "single_prefill", lse=lse,
              ref_lse=ref_lse, shape=f"{qo_len}x{kv_len}", heads=HEADS)


@pytest.mark.parametrize("head_dim", NEW_HEAD_DIMS)
@pytest.mark.parametrize("dtype,tensor_cores", DECODE_PATHS, ids=[decode_id(p) for p in DECODE_PATHS])
def test_single_decode(built, error_report, dtype, tensor_cores, head_dim):
    num_qo, num_kv = HEADS
    spec = spec_for("single_decode", dtype, head_dim, False, "lse", tensor_cores=tensor_cores)
    for kv_len, layout in [(1, "NHD"), (255, "HND"), (4097, "NHD")]:
        q = randn(num_qo, head_dim, dtype=dtype)
        k_nhd, v_nhd = (randn(kv_len, num_kv, head_dim, dtype=dtype) for _ in range(2))
        k, v = (k_nhd, v_nhd) if layout == "NHD" else (k_nhd.transpose(0, 1).contiguous(),
                                                        v_nhd.transpose(0, 1).contiguous())
        poison_allocator()
        out, lse = flashjit.single_decode_with_kv_cache(q, k, v, kv_layout=layout, use_tensor_cores=tensor_cores,
                                                        return_lse=True)
        torch.cuda.synchronize()
        ref, ref_lse = attention_reference(q[None], k_nhd, v_nhd)
        check(spec, out, ref[0], q, k_nhd, v_nhd, kv_len, 1 / math.sqrt(head_dim), error_report, "single_decode",
              lse=lse, ref_lse=ref_lse[0], shape=f"1x{kv_len}_{layout}", heads=HEADS)


@pytest.mark.parametrize("causal", CAUSAL, ids=["full", "causal"])
@pytest.mark.parametrize("dtype,path,head_dim", prefill_cases("batch_prefill_ragged"))
def test_batch_prefill_ragged(built, error_report, dtype, path, head_dim, causal):
    num_qo, num_kv = HEADS
    spec = spec_for("batch_prefill_ragged", dtype, head_dim, causal, **spec_path(path))
    for batch, (qo_lens, kv_lens) in sorted(RAGGED_BATCHES.items()):
        qo_indptr = torch.tensor([0] + qo_lens, dtype=torch.int32).cumsum(0, dtype=torch.int32)
        kv_indptr = torch.tensor([0] + kv_lens, dtype=torch.int32).cumsum(0, dtype=torch.int32)
        q = randn(int(qo_indptr[-1]), num_qo, head_dim, dtype=dtype)
        k, v = (randn(int(kv_indptr[-1]), num_kv, head_dim, dtype=dtype) for _ in range(2))
        wrapper = flashjit.BatchPrefillWithRaggedKVCacheWrapper(torch.empty(1 << 20, dtype=torch.uint8, device="cuda"),
                                                                backend=path_kwargs(path)["backend"])
        wrapper.plan(qo_indptr, kv_indptr, num_qo, num_kv, head_dim, causal=causal, q_data_type=dtype,
                     use_tensor_cores=path != "cc")
        assert wrapper._plan.module.spec == spec
        out = torch.full_like(q, float("nan"))
        lse = torch.full((q.shape[0], num_qo), float("nan"), device="cuda")
        wrapper.run(q, k, v, out=out, lse=lse, return_lse=True)
        torch.cuda.synchronize()
        ref, ref_lse = ragged_reference(q, k, v, qo_indptr.tolist(), kv_indptr.tolist(), causal=causal)
        check(spec, out, ref, q, k, v, max(kv_lens), 1 / math.sqrt(head_dim), error_report, "batch_prefill_ragged",
              lse=lse, ref_lse=ref_lse, shape=batch, heads=HEADS)


@pytest.mark.parametrize("causal", CAUSAL, ids=["full", "causal"])
@pytest.mark.parametrize("dtype,path,head_dim", prefill_cases("batch_prefill_paged"))
def test_batch_prefill_paged(built, error_report, dtype, path, head_dim, causal):
    """At 512 also MQA 32/1: each token's 32 rows over two CTAs of the fa2 kernel."""
    spec = spec_for("batch_prefill_paged", dtype, head_dim, causal, **spec_path(path))
    cases = [(16, "NHD", HEADS), (1, "HND", HEADS)] + ([(16, "NHD", (32, 1))] if head_dim in WIDE_HEAD_DIMS else [])
    for page_size, layout, heads in cases:
        batch, q, out, lse, ref, ref_lse = prefill_case(PREFILL_QO, PREFILL_KV, dtype, path, head_dim, heads, causal,
                                                        page_size, layout)
        check(spec, out, ref, q, batch.k, batch.v, max(PREFILL_KV), 1 / math.sqrt(head_dim), error_report,
              "batch_prefill_paged", lse=lse, ref_lse=ref_lse, shape=f"page{page_size}_{layout}", heads=heads)


@pytest.mark.parametrize("head_dim", NEW_HEAD_DIMS)
@pytest.mark.parametrize("dtype,tensor_cores", DECODE_PATHS, ids=[decode_id(p) for p in DECODE_PATHS])
def test_batch_decode_paged(built, error_report, dtype, tensor_cores, head_dim):
    """DECODE_LENS holds a request without keys (o = 0, LSE -inf); the long
    requests, split at 40 pages, go through the merge pass. At 512 also pages
    of one token and MQA 32/1 (two fa2 CTAs of 16 rows per KV head)."""
    spec = spec_for("batch_decode_paged", dtype, head_dim, False, tensor_cores=tensor_cores)
    cases = [(DECODE_LENS, {}, 16, HEADS), ([20000, 5, 3001], {"fixed_split_size": 40}, 16, HEADS)]
    if head_dim in WIDE_HEAD_DIMS:
        cases += [(DECODE_LENS, {}, 1, HEADS), ([3000, 0, 17], {"fixed_split_size": 512}, 1, (32, 1))]
    for kv_lens, plan_kw, page_size, heads in cases:
        wrapper, batch, q, out, lse, ref, ref_lse = decode_case(kv_lens, dtype, tensor_cores, head_dim, heads,
                                                                page_size=page_size, plan_kw=plan_kw)
        assert wrapper._plan.work.kv_chunk > 0 or not plan_kw, "the plan was meant to split"
        check(spec, out, ref, q, batch.k, batch.v, max(kv_lens), 1 / math.sqrt(head_dim), error_report,
              "batch_decode_paged", lse=lse, ref_lse=ref_lse, heads=heads,
              shape=("split" if plan_kw else "mixed") + f"_page{page_size}")
        if 0 in kv_lens:
            assert (out[kv_lens.index(0)] == 0).all() and torch.isneginf(lse[kv_lens.index(0)]).all()


@pytest.mark.parametrize("head_dim", PREFILL_DIMS)
def test_sinks(built, error_report, head_dim):
    """Ragged causal prefill on fa2, bf16: random sinks and sinks that dominate
    every row within the profile; sinks of -inf bit for bit no sinks."""
    case = Case("batch_prefill_ragged", "fa2", head_dim, *RAGGED_BATCHES["mixed"], causal=True)
    for kind in ("randn", "dominant"):
        run_and_check(case, kind, error_report, "ragged_sinks", shape="mixed")
    out, lse = case.run(None)
    out_inf, lse_inf = case.run(make_sinks("none"))
    assert torch.equal(out_inf, out) and torch.equal(lse_inf, lse)


@pytest.mark.parametrize("head_dim", PREFILL_DIMS)
def test_soft_cap_with_sliding_window(built, error_report, head_dim):
    num_qo, num_kv = HEADS
    spec = cap_window_spec(head_dim)
    q = randn(300, num_qo, head_dim, dtype=BF16, scale=3.0)  # logits past the cap
    k, v = (randn(1000, num_kv, head_dim, dtype=BF16) for _ in range(2))
    poison_allocator()
    out, lse = flashjit.single_prefill_with_kv_cache(q, k, v, causal=True, return_lse=True, backend="fa2",
                                                     use_tensor_cores=True, **CAP_WINDOW)
    torch.cuda.synchronize()
    ref, ref_lse = attention_reference(q, k, v, causal=True, **CAP_WINDOW)
    check(spec, out, ref, q, k, v, 1000, 1 / math.sqrt(head_dim), error_report, "softcap_window", lse=lse,
          ref_lse=ref_lse, shape="300x1000", heads=HEADS)


@pytest.mark.parametrize("head_dim", PREFILL_DIMS)
def test_auto_runs_its_choice(built, head_dim):
    """`auto` takes fa3 where it generates the head dim on an sm_90a GPU, fa2
    elsewhere: bit for bit the explicit call of that backend."""
    q = randn(300, HEADS[0], head_dim, dtype=BF16)
    k, v = (randn(700, HEADS[1], head_dim, dtype=BF16) for _ in range(2))
    auto = flashjit.single_prefill_with_kv_cache(q, k, v, causal=True, return_lse=True)
    backend = "fa3" if head_dim in FA3_AUTO_HEAD_DIMS and fa3_runs_here() else "fa2"
    explicit = flashjit.single_prefill_with_kv_cache(q, k, v, causal=True, return_lse=True, backend=backend,
                                                     use_tensor_cores=True)
    assert torch.equal(auto[0], explicit[0]) and torch.equal(auto[1], explicit[1])


@pytest.mark.parametrize("head_dim", PREFILL_DIMS)
def test_append_writes_every_head_dim(built, head_dim):
    """The append kernel (16-byte vectors of each head) at each new head dim: the
    rows land in their pages and slots bit for bit, and nothing else moves."""
    num_kv, page_size, lens = HEADS[1], 16, [5, 40, 17]
    pages = [math.ceil(n / page_size) for n in lens]
    cache = randn(sum(pages) + 2, 2, page_size, num_kv, head_dim, dtype=BF16)
    before = cache.clone()
    indices = torch.randperm(cache.shape[0], device="cuda")[:sum(pages)].to(torch.int32)
    indptr = torch.tensor([0, *pages], dtype=torch.int32, device="cuda").cumsum(0, dtype=torch.int32)
    last = torch.tensor([(n - 1) % page_size + 1 for n in lens], dtype=torch.int32, device="cuda")
    batch = torch.cat([torch.full((n,), r, dtype=torch.int32) for r, n in enumerate(lens)]).cuda()
    pos = torch.cat([torch.arange(n, dtype=torch.int32) for n in lens]).cuda()
    k, v = (randn(sum(lens), num_kv, head_dim, dtype=BF16) for _ in range(2))
    flashjit.append_paged_kv_cache(k, v, batch, pos, cache, indices, indptr, last)
    torch.cuda.synchronize()
    page = indices[(indptr[batch.long()] + pos // page_size).long()].long()
    slot = (pos % page_size).long()
    assert torch.equal(cache[page, 0, slot], k) and torch.equal(cache[page, 1, slot], v)
    written = torch.zeros(cache.shape[:3], dtype=torch.bool, device="cuda")
    written[page, :, slot] = True
    assert torch.equal(cache[~written], before[~written])


# ---------------------------------------------------------------------------
# V narrower than Q and K: head_dim_qk 192, head_dim_vo 128


def planned_vo(dtype, path: str, causal: bool, qo_lens, kv_lens, **plan_kw):
    """(wrapper planned with head_dim_vo, q, k, v, qo_indptr, kv_indptr) of a ragged batch."""
    num_qo, num_kv = HEADS
    qo_indptr = torch.tensor([0] + list(qo_lens), dtype=torch.int32).cumsum(0, dtype=torch.int32)
    kv_indptr = torch.tensor([0] + list(kv_lens), dtype=torch.int32).cumsum(0, dtype=torch.int32)
    q = randn(int(qo_indptr[-1]), num_qo, QK, dtype=dtype)
    k, v = randn(int(kv_indptr[-1]), num_kv, QK, dtype=dtype), randn(int(kv_indptr[-1]), num_kv, VO, dtype=dtype)
    wrapper = flashjit.BatchPrefillWithRaggedKVCacheWrapper(torch.empty(1 << 24, dtype=torch.uint8, device="cuda"),
                                                            backend=path_kwargs(path)["backend"])
    wrapper.plan(qo_indptr, kv_indptr, num_qo, num_kv, QK, head_dim_vo=VO, causal=causal, q_data_type=dtype,
                 use_tensor_cores=path != "cc", **plan_kw)
    assert wrapper._plan.module.spec == vo_spec("batch_prefill_ragged", dtype, path, causal)
    return wrapper, q, k, v, qo_indptr.tolist(), kv_indptr.tolist()


@pytest.mark.parametrize("causal", CAUSAL, ids=["full", "causal"])
@pytest.mark.parametrize("dtype,path", vo_cases())
def test_single_prefill_v_narrower(built, error_report, dtype, path, causal):
    """o [qo_len, heads, 128]; (513, 77) causal: rows without keys; (16, 5000): split keys, 128-wide states merged."""
    num_qo, num_kv = HEADS
    spec = vo_spec("single_prefill", dtype, path, causal)
    for qo_len, kv_len in [(1, 1), (37, 300), (513, 77), (16, 5000)]:
        q, k = randn(qo_len, num_qo, QK, dtype=dtype), randn(kv_len, num_kv, QK, dtype=dtype)
        v = randn(kv_len, num_kv, VO, dtype=dtype)
        poison_allocator()
        out, lse = flashjit.single_prefill_with_kv_cache(q, k, v, causal=causal, return_lse=True,
                                                         **path_kwargs(path))
        torch.cuda.synchronize()
        assert out.shape == (qo_len, num_qo, VO) and lse.shape == (qo_len, num_qo)
        ref, ref_lse = attention_reference(q, k, v, causal=causal)
        check(spec, out, ref, q, k, v, kv_len, 1 / math.sqrt(QK), error_report, "single_prefill_vo", lse=lse,
              ref_lse=ref_lse, shape=f"{qo_len}x{kv_len}", heads=HEADS)


@pytest.mark.parametrize("causal", CAUSAL, ids=["full", "causal"])
@pytest.mark.parametrize("dtype,path", vo_cases())
def test_batch_prefill_ragged_v_narrower(built, error_report, dtype, path, causal):
    num_qo = HEADS[0]
    spec = vo_spec("batch_prefill_ragged", dtype, path, causal)
    for batch, (qo_lens, kv_lens) in sorted(RAGGED_BATCHES.items()):
        wrapper, q, k, v, qo_indptr, kv_indptr = planned_vo(dtype, path, causal, qo_lens, kv_lens)
        out = torch.full((q.shape[0], num_qo, VO), float("nan"), dtype=dtype, device="cuda")
        lse = torch.full((q.shape[0], num_qo), float("nan"), device="cuda")
        wrapper.run(q, k, v, out=out, lse=lse, return_lse=True)
        torch.cuda.synchronize()
        ref, ref_lse = ragged_reference(q, k, v, qo_indptr, kv_indptr, causal=causal)
        check(spec, out, ref, q, k, v, max(kv_lens), 1 / math.sqrt(QK), error_report, "batch_prefill_ragged_vo",
              lse=lse, ref_lse=ref_lse, shape=batch, heads=HEADS)


@pytest.mark.parametrize("dtype,path", [pytest.param(BF16, "fa2", id="bfloat16-fa2"),
                                        pytest.param(F32, "cc", id="float32-cc"),
                                        pytest.param(BF16, "fa3", id="bfloat16-fa3", marks=ON_FA3)])
def test_ragged_split_kv_merges_v_narrower_states(built, error_report, dtype, path):
    """Long keys, few rows, chunks of 512 keys: the merge pass combines 128-wide partial states."""
    qo_lens, kv_lens = [4, 1, 16], [9000, 300, 3000]
    wrapper, q, k, v, qo_indptr, kv_indptr = planned_vo(dtype, path, True, qo_lens, kv_lens, fixed_split_size=512)
    assert wrapper._plan.work.kv_chunk > 0 and wrapper._plan.work.merge_indptr is not None, "meant to split"
    poison_allocator()
    out, lse = wrapper.run(q, k, v, return_lse=True)
    torch.cuda.synchronize()
    assert out.shape == (sum(qo_lens), HEADS[0], VO)
    ref, ref_lse = ragged_reference(q, k, v, qo_indptr, kv_indptr, causal=True)
    check(vo_spec("batch_prefill_ragged", dtype, path, True), out, ref, q, k, v, max(kv_lens), 1 / math.sqrt(QK),
          error_report, "ragged_split_vo", lse=lse, ref_lse=ref_lse, shape="split512", heads=HEADS)


@pytest.mark.parametrize("path", ["fa2", pytest.param("fa3", marks=ON_FA3)])
def test_sinks_v_narrower(built, error_report, path):
    """Ragged causal prefill, bf16: random sinks and sinks that dominate every
    row within the profile; sinks of -inf bit for bit no sinks."""
    qo_lens, kv_lens = RAGGED_BATCHES["mixed"]
    wrapper, q, k, v, _, _ = planned_vo(BF16, path, True, qo_lens, kv_lens)
    problem = SinkProblem(vo_spec("batch_prefill_ragged", BF16, path, True), q, k, v, list(qo_lens), list(kv_lens),
                          causal=True)

    def run(sinks):
        poison_allocator()
        res = wrapper.run(q, k, v, return_lse=True, sinks=sinks)
        torch.cuda.synchronize()
        return res

    for kind in ("randn", "dominant"):
        sinks = make_sinks(kind)
        out, lse = run(sinks)
        sink_check(problem, sinks, out, lse, error_report, "ragged_sinks_vo", dominant=kind == "dominant", kind=kind,
                   shape="mixed")
    out, lse = run(None)
    out_inf, lse_inf = run(make_sinks("none"))
    assert torch.equal(out_inf, out) and torch.equal(lse_inf, lse)


@ON_FA3
@pytest.mark.parametrize("qk,vo", [(QK, QK), (QK, VO), (96, 96)], ids=["192", "192-128", "96"])
def test_batch_invariant_fa3_folds_chunks(built, error_report, monkeypatch, qk, vo):
    """Batch-invariant ragged prefill on fa3 at 192 (and V 128 wide) and at 96
    (the output's columns of a padded accumulator): the long request's CTAs fold
    its chunks (the chunk-fold kernel, asked for with fold_policy "always"),
    within the profile; the request alone gives the same bits as beside the
    others."""
    num_qo, num_kv = HEADS
    monkeypatch.setattr(_invariant, "fold_policy", "always")

    def run(qo_lens, kv_lens, q, k, v):
        qo_indptr = torch.tensor([0, *qo_lens], dtype=torch.int32).cumsum(0, dtype=torch.int32)
        kv_indptr = torch.tensor([0, *kv_lens], dtype=torch.int32).cumsum(0, dtype=torch.int32)
        w = flashjit.BatchPrefillWithRaggedKVCacheWrapper(torch.empty(1 << 26, dtype=torch.uint8, device="cuda"),
                                                          backend="fa3")
        w.plan(qo_indptr, kv_indptr, num_qo, num_kv, qk, head_dim_vo=vo, causal=True, q_data_type=BF16,
               batch_invariant=True)
        assert w._plan.module.spec.backend == "fa3" and w._plan.work.folds
        poison_allocator()
        res = w.run(q, k, v, return_lse=True)
        torch.cuda.synchronize()
        return res

    qo_lens, kv_lens = [40, 3, 1], [9000, 300, 20]
    q = randn(sum(qo_lens), num_qo, qk, dtype=BF16)
    k, v = randn(sum(kv_lens), num_kv, qk, dtype=BF16), randn(sum(kv_lens), num_kv, vo, dtype=BF16)
    out, lse = run(qo_lens, kv_lens, q, k, v)
    ref, ref_lse = ragged_reference(q, k, v, [0, 40, 43, 44], [0, 9000, 9300, 9320], causal=True)
    spec = KernelSpec.make("batch_prefill_ragged", BF16, qk, head_dim_vo=vo, backend="fa3", use_tensor_cores=True,
                           causal=True, return_lse=True)
    check(spec, out, ref, q, k, v, max(kv_lens), 1 / math.sqrt(qk), error_report, "ragged_invariant_fa3", lse=lse,
          ref_lse=ref_lse, shape="fold", heads=HEADS)
    alone, alone_lse = run(qo_lens[:1], kv_lens[:1], q[:40], k[:9000], v[:9000])
    assert torch.equal(alone, out[:40]) and torch.equal(alone_lse, lse[:40])

