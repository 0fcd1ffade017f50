"""MLA over an FP8 ckv / kpe cache on a GPU: BatchMLAPagedAttentionWrapper
planned with kv_data_type float8_e4m3fn / float8_e5m2 against float64 MLA over
the dequantised cache (codes x ckv_scale, codes x kpe_scale: flashjit.mla_reference
on those values) within its configuration's profile, output and LSE, over
backend (fa2; fa3 on sm_90a) x cache dtype x q dtype x heads 16 / 64 / 128 x
page sizes 1 / 64 x (decode, causal chunk of 4), with scales other than 1 on
ragged lengths (a page boundary, a partial last tile behind whole ones, an
empty request); split-KV; scale tensors a captured CUDA graph reads at each
replay; unit scales against the 16-bit kernel over the widened cache, bit for
bit. Outputs are poisoned (NaN) before each run, inputs drawn fresh."""

from __future__ import annotations

import math

import pytest
import torch

import flashjit
from flashjit.error_model import evaluate_lse, measure_mla, mla_tolerance, profile
from flashjit.spec import FA3_FP8_OPS, FP8_MAX, canonical_dtype, mla_spec
from sweep import FP8_KV_DTYPES, MLA_BACKENDS, MLA_DTYPES, build_for_gpu, fa3_runs_here
from test_gpu_attention import poison_allocator, randn
from test_gpu_mla import CKV, KPE, KV_LENS, MODES, SM_SCALE, mla_wrapper
from test_gpu_paged import indptr_of

pytestmark = pytest.mark.gpu

# Values ~ N(0, 1): ckv codes ~ N(0, 2.7), kpe codes ~ N(0, 0.4) (float32 values, as the kernel holds them).
CKV_SCALE, KPE_SCALE = 0.375, 2.5
HEADS = [16, 64, 128]
PAGE_SIZES = [1, 64]


def fp8_id(dtype) -> str:
    return str(dtype).removeprefix("torch.float8_")


def f32(x) -> float:
    return float(torch.tensor(float(x), dtype=torch.float32))

# fa3 where spec.FA3_FP8_OPS lists mla_paged (otherwise backend="fa3" would run fa2, and these tests
# would compare fa2 with itself).
FP8_MLA_BACKENDS = [b for b in MLA_BACKENDS if b == "fa2" or "mla_paged" in FA3_FP8_OPS]


def fp8_mla_specs() -> list:
    return [mla_spec(q, causal=causal, backend=backend, dtype_kv=canonical_dtype(kv))
            for q in MLA_DTYPES for kv in FP8_KV_DTYPES for causal in (False, True) for backend in FP8_MLA_BACKENDS
            if backend == "fa2" or fa3_runs_here()]


@pytest.fixture(scope="module")
def built():
    """This file's configurations in one parallel build."""
    return build_for_gpu(fp8_mla_specs())


def codes(shape, kv_dtype, scale: float) -> torch.Tensor:
    """FP8 codes of N(0, 1) values quantised with `scale` (saturated at the format's largest value)."""
    bound = FP8_MAX[canonical_dtype(kv_dtype)]
    return (torch.randn(*shape, device="cuda") / scale).clamp(-bound, bound).to(kv_dtype)


