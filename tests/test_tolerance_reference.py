"""The float64 reference against hand-computed cases, and the error model:
its coefficients, its arithmetic, and its soundness for the kernels' arithmetic
emulated on the CPU (no GPU, no nvcc)."""

from __future__ import annotations

import math
import zlib

import pytest
import torch

import flashjit
from flashjit.error_model import Tolerance, evaluate, measure, profile, rescales
from flashjit.reference import attention_reference, ragged_reference
from flashjit.spec import KernelSpec

LOG2E = 1.0 / math.log(2.0)
DTYPES = [torch.float16, torch.bfloat16, torch.float32]
# (dtype, use_tensor_cores) pairs that exist: fp32 runs on CUDA cores only.
PATHS = [pytest.param(d, tc, id=f"{str(d).removeprefix('torch.')}-{'tc' if tc else 'cc'}")
         for d in DTYPES for tc in (False, True) if not (tc and d == torch.float32)]
U = {torch.float16: 2.0**-11, torch.bfloat16: 2.0**-8, torch.float32: 2.0**-24}


def t64(values) -> torch.Tensor:
    return torch.tensor(values, dtype=torch.float64)


# ---------------------------------------------------------------------------
# attention_reference on cases computed by hand


def test_single_key_outputs_its_value():
    q = torch.randn(3, 2, 64, dtype=torch.float64)
    k = torch.randn(1, 2, 64, dtype=torch.float64)
    v = torch.randn(1, 2, 64, dtype=torch.float64)
    out, lse = attention_reference(q, k, v)
    torch.testing.assert_close(out, v.expand(3, 2, 64), rtol=0, atol=1e-15)
    logits = torch.einsum("qhd,khd->qh", q, k) / 8.0
    torch.testing.assert_close(lse, logits * LOG2E, rtol=1e-14, atol=1e-14)


def test_equal_logits_average_the_values():
    q = torch.randn(4, 1, 64, dtype=torch.float64)
    k = torch.randn(1, 1, 64, dtype=torch.float64).expand(2, 1, 64).contiguous()  # two identical keys
    v = torch.randn(2, 1, 64, dtype=torch.float64)
    out, lse = attention_reference(q, k, v)
    torch.testing.assert_close(out, v.mean(0, keepdim=True).expand(4, 1, 64), rtol=0, atol=1e-15)
    logit = torch.einsum("qhd,hd->qh", q, k[0]) / 8.0
    torch.testing.assert_close(lse, logit * LOG2E + 1.0, rtol=1e-14, atol=1e-14)  # log2(2 e^s) = s log2 e + 1


def test_two_keys_weights_and_lse_base_2():
    # head_dim 1, sm_scale 1: logits are q*k exactly.
    q, k = t64([[[1.0]]]), t64([[[2.0]], [[0.5]]])
    v = t64([[[10.0]], [[-4.0]]])
    out, lse = attention_reference(q, k, v, sm_scale=1.0)
    w0 = math.exp(2.0) / (math.exp(2.0) + math.exp(0.5))
    assert out.item() == pytest.approx(10.0 * w0 - 4.0 * (1 - w0), rel=1e-14)
    assert lse.item() == pytest.approx(math.log2(math.exp(2.0) + math.exp(0.5)), rel=1e-14)


def _uniform_case(qo_len: int, kv_len: int):
    """q = 0: every visible key has logit 0, so the output is the mean of the
    visible values; v = identity rows make the visible set readable."""
    q = torch.zeros(qo_len, 1, kv_len, dtype=torch.float64)
    k = torch.randn(kv_len, 1, kv_len, dtype=torch.float64)
    v = torch.eye(kv_len, dtype=torch.float64)[:, None, :]
    return q, k, v


