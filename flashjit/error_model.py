"""Tolerance profiles: the error bound each configuration guarantees.

A bound is elementwise `|out - ref| <= atol + rtol * |ref|`, where `ref` is the
same attention computed in float64 from the same (already rounded) inputs.
docs/numerics.md derives every term; in short, with u_in / u_out the unit
roundoff of the input / output dtype, u = 2^-24 (fp32), lam = 2 (probabilistic
accumulation bound: lam*sqrt(n)*u instead of the worst case n*u), n = kv_len,
D = head_dim, T = online-softmax rescalings (per kernel tiling, about n / 32), S = log2(e) * max_ij |sm_scale| sum_d |q_id k_jd|:

  rtol = u_out + 4u                                (output rounding, final 1/l multiply,
                                                    split-KV merge weights and 1/sum)
  atol = vmax * ( [tensor cores] u_in               (P rounded to the input dtype before P.V)
                  + [tensor cores] n*sub_in        (... where P lies below the dtype's normal range:
                                                    absolute, half the subnormal spacing, 2^-25 for fp16)
                  + 2*Delta                         (perturbed logits move the softmax weights)
                  + 2*lam*sqrt(n)*u )               (fp32 P.V and row-sum accumulation)
         + u_out * tiny(out dtype)                  (subnormal outputs)
  Delta = ln2 * (lam*sqrt(D) + 3 + [soft-cap] 4) * u * S
                                                    (fp32 Q.K accumulation; rounding of sm_scale*log2e,
                                                     of the scaled q and of the max subtraction; tanhf)
          + 8u + 4*lam*sqrt(T)*u                    (exp2f, 2 ulp, in the softmax and in the split-KV
                                                     merge; online-softmax rescaling)

CUDA-core kernels (fp32 arithmetic whatever the dtypes) are bounded in the worst
case instead (evaluate_worst_case): the lam*sqrt terms above assume roundings
that cancel, and an fp32 or fp16 output shows the difference at long contexts:
a dominant first key with a tail of tiny weights, or equal logits over a
constant V, make the P.V chain's roundings all go one way
(docs/numerics-fp32.md, "Why not the √n model"). Tensor-core kernels keep the
sqrt form (docs/numerics.md says what that assumes).

An FP8 KV cache (docs/numerics.md, "FP8 KV caches"): the reference is float64
attention over the dequantised keys and values (codes times k_scale / v_scale),
so the cache's quantisation is input error, outside the bound; vmax and S are
those of the dequantised values. Widening the codes is exact; the kernel adds
one rounding where k_scale joins the query's scale (a logit term) and one where
v_scale multiplies the output (rtol + u). Tensor-core paths round P to the MMA
operand type, q's dtype, so u_in is q's unit roundoff, not the cache's. MLA's
two scales (ckv_scale on K's first 512 dims and on V, kpe_scale on its last 64)
add three logit roundings (S's ckv part times fl(ckv_scale / kpe_scale): the
ratio's rounding and the product's, each at most u of that part; kpe_scale
joining sm_scale) and ckv_scale's one on the output (rtol + u).

The profile stored beside each kernel holds these coefficients; magnitudes (vmax,
S, n) come from the call: given directly, or measured from q, k, v. A bound per
element from the call's own data, sound and far tighter, is error_bound.py's.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from .kernels import tiling_for
from .spec import DTYPES, KV_ONLY_DTYPES, MLA_OPS, UTILITY_OPS, KernelSpec, canonical_dtype, mla_spec

MODEL_VERSION = "flashjit-error-model-6"
U32 = 2.0**-24
LAMBDA = 2.0
_TINY = {"float16": 2.0**-14, "bfloat16": 2.0**-126, "float32": 2.0**-126}
# Half the spacing of the subnormal numbers: the absolute rounding error below the normal range.
_HALF_SUBNORMAL = {"float16": 2.0**-25, "bfloat16": 2.0**-134, "float32": 2.0**-150}
_LN2 = math.log(2.0)
_LOG2E = 1.0 / _LN2


def profile(spec: KernelSpec) -> dict:
    """The coefficients of the bound for one configuration (stored in its manifest)."""
    # P is rounded to the MMA operand type, q's dtype (K/V of another dtype, FP8,
    # are widened to it exactly before the MMA).
    u_in = DTYPES[spec.dtype_q][2]
    u_out = DTYPES[spec.dtype_o][2]
    fp8 = spec.dtype_kv in KV_ONLY_DTYPES and spec.op not in UTILITY_OPS
    # Roundings an FP8 cache's scales add to every logit (the module docstring).
    scale_roundings = (3 if spec.op in MLA_OPS else 1) if fp8 else 0
    coefficients = {
        "model": MODEL_VERSION,
        # FP8: v_scale multiplies the normalised output, one more rounding.
        "rtol": u_out + (5 if fp8 else 4) * U32,
        "atol_floor": u_out * _TINY[spec.dtype_o],
        # Coefficients of vmax * (...):
        "p_rounding": u_in if spec.use_tensor_cores else 0.0,
        # p_j below 2^-14 (fp16's normal range) rounds by up to 2^-25 absolute, not u_in
        # relative: n such keys, every one rounded the same way, move o by n * 2^-25 * vmax
        # (l >= 1: the row's largest p is at least 1 against the softmax's reference).
        "p_subnormal_per_key": _HALF_SUBNORMAL[spec.dtype_q] if spec.use_tensor_cores else 0.0,
        "accumulation_per_sqrt_kv": 2 * LAMBDA * U32,
        # FP8: k_scale joins the query's scale, one more rounding of every logit
        # (MLA: three, with the ratio of its two scales on S's ckv part).
        "logit_per_s": 2 * _LN2 * (LAMBDA * math.sqrt(spec.head_dim_qk) + 3 + (4 if spec.soft_cap else 0)
                                   + scale_roundings) * U32,
        "exp2": 2 * 8 * U32,
        "rescale_per_sqrt_tiles": 2 * 4 * LAMBDA * U32,
        "head_dim_qk": spec.head_dim_qk,
        "use_tensor_cores": spec.use_tensor_cores,
        "dtype_in": spec.dtype_kv,
        "dtype_out": spec.dtype_o,
    }
    if fp8:
        coefficients.update(dtype_mma=spec.dtype_q, kv_scales=True)
    if spec.op in UTILITY_OPS:  # a copy: exact, every coefficient 0
        coefficients.update({k: 0.0 for k, v in coefficients.items() if isinstance(v, float)}, exact=True)
        return coefficients
    tiling = tiling_for(spec)[1]
    coefficients["keys_per_rescale"], coefficients["merge_rescales"] = tiling.rescales(spec)
    if not spec.use_tensor_cores:
        # Every CUDA-core kernel computes in fp32 whatever its dtypes: fp16 outputs
        # showed the one-way roundings past the sqrt(n) form as fp32 ones did.
        coefficients.update(bound="worst_case", soft_cap=spec.soft_cap, **tiling.chains(spec))
    return coefficients


@dataclass(frozen=True)
class Tolerance:
    """An elementwise bound |out - ref| <= atol + rtol * |ref|."""

    rtol: float
    atol: float

    def __add__(self, other: "Tolerance") -> "Tolerance":
        """The difference two paths may show: the sum of their bounds."""
        return Tolerance(self.rtol + other.rtol, self.atol + other.atol)

    def bound(self, ref):
        return self.atol + self.rtol * ref.abs()

    def ratio(self, out, ref) -> float:
        """max |out - ref| / bound over all elements (<= 1 means within the profile);
        inf if anything is NaN/Inf where ref is finite."""
        import torch

        out, ref = out.double(), ref.double()
        err = torch.where(out == ref, torch.zeros_like(ref), (out - ref).abs())  # equal infinities agree
        ratio = err / self.bound(ref)
        ratio = torch.where(torch.isnan(ratio), torch.full_like(ratio, math.inf), ratio)
        return float(ratio.max()) if ratio.numel() else 0.0

    def assert_close(self, out, ref, what: str = "output") -> float:
        import torch

        r = self.ratio(out, ref)
        if not r <= 1.0:
            diff = torch.where(out.double() == ref.double(), 0.0, (out.double() - ref.double()).abs())
            err = float(diff.nan_to_num(math.inf).max())
            raise AssertionError(f"{what} exceeds its tolerance: max |err| = {err:.3e}, "
                                 f"max err/bound = {r:.3f} (rtol {self.rtol:.3e}, atol {self.atol:.3e})")
        return r


def rescales(prof: dict, n: int) -> int:
    """T: the online-softmax rescales a key's weight passes through in this
    configuration's kernel (profiles written before the field: 32 keys each)."""
    return math.ceil(n / prof.get("keys_per_rescale", 32)) + int(prof.get("merge_rescales", 0))


