"""FP8 KV caches on a GPU: CUDA-core paged and single decode against float64
attention over the dequantised cache (codes times k_scale / v_scale) within
their profiles, the quantising append against a torch model of it, bit for
bit, and CUDA-graph replays that read new scale tensors.

Caches are built in float32 from values already on the FP8 grid (x / scale
rounded to the format), then converted: the conversion is exact, and the
reference reads the same values."""

from __future__ import annotations

import math

import pytest
import torch

import flashjit
from flashjit.reference import ragged_reference
from flashjit.spec import canonical_dtype
from sweep import FP8_KV_DTYPES, FP8_PAGE_SIZES, FP8_Q_DTYPES, HEAD_DIMS, HEADS, spec_for, variant_kwargs
from test_gpu_attention import check, poison_allocator, randn
from test_gpu_paged import indptr_of, scatter_requests, workspace

pytestmark = pytest.mark.gpu

FP8_MAX = {torch.float8_e4m3fn: 448.0, torch.float8_e5m2: 57344.0}
K_SCALE, V_SCALE = 0.37, 1.9  # dequantised values ~ N(0, 1): codes ~ N(0, 2.7) and N(0, 0.5)
DECODE_LENS = [1, 15, 16, 17, 300, 2000, 0, 77]


def f32(x: float) -> float:
    """A scale as the kernel holds it (a float32)."""
    return float(torch.tensor(x, dtype=torch.float32))


def fp8_id(dtype) -> str:
    return str(dtype).removeprefix("torch.float8_")


def on_grid(x: torch.Tensor, kv_dtype) -> torch.Tensor:
    """float32 values that an FP8 tensor of kv_dtype holds exactly."""
    return x.clamp(-FP8_MAX[kv_dtype], FP8_MAX[kv_dtype]).to(kv_dtype).float()


def codes(*shape, kv_dtype, scale) -> torch.Tensor:
    """float32 FP8 codes of N(0, 1) values quantised with `scale`."""
    return on_grid(torch.randn(*shape, device="cuda") / scale, kv_dtype)


class Fp8PagedBatch:
    """Requests' K/V codes packed NHD (float32, for the reference) and the same
    codes scattered over an FP8 cache's pages in random order, the other pages random."""

    def __init__(self, kv_lens, page_size, num_kv, head_dim, kv_dtype, layout="NHD", form="5d", spare_pages=3):
        self.kv_lens, self.page_size = list(kv_lens), page_size
        self.kv_indptr = indptr_of(self.kv_lens)
        pages = [math.ceil(n / page_size) for n in self.kv_lens]
        self.num_pages = sum(pages) + spare_pages
        self.k = codes(self.kv_indptr[-1], num_kv, head_dim, kv_dtype=kv_dtype, scale=K_SCALE)
        self.v = codes(self.kv_indptr[-1], num_kv, head_dim, kv_dtype=kv_dtype, scale=V_SCALE)
        cache = codes(self.num_pages, 2, page_size, num_kv, head_dim, kv_dtype=kv_dtype, scale=K_SCALE)
        self.indptr, self.indices, self.last = scatter_requests(cache, self.kv_lens, self.k, self.v)
        self.codes = cache  # float32, NHD, 5-D
        if layout == "HND":
            cache = cache.transpose(2, 3).contiguous()
        self.cache = cache.to(kv_dtype) if form == "5d" else (cache[:, 0].contiguous().to(kv_dtype),
                                                              cache[:, 1].contiguous().to(kv_dtype))


def fp8_spec(op: str, q_dtype, kv_dtype, head_dim: int, return_lse: bool):
    return flashjit.KernelSpec.make(op, q_dtype, head_dim, dtype_kv=kv_dtype, return_lse=return_lse)


def reference(q, k, v, kv_lens, k_scale=K_SCALE, v_scale=V_SCALE):
    """float64 attention of each row of q over its request's dequantised codes (k, v packed NHD)."""
    return ragged_reference(q, k, v, list(range(q.shape[0] + 1)), indptr_of(kv_lens), k_scale=f32(k_scale),
                            v_scale=f32(v_scale))


def check_fp8(spec, out, ref, q, k, v, kv_len, report, what, k_scale=K_SCALE, v_scale=V_SCALE, lse=None,
              ref_lse=None, **info):
    """check() of test_gpu_attention on the dequantised K/V (the profile's magnitudes are theirs)."""
    check(spec, out, ref, q, k.double() * f32(k_scale), v.double() * f32(v_scale), kv_len, 1 / math.sqrt(q.shape[-1]),
          report, what, lse=lse, ref_lse=ref_lse, **info)