class Fp8MlaBatch:
    """q_nope / q_pe of qo_lens tokens per request and an FP8 ckv / kpe cache whose
    pages are handed out in random order (spare pages of random codes too)."""

    def __init__(self, qo_lens, kv_lens, page_size, num_heads, q_dtype, kv_dtype, spare_pages=3):
        self.qo_lens, self.kv_lens, self.page_size, self.num_heads = qo_lens, kv_lens, page_size, num_heads
        self.q_dtype, self.kv_dtype = q_dtype, kv_dtype
        self.ckv_scale, self.kpe_scale = CKV_SCALE, KPE_SCALE
        pages = [math.ceil(n / page_size) for n in kv_lens]
        num_pages = sum(pages) + spare_pages
        self.ckv = codes((num_pages, page_size, CKV), kv_dtype, CKV_SCALE)
        self.kpe = codes((num_pages, page_size, KPE), kv_dtype, KPE_SCALE)
        self.qo_indptr = torch.tensor(indptr_of(qo_lens), dtype=torch.int32, device="cuda")
        self.kv_indptr = torch.tensor(indptr_of(pages), dtype=torch.int32, device="cuda")
        self.kv_indices = torch.randperm(num_pages, device="cuda")[:sum(pages)].to(torch.int32)
        self.kv_len_arr = torch.tensor(kv_lens, dtype=torch.int32, device="cuda")
        tokens = sum(qo_lens)
        self.q_nope = randn(tokens, num_heads, CKV, dtype=q_dtype)
        self.q_pe = randn(tokens, num_heads, KPE, dtype=q_dtype)

    def plan(self, wrapper, causal, **kw):
        wrapper.plan(self.qo_indptr, self.kv_indptr, self.kv_indices, self.kv_len_arr, self.num_heads, CKV, KPE,
                     self.page_size, causal, SM_SCALE, self.q_dtype, self.kv_dtype, **kw)

    def run(self, wrapper, **kw):
        scales = {"ckv_scale": self.ckv_scale, "kpe_scale": self.kpe_scale}
        return wrapper.run(self.q_nope, self.q_pe, self.ckv, self.kpe, **{**scales, **kw})

    def values(self) -> tuple[torch.Tensor, torch.Tensor]:
        """The caches' values: codes times the float32 scales, in float64 (exact)."""
        return self.ckv.double() * f32(self.ckv_scale), self.kpe.double() * f32(self.kpe_scale)

    def check(self, out, lse, causal, report, what, backend, **info):
        """out (and lse, when given) against float64 over the dequantised cache within the profile."""
        torch.cuda.synchronize()
        ckv, kpe = self.values()
        ref, ref_lse = flashjit.mla_reference(self.q_nope, self.q_pe, ckv, kpe, self.qo_indptr, self.kv_indptr,
                                              self.kv_indices, self.kv_lens, causal=causal, sm_scale=SM_SCALE)
        assert out.shape == ref.shape and out.dtype == self.q_dtype
        assert not torch.isnan(out).any(), f"{what}: NaN in the output (unwritten or invalid)"
        kv_len = max(max(self.kv_lens), 1)
        tol = mla_tolerance(self.q_dtype, kv_len=kv_len, q_nope=self.q_nope, q_pe=self.q_pe, ckv=self.ckv,
                            kpe=self.kpe, sm_scale=SM_SCALE, backend=backend, dtype_kv=self.kv_dtype,
                            ckv_scale=f32(self.ckv_scale), kpe_scale=f32(self.kpe_scale))
        spec = mla_spec(self.q_dtype, causal=causal, backend=backend, dtype_kv=canonical_dtype(self.kv_dtype))
        row = {"config": spec.name, "what": what, "ratio": tol.assert_close(out, ref, what), "rtol": tol.rtol,
               "atol": tol.atol, "max_err": float((out.double() - ref).abs().max()) if out.numel() else 0.0,
               "heads": self.num_heads, "page_size": self.page_size, **info}
        if lse is not None:
            _, logit_absmax = measure_mla(self.q_nope, self.q_pe, ckv, kpe, SM_SCALE)
            lse_tol = evaluate_lse(profile(spec), kv_len=kv_len, logit_absmax=logit_absmax)
            row["lse_ratio"] = lse_tol.assert_close(lse, ref_lse, f"{what} LSE")
        report.append(row)