def evaluate(prof: dict, *, kv_len: int, v_absmax: float, logit_absmax: float) -> Tolerance:
    """Turns a stored profile and the call's magnitudes into (rtol, atol).
    logit_absmax bounds |sm_scale| * sum_d |q_d k_d| over all query/key pairs."""
    if prof.get("bound") == "worst_case":
        return evaluate_worst_case(prof, kv_len=kv_len, v_absmax=v_absmax, logit_absmax=logit_absmax)[0]
    n = max(int(kv_len), 1)
    tiles = rescales(prof, n)
    s_log2 = _LOG2E * float(logit_absmax)
    per_v = (prof["p_rounding"] + prof.get("p_subnormal_per_key", 0.0) * n
             + prof["accumulation_per_sqrt_kv"] * math.sqrt(n)
             + prof["logit_per_s"] * s_log2 + prof["exp2"] + prof["rescale_per_sqrt_tiles"] * math.sqrt(tiles))
    return Tolerance(rtol=prof["rtol"], atol=float(v_absmax) * per_v + prof["atol_floor"])


# Split-KV: a single-request launch cuts the keys into at most kv_len / 512
# chunks (ops._launch, MIN_CHUNK_KEYS), a batch plan into at most 64.
_MAX_PIECES_BATCH, _MIN_CHUNK = 64, 512