def paged_prefill_reference(q, batch, qo_lens, causal, k_scale=K_SCALE, v_scale=V_SCALE, **kw):
    """float64 attention of a paged prefill batch's queries over its dequantised codes."""
    return ragged_reference(q, batch.k, batch.v, indptr_of(qo_lens), batch.kv_indptr, causal=causal,
                            k_scale=f32(k_scale), v_scale=f32(v_scale), **kw)


def check_fp8_ragged_prefill_tensor_scales(wrapper, spec, q_dtype, kv_dtype, head_dim, variant, prefill,
                                           report, what):
    """Causal ragged prefill of the (query tokens, keys) requests `prefill` through
    `wrapper` (a BatchPrefillWithRaggedKVCacheWrapper that plans `spec`), scales as
    one-element float32 tensors, against float64 attention within the profile."""
    num_qo, num_kv = 8, 2
    qo_lens, kv_lens = zip(*prefill)
    k = codes(sum(kv_lens), num_kv, head_dim, kv_dtype=kv_dtype, scale=K_SCALE)
    v = codes(sum(kv_lens), num_kv, head_dim, kv_dtype=kv_dtype, scale=V_SCALE)
    q = randn(sum(qo_lens), num_qo, head_dim, dtype=q_dtype, scale=3.0 if variant == "softcap" else 1.0)
    kw = {"logits_soft_cap": 30.0} if variant == "softcap" else {}
    wrapper.plan(torch.tensor(indptr_of(qo_lens), dtype=torch.int32, device="cuda"),
                 torch.tensor(indptr_of(kv_lens), dtype=torch.int32, device="cuda"), num_qo, num_kv, head_dim,
                 causal=True, q_data_type=q_dtype, kv_data_type=kv_dtype, **kw)
    assert wrapper._plan.module.spec == spec
    scales = torch.tensor([K_SCALE], device="cuda"), torch.tensor([V_SCALE], device="cuda")
    poison_allocator()
    out, lse = wrapper.run(q, k.to(kv_dtype), v.to(kv_dtype), k_scale=scales[0], v_scale=scales[1], return_lse=True)
    torch.cuda.synchronize()
    ref, ref_lse = ragged_reference(q, k, v, indptr_of(qo_lens), indptr_of(kv_lens), causal=True,
                                    k_scale=f32(K_SCALE), v_scale=f32(V_SCALE), **kw)
    check_fp8(spec, out, ref, q, k, v, max(kv_lens), report, what, lse=lse, ref_lse=ref_lse, shape="mixed",
              heads=(num_qo, num_kv))


def check_fp8_single_prefill(spec, q_dtype, kv_dtype, head_dim, qo_len, kv_len, report, what, **call_kw):
    """single_prefill_with_kv_cache (call_kw: its backend) with FlashInfer's
    scale_k / scale_v, against float64 attention within spec's profile."""
    num_qo, num_kv = 8, 2
    q = randn(qo_len, num_qo, head_dim, dtype=q_dtype)
    k = codes(kv_len, num_kv, head_dim, kv_dtype=kv_dtype, scale=K_SCALE)
    v = codes(kv_len, num_kv, head_dim, kv_dtype=kv_dtype, scale=V_SCALE)
    poison_allocator()
    out = flashjit.single_prefill_with_kv_cache(q, k.to(kv_dtype), v.to(kv_dtype), scale_k=K_SCALE, scale_v=V_SCALE,
                                                **call_kw)
    torch.cuda.synchronize()
    ref, _ = ragged_reference(q, k, v, [0, qo_len], [0, kv_len], k_scale=f32(K_SCALE), v_scale=f32(V_SCALE))
    check_fp8(spec, out, ref, q, k, v, kv_len, report, what, shape=f"{qo_len}x{kv_len}", heads=(num_qo, num_kv))


# The (k_scale, v_scale) a captured call is replayed with: the captured values, then others.
REPLAY_SCALES = ((K_SCALE, V_SCALE), (0.05, 3.0), (1.5, 0.25))