def _expected_from_visible(visible: list[list[int]], kv_len: int):
    out = torch.zeros(len(visible), 1, kv_len, dtype=torch.float64)
    lse = torch.full((len(visible), 1), -math.inf, dtype=torch.float64)
    for i, keys in enumerate(visible):
        if keys:
            out[i, 0, keys] = 1.0 / len(keys)
            lse[i, 0] = math.log2(len(keys))
    return out, lse


def test_causal_is_bottom_right_aligned():
    # qo_len 2, kv_len 5: query i sees keys j <= i + 3.
    q, k, v = _uniform_case(2, 5)
    out, lse = attention_reference(q, k, v, causal=True)
    exp_out, exp_lse = _expected_from_visible([[0, 1, 2, 3], [0, 1, 2, 3, 4]], 5)
    torch.testing.assert_close(out, exp_out, rtol=0, atol=1e-15)
    torch.testing.assert_close(lse, exp_lse, rtol=0, atol=1e-14)


def test_causal_with_more_queries_than_keys_masks_whole_rows():
    # qo_len 4, kv_len 2: offset -2; queries 0 and 1 see nothing -> output 0, LSE -inf.
    q, k, v = _uniform_case(4, 2)
    out, lse = attention_reference(q, k, v, causal=True)
    exp_out, exp_lse = _expected_from_visible([[], [], [0], [0, 1]], 2)
    torch.testing.assert_close(out, exp_out, rtol=0, atol=1e-15)
    assert torch.isneginf(lse[:2]).all()
    torch.testing.assert_close(lse[2:], exp_lse[2:], rtol=0, atol=1e-14)
    assert not torch.isnan(out).any()


@pytest.mark.parametrize("causal", [False, True])
def test_sliding_window(causal):
    # qo_len 3, kv_len 6, window_left 1: query i sees j >= i + 3 - 1 (and j <= i + 3 if causal).
    q, k, v = _uniform_case(3, 6)
    out, lse = attention_reference(q, k, v, causal=causal, window_left=1)
    if causal:
        visible = [[2, 3], [3, 4], [4, 5]]
    else:
        visible = [[2, 3, 4, 5], [3, 4, 5], [4, 5]]
    exp_out, exp_lse = _expected_from_visible(visible, 6)
    torch.testing.assert_close(out, exp_out, rtol=0, atol=1e-15)
    torch.testing.assert_close(lse, exp_lse, rtol=0, atol=1e-14)


def test_window_left_zero_sees_only_the_diagonal_key():
    q, k, v = _uniform_case(3, 3)
    out, _ = attention_reference(q, k, v, causal=True, window_left=0)
    torch.testing.assert_close(out, v.transpose(0, 1).squeeze(0)[:, None, :], rtol=0, atol=1e-15)


def test_soft_cap():
    cap = 2.0
    q, k = t64([[[3.0]]]), t64([[[1.0]], [[-0.5]]])
    v = t64([[[1.0]], [[0.0]]])
    out, lse = attention_reference(q, k, v, sm_scale=1.0, logits_soft_cap=cap)
    s0, s1 = cap * math.tanh(3.0 / cap), cap * math.tanh(-1.5 / cap)
    assert out.item() == pytest.approx(math.exp(s0) / (math.exp(s0) + math.exp(s1)), rel=1e-14)
    assert lse.item() == pytest.approx(math.log2(math.exp(s0) + math.exp(s1)), rel=1e-14)
    # The cap bounds the logits: a huge logit no longer dominates.
    out_big, _ = attention_reference(t64([[[1000.0]]]), k, v, sm_scale=1.0, logits_soft_cap=cap)
    assert out_big.item() == pytest.approx(math.exp(cap) / (math.exp(cap) + math.exp(-cap)), rel=1e-12)


def test_empty_kv_gives_zeros_and_minus_inf_lse():
    q = torch.randn(3, 4, 64, dtype=torch.float64)
    k = torch.empty(0, 2, 64, dtype=torch.float64)
    out, lse = attention_reference(q, k, k)
    assert out.shape == (3, 4, 64) and lse.shape == (3, 4)
    assert (out == 0).all()
    assert torch.isneginf(lse).all()