def evaluate_worst_case(prof: dict, *, kv_len: int, v_absmax: float, logit_absmax: float) -> tuple:
    """(output Tolerance, LSE Tolerance) that hold for every rounding of a
    CUDA-core kernel, from magnitudes alone: every term of error_bound.py at its
    largest (docs/numerics-fp32.md, "The worst-case profile"). S = log2(e)*logit_absmax
    bounds every |logit| in log2 units, 2S their spread; a weight's relative
    error delta moves the output by at most delta * max|v - o| <= 2 delta vmax."""
    n = max(int(kv_len), 1)
    s = _LOG2E * float(logit_absmax)
    steps = rescales(prof, n)
    pieces = max(_MAX_PIECES_BATCH, math.ceil(n / _MIN_CHUNK)) + 4
    # Logit error (log2 units): the dot product's chain, the scaling of q (sm_scale,
    # log2 e, their product, q itself), with soft-cap tanhf and three more roundings.
    logit = U32 * s * (prof["dot_chain"] + 4 + (8 if prof.get("soft_cap") else 0) + (1 if prof.get("kv_scales") else 0))
    spread = U32 * (2 * s + 2 * logit)                  # a rounding of a difference of two logits
    delta = (_LN2 * (logit + spread) + 4 * U32           # the key's logit, s - m, exp2
             + steps * 4 * U32 + _LN2 * spread           # rescales: exp2 each, the max rises by <= 2S in all
             + prof["merge_levels"] * (4 * U32 + _LN2 * spread)
             + _LN2 * U32 * (3 * s + 4 * math.log2(n) + 6 * logit) + 4 * U32)   # the split's LSE and merge weight
    l_rel = U32 * (math.ceil(n / prof["l_chains"]) + steps + prof["l_tail"] + pieces)
    pv = U32 * (math.ceil(n / prof["pv_chains"]) + steps + 2 * prof["merge_levels"] + 4 + 2 + pieces)
    kappa = 4 * (delta + l_rel + U32 * (n + prof["head_dim_qk"] + 64))
    atol = float(v_absmax) * (2 * delta + pv + l_rel + U32 * pieces) * (1 + kappa) + prof["atol_floor"]
    lse = Tolerance(rtol=U32, atol=((delta + l_rel) / _LN2 + 2 * U32 * math.log2(n) + 2 * U32) * (1 + kappa))
    return Tolerance(rtol=prof["rtol"], atol=atol), lse