def replay_with_new_scales(wrapper, q, cache, out, check_replay):
    """Captures wrapper.run(q, cache) into `out` in a CUDA graph, its scales in
    one-element float32 tensors (two warm-up calls first: they load the kernels
    and prepare the calls); then, for each pair of REPLAY_SCALES, refills the
    tensors, fills `out` with NaN, replays and calls check_replay(k_scale, v_scale)."""
    k_scale, v_scale = torch.tensor([K_SCALE], device="cuda"), torch.tensor([V_SCALE], device="cuda")
    for _ in range(2):
        wrapper.run(q, cache, k_scale=k_scale, v_scale=v_scale, out=out)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        wrapper.run(q, cache, k_scale=k_scale, v_scale=v_scale, out=out)
    for ks, vs in REPLAY_SCALES:
        k_scale.fill_(ks)
        v_scale.fill_(vs)
        out.fill_(float("nan"))
        graph.replay()
        torch.cuda.synchronize()
        check_replay(ks, vs)


@pytest.mark.parametrize("tensor_cores", [False, True], ids=["cc", "tc"])
@pytest.mark.parametrize("page_size", FP8_PAGE_SIZES, ids=lambda p: f"page{p}")
@pytest.mark.parametrize("heads", HEADS, ids=lambda h: f"h{h[0]}kv{h[1]}")
@pytest.mark.parametrize("head_dim", HEAD_DIMS)
@pytest.mark.parametrize("kv_dtype", FP8_KV_DTYPES, ids=fp8_id)
@pytest.mark.parametrize("q_dtype", FP8_Q_DTYPES, ids=str)
def test_fp8_paged_decode(prewarmed, error_report, q_dtype, kv_dtype, head_dim, heads, page_size, tensor_cores):
    """CUDA cores, and tensor cores (fa2: tiles of codes widened in shared memory)."""
    num_qo, num_kv = heads
    batch = Fp8PagedBatch(DECODE_LENS, page_size, num_kv, head_dim, kv_dtype)
    q = randn(len(DECODE_LENS), num_qo, head_dim, dtype=q_dtype)
    wrapper = flashjit.BatchDecodeWithPagedKVCacheWrapper(workspace(), "NHD", use_tensor_cores=tensor_cores)
    wrapper.plan(batch.indptr, batch.indices, batch.last, num_qo, num_kv, head_dim, page_size, q_data_type=q_dtype,
                 kv_data_type=kv_dtype)
    poison_allocator()
    out, lse = wrapper.run(q, batch.cache, k_scale=K_SCALE, v_scale=V_SCALE, return_lse=True)
    torch.cuda.synchronize()
    assert out.dtype == q_dtype and out.shape == q.shape
    ref, ref_lse = reference(q, batch.k, batch.v, DECODE_LENS)
    spec = fp8_spec("batch_decode_paged", q_dtype, kv_dtype, head_dim, True).replace(use_tensor_cores=tensor_cores)
    assert wrapper._plan.module.spec == spec
    check_fp8(spec, out, ref, q, batch.k, batch.v, max(DECODE_LENS), error_report,
              f"fp8_batch_decode_paged_{'tc' if tensor_cores else 'cc'}", lse=lse, ref_lse=ref_lse,
              shape=f"mixed-page{page_size}", heads=heads)
    empty = DECODE_LENS.index(0)
    assert (out[empty] == 0).all() and torch.isneginf(lse[empty]).all()


@pytest.mark.parametrize("variant", ["window", "softcap"])
@pytest.mark.parametrize("kv_dtype", FP8_KV_DTYPES, ids=fp8_id)
def test_fp8_paged_decode_variants(prewarmed, error_report, kv_dtype, variant):
    """A sliding window and the soft-cap (whose logits are in natural units, k_scale folded in)."""
    q_dtype, head_dim, (num_qo, num_kv), page_size = torch.bfloat16, 128, (8, 2), 16
    kw = variant_kwargs(variant)
    batch = Fp8PagedBatch(DECODE_LENS, page_size, num_kv, head_dim, kv_dtype)
    q = randn(len(DECODE_LENS), num_qo, head_dim, dtype=q_dtype, scale=3.0)  # logits past the soft-cap's knee
    wrapper = flashjit.BatchDecodeWithPagedKVCacheWrapper(workspace(), "NHD")
    wrapper.plan(batch.indptr, batch.indices, batch.last, num_qo, num_kv, head_dim, page_size, q_data_type=q_dtype,
                 kv_data_type=kv_dtype, **kw)
    poison_allocator()
    out, lse = wrapper.run(q, batch.cache, k_scale=K_SCALE, v_scale=V_SCALE, return_lse=True)
    torch.cuda.synchronize()
    ref, ref_lse = ragged_reference(q, batch.k, batch.v, list(range(len(DECODE_LENS) + 1)), batch.kv_indptr,
                                    k_scale=f32(K_SCALE), v_scale=f32(V_SCALE), **kw)
    spec = spec_for("batch_decode_paged", q_dtype, head_dim, variant=variant).replace(dtype_kv=canonical_dtype(kv_dtype))
    assert wrapper._plan.module.spec == spec
    check_fp8(spec, out, ref, q, batch.k, batch.v, max(DECODE_LENS), error_report, f"fp8_decode_{variant}", lse=lse,
              ref_lse=ref_lse, shape="mixed", heads=(num_qo, num_kv))