@pytest.mark.parametrize("mode", MODES, ids=["decode", "qo4_causal"])
@pytest.mark.parametrize("page_size", PAGE_SIZES, ids=lambda p: f"page{p}")
@pytest.mark.parametrize("num_heads", HEADS, ids=lambda h: f"heads{h}")
@pytest.mark.parametrize("q_dtype", MLA_DTYPES, ids=str)
@pytest.mark.parametrize("kv_dtype", FP8_KV_DTYPES, ids=fp8_id)
@pytest.mark.parametrize("backend", FP8_MLA_BACKENDS)
def test_fp8_mla_against_float64(built, error_report, backend, kv_dtype, q_dtype, num_heads, page_size, mode):
    """Pages of 64 on fa3: whole tiles by TMA boxes of codes, partial last tiles
    gathered between them; pages of 1: every tile gathered. 64 heads on fa2 in
    an sm_90a build: the 64-row kernel; 128 heads on fa3: two CTAs a token."""
    qo_len, causal = mode
    batch = Fp8MlaBatch([qo_len] * len(KV_LENS), KV_LENS, page_size, num_heads, q_dtype, kv_dtype)
    wrapper = mla_wrapper(backend)
    batch.plan(wrapper, causal)
    assert wrapper._plan.module.spec == mla_spec(q_dtype, causal=causal, backend=backend,
                                                 dtype_kv=canonical_dtype(kv_dtype))
    poison_allocator()
    out, lse = batch.run(wrapper, return_lse=True)
    batch.check(out, lse, causal, error_report, "fp8_mla", backend, qo_len=qo_len)


@pytest.mark.parametrize("num_heads", [16, 128], ids=lambda h: f"heads{h}")
@pytest.mark.parametrize("split", ["fixed", "auto"])
@pytest.mark.parametrize("kv_dtype", FP8_KV_DTYPES, ids=fp8_id)
@pytest.mark.parametrize("backend", FP8_MLA_BACKENDS)
def test_fp8_mla_split_kv(built, error_report, backend, kv_dtype, split, num_heads):
    """Split-KV chunks write fp32 partial rows (ckv_scale applied) that the merge pass rounds."""
    kv_lens = [2000, 1, 777, 0, 64] if split == "fixed" else [20000, 9000]
    batch = Fp8MlaBatch([1] * len(kv_lens), kv_lens, 64, num_heads, torch.bfloat16, kv_dtype)
    wrapper = mla_wrapper(backend)
    batch.plan(wrapper, False, **({"fixed_split_size": 1} if split == "fixed" else {}))
    assert wrapper._plan.work.merge_indptr is not None, "the plan did not split"
    poison_allocator()
    out, lse = batch.run(wrapper, return_lse=True)
    batch.check(out, lse, False, error_report, f"fp8_mla_split_{split}", backend)


@pytest.mark.parametrize(("num_heads", "page_size"), [(16, 1), (128, 64)], ids=["heads16_page1", "heads128_page64"])
@pytest.mark.parametrize("backend", FP8_MLA_BACKENDS)
def test_fp8_mla_tensor_scales_replay_in_a_cuda_graph(built, error_report, backend, num_heads, page_size):
    """Capture a run whose scales are one-element float32 tensors; write new
    scales (and queries) into them, re-plan new lengths, replay: each replay
    reads the values the tensors hold then."""
    kv_dtype, q_dtype, bsz = torch.float8_e4m3fn, torch.bfloat16, 4
    num_pages = 16384 // page_size
    page_buf = torch.zeros(num_pages, dtype=torch.int32, device="cuda")
    wrapper = mla_wrapper(backend, use_cuda_graph=True, kv_indices=page_buf)
    batch = Fp8MlaBatch([1] * bsz, [100, 7, 300, 64], page_size, num_heads, q_dtype, kv_dtype)
    ckv = codes((num_pages, page_size, CKV), kv_dtype, CKV_SCALE)
    kpe = codes((num_pages, page_size, KPE), kv_dtype, KPE_SCALE)
    ckv_scale = torch.tensor([CKV_SCALE], dtype=torch.float32, device="cuda")
    kpe_scale = torch.tensor([KPE_SCALE], dtype=torch.float32, device="cuda")
    out = torch.empty_like(batch.q_nope)

    def plan(kv_lens):
        pages = [math.ceil(n / page_size) for n in kv_lens]
        batch.kv_lens, batch.ckv, batch.kpe = kv_lens, ckv, kpe
        batch.kv_indptr = torch.tensor(indptr_of(pages), dtype=torch.int32, device="cuda")
        batch.kv_indices = torch.randperm(num_pages, device="cuda")[:sum(pages)].to(torch.int32)
        batch.kv_len_arr = torch.tensor(kv_lens, dtype=torch.int32, device="cuda")
        batch.plan(wrapper, False)

    def run():
        wrapper.run(batch.q_nope, batch.q_pe, ckv, kpe, out=out, ckv_scale=ckv_scale, kpe_scale=kpe_scale)

    plan([100, 7, 300, 64])
    run()  # warm-up outside the capture (loads the kernel)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        run()
    for kv_lens, scales in (([100, 7, 300, 64], (0.5, 0.125)), ([3000, 1, 1200, 17], (1.25, 3.0)),
                            ([0, 500, 33, 1], (CKV_SCALE, KPE_SCALE))):
        plan(kv_lens)
        batch.ckv_scale, batch.kpe_scale = scales
        ckv_scale.fill_(scales[0])
        kpe_scale.fill_(scales[1])
        batch.q_nope.copy_(randn(*batch.q_nope.shape, dtype=q_dtype))
        batch.q_pe.copy_(randn(*batch.q_pe.shape, dtype=q_dtype))
        out.fill_(float("nan"))
        graph.replay()
        batch.check(out, None, False, error_report, "fp8_mla_cuda_graph_replay", backend, shape=str(kv_lens),
                    scales=str(scales))


