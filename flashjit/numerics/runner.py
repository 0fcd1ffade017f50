"""Runs one configuration on a case's inputs through the public op that selects
exactly that configuration, and measures its output against the float64
reference within the configuration's own tolerance profile (MLA's inputs,
call, reference and bound: numerics.mla).

An FP8 KV-cache configuration runs on K/V quantised per tensor (cases.quantise)
with its scales as k_scale / v_scale (MLA: ckv and kpe, as ckv_scale / kpe_scale).
Its pass/fail error is against float64 attention over the dequantised cache
(codes times scales), which the profile bounds; beside it, the end-to-end error
against float64 attention over the unquantised K/V (ckv / kpe) says what the
quantisation costs (no bound: it is the user's choice)."""

from __future__ import annotations

import inspect
import math
import time
import zlib

import torch

import flashjit
from ..error_model import evaluate_lse, measure as magnitudes, profile
from ..ops._launch import select_spec
from ..reference import attention_reference, ragged_reference, request_masks
from ..spec import KV_ONLY_DTYPES, MLA_OPS, KernelSpec
from . import mla
from .catalog import describe
from .cases import HEADS, Problem, add_mask, applies, indptr, make_problems, paged

TORCH_DTYPES = {"float16": torch.float16, "bfloat16": torch.bfloat16, "float32": torch.float32,
                "float8_e4m3fn": torch.float8_e4m3fn, "float8_e5m2": torch.float8_e5m2}
WINDOW_LEFT = 70          # as the GPU tests: wider than a tile, shorter than most requests
SOFT_CAP = 30.0
WORKSPACE_BYTES = 64 << 20
P999 = 0.999