@pytest.mark.parametrize("layout,form", [("HND", "5d"), ("NHD", "tuple"), ("HND", "tuple")])
@pytest.mark.parametrize("kv_dtype", FP8_KV_DTYPES, ids=fp8_id)
def test_fp8_paged_decode_layouts_and_tensor_scales(prewarmed, error_report, kv_dtype, layout, form):
    """HND pages, (K, V) tuples, and scales given as one-element float32 tensors."""
    q_dtype, head_dim, (num_qo, num_kv), page_size = torch.bfloat16, 128, (8, 2), 16
    batch = Fp8PagedBatch(DECODE_LENS, page_size, num_kv, head_dim, kv_dtype, layout, form)
    q = randn(len(DECODE_LENS), num_qo, head_dim, dtype=q_dtype)
    wrapper = flashjit.BatchDecodeWithPagedKVCacheWrapper(workspace(), layout)
    wrapper.plan(batch.indptr, batch.indices, batch.last, num_qo, num_kv, head_dim, page_size, q_data_type=q_dtype,
                 kv_data_type=kv_dtype)
    k_scale = torch.tensor([K_SCALE], device="cuda")
    v_scale = torch.tensor([V_SCALE], device="cuda")
    poison_allocator()
    out = wrapper.run(q, batch.cache, k_scale=k_scale, v_scale=v_scale)
    torch.cuda.synchronize()
    ref, _ = reference(q, batch.k, batch.v, DECODE_LENS)
    spec = fp8_spec("batch_decode_paged", q_dtype, kv_dtype, head_dim, True)
    check_fp8(spec, out, ref, q, batch.k, batch.v, max(DECODE_LENS), error_report, "fp8_decode_layouts",
              shape=f"{layout}-{form}", heads=(num_qo, num_kv))


@pytest.mark.parametrize("kv_len", [1, 300, 5000])
@pytest.mark.parametrize("heads", HEADS, ids=lambda h: f"h{h[0]}kv{h[1]}")
@pytest.mark.parametrize("head_dim", HEAD_DIMS)
@pytest.mark.parametrize("kv_dtype", FP8_KV_DTYPES, ids=fp8_id)
@pytest.mark.parametrize("q_dtype", FP8_Q_DTYPES, ids=str)
def test_fp8_single_decode(prewarmed, error_report, q_dtype, kv_dtype, head_dim, heads, kv_len):
    """One request; 5000 keys split across CTAs (flash-decoding) and merged."""
    num_qo, num_kv = heads
    q = randn(num_qo, head_dim, dtype=q_dtype)
    k = codes(kv_len, num_kv, head_dim, kv_dtype=kv_dtype, scale=K_SCALE)
    v = codes(kv_len, num_kv, head_dim, kv_dtype=kv_dtype, scale=V_SCALE)
    poison_allocator()
    out, lse = flashjit.single_decode_with_kv_cache(q, k.to(kv_dtype), v.to(kv_dtype), k_scale=K_SCALE,
                                                    v_scale=V_SCALE, return_lse=True)
    torch.cuda.synchronize()
    ref, ref_lse = reference(q[None], k, v, [kv_len])
    spec = fp8_spec("single_decode", q_dtype, kv_dtype, head_dim, True)
    check_fp8(spec, out, ref[0], q, k, v, kv_len, error_report, "fp8_single_decode", lse=lse, ref_lse=ref_lse[0],
              shape=f"1x{kv_len}", heads=heads)


@pytest.mark.parametrize("kv_dtype", FP8_KV_DTYPES, ids=fp8_id)
def test_fp8_scales_are_applied_in_the_kernel(prewarmed, kv_dtype):
    """Scaling V by 4 scales the output by 4 (exactly: a power of two); scaling K
    changes the logits, as the reference says."""
    q = randn(8, 128, dtype=torch.bfloat16)  # bf16 outputs: x4 rounds as x does (no subnormals in reach)
    k = codes(700, 2, 128, kv_dtype=kv_dtype, scale=1.0).to(kv_dtype)
    v = codes(700, 2, 128, kv_dtype=kv_dtype, scale=1.0).to(kv_dtype)
    base = flashjit.single_decode_with_kv_cache(q, k, v)
    four = flashjit.single_decode_with_kv_cache(q, k, v, v_scale=4.0)
    torch.testing.assert_close(four.float(), base.float() * 4, rtol=0, atol=0)
    sharper = flashjit.single_decode_with_kv_cache(q, k, v, k_scale=3.0)
    assert not torch.equal(sharper, base)