def sink_terms(kv_len: int, logit_absmax: float, sink_absmax: float | None) -> tuple[float, float]:
    """(rtol, LSE atol) that folding a sink into a finished row adds (sink_fold.cuh):
    lse' = hi + log2(1 + 2^(lo - hi)) and the output factor 2^(lse - lse').
    The sink's conversion to log2 units rounds by |s| log2 e * u; lse' by |lse'| * u
    plus exp2f / log2f (2 ulp each); the factor's exponent lse - lse' carries both,
    times ln 2, and exp2f's 2 ulp. |lse| <= S + log2(n) (S: the logit bound in log2
    units), |lse'| <= max(|lse|, |s| log2 e) + 1. Logaddexp moves by at most the
    larger of its arguments' errors, so the row's own LSE bound carries over.
    No sinks (None): (0, 0)."""
    if sink_absmax is None:
        return 0.0, 0.0
    n = max(int(kv_len), 1)
    lse_abs = _LOG2E * float(logit_absmax) + math.log2(n)
    s_abs = _LOG2E * float(sink_absmax)
    exponent = U32 * (s_abs + max(lse_abs, s_abs) + 1 + lse_abs + 8)  # lse' and lse - lse', in log2 units
    return _LN2 * exponent + 4 * U32, exponent


def evaluate_lse(prof: dict, *, kv_len: int, logit_absmax: float, sink_absmax: float | None = None) -> Tolerance:
    """Bound on the base-2 LSE (m + log2 l): the logit perturbation in log2 units,
    the relative error of l over ln 2, and the final rounding of m + log2 l; with
    sinks (sink_absmax: the largest |sink| of the call), sink_terms' as well."""
    sink_atol = sink_terms(kv_len, logit_absmax, sink_absmax)[1]
    if prof.get("bound") == "worst_case":
        t = evaluate_worst_case(prof, kv_len=kv_len, v_absmax=0.0, logit_absmax=logit_absmax)[1]
        return Tolerance(rtol=t.rtol, atol=t.atol + sink_atol)
    n = max(int(kv_len), 1)
    tiles = rescales(prof, n)
    s_log2 = _LOG2E * float(logit_absmax)
    logit = prof["logit_per_s"] * s_log2 / (2 * _LN2)          # Delta's logit part, back in log2 units
    l_rel = (prof["accumulation_per_sqrt_kv"] * math.sqrt(n) + prof["exp2"]
             + prof["rescale_per_sqrt_tiles"] * math.sqrt(tiles)) / 2
    return Tolerance(rtol=2 * U32, atol=logit + l_rel / _LN2 + 2 * U32 + sink_atol)


def measure(q, k, v, sm_scale: float) -> tuple[float, float]:
    """(v_absmax, logit_absmax) of actual inputs; the logit bound uses
    Cauchy-Schwarz: sum_d |q_d k_d| <= ||q|| ||k||."""
    v_absmax = float(v.abs().max()) if v.numel() else 0.0
    qn = float(q.float().norm(dim=-1).max()) if q.numel() else 0.0
    kn = float(k.float().norm(dim=-1).max()) if k.numel() else 0.0
    return v_absmax, abs(sm_scale) * qn * kn


def _dequantised(t, scale):
    """An FP8 (or scaled) K or V as the reference sees it: codes times scale, in float64."""
    if t is None or (float(scale) == 1.0 and not str(t.dtype).startswith("torch.float8")):
        return t
    return t.double() * float(scale)


