"""MLA (mla_paged) in `flashjit numerics`: each case's inputs for DeepSeek latent
attention (q_nope, q_pe and a paged cache of ckv and kpe rows), the call through
BatchMLAPagedAttentionWrapper, the float64 reference over the same pages
(flashjit.mla_reference) and the bound of the MLA error model (Q.K^T 576 wide,
vmax = max|ckv|; docs/numerics.md, "MLA").

A configuration without the causal mask is measured on decode steps (one query
per request); a causal one on chunks of CAUSAL_QO queries per request (chunked
prefill, speculative decoding), where the bottom-right mask leaves the first
queries of a request fewer keys. Every call carries a request with no keys.

An FP8 cache's ckv and kpe are drawn in q's dtype as any other's, then quantised
per tensor with a scale each (cases.quantise; FlashInfer's ckv_scale / kpe_scale),
which the call passes. Pass/fail is against float64 over the dequantised cache
(codes x scales); reference(unquantised=True) is over the rows before quantising.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from ..error_model import evaluate_lse, measure_mla, profile, tolerance
from ..reference import mla_reference
from ..spec import MLA_HEAD_DIM_CKV as CKV, MLA_HEAD_DIM_KPE as KPE, KernelSpec
from .cases import FP8_MAX, _randn, add_outliers, fp8_codes, indptr, quantise
from .catalog import CASES, LONG_KV, LONG_KV_MAX, PEAKED_SCALE

HEADS = 16                     # DeepSeek-V3's 128 query heads split over 8 GPUs
PAGE_SIZE = 64
CAUSAL_QO = 4
SM_SCALE = 1 / math.sqrt(192)  # DeepSeek-V2/V3: (qk_nope 128 + rope 64) ** -0.5
# Across the page boundary at 64, one-key and one-page requests, and longer ones.
MIXED = [1, 63, 64, 65, 300, 2000, 77]


@dataclass
class MlaProblem:
    """One call's inputs: q_nope [tokens, H, 512], q_pe [tokens, H, 64]; ckv
    [keys, 512] and kpe [keys, 64] packed request after request (what the kernel
    reads), the same rows scattered over pages of ckv_cache / kpe_cache
    [num_pages, page_size, dim] in random page order (spare slots and pages random).
    An FP8 cache: ckv, kpe and the caches hold codes, which ckv_scale / kpe_scale
    dequantise (codes x scale); ckv_full / kpe_full are the rows in q's dtype they came from."""

    case: str
    qo_lens: list[int]
    kv_lens: list[int]
    q_nope: torch.Tensor
    q_pe: torch.Tensor
    ckv: torch.Tensor
    kpe: torch.Tensor
    ckv_cache: torch.Tensor
    kpe_cache: torch.Tensor
    kv_indptr: torch.Tensor
    kv_indices: torch.Tensor
    outlier_rows: int = 0
    ckv_scale: float = 1.0
    kpe_scale: float = 1.0
    ckv_full: torch.Tensor | None = None
    kpe_full: torch.Tensor | None = None

    @property
    def fp8(self) -> bool:
        return self.ckv_full is not None

    def dequantised(self, pages: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
        """ckv and kpe (with `pages`, the caches) as the profile sees them: an FP8
        cache's float64 codes times their scales (exact); the tensors themselves otherwise."""
        ckv, kpe = (self.ckv_cache, self.kpe_cache) if pages else (self.ckv, self.kpe)
        if not self.fp8:
            return ckv, kpe
        return ckv.double() * self.ckv_scale, kpe.double() * self.kpe_scale


def shapes(case: str, causal: bool) -> list[tuple[list[int], list[int]]]:
    """(qo_lens, kv_lens) of each call the case makes ([] where it does not apply)."""
    long_kv = LONG_KV_MAX if case == "long128k" else LONG_KV
    kv = {"normal": MIXED, "peaked": MIXED, "v_outliers": MIXED, "long": [long_kv, 5, 1000],
          "long128k": [long_kv, 5, 1000], "skewed": [8192] + [16] * 31, "near_empty": [1, 1, 2, 1]}.get(case)
    if kv is None:
        return []
    qo_len = CAUSAL_QO if causal else 1
    qo = [qo_len] * len(kv)
    if causal and case == "near_empty":
        qo = [1, 64, qo_len, 1]  # 64 queries against one key: all but the last see none
    return [(qo + [qo_len], kv + [0])]


def applies(case: str) -> bool:
    return bool(shapes(case, False))


def make_problems(case: str, causal: bool, dtype: torch.dtype, *, generator: torch.Generator, device="cuda",
                  heads: int = HEADS, page_size: int = PAGE_SIZE,
                  kv_dtype: torch.dtype | None = None) -> list[MlaProblem]:
    """Fresh inputs for each call of `case`; [] where the case does not apply.
    peaked scales q_nope and q_pe; v_outliers scales whole ckv rows, which in
    MLA are the keys' latent part too, so those keys' logits grow with them.
    kv_dtype (FP8): drawn in `dtype` as always, then quantised (quantise_cache())."""
    if case not in CASES:
        raise ValueError(f"case: expected one of {', '.join(CASES)}, got {case!r}")
    problems = []
    for qo_lens, kv_lens in shapes(case, causal):
        q_scale = PEAKED_SCALE if case == "peaked" else 1.0
        tokens, keys = sum(qo_lens), sum(kv_lens)
        q_nope = _randn((tokens, heads, CKV), generator, device, q_scale).to(dtype)
        q_pe = _randn((tokens, heads, KPE), generator, device, q_scale).to(dtype)
        ckv, kpe = _randn((keys, CKV), generator, device), _randn((keys, KPE), generator, device)
        outliers = 0
        if case == "v_outliers":
            scaled, outliers = add_outliers(ckv[:, None], generator)
            ckv = scaled[:, 0]
        ckv, kpe = ckv.to(dtype), kpe.to(dtype)
        p = MlaProblem(case, list(qo_lens), list(kv_lens), q_nope, q_pe, ckv, kpe,
                       *_pages(ckv, kpe, kv_lens, generator, page_size), outlier_rows=outliers)
        if kv_dtype is not None and kv_dtype in FP8_MAX:
            quantise_cache(p, kv_dtype)
        problems.append(p)
    return problems


def quantise_cache(p: MlaProblem, kv_dtype: torch.dtype) -> None:
    """ckv and kpe quantised per tensor, each with its own scale (cases.quantise);
    the pages get the same codes, by the scales of the rows the requests read
    (a spare slot past them saturates)."""
    p.ckv_full, p.kpe_full = p.ckv, p.kpe
    (p.ckv, p.ckv_scale), (p.kpe, p.kpe_scale) = quantise(p.ckv_full, kv_dtype), quantise(p.kpe_full, kv_dtype)
    p.ckv_cache = fp8_codes(p.ckv_cache, p.ckv_scale, kv_dtype)
    p.kpe_cache = fp8_codes(p.kpe_cache, p.kpe_scale, kv_dtype)


def _pages(ckv, kpe, kv_lens, generator, page_size: int, spare_pages: int = 3) -> tuple:
    """(ckv_cache, kpe_cache, kv_indptr, kv_indices) holding the packed rows."""
    device = ckv.device
    pages = [math.ceil(n / page_size) for n in kv_lens]
    page_indptr, kv_indptr = indptr(pages), indptr(kv_lens)
    num_pages = page_indptr[-1] + spare_pages
    caches = [_randn((num_pages, page_size, t.shape[-1]), generator, device).to(t.dtype) for t in (ckv, kpe)]
    order = torch.randperm(num_pages, generator=generator, device=device)[:page_indptr[-1]].to(torch.int32)
    for r, n in enumerate(kv_lens):
        pos = torch.arange(n, device=device)
        page = order[page_indptr[r] + pos // page_size].long()
        for cache, rows in zip(caches, (ckv, kpe)):
            cache[page, pos % page_size] = rows[kv_indptr[r]:kv_indptr[r] + n]
    return (*caches, torch.tensor(page_indptr, dtype=torch.int32, device=device), order)


def planned_wrapper(spec: KernelSpec, p: MlaProblem, workspace: torch.Tensor):
    """A wrapper planned for p that may run nothing but spec's backend (strict)."""
    import flashjit

    wrapper = flashjit.BatchMLAPagedAttentionWrapper(workspace, backend=spec.backend, strict=True)
    wrapper.plan(torch.tensor(indptr(p.qo_lens), dtype=torch.int32), p.kv_indptr, p.kv_indices,
                 torch.tensor(p.kv_lens, dtype=torch.int32), p.q_nope.shape[1], CKV, KPE, p.ckv_cache.shape[1],
                 spec.causal, SM_SCALE, p.q_nope.dtype, p.ckv_cache.dtype)
    return wrapper


def run(wrapper, p: MlaProblem) -> tuple[torch.Tensor, torch.Tensor]:
    scales = {"ckv_scale": p.ckv_scale, "kpe_scale": p.kpe_scale} if p.fp8 else {}
    return wrapper.run(p.q_nope, p.q_pe, p.ckv_cache, p.kpe_cache, return_lse=True, **scales)


def reference(spec: KernelSpec, p: MlaProblem, unquantised: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """float64 MLA over p's pages (an FP8 cache's codes times its scales), or with
    `unquantised` over an FP8 problem's rows before quantising (packed: pages of one row)."""
    qo_indptr = indptr(p.qo_lens)
    if unquantised and p.fp8:
        rows = torch.arange(p.ckv_full.shape[0], dtype=torch.int32, device=p.ckv_full.device)
        return mla_reference(p.q_nope, p.q_pe, p.ckv_full[:, None], p.kpe_full[:, None], qo_indptr,
                             indptr(p.kv_lens), rows, p.kv_lens, causal=spec.causal, sm_scale=SM_SCALE)
    ckv_cache, kpe_cache = p.dequantised(pages=True)
    return mla_reference(p.q_nope, p.q_pe, ckv_cache, kpe_cache, qo_indptr, p.kv_indptr, p.kv_indices, p.kv_lens,
                         causal=spec.causal, sm_scale=SM_SCALE)


def bounds(spec: KernelSpec, p: MlaProblem):
    """(kv_len, output bound, LSE bound) of one call: the configuration's profile
    at the magnitudes of the rows the requests read, an FP8 cache's dequantised
    (error_model.mla_tolerance of spec's backend)."""
    kv_len = max(max(p.kv_lens), 1)
    v_absmax, logit_absmax = measure_mla(p.q_nope, p.q_pe, *p.dequantised(), SM_SCALE)
    return (kv_len, tolerance(spec, kv_len=kv_len, v_absmax=v_absmax, logit_absmax=logit_absmax),
            evaluate_lse(profile(spec), kv_len=kv_len, logit_absmax=logit_absmax))
