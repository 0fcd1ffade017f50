"""MLA paged attention on a GPU: BatchMLAPagedAttentionWrapper against float64
(flashjit.mla_reference) within the mla_paged profile of its backend, output
and LSE, over backend (fa2; fa3 on sm_90a) x dtype x heads x page size x
(decode, causal chunk of 4) on ragged lengths with page boundaries and an empty
request; split-KV fixed and automatic; CUDA-graph replay after re-planning;
out= and return_lse=False; fa2 against fa3; the backend choice; a page id past
the caches."""

from __future__ import annotations

import math

import pytest
import torch

import flashjit
from flashjit.error_model import evaluate_lse, measure_mla, mla_tolerance, profile
from flashjit.spec import mla_spec
from sweep import MLA_BACKENDS, MLA_DTYPES, fa3_runs_here
from test_gpu_attention import poison_allocator, randn
from test_gpu_paged import indptr_of

pytestmark = pytest.mark.gpu

SM_SCALE = 1 / math.sqrt(192)  # DeepSeek-V2/V3: (qk_nope 128 + rope 64) ** -0.5
CKV, KPE = 512, 64
# Ragged, with 1, page boundaries of 16 and 64 (and one past them) and an empty request.
KV_LENS = [1, 16, 17, 64, 65, 300, 0, 1000]


def workspace(nbytes: int = 128 << 20) -> torch.Tensor:
    return torch.empty(nbytes, dtype=torch.uint8, device="cuda")


def mla_wrapper(backend: str, **kw) -> flashjit.BatchMLAPagedAttentionWrapper:
    """A wrapper that runs `backend` or raises (strict: no silent fallback); fa3
    tests skip where fa3 cannot run."""
    if backend == "fa3" and not fa3_runs_here():
        pytest.skip("fa3 MLA needs sm_90a (H100/H200)")
    return flashjit.BatchMLAPagedAttentionWrapper(workspace(), backend=backend, strict=True, **kw)


class MlaBatch:
    """q_nope / q_pe for qo_lens tokens and a paged ckv / kpe cache whose pages
    are handed out in random order (the spare ones random too)."""

    def __init__(self, qo_lens, kv_lens, page_size, num_heads, dtype, spare_pages=3):
        self.qo_lens, self.kv_lens, self.page_size, self.num_heads, self.dtype = qo_lens, kv_lens, page_size, \
            num_heads, dtype
        pages = [math.ceil(n / page_size) for n in kv_lens]
        num_pages = sum(pages) + spare_pages
        self.ckv = randn(num_pages, page_size, CKV, dtype=dtype)
        self.kpe = randn(num_pages, page_size, KPE, dtype=dtype)
        self.qo_indptr = torch.tensor(indptr_of(qo_lens), dtype=torch.int32, device="cuda")
        self.kv_indptr = torch.tensor(indptr_of(pages), dtype=torch.int32, device="cuda")
        self.kv_indices = torch.randperm(num_pages, device="cuda")[:sum(pages)].to(torch.int32)
        self.kv_len_arr = torch.tensor(kv_lens, dtype=torch.int32, device="cuda")
        self.new_queries()

    def new_queries(self):
        tokens = sum(self.qo_lens)
        self.q_nope = randn(tokens, self.num_heads, CKV, dtype=self.dtype)
        self.q_pe = randn(tokens, self.num_heads, KPE, dtype=self.dtype)

    def plan(self, wrapper, causal, **kw):
        wrapper.plan(self.qo_indptr, self.kv_indptr, self.kv_indices, self.kv_len_arr, self.num_heads, CKV, KPE,
                     self.page_size, causal, SM_SCALE, self.dtype, self.dtype, **kw)

    def run(self, wrapper, **kw):
        return wrapper.run(self.q_nope, self.q_pe, self.ckv, self.kpe, **kw)

    def check(self, out, lse, causal, report, what, backend="fa2", **info):
        """out (and lse, when given) against float64 within `backend`'s profile."""
        torch.cuda.synchronize()
        ref, ref_lse = flashjit.mla_reference(self.q_nope, self.q_pe, self.ckv, self.kpe, self.qo_indptr,
                                              self.kv_indptr, self.kv_indices, self.kv_lens, causal=causal,
                                              sm_scale=SM_SCALE)
        assert out.shape == ref.shape and out.dtype == self.dtype
        assert not torch.isnan(out).any(), f"{what}: NaN in the output (unwritten or invalid)"
        kv_len = max(max(self.kv_lens), 1)
        tol = mla_tolerance(self.dtype, kv_len=kv_len, q_nope=self.q_nope, q_pe=self.q_pe, ckv=self.ckv,
                            kpe=self.kpe, sm_scale=SM_SCALE, backend=backend)
        spec = mla_spec(self.dtype, causal=causal, backend=backend)
        row = {"config": spec.name, "what": what, "ratio": tol.assert_close(out, ref, what), "rtol": tol.rtol,
               "atol": tol.atol, "max_err": float((out.double() - ref).abs().max()) if out.numel() else 0.0,
               "heads": self.num_heads, "page_size": self.page_size, **info}
        if lse is not None:
            _, logit_absmax = measure_mla(self.q_nope, self.q_pe, self.ckv, self.kpe, SM_SCALE)
            lse_tol = evaluate_lse(profile(spec), kv_len=kv_len, logit_absmax=logit_absmax)
            row["lse_ratio"] = lse_tol.assert_close(lse, ref_lse, f"{what} LSE")
        report.append(row)
        return ref