def test_gqa_equals_repeated_kv_heads():
    q = torch.randn(5, 6, 32, dtype=torch.float64)
    k = torch.randn(7, 2, 32, dtype=torch.float64)
    v = torch.randn(7, 2, 32, dtype=torch.float64)
    out, lse = attention_reference(q, k, v)
    out_rep, lse_rep = attention_reference(q, k.repeat_interleave(3, dim=1), v.repeat_interleave(3, dim=1))
    torch.testing.assert_close(out, out_rep, rtol=0, atol=0)
    torch.testing.assert_close(lse, lse_rep, rtol=0, atol=0)
    # Query head h uses KV head h // group (FlashInfer's mapping), checked head by head.
    for h in range(6):
        o_h, _ = attention_reference(q[:, h:h + 1], k[:, h // 3:h // 3 + 1], v[:, h // 3:h // 3 + 1])
        torch.testing.assert_close(out[:, h:h + 1], o_h, rtol=1e-14, atol=1e-14)


def test_hnd_equals_nhd_transposed():
    q = torch.randn(4, 4, 64, dtype=torch.float64)
    k = torch.randn(9, 2, 64, dtype=torch.float64)
    v = torch.randn(9, 2, 64, dtype=torch.float64)
    nhd = attention_reference(q, k, v, causal=True)
    hnd = attention_reference(q, k.transpose(0, 1).contiguous(), v.transpose(0, 1).contiguous(), causal=True,
                              kv_layout="HND")
    for a, b in zip(nhd, hnd):
        torch.testing.assert_close(a, b, rtol=0, atol=0)


def test_lse_is_base_2_and_sm_scale_applies():
    q = torch.randn(2, 1, 16, dtype=torch.float64)
    k = torch.randn(5, 1, 16, dtype=torch.float64)
    v = torch.randn(5, 1, 16, dtype=torch.float64)
    _, lse = attention_reference(q, k, v, sm_scale=0.3)
    logits = torch.einsum("qhd,khd->qhk", q, k) * 0.3
    torch.testing.assert_close(lse, torch.logsumexp(logits, -1) / math.log(2.0), rtol=1e-14, atol=1e-14)


def test_reference_takes_rounded_inputs_exactly():
    """ref is computed from the already rounded inputs, not from fp32 originals."""
    q = torch.randn(3, 2, 64).to(torch.bfloat16)
    k = torch.randn(6, 2, 64).to(torch.bfloat16)
    v = torch.randn(6, 2, 64).to(torch.bfloat16)
    out, lse = attention_reference(q, k, v)
    out64, lse64 = attention_reference(q.double(), k.double(), v.double())
    assert out.dtype == torch.float64 and lse.dtype == torch.float64
    torch.testing.assert_close(out, out64, rtol=0, atol=0)
    torch.testing.assert_close(lse, lse64, rtol=0, atol=0)


def test_ragged_reference_is_per_request():
    qo, kv = [0, 2, 2, 7], [0, 5, 9, 12]
    q = torch.randn(7, 2, 32, dtype=torch.float64)
    k = torch.randn(12, 1, 32, dtype=torch.float64)
    v = torch.randn(12, 1, 32, dtype=torch.float64)
    out, lse = ragged_reference(q, k, v, qo, kv, causal=True)
    for b in range(3):
        o, l_ = attention_reference(q[qo[b]:qo[b + 1]], k[kv[b]:kv[b + 1]], v[kv[b]:kv[b + 1]], causal=True)
        torch.testing.assert_close(out[qo[b]:qo[b + 1]], o, rtol=0, atol=0)
        torch.testing.assert_close(lse[qo[b]:qo[b + 1]], l_, rtol=0, atol=0)


# ---------------------------------------------------------------------------
# The error model's coefficients


@pytest.mark.parametrize("dtype,users_atol", [(torch.bfloat16, 1e-2), (torch.float16, 1e-3)], ids=str)
@pytest.mark.parametrize("op", ["single_prefill", "single_decode", "batch_prefill_ragged"])
def test_tensor_core_profile_reproduces_users_numbers(dtype, users_atol, op):
    """Tensor-core paths at head_dim 128, max|v| ~ 4: atol ~1e-2 in bf16 and ~1e-3
    in fp16, the numbers users found by trial (within a factor 3), besides fp16's
    term for weights below its normal range (kv_len * 2^-25 * max|v|, 4.9e-4 at
    4096 keys), which inputs like theirs (logits within a few units) do not reach
    and which the sink input at 131072 keys does (docs/numerics.md, P rounding)."""
    for kv_len in (128, 1024, 4096):
        tol = flashjit.tolerance(op=op, dtype=dtype, head_dim=128, use_tensor_cores=True, kv_len=kv_len,
                                 v_absmax=4.0)
        subnormal = kv_len * 2.0**-25 * 4.0 if dtype == torch.float16 else 0.0
        assert users_atol / 3 <= tol.atol - subnormal <= users_atol * 3, (kv_len, tol)


def test_two_paths_allow_what_users_saw_between_varlen_and_kv_cache():
    """The brief's third report: bf16 varlen attention against attention on a KV
    cache, mean difference ~1e-5 and max 0.125 (one bf16 ulp of an output in
    [16, 32)). The sum of the two paths' profiles allows that at such an output
    (no bug, by the model), and with unit inputs (max|v| ~ 4) it is ~2e-2."""
    def paths(v_absmax: float):
        ragged, paged = (flashjit.tolerance(op=op, dtype=torch.bfloat16, head_dim=128, use_tensor_cores=True,
                                            kv_len=4096, v_absmax=v_absmax)
                         for op in ("batch_prefill_ragged", "batch_prefill_paged"))
        return ragged + paged

    large = paths(32.0)
    assert large.atol + large.rtol * 16.0 >= 0.125
    assert 1e-2 <= paths(4.0).atol <= 4e-2


@pytest.mark.parametrize("dtype,tensor_cores", PATHS)
def test_rtol_is_output_rounding_plus_a_few_fp32_roundings(dtype, tensor_cores):
    """rtol = u_out + c * 2^-24: the output rounding, plus the fp32 roundings of the
    final 1/l multiply (and of the split-KV merge), c a small whole number."""
    tol = flashjit.tolerance(dtype=dtype, head_dim=128, use_tensor_cores=tensor_cores, kv_len=100, v_absmax=1.0)
    c = (tol.rtol - U[dtype]) / 2.0**-24
    assert c == int(c) and 2 <= c <= 8, f"rtol = u_out + {c} * 2^-24"
    assert tol.rtol == profile(KernelSpec.make("single_decode", dtype, 64))["rtol"], "rtol depends on dtype only"


@pytest.mark.parametrize("head_dim", [64, 128, 256])
def test_p_rounding_term_is_8x_larger_in_bf16(head_dim):
    bf16 = profile(KernelSpec.make("single_prefill", "bfloat16", head_dim, use_tensor_cores=True))
    fp16 = profile(KernelSpec.make("single_prefill", "float16", head_dim, use_tensor_cores=True))
    assert bf16["p_rounding"] / fp16["p_rounding"] == 8.0
    assert bf16["p_rounding"] == 2.0**-8
    for spec in (KernelSpec.make("single_prefill", d, head_dim) for d in ("float16", "bfloat16", "float32")):
        assert profile(spec)["p_rounding"] == 0.0, "CUDA cores keep P in fp32"


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=str)
def test_tensor_core_and_cuda_core_bounds(dtype):
    """Tensor cores: the sqrt(n) accumulation model plus P rounded to the input
    dtype (u_in * vmax); CUDA cores (fp32 arithmetic whatever the dtypes): the
    worst case over every rounding, from the same magnitudes. Both round the
    output alike (one rtol)."""
    kw = dict(dtype=dtype, head_dim=128, kv_len=2048, v_absmax=3.0)
    tc = flashjit.tolerance(use_tensor_cores=True, **kw)
    cc = flashjit.tolerance(use_tensor_cores=False, **kw)
    assert tc.rtol == cc.rtol
    profiles = {c: profile(KernelSpec.make("single_prefill", dtype, 128, use_tensor_cores=c)) for c in (True, False)}
    sqrt_t = math.sqrt(rescales(profiles[True], 2048))
    sqrt_part = (profiles[True]["accumulation_per_sqrt_kv"] * math.sqrt(2048) + profiles[True]["exp2"]
                 + profiles[True]["rescale_per_sqrt_tiles"] * sqrt_t)
    assert tc.atol >= 3.0 * (U[dtype] + sqrt_part)
    assert profiles[False]["bound"] == "worst_case" and "bound" not in profiles[True]
    worst = evaluate(profiles[False], kv_len=2048, v_absmax=3.0, logit_absmax=4.0 * math.sqrt(128))
    assert (cc.rtol, cc.atol) == (worst.rtol, worst.atol)
    # Two paths may differ by the sum of their bounds.
    both = tc + cc
    assert (both.rtol, both.atol) == (tc.rtol + cc.rtol, tc.atol + cc.atol)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_bound_grows_with_kv_len_head_dim_vmax_and_logits(dtype):
    base = dict(dtype=dtype, head_dim=128, kv_len=1024, v_absmax=1.0, logit_absmax=10.0)
    t0 = flashjit.tolerance(**base).atol
    assert flashjit.tolerance(**{**base, "kv_len": 8192}).atol > t0
    assert flashjit.tolerance(**{**base, "head_dim": 256}).atol > t0
    assert flashjit.tolerance(**{**base, "logit_absmax": 40.0}).atol > t0
    t_v2 = flashjit.tolerance(**{**base, "v_absmax": 2.0}).atol
    floor = profile(KernelSpec.make("single_prefill", dtype, 128))["atol_floor"]
    assert t_v2 - floor == pytest.approx(2 * (t0 - floor), rel=1e-12), "atol scales linearly with max|v|"


def test_tolerance_measures_magnitudes_from_tensors():
    q = torch.randn(16, 2, 64).to(torch.bfloat16)
    k = torch.randn(300, 2, 64).to(torch.bfloat16)
    v = (torch.randn(300, 2, 64) * 3).to(torch.bfloat16)
    tol = flashjit.tolerance(dtype=torch.bfloat16, head_dim=64, q=q, k=k, v=v, kv_len=300)
    vmax, logit = measure(q, k, v, 1 / 8)
    assert vmax == float(v.abs().max())
    assert logit == pytest.approx(float(q.float().norm(dim=-1).max() * k.float().norm(dim=-1).max()) / 8)
    expected = evaluate(profile(KernelSpec.make("single_prefill", "bfloat16", 64)), kv_len=300, v_absmax=vmax,
                        logit_absmax=logit)
    assert tol == expected


def test_tolerance_needs_magnitudes():
    with pytest.raises(ValueError, match="v_absmax"):
        flashjit.tolerance(dtype="bfloat16", head_dim=128, kv_len=10)
    with pytest.raises(ValueError, match="kv_len"):
        flashjit.tolerance(dtype="bfloat16", head_dim=128, v_absmax=1.0)
    with pytest.raises(ValueError, match="dtype"):
        flashjit.tolerance(head_dim=128, v_absmax=1.0, kv_len=10)


def test_tolerance_sum_and_bound():
    a, b = Tolerance(rtol=2.0**-10, atol=2.0**-12), Tolerance(rtol=2.0**-11, atol=2.0**-13)
    s = a + b
    assert s == Tolerance(rtol=3 * 2.0**-11, atol=3 * 2.0**-13)
    ref = t64([0.0, -2.0, 4.0])
    torch.testing.assert_close(s.bound(ref), s.atol + s.rtol * t64([0.0, 2.0, 4.0]), rtol=0, atol=0)
    assert (a + b) + a == Tolerance(rtol=a.rtol * 2 + b.rtol, atol=a.atol * 2 + b.atol)


def test_tolerance_ratio():
    tol = Tolerance(rtol=0.01, atol=0.1)
    ref = t64([1.0, -2.0, 0.0])
    assert tol.ratio(ref, ref) == 0.0
    assert tol.ratio(ref + t64([0.055, 0.0, 0.0]), ref) == pytest.approx(0.5)          # 0.055 / 0.11
    assert tol.ratio(ref + t64([0.0, 0.24, 0.0]), ref) == pytest.approx(2.0)           # 0.24 / 0.12
    assert tol.ratio(torch.empty(0), torch.empty(0)) == 0.0


@pytest.mark.parametrize("bad", [math.nan, math.inf, -math.inf])
def test_tolerance_ratio_flags_nan_and_inf_as_inf(bad):
    tol = Tolerance(rtol=0.01, atol=0.1)
    ref = t64([1.0, 2.0])
    out = t64([1.0, bad])
    assert tol.ratio(out, ref) == math.inf
    with pytest.raises(AssertionError, match="exceeds its tolerance"):
        tol.assert_close(out, ref)


def test_tolerance_ratio_accepts_matching_infinities_and_assert_close_reports():
    tol = Tolerance(rtol=0.01, atol=0.1)
    lse_ref = t64([-math.inf, 3.0])
    assert tol.ratio(t64([-math.inf, 3.05]), lse_ref) == pytest.approx(0.05 / 0.13)
    assert tol.assert_close(t64([1.0]), t64([1.05])) == pytest.approx(0.05 / 0.1105)
    with pytest.raises(AssertionError) as info:
        tol.assert_close(t64([1.0]), t64([2.0]), what="o[3]")
    assert "o[3]" in str(info.value) and "1.000e+00" in str(info.value)


# ---------------------------------------------------------------------------
# Soundness: the kernels' arithmetic emulated on the CPU stays within the bound


def emulate_kernel(q, k, v, *, causal: bool, tensor_cores: bool, soft_cap: float | None = None,
                   sm_scale: float | None = None) -> torch.Tensor:
    """fp32 emulation of the generated kernels (MHA, NHD): q pre-scaled by
    sm_scale*log2(e) in fp32 (by sm_scale alone with a soft-cap, applied as
    cap*tanh(s/cap)*log2(e) in fp32), fp32 logits, exp2, online softmax over 32-key
    tiles with per-lane partial row sums (summed at the end), fp32 P.V
    accumulation, output = acc * (1/l) rounded to the dtype. tensor_cores=True
    rounds P to the input dtype before P.V (the row sum keeps fp32 P), like the
    fa2 kernels."""
    qo_len, heads, dim = q.shape
    kv_len = k.shape[0]
    sm_scale = 1.0 / math.sqrt(dim) if sm_scale is None else sm_scale
    f32 = torch.float32
    log2e = torch.tensor(LOG2E, dtype=f32)
    scale = torch.tensor(sm_scale, dtype=f32) * (1 if soft_cap else log2e)
    qs = (q.float() * scale).transpose(0, 1)                       # [H, qo, D] fp32
    logits = torch.matmul(qs, k.float().permute(1, 2, 0))          # [H, qo, kv] fp32 dot products
    if soft_cap:
        cap = torch.tensor(soft_cap, dtype=f32)
        logits = cap * torch.tanh(logits / cap) * log2e
    if causal:
        i = torch.arange(qo_len)[:, None]
        j = torch.arange(kv_len)[None, :]
        logits = logits.masked_fill(~(j <= i + kv_len - qo_len), -math.inf)
    vf = v.float().transpose(0, 1)                                 # [H, kv, D]
    m = torch.full((heads, qo_len, 1), -math.inf)
    lane_l = torch.zeros(heads, qo_len, 32)
    acc = torch.zeros(heads, qo_len, dim)
    for t0 in range(0, kv_len, 32):
        s = logits[..., t0:t0 + 32]
        vt = vf[:, t0:t0 + 32]
        if s.shape[-1] < 32:                                        # zero-filled, masked tail of the last tile
            pad = 32 - s.shape[-1]
            s = torch.cat([s, torch.full((heads, qo_len, pad), -math.inf)], -1)
            vt = torch.cat([vt, torch.zeros(heads, pad, dim)], 1)
        m_new = torch.maximum(m, s.amax(-1, keepdim=True))
        dead = m_new == -math.inf
        base = torch.where(dead, torch.zeros_like(m_new), m_new)
        rescale = torch.where(dead, torch.zeros_like(m_new), torch.exp2(m - base))
        p = torch.where(dead, torch.zeros_like(s), torch.exp2(s - base))
        m = m_new
        lane_l = lane_l * rescale + p
        p_pv = p.to(q.dtype).float() if tensor_cores else p
        acc = acc * rescale + torch.matmul(p_pv, vt)
    l_sum = lane_l.sum(-1, keepdim=True)
    inv_l = torch.where(l_sum > 0, 1.0 / l_sum, torch.zeros_like(l_sum))
    return (acc * inv_l).transpose(0, 1).to(q.dtype)


def make_inputs(kind: str, dtype, qo_len: int, kv_len: int, heads: int, dim: int, seed: int):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(qo_len, heads, dim, generator=g)
    k = torch.randn(kv_len, heads, dim, generator=g)
    v = torch.randn(kv_len, heads, dim, generator=g)
    if kind == "peaked_outliers":
        q = q * 8                                                   # peaked softmax
        outliers = torch.rand(kv_len, heads, dim, generator=g) < 0.01
        v = torch.where(outliers, v * 20, v)                        # 1% of V x20
    return q.to(dtype), k.to(dtype), v.to(dtype)


_WORST: dict[tuple, float] = {}


@pytest.fixture
def one_thread():
    """The emulation is many small fp32 ops: one intra-op thread avoids thread
    hand-off stalls on a busy 2-core CI machine (and changes no result)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.mark.parametrize("kind", ["randn", "peaked_outliers"])
@pytest.mark.parametrize("soft_cap", [None, 30.0], ids=["nocap", "softcap30"])
@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
@pytest.mark.parametrize("head_dim", [64, 128, 256])
@pytest.mark.parametrize("dtype,tensor_cores", PATHS)
def test_emulated_kernel_error_is_within_tolerance(one_thread, dtype, tensor_cores, head_dim, causal, soft_cap,
                                                   kind):
    qo_len, kv_len, heads = 40, 1000, 2                             # kv_len: 31 full tiles and a partial one
    seed = zlib.crc32(f"{dtype}-{tensor_cores}-{head_dim}-{causal}-{soft_cap}-{kind}".encode())
    q, k, v = make_inputs(kind, dtype, qo_len, kv_len, heads, head_dim, seed)
    out = emulate_kernel(q, k, v, causal=causal, tensor_cores=tensor_cores, soft_cap=soft_cap)
    ref, _ = attention_reference(q, k, v, causal=causal, logits_soft_cap=soft_cap)
    spec = KernelSpec.make("single_prefill", dtype, head_dim, use_tensor_cores=tensor_cores, causal=causal,
                           soft_cap=soft_cap is not None)
    tol = flashjit.tolerance(spec, q=q, k=k, v=v, kv_len=kv_len)
    ratio = tol.ratio(out, ref)
    max_err = float((out.double() - ref).abs().max())
    print(f"\n{spec.name} {kind}: max err {max_err:.3e}, max err/bound {ratio:.3f} "
          f"(rtol {tol.rtol:.2e}, atol {tol.atol:.2e})")
    key = (dtype, tensor_cores)
    _WORST[key] = max(_WORST.get(key, 0.0), ratio)
    assert ratio <= 1.0, f"emulated kernel error exceeds the profile: err/bound {ratio:.3f}"
    assert max_err > 0, "the emulation must actually round something"


@pytest.mark.parametrize("dtype,tensor_cores", [
    (torch.float16, False), (torch.bfloat16, False), (torch.float16, True), (torch.bfloat16, True),
    pytest.param(torch.float32, False, marks=pytest.mark.xfail(
        strict=True, reason="fp32's (rtol, atol) profile is the worst case over all inputs of these magnitudes "
                            "(inputs that make the roundings coherent reach it); the data-dependent bound "
                            "(tests/test_fp32_bound.py) is within 20x here")),
], ids=["f16-cc", "bf16-cc", "f16-tc", "bf16-tc", "f32-cc"])
def test_bound_is_tight_on_peaked_inputs(one_thread, dtype, tensor_cores):
    """The bound stays within 20x of the worst error seen on peaked/outlier inputs."""
    worst = 0.0
    for head_dim in (64, 128):
        q, k, v = make_inputs("peaked_outliers", dtype, 40, 1000, 2, head_dim, seed=1234 + head_dim)
        out = emulate_kernel(q, k, v, causal=False, tensor_cores=tensor_cores)
        ref, _ = attention_reference(q, k, v)
        tol = flashjit.tolerance(dtype=dtype, head_dim=head_dim, use_tensor_cores=tensor_cores, q=q, k=k, v=v,
                                 kv_len=1000)
        worst = max(worst, tol.ratio(out, ref))
    print(f"\n{dtype} {'tc' if tensor_cores else 'cc'}: worst err/bound on peaked inputs {worst:.4f}")
    assert worst <= 1.0
    assert worst >= 1 / 20, f"bound is {1 / worst:.0f}x the worst observed error"


def test_report_worst_ratios(capsys):
    """Prints the worst err/bound per (dtype, path) seen by the emulation sweep above."""
    if not _WORST:
        pytest.skip("the emulation sweep did not run in this pytest run")
    with capsys.disabled():
        print("\nworst emulated err/bound:", ", ".join(
            f"{str(d).removeprefix('torch.')} {'tc' if tc else 'cc'} {r:.3f}" for (d, tc), r in sorted(
                _WORST.items(), key=str)))
    assert all(r <= 1.0 for r in _WORST.values())


def test_fp16_tensor_core_bound_covers_one_way_subnormal_weights():
    """The sink input (one key of weight 1, every other 2^-24.5 of it, over a
    constant V): fp16 rounds each small weight up to 2^-24, while l sums the
    unrounded ones, so o drifts by (1 + (n-1) 2^-24) / (1 + (n-1) 2^-24.5) - 1
    of |v|, all one way. Measured on an H200 through unsplit 131072-key chains
    (benchmarks/results/2026-11-25-h200-one-way-roundings.md): 5.86e-3 at max|v|
    about 2.5, 1.67x the bound before the subnormal term."""
    for n in (32768, 131072):
        drift = (1 + (n - 1) * 2.0**-24) / (1 + (n - 1) * 2.0**-24.5) - 1
        for op in ("single_prefill", "batch_prefill_ragged", "single_decode"):
            tol = flashjit.tolerance(op=op, dtype=torch.float16, head_dim=128, use_tensor_cores=True, kv_len=n,
                                     v_absmax=1.0, logit_absmax=24.5 * math.log(2.0) * 128**0.5)
            assert drift <= tol.atol + tol.rtol, (op, n, drift, tol)