@pytest.mark.parametrize("backend", FP8_MLA_BACKENDS)
def test_fp8_mla_float_and_tensor_scales_agree_bit_for_bit(built, backend):
    batch = Fp8MlaBatch([1, 4, 2], [40, 700, 65], 64, 16, torch.float16, torch.float8_e5m2)
    wrapper = mla_wrapper(backend)
    batch.plan(wrapper, True)
    as_floats = batch.run(wrapper)
    as_tensors = wrapper.run(batch.q_nope, batch.q_pe, batch.ckv, batch.kpe,
                             ckv_scale=torch.tensor([CKV_SCALE], device="cuda"),
                             kpe_scale=torch.tensor(KPE_SCALE, device="cuda").reshape(1))
    torch.cuda.synchronize()
    assert torch.equal(as_floats, as_tensors)


@pytest.mark.parametrize("mode", MODES, ids=["decode", "qo4_causal"])
@pytest.mark.parametrize("num_heads", [16, 64], ids=lambda h: f"heads{h}")
@pytest.mark.parametrize("kv_dtype", FP8_KV_DTYPES, ids=fp8_id)
@pytest.mark.parametrize("q_dtype", MLA_DTYPES, ids=str)
@pytest.mark.parametrize("backend", FP8_MLA_BACKENDS)
def test_unit_scales_match_the_16_bit_kernel_over_the_widened_cache(built, backend, q_dtype, kv_dtype, num_heads,
                                                                      mode):
    """Widening is exact, and with ckv_scale = kpe_scale = 1 every scaling is a
    multiplication by 1: the FP8 kernel's output is the 16-bit kernel's over the
    cache converted to q's dtype, bit for bit (same tiles, same order; up to 64
    heads, where fa3 runs its loader kernel for both)."""
    qo_len, causal = mode
    batch = Fp8MlaBatch([qo_len] * len(KV_LENS), KV_LENS, 64, num_heads, q_dtype, kv_dtype)
    batch.ckv_scale = batch.kpe_scale = 1.0
    fp8 = mla_wrapper(backend)
    batch.plan(fp8, causal, disable_split_kv=True)  # the same work items for both
    out = batch.run(fp8)
    wide = mla_wrapper(backend)
    wide.plan(batch.qo_indptr, batch.kv_indptr, batch.kv_indices, batch.kv_len_arr, num_heads, CKV, KPE, 64, causal,
              SM_SCALE, q_dtype, q_dtype, disable_split_kv=True)
    same = wide.run(batch.q_nope, batch.q_pe, batch.ckv.to(q_dtype), batch.kpe.to(q_dtype))
    torch.cuda.synchronize()
    assert torch.equal(out, same), f"max |diff| {float((out.double() - same.double()).abs().max())}"
