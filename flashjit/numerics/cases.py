"""The inputs `flashjit numerics` measures on: per case and op, the request
lengths, and fresh random tensors drawn from a generator the caller seeds.

Every case keeps the sizes small enough that a default run over the whole
default selection stays within minutes; the float64 reference dominates the
time once the kernels are built. An FP8 KV-cache configuration's K/V are drawn
in q's dtype as any other's, then quantised per tensor (quantise()).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from ..spec import FP8_MAX as SPEC_FP8_MAX
from .catalog import CASES, LONG_KV, LONG_KV_MAX, OUTLIER_FRACTION, OUTLIER_SCALE, PEAKED_SCALE

BATCH_OPS = ("batch_prefill_ragged", "batch_prefill_paged", "batch_decode_paged")
# The empty request each batch op's GPU tests already cover (tests/test_gpu_attention.py
# RAGGED_BATCHES["empty_kv"], tests/test_gpu_paged.py PREFILL_QO and DECODE_LENS):
# (qo_len, kv_len). Every batch case carries it, so that an unwritten row is seen on hard inputs too.
EMPTY_REQUEST = {"batch_prefill_ragged": (3, 0), "batch_prefill_paged": (0, 40), "batch_decode_paged": (1, 0)}
HEADS = (8, 2)  # GQA: four query heads per KV head, the common serving shape
PAGE_SIZE = 16
# The largest finite value of each FP8 KV-cache format (spec.FP8_MAX), by torch dtype.
FP8_MAX = {getattr(torch, name): value for name, value in SPEC_FP8_MAX.items()}


@dataclass
class Problem:
    """One call's inputs: q [sum(qo_lens), Hq, D] (decode ops: one row per request),
    k [sum(kv_lens), Hkv, D] and v [sum(kv_lens), Hkv, Dv] packed NHD (Dv: the
    configuration's head_dim_vo); the paged ops scatter them over pages."""

    case: str
    qo_lens: list[int]
    kv_lens: list[int]
    q: torch.Tensor
    k: torch.Tensor
    v: torch.Tensor
    outlier_rows: int = 0
    # An FP8 KV cache: k and v hold its codes, which k_scale / v_scale dequantise
    # (codes * scale); k_full / v_full are the unquantised K/V (q's dtype) they came from.
    k_scale: float = 1.0
    v_scale: float = 1.0
    k_full: torch.Tensor | None = None
    v_full: torch.Tensor | None = None
    # A custom-mask configuration's mask: each request's [qo_len, kv_len] bool
    # pairs, row-major, request after request (add_mask()).
    mask: torch.Tensor | None = None

    @property
    def fp8(self) -> bool:
        return self.k_full is not None

    def dequantised(self) -> tuple[torch.Tensor, torch.Tensor]:
        """K and V as the kernel's profile sees them: float64 codes times their scales (exact)."""
        if not self.fp8:
            return self.k, self.v
        return self.k.double() * self.k_scale, self.v.double() * self.v_scale


def _prefill_batch(lengths: tuple[list[int], list[int]], op: str) -> tuple[list[int], list[int]]:
    qo, kv = lengths
    empty_qo, empty_kv = EMPTY_REQUEST[op]
    return qo + [empty_qo], kv + [empty_kv]


def _shapes(case: str, op: str) -> list[tuple[list[int], list[int]]]:
    """(qo_lens, kv_lens) of each call the case makes for `op` ([] where it does not apply)."""
    long_kv = LONG_KV_MAX if case == "long128k" else LONG_KV
    if op == "single_prefill":
        return {"normal": [([256], [1024])], "peaked": [([256], [1024])], "v_outliers": [([256], [1024])],
                "long": [([16], [long_kv])], "long128k": [([16], [long_kv])],
                "near_empty": [([1], [1]), ([64], [1]), ([1], [300])]}.get(case, [])
    if op == "single_decode":
        return {"normal": [([1], [1024])], "peaked": [([1], [1024])], "v_outliers": [([1], [1024])],
                "long": [([1], [long_kv])], "long128k": [([1], [long_kv])],
                "near_empty": [([1], [1])]}.get(case, [])
    if op == "batch_decode_paged":
        kv = {"normal": [1, 15, 16, 17, 300, 2000, 77], "peaked": [1, 15, 16, 17, 300, 2000, 77],
              "v_outliers": [1, 15, 16, 17, 300, 2000, 77], "long": [long_kv, 5, 1000],
              "long128k": [long_kv, 5, 1000], "skewed": [8192] + [16] * 31, "near_empty": [1, 1, 2, 1]}.get(case)
        return [] if kv is None else [([1] * (len(kv) + 1), kv + [EMPTY_REQUEST[op][1]])]
    if op in ("batch_prefill_ragged", "batch_prefill_paged"):
        mixed = ([37, 128, 300, 5], [300, 128, 1000, 700])
        lengths = {"normal": mixed, "peaked": mixed, "v_outliers": mixed, "long": ([16, 1], [long_kv, 100]),
                   "long128k": ([16, 1], [long_kv, 100]), "skewed": ([1024] + [32] * 15, [4096] + [64] * 15),
                   "near_empty": ([1, 64, 1, 1], [1, 1, 300, 2])}.get(case)
        return [] if lengths is None else [_prefill_batch(lengths, op)]
    return []


def applies(case: str, op: str) -> bool:
    return bool(_shapes(case, op))


def _randn(shape, generator, device, scale: float = 1.0) -> torch.Tensor:
    # Drawn in fp32 and rounded once, so that the reference sees exactly the kernel's inputs.
    return torch.randn(shape, generator=generator, device=device, dtype=torch.float32) * scale


def add_outliers(v: torch.Tensor, generator, fraction: float = OUTLIER_FRACTION,
                 scale: float = OUTLIER_SCALE) -> tuple[torch.Tensor, int]:
    """v (fp32, [tokens, heads, dim]) with round(fraction) of its (token, head)
    vectors, at least one, multiplied by `scale`; returns (v, how many)."""
    rows = v.shape[0] * v.shape[1]
    if rows == 0:
        return v, 0
    count = max(1, round(fraction * rows))
    picked = torch.randperm(rows, generator=generator, device=v.device)[:count]
    factor = torch.ones(rows, device=v.device, dtype=v.dtype)
    factor[picked] = scale
    return v * factor.view(v.shape[0], v.shape[1], 1), count


def per_tensor_scale(x: torch.Tensor, kv_dtype: torch.dtype) -> float:
    """amax(|x|) / the FP8 format's largest finite value (448 e4m3, 57344 e5m2),
    rounded to float32 as the kernel holds it; 1 for an empty or all-zero x."""
    amax = float(x.abs().amax()) if x.numel() else 0.0
    if not math.isfinite(amax) or amax == 0.0:
        return 1.0
    return float(torch.tensor(amax / FP8_MAX[kv_dtype], dtype=torch.float32))


def fp8_codes(x: torch.Tensor, scale: float, kv_dtype: torch.dtype) -> torch.Tensor:
    """x / scale rounded to the FP8 format, saturated at its largest finite value
    (the float32 scale may leave amax / scale a hair past it)."""
    limit = FP8_MAX[kv_dtype]
    return (x.float() / scale).clamp(-limit, limit).to(kv_dtype)


def quantise(x: torch.Tensor, kv_dtype: torch.dtype) -> tuple[torch.Tensor, float]:
    """(FP8 codes, per-tensor scale) of x (per_tensor_scale(), fp8_codes())."""
    scale = per_tensor_scale(x, kv_dtype)
    return fp8_codes(x, scale, kv_dtype), scale


def make_problems(case: str, op: str, head_dim: int, dtype: torch.dtype, *, generator: torch.Generator,
                  device="cuda", heads: tuple[int, int] = HEADS, kv_dtype: torch.dtype | None = None,
                  head_dim_vo: int | None = None) -> list[Problem]:
    """Fresh inputs for each call of `case` on `op`; [] where the case does not apply.
    kv_dtype (FP8): K/V drawn in `dtype` as always, then quantised per tensor (quantise()).
    head_dim_vo: V's width (None: head_dim)."""
    if case not in CASES:
        raise ValueError(f"case: expected one of {', '.join(CASES)}, got {case!r}")
    num_qo, num_kv = heads
    problems = []
    for qo_lens, kv_lens in _shapes(case, op):
        q_scale = PEAKED_SCALE if case == "peaked" else 1.0
        q = _randn((sum(qo_lens), num_qo, head_dim), generator, device, q_scale)
        k = _randn((sum(kv_lens), num_kv, head_dim), generator, device)
        v = _randn((sum(kv_lens), num_kv, head_dim_vo or head_dim), generator, device)
        outliers = 0
        if case == "v_outliers":
            v, outliers = add_outliers(v, generator)
        p = Problem(case, list(qo_lens), list(kv_lens), q.to(dtype), k.to(dtype), v.to(dtype), outliers)
        if kv_dtype is not None and kv_dtype in FP8_MAX:
            p.k_full, p.v_full = p.k, p.v
            (p.k, p.k_scale), (p.v, p.v_scale) = quantise(p.k_full, kv_dtype), quantise(p.v_full, kv_dtype)
        problems.append(p)
    return problems


def add_mask(p: Problem, generator, visible: float = 0.5) -> None:
    """A custom mask for p: each (query, key) pair visible with probability
    `visible`, so that short rows also see no key at all."""
    pairs = sum(q * k for q, k in zip(p.qo_lens, p.kv_lens))
    p.mask = torch.rand(pairs, generator=generator, device=p.q.device) < visible


def indptr(lengths) -> list[int]:
    out = [0]
    for n in lengths:
        out.append(out[-1] + n)
    return out


@dataclass
class Pages:
    """A problem's keys and values scattered over a paged NHD cache
    [num_pages, 2, page_size, Hkv, D] in random page order, spare pages random."""

    cache: torch.Tensor
    indptr: torch.Tensor
    indices: torch.Tensor
    last_page_len: torch.Tensor


def paged(problem: Problem, generator, page_size: int = PAGE_SIZE, spare_pages: int = 3) -> Pages:
    k, v, device = problem.k, problem.v, problem.k.device
    pages = [math.ceil(n / page_size) for n in problem.kv_lens]
    page_indptr, kv_indptr = indptr(pages), indptr(problem.kv_lens)
    num_pages = page_indptr[-1] + spare_pages
    cache = _randn((num_pages, 2, page_size, k.shape[1], k.shape[2]), generator, device).to(k.dtype)
    order = torch.randperm(num_pages, generator=generator, device=device)[:page_indptr[-1]].to(torch.int32)
    # FP8 codes are scattered as their bytes: indexed writes are not defined for every float8 dtype.
    raw, k, v = (t.view(torch.uint8) if problem.fp8 else t for t in (cache, k, v))
    for r, n in enumerate(problem.kv_lens):
        pos = torch.arange(n, device=device)
        page = order[page_indptr[r] + pos // page_size].long()
        raw[page, 0, pos % page_size] = k[kv_indptr[r]:kv_indptr[r] + n]
        raw[page, 1, pos % page_size] = v[kv_indptr[r]:kv_indptr[r] + n]
    last = [(n - 1) % page_size + 1 if n else 0 for n in problem.kv_lens]
    return Pages(cache, torch.tensor(page_indptr, dtype=torch.int32, device=device), order,
                 torch.tensor(last, dtype=torch.int32, device=device))