@pytest.mark.parametrize("kv_dtype", FP8_KV_DTYPES, ids=fp8_id)
def test_fp8_cuda_graph_replays_with_new_scales(prewarmed, error_report, kv_dtype):
    """Scales in one-element tensors: a captured paged decode and a captured single
    decode read the values the tensors hold at each replay."""
    q_dtype, head_dim, (num_qo, num_kv), page_size = torch.float16, 128, (16, 4), 16
    kv_lens = [100, 7, 3000, 64]
    batch = Fp8PagedBatch(kv_lens, page_size, num_kv, head_dim, kv_dtype)
    page_buf = torch.zeros(batch.num_pages, dtype=torch.int32, device="cuda")
    wrapper = flashjit.BatchDecodeWithPagedKVCacheWrapper(workspace(), use_cuda_graph=True,
                                                          paged_kv_indices_buffer=page_buf)
    wrapper.plan(batch.indptr, batch.indices, batch.last, num_qo, num_kv, head_dim, page_size, q_data_type=q_dtype,
                 kv_data_type=kv_dtype)
    q = randn(len(kv_lens), num_qo, head_dim, dtype=q_dtype)
    out = torch.empty_like(q)
    k_scale = torch.tensor([K_SCALE], device="cuda")
    v_scale = torch.tensor([V_SCALE], device="cuda")
    single_q = randn(num_qo, head_dim, dtype=q_dtype)
    k_all, v_all = batch.codes[:, 0].flatten(0, 1), batch.codes[:, 1].flatten(0, 1)  # float32 codes of every page
    single_k, single_v = k_all.to(kv_dtype), v_all.to(kv_dtype)
    for _ in range(2):  # warm-up outside the capture (loads the kernels, prepares the calls)
        wrapper.run(q, batch.cache, k_scale=k_scale, v_scale=v_scale, out=out)
        flashjit.single_decode_with_kv_cache(single_q, single_k, single_v, k_scale=k_scale, v_scale=v_scale)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        wrapper.run(q, batch.cache, k_scale=k_scale, v_scale=v_scale, out=out)
        single_out = flashjit.single_decode_with_kv_cache(single_q, single_k, single_v, k_scale=k_scale,
                                                          v_scale=v_scale)
    spec = fp8_spec("batch_decode_paged", q_dtype, kv_dtype, head_dim, True)
    single_spec = fp8_spec("single_decode", q_dtype, kv_dtype, head_dim, False)
    for ks, vs in ((K_SCALE, V_SCALE), (0.05, 3.0), (1.5, 0.25)):
        k_scale.fill_(ks)
        v_scale.fill_(vs)
        out.fill_(float("nan"))
        single_out.fill_(float("nan"))
        graph.replay()
        torch.cuda.synchronize()
        ref, _ = reference(q, batch.k, batch.v, kv_lens, ks, vs)
        check_fp8(spec, out, ref, q, k_all, v_all, max(kv_lens), error_report, "fp8_graph_replay", k_scale=ks,
                  v_scale=vs, shape=str(kv_lens), heads=(num_qo, num_kv))
        ref1, _ = reference(single_q[None], k_all, v_all, [k_all.shape[0]], ks, vs)
        check_fp8(single_spec, single_out, ref1[0], single_q, k_all, v_all, k_all.shape[0], error_report,
                  "fp8_graph_replay_single", k_scale=ks, v_scale=vs, shape=f"1x{k_all.shape[0]}",
                  heads=(num_qo, num_kv))


def quantized_reference(rows: torch.Tensor, kv_dtype, scale: float) -> torch.Tensor:
    """The append's quantisation on the CPU: the correctly rounded fp32 quotient (a
    float64 division of the fp32 operands, rounded once), clamped to the largest
    finite value (NaN stays), to the nearest FP8 code."""
    quotient = (rows.cpu().double() / f32(scale)).float()
    return quotient.clamp(-FP8_MAX[kv_dtype], FP8_MAX[kv_dtype]).to(kv_dtype)