def poison_allocator(nbytes: int = 1 << 26) -> None:
    """NaN into a block the caching allocator hands out next: an output element
    a kernel forgets to write stays NaN and counts as over its bound."""
    torch.full((nbytes // 4,), float("nan"), device="cuda").data_ptr()
    torch.cuda.synchronize()


def not_runnable(spec: KernelSpec) -> str | None:
    """Why the ops cannot run exactly this configuration on this GPU (strict: no
    fallback to another backend), or None. A selection that differs is a bug, raised."""
    try:
        chosen = select_spec(spec.op, TORCH_DTYPES[spec.dtype_q], spec.head_dim_qk, backend=spec.backend,
                             use_tensor_cores=spec.use_tensor_cores, causal=spec.causal, window=spec.sliding_window,
                             soft_cap=spec.soft_cap, return_lse=spec.return_lse, strict=True,
                             head_dim_vo=spec.head_dim_vo, **_kv_dtype(spec),
                             custom_mask="custom_mask" if spec.custom_mask else None)
    except ValueError as exc:
        return str(exc)
    if chosen != spec:
        raise RuntimeError(f"the ops select {chosen.name} for the arguments of {spec.name}")
    return None


def is_fp8(spec: KernelSpec) -> bool:
    return spec.dtype_kv in KV_ONLY_DTYPES


def _kv_dtype(spec: KernelSpec) -> dict:
    """select_spec's dtype_kv for an FP8 cache; nothing otherwise."""
    return {"dtype_kv": TORCH_DTYPES[spec.dtype_kv]} if is_fp8(spec) else {}


def _scales(p: Problem, names: tuple[str, str] = ("k_scale", "v_scale")) -> dict:
    """The dequantisation scales of an FP8 problem (Python floats, float32 values) under
    the op's keyword names; nothing otherwise."""
    return dict(zip(names, (p.k_scale, p.v_scale))) if p.fp8 else {}


def _single_prefill_scale_names() -> tuple[str, str]:
    """single_prefill_with_kv_cache's names for the scales: FlashInfer 0.7's function has
    scale_k / scale_v beside k_scale / v_scale; flashjit's takes one pair."""
    params = inspect.signature(flashjit.single_prefill_with_kv_cache).parameters
    return ("k_scale", "v_scale") if "k_scale" in params else ("scale_k", "scale_v")


def _variant(spec: KernelSpec) -> dict:
    return {"window_left": WINDOW_LEFT if spec.sliding_window else -1,
            "logits_soft_cap": SOFT_CAP if spec.soft_cap else None}


def _check_planned(wrapper, spec: KernelSpec) -> None:
    ran = wrapper._plan.module.spec
    if ran != spec:
        raise RuntimeError(f"plan() selected {ran.name}, not {spec.name}")


def applies_to(case: str, spec: KernelSpec) -> bool:
    return mla.applies(case) if spec.op in MLA_OPS else applies(case, spec.op)


def problems(spec: KernelSpec, case: str, generator, device="cuda") -> list:
    """Fresh inputs for each call `case` makes on spec's op."""
    dtype = TORCH_DTYPES[spec.dtype_q]
    kv_dtype = TORCH_DTYPES[spec.dtype_kv] if is_fp8(spec) else None
    if spec.op in MLA_OPS:
        return mla.make_problems(case, spec.causal, dtype, generator=generator, device=device, kv_dtype=kv_dtype)
    made = make_problems(case, spec.op, spec.head_dim_qk, dtype, generator=generator, device=device, heads=HEADS,
                         kv_dtype=kv_dtype, head_dim_vo=spec.head_dim_vo)
    for p in made if spec.custom_mask else ():
        add_mask(p, generator)
    return made


def single_kv_chunk(spec: KernelSpec, p: Problem) -> int | None:
    """The keys per split-KV chunk a single-request launch of p uses here (0:
    not split), by the launch's own rule (ops._calls.single_request_split); None
    for tensor-core configurations, which the data-dependent bound does not model."""
    if spec.use_tensor_cores:
        return None
    from .. import jit
    from ..ops import _calls, _invariant

    module = jit.get_module(spec)
    group, num_kv = p.q.shape[1] // p.k.shape[1], p.k.shape[1]
    qo_len = p.q.shape[0] if spec.op == "single_prefill" else 1
    ctas = -(-qo_len * group // module.rows_per_cta) * num_kv
    chunk = _invariant.chunk_keys(None, True, module.split_align) if _invariant.env_setting() else 0
    return _calls.single_request_split(p.kv_lens[0], ctas, _calls.resident_ctas(module, p.q.device), chunk)[1]


def run_op(spec: KernelSpec, p: Problem, workspace: torch.Tensor, generator) -> tuple:
    """(out, lse or None, kv_chunk) of the op for `spec` on problem p (an
    MlaProblem for MLA); kv_chunk: the keys per split-KV chunk of the requests
    the launch split (0: none; None where the data-dependent bound does not apply)."""
    if spec.op in MLA_OPS:
        wrapper = mla.planned_wrapper(spec, p, workspace)
        _check_planned(wrapper, spec)
        poison_allocator()
        return (*mla.run(wrapper, p), None)
    var, dtype, scales = _variant(spec), TORCH_DTYPES[spec.dtype_q], _scales(p)
    num_qo, num_kv, head_dim = p.q.shape[1], p.k.shape[1], spec.head_dim_qk
    mask = {} if p.mask is None else {"custom_mask": p.mask}
    picks = {"backend": spec.backend, "strict": True}
    kv_type = {"kv_data_type": p.k.dtype} if p.fp8 else {}  # plan(): the cache's dtype where it is not q's
    if spec.op == "single_prefill":
        poison_allocator()
        res = flashjit.single_prefill_with_kv_cache(p.q, p.k, p.v, causal=spec.causal, return_lse=spec.return_lse,
                                                    use_tensor_cores=spec.use_tensor_cores, **picks, **var,
                                                    **_scales(p, _single_prefill_scale_names()), **mask)
        return (*(res if spec.return_lse else (res, None)), single_kv_chunk(spec, p))
    if spec.op == "single_decode":
        poison_allocator()
        res = flashjit.single_decode_with_kv_cache(p.q[0], p.k, p.v, use_tensor_cores=spec.use_tensor_cores,
                                                   return_lse=spec.return_lse, **picks, **var, **scales)
        out, lse = res if spec.return_lse else (res, None)
        return out[None], (lse[None] if lse is not None else None), single_kv_chunk(spec, p)
    if spec.op == "batch_prefill_ragged":
        wrapper = flashjit.BatchPrefillWithRaggedKVCacheWrapper(workspace, **picks)
        wrapper.plan(torch.tensor(indptr(p.qo_lens), dtype=torch.int32),
                     torch.tensor(indptr(p.kv_lens), dtype=torch.int32), num_qo, num_kv, head_dim,
                     head_dim_vo=spec.head_dim_vo, causal=spec.causal, q_data_type=dtype,
                     use_tensor_cores=spec.use_tensor_cores, **kv_type, **var, **mask)
        _check_planned(wrapper, spec)
        poison_allocator()
        return (*wrapper.run(p.q, p.k, p.v, return_lse=True, **scales), wrapper._plan.work.kv_chunk)
    pages = paged(p, generator)
    if spec.op == "batch_prefill_paged":
        wrapper = flashjit.BatchPrefillWithPagedKVCacheWrapper(workspace, "NHD", **picks)
        wrapper.plan(torch.tensor(indptr(p.qo_lens), dtype=torch.int32), pages.indptr, pages.indices,
                     pages.last_page_len, num_qo, num_kv, head_dim, pages.cache.shape[2], causal=spec.causal,
                     q_data_type=dtype, use_tensor_cores=spec.use_tensor_cores, **kv_type, **var, **mask)
    elif spec.op == "batch_decode_paged":
        wrapper = flashjit.BatchDecodeWithPagedKVCacheWrapper(workspace, "NHD", use_tensor_cores=spec.use_tensor_cores,
                                                              **picks)
        wrapper.plan(pages.indptr, pages.indices, pages.last_page_len, num_qo, num_kv, head_dim,
                     pages.cache.shape[2], q_data_type=dtype, **kv_type, **var)
    else:
        raise ValueError(f"{spec.op} is not an attention op: nothing to measure")
    _check_planned(wrapper, spec)
    poison_allocator()
    return (*wrapper.run(p.q, pages.cache, return_lse=True, **scales), wrapper._plan.work.kv_chunk)


def reference(spec: KernelSpec, p: Problem, unquantised: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """float64 attention over p's K/V: an FP8 cache's codes times its scales, or
    with `unquantised` the K/V in q's dtype that were quantised into them (MLA: ckv / kpe)."""
    if spec.op in MLA_OPS:
        return mla.reference(spec, p, unquantised)
    var = _variant(spec)
    causal = spec.causal and spec.op not in ("single_decode", "batch_decode_paged")
    k, v = (p.k_full, p.v_full) if unquantised else (p.k, p.v)
    if p.fp8 and not unquantised:
        var.update(k_scale=p.k_scale, v_scale=p.v_scale)
    masks = None if p.mask is None else request_masks(p.mask, p.qo_lens, p.kv_lens)
    if len(p.qo_lens) == 1:
        return attention_reference(p.q, k, v, causal=causal, mask=masks[0] if masks else None, **var)
    return ragged_reference(p.q, k, v, indptr(p.qo_lens), indptr(p.kv_lens), masks=masks, causal=causal, **var)


def bounds(spec: KernelSpec, p: Problem) -> tuple:
    """(kv_len, output bound, LSE bound) of one call, each from the call's own inputs."""
    if spec.op in MLA_OPS:
        return mla.bounds(spec, p)
    kv_len = max(max(p.kv_lens), 1)
    sm_scale = 1.0 / math.sqrt(spec.head_dim_qk)
    k, v = p.dequantised()  # an FP8 cache's magnitudes are its dequantised values'
    tol = flashjit.tolerance(spec, q=p.q, k=k, v=v, kv_len=kv_len, sm_scale=sm_scale)
    _, logit_absmax = magnitudes(p.q, k, v, sm_scale)
    return kv_len, tol, evaluate_lse(profile(spec), kv_len=kv_len, logit_absmax=logit_absmax)


class Accumulator:
    """Every call of one (configuration, case): the errors for the quantiles,
    and the call that came closest to its bound; for an FP8 cache also the
    end-to-end errors against the unquantised K/V."""

    def __init__(self):
        self.errors: list[torch.Tensor] = []
        self.e2e_errors: list[torch.Tensor] = []
        self.calls = self.nan = 0
        self.ratio, self.lse_ratio, self.worst = 0.0, None, None
        self.data = {}

    def add(self, spec: KernelSpec, p: Problem, out, lse, ref, ref_lse, kv_chunk: int | None = None,
            ref_unquantised=None) -> None:
        """One call. With kv_chunk (the launch's split-KV chunk, 0: none), a
        CUDA-core configuration is also checked against the data-dependent
        bound of error_bound.py (not with an FP8 cache: it does not model the
        scales). ref_unquantised: an FP8 call's reference over the unquantised K/V."""
        kv_len, tol, lse_tol = bounds(spec, p)
        out_d, ref_d = out.double(), ref.double()
        err = abs_error(out_d, ref_d)
        if ref_unquantised is not None:
            self.e2e_errors.append(abs_error(out_d, ref_unquantised.double()).flatten())
        ratio = err / tol.bound(ref_d)
        self.calls += 1
        self.nan += int(torch.isnan(out).sum())
        self.errors.append(err.flatten())
        if ratio.numel():
            at = int(ratio.flatten().argmax())
            worst = float(ratio.flatten()[at])
            if self.worst is None or worst > self.ratio:
                self.ratio = worst
                bound = tol.atol + tol.rtol * float(ref_d.flatten()[at].abs())
                self.worst = {"worst_err": float(err.flatten()[at]), "worst_bound": bound, "atol": tol.atol,
                              "rtol": tol.rtol, "kv_len": kv_len}
        if lse is not None:
            r = lse_tol.ratio(lse, ref_lse)
            self.lse_ratio = r if self.lse_ratio is None else max(self.lse_ratio, r)
        if kv_chunk is not None and not spec.use_tensor_cores and not is_fp8(spec):
            self._add_data_bound(spec, p, out, lse, kv_chunk, 1.0 / math.sqrt(spec.head_dim_qk))

    def _add_data_bound(self, spec: KernelSpec, p: Problem, out, lse, kv_chunk: int, sm_scale: float) -> None:
        from ..error_bound import ragged_cuda_core_bound

        var = _variant(spec)
        bound = ragged_cuda_core_bound(spec, p.q, p.k, p.v, indptr(p.qo_lens), indptr(p.kv_lens), kv_chunk=kv_chunk,
                                       causal=spec.causal and spec.op not in ("single_decode", "batch_decode_paged"),
                                       sm_scale=sm_scale, **var)
        self.data["data_ratio"] = max(self.data.get("data_ratio", 0.0), bound.ratio(out))
        if lse is not None:
            self.data["data_lse_ratio"] = max(self.data.get("data_lse_ratio", 0.0), bound.lse_ratio(lse))

    def row(self) -> dict:
        stats = {"elements": sum(e.numel() for e in self.errors), **error_stats(self.errors)}
        if self.e2e_errors:
            stats.update({f"e2e_{k}": v for k, v in error_stats(self.e2e_errors).items()})
        over = not self.ratio <= 1.0 or (self.lse_ratio is not None and not self.lse_ratio <= 1.0) or self.nan > 0
        over = over or not all(r <= 1.0 for r in self.data.values())
        return {"status": "over" if over else "ok", "calls": self.calls, **stats, "ratio": self.ratio,
                "lse_ratio": self.lse_ratio, "nan": self.nan, **self.data, **(self.worst or {})}


def abs_error(out_d: torch.Tensor, ref_d: torch.Tensor) -> torch.Tensor:
    """|out - ref|: equal values (infinities included) agree; NaN is as far off as it gets."""
    return torch.where(out_d == ref_d, torch.zeros_like(ref_d), (out_d - ref_d).abs()).nan_to_num(math.inf)


def error_stats(errors: list[torch.Tensor]) -> dict:
    """max, p99.9 and mean of the errors of every call."""
    err = torch.cat(errors) if errors else torch.zeros(0, dtype=torch.float64)
    n = err.numel()
    return {"max_err": float(err.max()) if n else 0.0,
            "p999_err": float(err.kthvalue(max(1, math.ceil(P999 * n))).values) if n else 0.0,
            "mean_err": float(err.mean()) if n else 0.0}


def seed_for(base: int, spec: KernelSpec, case: str, draw: int) -> int:
    # zlib.crc32, not hash(): string hashes change from one process to the next.
    return (base * 1_000_003 + zlib.crc32(f"{spec.name}/{case}/{draw}".encode())) % 2**63


def measure_spec(spec: KernelSpec, cases, seeds: int, base_seed: int, workspace) -> list[dict]:
    """One row per case that applies to the op; one 'skipped' row where the op
    cannot run this configuration here."""
    head = describe(spec)
    try:
        why_not = not_runnable(spec)
    except (RuntimeError, ValueError) as exc:
        return [{**head, "case": "-", "status": "error", "reason": str(exc)}]
    if why_not is not None:
        return [{**head, "case": "-", "status": "skipped", "reason": why_not}]
    rows = []
    for case in cases:
        if not applies_to(case, spec):
            continue
        started, acc = time.monotonic(), Accumulator()
        try:
            for draw in range(seeds):
                generator = torch.Generator(device="cuda").manual_seed(seed_for(base_seed, spec, case, draw))
                for p in problems(spec, case, generator):
                    out, lse, kv_chunk = run_op(spec, p, workspace, generator)
                    torch.cuda.synchronize()
                    ref, ref_lse = reference(spec, p)
                    unquantised = reference(spec, p, unquantised=True)[0] if p.fp8 else None
                    acc.add(spec, p, out, lse, ref, ref_lse if lse is not None else None, kv_chunk, unquantised)
            row = acc.row()
        except Exception as exc:  # the other cases and configurations still run; the row says what failed
            row = {"status": "error", "reason": f"{type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}"}
        rows.append({**head, "case": case, "seeds": seeds, **row, "seconds": round(time.monotonic() - started, 3)})
    return rows