def tolerance(spec: KernelSpec | None = None, *, op: str = "single_prefill", dtype=None, head_dim: int | None = None,
              use_tensor_cores: bool = False, kv_len: int | None = None, v_absmax: float | None = None,
              logit_absmax: float | None = None, q=None, k=None, v=None, sm_scale: float | None = None,
              dtype_kv=None, k_scale=1.0, v_scale=1.0, sinks=None) -> Tolerance:
    """The bound for a configuration and the magnitudes of a call.

    Pass a KernelSpec, or op/dtype/head_dim/use_tensor_cores (and dtype_kv for an
    FP8 cache) as the ops take them. Magnitudes: pass q, k, v (measured; an FP8
    k / v is dequantised with k_scale / v_scale first), or v_absmax (of the
    dequantised values) and optionally logit_absmax (default 4*sqrt(head_dim),
    i.e. unit-scale inputs), and kv_len. sinks: the call's attention sinks (a
    tensor or the largest |sink| as a float; -inf entries are no sink), which
    add sink_terms' relative error.
    """
    if spec is None and op in MLA_OPS:
        if dtype is None:
            raise ValueError("tolerance: pass a KernelSpec, or dtype=")
        spec = mla_spec(canonical_dtype(dtype), dtype_kv=dtype_kv)
    if spec is None:
        if dtype is None or head_dim is None:
            raise ValueError("tolerance: pass a KernelSpec, or dtype= and head_dim=")
        spec = KernelSpec.make(op, canonical_dtype(dtype), head_dim, use_tensor_cores=use_tensor_cores,
                               dtype_kv=dtype_kv)
    if sm_scale is None:
        sm_scale = 1.0 / math.sqrt(spec.head_dim_qk)
    k, v = _dequantised(k, k_scale), _dequantised(v, v_scale)
    if v is not None:
        mv, ml = measure(q if q is not None else v, k if k is not None else v, v, sm_scale)
        v_absmax = mv if v_absmax is None else v_absmax
        if logit_absmax is None and q is not None and k is not None:
            logit_absmax = ml
    if v_absmax is None:
        raise ValueError("tolerance: the bound scales with max|v|: pass v= or v_absmax=")
    if kv_len is None:
        raise ValueError("tolerance: pass kv_len= (the most keys one query attends to)")
    if logit_absmax is None:
        logit_absmax = 4.0 * math.sqrt(spec.head_dim_qk)
    bound = evaluate(profile(spec), kv_len=kv_len, v_absmax=v_absmax, logit_absmax=logit_absmax)
    sink_rtol = sink_terms(kv_len, logit_absmax, sink_absmax(sinks))[0]
    return Tolerance(rtol=bound.rtol + sink_rtol, atol=bound.atol) if sink_rtol else bound


def sink_absmax(sinks) -> float | None:
    """The largest finite |sink| of a call's sinks (a tensor or a number; None: no sinks)."""
    if sinks is None:
        return None
    if not hasattr(sinks, "double"):
        return abs(float(sinks))
    finite = sinks.double()[sinks.double().isfinite()]
    return float(finite.abs().max()) if finite.numel() else 0.0


def measure_mla(q_nope, q_pe, ckv, kpe, sm_scale: float) -> tuple[float, float]:
    """(v_absmax, logit_absmax) of MLA inputs: V is ckv, a key is [ckv | kpe] and
    a query [q_nope | q_pe] (576 wide), the logit bound by Cauchy-Schwarz as measure()."""
    import torch

    q = torch.cat([q_nope.float(), q_pe.float()], dim=-1)
    k = torch.cat([ckv.float().reshape(-1, ckv.shape[-1]), kpe.float().reshape(-1, kpe.shape[-1])], dim=-1)
    return measure(q, k, ckv, sm_scale)


def mla_tolerance(dtype, *, kv_len: int, q_nope=None, q_pe=None, ckv=None, kpe=None, sm_scale: float | None = None,
                  v_absmax: float | None = None, logit_absmax: float | None = None,
                  backend: str = "fa2", dtype_kv=None, ckv_scale=1.0, kpe_scale=1.0) -> Tolerance:
    """The bound of the mla_paged kernel of `backend`: the model above with D =
    576 (Q.K^T over [ckv | kpe]) and vmax = max|ckv|. Magnitudes measured from
    the tensors (the whole caches: an upper bound) or given. An FP8 cache
    (dtype_kv; ckv / kpe its codes): its values are codes x ckv_scale and codes
    x kpe_scale, which the magnitudes are measured on."""
    spec = mla_spec(canonical_dtype(dtype), backend=backend,
                    dtype_kv=canonical_dtype(dtype_kv) if dtype_kv is not None else None)
    ckv, kpe = _dequantised(ckv, ckv_scale), _dequantised(kpe, kpe_scale)
    if ckv is not None:
        if sm_scale is None:
            raise ValueError("mla_tolerance: pass the sm_scale the wrapper was planned with")
        mv, ml = measure_mla(q_nope, q_pe, ckv, kpe, sm_scale)
        v_absmax = mv if v_absmax is None else v_absmax
        logit_absmax = ml if logit_absmax is None else logit_absmax
    return tolerance(spec, kv_len=kv_len, v_absmax=v_absmax, logit_absmax=logit_absmax)