MODES = [(1, False), (4, True)]  # (qo_len per request, causal): decode; a causal chunk / speculative step


@pytest.mark.parametrize("mode", MODES, ids=["decode", "qo4_causal"])
@pytest.mark.parametrize("page_size", [1, 16, 64])
@pytest.mark.parametrize("num_heads", [16, 128])
@pytest.mark.parametrize("dtype", MLA_DTYPES, ids=str)
@pytest.mark.parametrize("backend", MLA_BACKENDS)
def test_mla_against_float64(prewarmed, error_report, backend, dtype, num_heads, page_size, mode):
    qo_len, causal = mode
    batch = MlaBatch([qo_len] * len(KV_LENS), KV_LENS, page_size, num_heads, dtype)
    wrapper = mla_wrapper(backend)
    batch.plan(wrapper, causal)
    assert wrapper._plan.module.spec.backend == backend
    poison_allocator()
    out, lse = batch.run(wrapper, return_lse=True)
    batch.check(out, lse, causal, error_report, "mla", backend, qo_len=qo_len)


@pytest.mark.parametrize("page_size", [16, 64])
@pytest.mark.parametrize("num_heads", [16, 128])
@pytest.mark.parametrize("split", ["fixed", "auto"])
@pytest.mark.parametrize("mode", MODES, ids=["decode", "qo4_causal"])
@pytest.mark.parametrize("dtype", MLA_DTYPES, ids=str)
@pytest.mark.parametrize("backend", MLA_BACKENDS)
def test_mla_split_kv(prewarmed, error_report, backend, dtype, mode, split, num_heads, page_size):
    """fixed: 64-key chunks over every request; auto: two long requests leave the
    GPU idle unless the planner splits them. 128 heads: fa2's 64-row kernel on
    sm_90a-only builds (fa2_mla_wide.cuh); on fa3 with pages of 64, whole tiles
    by TMA in tile pairs (fa3_mla_pairs.cuh)."""
    qo_len, causal = mode
    kv_lens = [2000, 1, 777, 0, 64] if split == "fixed" else [20000, 9000]
    batch = MlaBatch([qo_len] * len(kv_lens), kv_lens, page_size, num_heads, dtype)
    wrapper = mla_wrapper(backend)
    batch.plan(wrapper, causal, **({"fixed_split_size": 64 // page_size} if split == "fixed" else {}))
    assert wrapper._plan.work.merge_indptr is not None, "the plan did not split"
    if split == "fixed":
        assert wrapper._plan.work.kv_chunk == 64
    poison_allocator()
    out, lse = batch.run(wrapper, return_lse=True)
    batch.check(out, lse, causal, error_report, f"mla_split_{split}", backend, qo_len=qo_len)
    # Unsplit, the same batch agrees with the reference as well (and so within two profiles of the split one).
    batch.plan(wrapper, causal, disable_split_kv=True)
    assert wrapper._plan.work.merge_indptr is None
    out2 = batch.run(wrapper)
    batch.check(out2, None, causal, error_report, "mla_unsplit", backend, qo_len=qo_len)


@pytest.mark.parametrize("dtype", MLA_DTYPES, ids=str)
def test_mla_out_buffer_without_lse(prewarmed, error_report, dtype):
    batch = MlaBatch([1, 3, 2], [40, 3, 700], 16, 32, dtype)
    wrapper = flashjit.BatchMLAPagedAttentionWrapper(workspace())
    batch.plan(wrapper, True)
    out = torch.full((6, 32, CKV), float("nan"), dtype=dtype, device="cuda")
    result = batch.run(wrapper, out=out)
    assert result is out
    batch.check(out, None, True, error_report, "mla_out_buffer")


@pytest.mark.parametrize(("num_heads", "page_size"), [(16, 16), (128, 64)], ids=["heads16_page16", "heads128_page64"])
@pytest.mark.parametrize("backend", MLA_BACKENDS)
def test_mla_cuda_graph_replays_after_replanning(prewarmed, error_report, backend, num_heads, page_size):
    """Capture once; plan() new lengths (short, long enough to split, one empty)
    within the batch size; replay; check each. 128 heads on pages of 64: fa3
    loads whole tiles by TMA, from tensor maps encoded at capture."""
    dtype, bsz = torch.bfloat16, 4
    num_pages = 65536 // page_size
    ckv = randn(num_pages, page_size, CKV, dtype=dtype)
    kpe = randn(num_pages, page_size, KPE, dtype=dtype)
    page_buf = torch.zeros(num_pages, dtype=torch.int32, device="cuda")
    wrapper = mla_wrapper(backend, use_cuda_graph=True, kv_indices=page_buf)
    q_nope = randn(bsz, num_heads, CKV, dtype=dtype)
    q_pe = randn(bsz, num_heads, KPE, dtype=dtype)
    out = torch.empty_like(q_nope)
    qo_indptr = torch.arange(bsz + 1, dtype=torch.int32, device="cuda")

    def plan(kv_lens):
        pages = [math.ceil(n / page_size) for n in kv_lens]
        batch = MlaBatch.__new__(MlaBatch)
        batch.qo_lens, batch.kv_lens, batch.page_size, batch.num_heads, batch.dtype = [1] * bsz, kv_lens, \
            page_size, num_heads, dtype
        batch.ckv, batch.kpe, batch.q_nope, batch.q_pe, batch.qo_indptr = ckv, kpe, q_nope, q_pe, qo_indptr
        batch.kv_indptr = torch.tensor(indptr_of(pages), dtype=torch.int32, device="cuda")
        batch.kv_indices = torch.randperm(num_pages, device="cuda")[:sum(pages)].to(torch.int32)
        batch.kv_len_arr = torch.tensor(kv_lens, dtype=torch.int32, device="cuda")
        batch.plan(wrapper, False)
        return batch

    plan([100, 7, 300, 64])
    wrapper.run(q_nope, q_pe, ckv, kpe, out=out)  # warm-up outside the capture (loads the kernel)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        wrapper.run(q_nope, q_pe, ckv, kpe, out=out)
    for kv_lens in ([100, 7, 300, 64], [30000, 1, 12000, 17], [0, 5000, 33, 1]):
        batch = plan(kv_lens)
        q_nope.copy_(randn(bsz, num_heads, CKV, dtype=dtype))
        q_pe.copy_(randn(bsz, num_heads, KPE, dtype=dtype))
        out.fill_(float("nan"))
        graph.replay()
        batch.check(out, None, False, error_report, "mla_cuda_graph_replay", backend, shape=str(kv_lens))


def test_mla_backend_choice(prewarmed, error_report, monkeypatch):
    """auto runs fa3 where it can (sm_90a) and fa2 elsewhere; an explicit fa3
    where it cannot runs fa2 with a one-time warning, or raises under strict."""
    from flashjit import arch

    monkeypatch.setattr(arch, "_warned_fallbacks", set())
    batch = MlaBatch([1, 1], [33, 200], 16, 16, torch.bfloat16)
    auto = flashjit.BatchMLAPagedAttentionWrapper(workspace())
    batch.plan(auto, False)
    assert auto._plan.module.spec.backend == ("fa3" if fa3_runs_here() else "fa2")
    wrapper = flashjit.BatchMLAPagedAttentionWrapper(workspace(), backend="fa3")
    if fa3_runs_here():
        batch.plan(wrapper, False)
        assert wrapper._plan.module.spec.backend == "fa3"
    else:
        with pytest.warns(UserWarning, match="backend='fa3' requested for mla_paged"):
            batch.plan(wrapper, False)
        assert wrapper._plan.module.spec.backend == "fa2"
        strict = flashjit.BatchMLAPagedAttentionWrapper(workspace(), backend="fa3", strict=True)
        with pytest.raises(ValueError, match="backend='fa3' cannot run here"):
            batch.plan(strict, False)
    out, lse = batch.run(wrapper, return_lse=True)
    batch.check(out, lse, False, error_report, "mla_backend_choice", wrapper._plan.module.spec.backend)


@pytest.mark.parametrize("mode", MODES, ids=["decode", "qo4_causal"])
@pytest.mark.parametrize("dtype", MLA_DTYPES, ids=str)
def test_mla_fa2_against_fa3(prewarmed, error_report, dtype, mode):
    """The two backends' outputs differ by no more than the sum of their bounds."""
    qo_len, causal = mode
    batch = MlaBatch([qo_len] * len(KV_LENS), KV_LENS, 16, 64, dtype)
    outs = {}
    for backend in ("fa2", "fa3"):
        wrapper = mla_wrapper(backend)
        batch.plan(wrapper, causal)
        outs[backend] = batch.run(wrapper)
    torch.cuda.synchronize()
    kv_len = max(KV_LENS)
    tols = [mla_tolerance(dtype, kv_len=kv_len, q_nope=batch.q_nope, q_pe=batch.q_pe, ckv=batch.ckv, kpe=batch.kpe,
                          sm_scale=SM_SCALE, backend=b) for b in ("fa2", "fa3")]
    ref, _ = flashjit.mla_reference(batch.q_nope, batch.q_pe, batch.ckv, batch.kpe, batch.qo_indptr,
                                    batch.kv_indptr, batch.kv_indices, batch.kv_lens, causal=causal,
                                    sm_scale=SM_SCALE)
    diff = (outs["fa2"].double() - outs["fa3"].double()).abs()
    ratio = float((diff / (tols[0] + tols[1]).bound(ref)).max())
    error_report.append({"config": mla_spec(dtype, causal=causal, backend="fa3").name, "what": "mla_fa2_vs_fa3",
                         "ratio": ratio, "max_err": float(diff.max()), "qo_len": qo_len})
    assert ratio <= 1.0, f"fa2 and fa3 MLA differ by {float(diff.max()):.3g}: {ratio:.3f} of their bounds' sum"


def test_mla_page_id_past_the_caches_is_an_error(prewarmed):
    batch = MlaBatch([1], [40], 16, 16, torch.float16)
    wrapper = flashjit.BatchMLAPagedAttentionWrapper(workspace())
    batch.plan(wrapper, False)
    with pytest.raises(ValueError, match=r"^kv_indices: page id \d+ is past the caches' 2 pages"):
        wrapper.run(batch.q_nope, batch.q_pe, batch.ckv[:2], batch.kpe[:2])
    with pytest.raises(ValueError, match=r"^q_pe: expected a torch.float16 tensor of shape \(1, 16, 64\)"):
        wrapper.run(batch.q_nope, batch.q_pe[:, :8], batch.ckv, batch.kpe)