def special_rows(nnz: int, num_kv: int, head_dim: int, dtype) -> torch.Tensor:
    """fp16/bf16 rows over many magnitudes (FP8 subnormals to overflow), with
    infinities, NaN and signed zeros in the first row."""
    magnitude = torch.pow(2.0, torch.randint(-20, 18, (nnz, num_kv, head_dim)).float())
    rows = (torch.randn(nnz, num_kv, head_dim) * magnitude).to(dtype)
    rows[0, 0, :6] = torch.tensor([float("inf"), -float("inf"), float("nan"), 0.0, -0.0, 1e4]).to(dtype)
    return rows.cuda()


@pytest.mark.parametrize("scale_kind", ["float", "tensor"])
@pytest.mark.parametrize("layout,form", [("NHD", "5d"), ("HND", "tuple")])
@pytest.mark.parametrize("page_size", FP8_PAGE_SIZES, ids=lambda p: f"page{p}")
@pytest.mark.parametrize("head_dim", HEAD_DIMS)
@pytest.mark.parametrize("kv_dtype", FP8_KV_DTYPES, ids=fp8_id)
@pytest.mark.parametrize("q_dtype", FP8_Q_DTYPES, ids=str)
def test_fp8_append_quantizes_bit_exactly(prewarmed, q_dtype, kv_dtype, head_dim, page_size, layout, form,
                                          scale_kind):
    """fp16/bf16 rows appended into an FP8 cache equal the torch model of the
    quantisation bit for bit (NaN: any NaN code); other slots keep their bytes."""
    num_kv, kv_lens, appended = 2, [40, 3, 17], [5, 3, 9]
    pages = [math.ceil(n / page_size) for n in kv_lens]
    num_pages = sum(pages) + 2
    kv_indptr = torch.tensor(indptr_of(pages), dtype=torch.int32, device="cuda")
    kv_indices = torch.randperm(num_pages, device="cuda")[:sum(pages)].to(torch.int32)
    last = torch.tensor([(n - 1) % page_size + 1 for n in kv_lens], dtype=torch.int32, device="cuda")
    nnz = sum(appended)
    batch_indices, positions = flashjit.get_batch_indices_positions(
        torch.tensor(indptr_of(appended), dtype=torch.int32, device="cuda"),
        flashjit.get_seq_lens(kv_indptr, last, page_size), nnz)
    key, value = special_rows(nnz, num_kv, head_dim, q_dtype), special_rows(nnz, num_kv, head_dim, q_dtype)
    before = codes(num_pages, 2, page_size, num_kv, head_dim, kv_dtype=kv_dtype, scale=1.0)  # float32, NHD
    cache = before.transpose(2, 3).contiguous() if layout == "HND" else before
    cache = (cache[:, 0].contiguous().to(kv_dtype), cache[:, 1].contiguous().to(kv_dtype)) if form == "tuple" \
        else cache.to(kv_dtype)
    k_scale, v_scale = 0.3, 2.5
    scales = (k_scale, v_scale) if scale_kind == "float" else \
        tuple(torch.tensor([s], device="cuda") for s in (k_scale, v_scale))
    flashjit.append_paged_kv_cache(key, value, batch_indices, positions, cache, kv_indices, kv_indptr, last, layout,
                                   k_scale=scales[0], v_scale=scales[1])
    torch.cuda.synchronize()
    got = torch.stack([c.cpu().view(torch.uint8) for c in cache], 1) if form == "tuple" \
        else cache.cpu().view(torch.uint8)
    got = got.transpose(2, 3) if layout == "HND" else got
    expected = before.cpu().to(kv_dtype).view(torch.uint8)
    page = kv_indices.long()[kv_indptr.long()[batch_indices.long()] + positions.long() // page_size].cpu()
    slot = (positions.long() % page_size).cpu()
    expected[page, 0, slot] = quantized_reference(key, kv_dtype, k_scale).view(torch.uint8)
    expected[page, 1, slot] = quantized_reference(value, kv_dtype, v_scale).view(torch.uint8)
    got_values, expected_values = got.view(kv_dtype).float(), expected.view(kv_dtype).float()
    nan = torch.isnan(expected_values)
    assert torch.equal(torch.isnan(got_values), nan), "NaN where the model has NaN, nowhere else"
    assert torch.equal(got[~nan], expected[~nan]), "every other byte as the model writes it"
    assert nan.sum() == 2, "the one NaN of the appended key and of the appended value"
    assert (expected_values.abs() == FP8_MAX[kv_dtype]).any(), "saturation was exercised"
