"""The CUDA-core attention kernels' fp32 arithmetic, emulated on the CPU in the
kernels' own order of operations (templates/include/flashjit/cuda_core/ and
common/merge_states.cuh), so that error bounds can be checked without a GPU.

Values are float64 tensors that hold fp32 numbers: every kernel operation is
done in float64 and rounded to fp32 (f32). A product of two fp32 numbers is
exact in float64, so fma(a, b, c) = f32(a*b + c) rounds twice (to 53 bits,
then to 24); it differs from a true fma only where the float64 sum lands on an
fp32 rounding midpoint, and then by one fp32 ulp.

Where the kernels call exp2f, log2f, tanhf or ex2.approx (documented to
2 ulp, 1 ulp, 2 ulp and 2 ulp), the emulation rounds the exact value and, with
a jitter generator, moves it by a random whole number of ulps within that
bound: the bound under test must hold for any result the hardware may return.
exp2 of exactly 0 stays 1 (the rescale of a tile whose max did not move).
"""

from __future__ import annotations

import math

import torch

F64 = torch.float64
LOG2E = 1.0 / math.log(2.0)
NEG_INF = -math.inf


def f32(x: torch.Tensor) -> torch.Tensor:
    return x.to(torch.float32).to(F64)


def fma(a, b, c):
    return f32(a * b + c)


def _ulp(y: torch.Tensor) -> torch.Tensor:
    mag = y.abs().clamp_min(2.0**-126)
    return torch.exp2(torch.floor(torch.log2(mag)) - 23)


class Jitter:
    """Random moves of a math function's result by up to `ulps` ulps."""

    def __init__(self, seed: int, ulps: int = 2):
        self.g = torch.Generator().manual_seed(seed)
        self.ulps = ulps

    def __call__(self, y: torch.Tensor, ulps: int | None = None) -> torch.Tensor:
        k = torch.randint(-(ulps or self.ulps), (ulps or self.ulps) + 1, y.shape, generator=self.g).to(F64)
        moved = y + k * _ulp(y)
        return torch.where(torch.isfinite(y) & (y != 0), moved, y)


def exp2f(x: torch.Tensor, jitter: Jitter | None, ftz: bool = False) -> torch.Tensor:
    y = f32(torch.exp2(x))
    if jitter is not None:
        y = torch.where(x == 0, y, jitter(y))
    if ftz:
        y = torch.where(y < 2.0**-126, torch.zeros_like(y), y)
    return y


def exp2_diff(a, b, jitter):
    """exp2_diff in numeric.cuh: 0 where b is -inf, else exp2f(a - b)."""
    dead = b == NEG_INF
    safe_b = torch.where(dead, torch.zeros_like(b), b)
    return torch.where(dead, torch.zeros_like(a), exp2f(f32(a - safe_b), jitter))


def log2f(x, jitter):
    y = f32(torch.log2(x))
    return jitter(y, 1) if jitter is not None else y


def to_dtype(x: torch.Tensor, dtype) -> torch.Tensor:
    return x.to(torch.float32).to(dtype)


def _scaled_q(q, sm_scale, soft_cap):
    """q pre-scaled in fp32 by sm_scale*log2(e) (by sm_scale alone with a soft-cap)."""
    scale = f32(torch.tensor(sm_scale, dtype=F64))
    if not soft_cap:
        scale = f32(scale * f32(torch.tensor(LOG2E, dtype=F64)))
    return f32(q.to(F64) * scale)


def _soft_cap(s, cap, jitter):
    """cap * tanhf(s / cap) * log2(e), each step rounded to fp32."""
    cap_t = torch.tensor(cap, dtype=F64)
    t = f32(torch.tanh(f32(s / cap_t)))
    if jitter is not None:
        t = jitter(t)
    return f32(f32(cap_t * t) * f32(torch.tensor(LOG2E, dtype=F64)))


def _visible(qo_len, kv_len, causal, window_left):
    i = torch.arange(qo_len)[:, None]
    j = torch.arange(kv_len)[None, :]
    ok = torch.ones(qo_len, kv_len, dtype=torch.bool)
    if causal:
        ok &= j <= i + kv_len - qo_len
    if window_left is not None and window_left >= 0:
        ok &= j >= i + kv_len - qo_len - window_left
    return ok


def _splits(kv_len: int, kv_chunk: int) -> list[tuple[int, int]]:
    if not kv_chunk or kv_chunk >= kv_len:
        return [(0, kv_len)]
    return [(b, min(b + kv_chunk, kv_len)) for b in range(0, kv_len, kv_chunk)]


def merge_states(states, jitter):
    """merge_split_states_kernel (four warps, the partial rows strided over them):
    states [(o [..., D], lse [...])] -> (o, lse), both fp32."""
    m = torch.stack([s[1] for s in states]).amax(0)
    warp_acc, warp_sum = [], []
    for w in range(4):
        acc = torch.zeros_like(states[0][0])
        total = torch.zeros_like(m)
        for o_s, lse_s in states[w::4]:
            wt = exp2_diff(lse_s, m, jitter)
            total = f32(total + wt)
            acc = fma(wt[..., None], o_s, acc)
        warp_acc.append(acc)
        warp_sum.append(total)
    acc, total = warp_acc[0], warp_sum[0]
    for w in range(1, 4):
        total = f32(total + warp_sum[w])
        acc = f32(acc + warp_acc[w])
    inv = torch.where(total > 0, f32(1.0 / total.clamp_min(1e-300)), torch.zeros_like(total))
    lse = torch.where(total > 0, f32(m + log2f(total.clamp_min(1e-300), jitter)), torch.full_like(m, NEG_INF))
    return f32(acc * inv[..., None]), lse


def prefill(q, k, v, *, causal=False, sm_scale=None, window_left=-1, soft_cap=None, kv_chunk=0, jitter=None):
    """cuda_core_attention.cuh on one request: q [qo, H, D], k/v [kv, Hkv, D]
    -> (o [qo, H, D] in q's dtype, lse [qo, H] fp32). Each split of kv_chunk keys
    runs the tile loop from zero and writes fp32 partial states for merge_states."""
    qo_len, heads, dim = q.shape
    kv_len, group = k.shape[0], heads // k.shape[1]
    sm_scale = 1.0 / math.sqrt(dim) if sm_scale is None else sm_scale
    qs = _scaled_q(q, sm_scale, soft_cap).transpose(0, 1)                    # [H, qo, D]
    kk = k.to(F64).repeat_interleave(group, 1).transpose(0, 1)              # [H, kv, D]
    vv = v.to(F64).repeat_interleave(group, 1).transpose(0, 1)
    s = torch.zeros(heads, qo_len, kv_len, dtype=F64)
    for d in range(dim):                                                    # one fma chain over head dims
        s = fma(qs[:, :, d, None], kk[:, None, :, d], s)
    if soft_cap:
        s = _soft_cap(s, soft_cap, jitter)
    s = s.masked_fill(~_visible(qo_len, kv_len, causal, window_left), NEG_INF)
    states = []
    for b, e in _splits(kv_len, kv_chunk):
        m = torch.full((heads, qo_len, 1), NEG_INF, dtype=F64)
        lane_l = torch.zeros(heads, qo_len, 32, dtype=F64)
        acc = torch.zeros(heads, qo_len, dim, dtype=F64)
        for t0 in range(b, e, 32):
            st = s[..., t0:min(t0 + 32, e)]
            vt = vv[:, t0:t0 + st.shape[-1]]
            if st.shape[-1] < 32:                       # rows past the keys: zero-filled and masked
                st = torch.cat([st, torch.full((heads, qo_len, 32 - st.shape[-1]), NEG_INF, dtype=F64)], -1)
            m_new = torch.maximum(m, st.amax(-1, keepdim=True))
            rescale = exp2_diff(m, m_new, jitter)
            prob = exp2_diff(st, m_new, jitter)
            m = m_new
            lane_l = fma(lane_l, rescale, prob)
            acc = f32(acc * rescale)
            for j in range(vt.shape[1]):               # keys in order, one fma each
                acc = fma(prob[..., j:j + 1], vt[:, None, j], acc)
        l_sum = lane_l
        while l_sum.shape[-1] > 1:                      # warp_sum: xor butterfly 16, 8, 4, 2, 1
            half = l_sum.shape[-1] // 2
            l_sum = f32(l_sum[..., :half] + l_sum[..., half:])
        live = l_sum > 0
        inv_l = torch.where(live, f32(1.0 / l_sum.clamp_min(1e-300)), torch.zeros_like(l_sum))
        lse = torch.where(live, f32(m + log2f(l_sum.clamp_min(1e-300), jitter)), torch.full_like(m, NEG_INF))
        states.append((f32(acc * inv_l), lse[..., 0]))
    o, lse = states[0] if len(states) == 1 else merge_states(states, jitter)
    return to_dtype(o.transpose(0, 1), q.dtype), lse.transpose(0, 1).to(torch.float32)


def decode_geometry(dim: int, dims_per_lane: int = 8) -> dict:
    """cuda_core_decode.cuh: dims_per_lane dims per lane (8 for 16-bit caches;
    16 for FP8 ones and at 512) on dim / dims_per_lane lanes of a group the next
    power of two wide (the rest idle), key groups side by side in a warp, 4 keys
    per group and chunk, 4 warps taking chunks in turn."""
    lanes = 1 << (dim // dims_per_lane - 1).bit_length()
    groups = 32 // lanes
    return {"lanes": lanes, "groups": groups, "keys_per_group": 4, "warps": 4, "chunk": groups * 4}


def decode_logits(qs, kk):
    """Per lane an fma chain over its 8 dims, then the lanes' partials summed by
    halving (reduce_scatter), lane i with lane i + half; a group's idle lanes
    (past dim / 8) add zeros: qs [H, D], kk [H, n, D] -> [H, n]."""
    heads, dim = qs.shape
    part = torch.zeros(heads, kk.shape[1], dim // 8, dtype=F64)
    qv, kv = qs.view(heads, 1, dim // 8, 8), kk.view(heads, kk.shape[1], dim // 8, 8)
    for e in range(8):
        part = fma(qv[..., e], kv[..., e], part)
    lanes = decode_geometry(dim)["lanes"]
    part = torch.cat([part, part.new_zeros(*part.shape[:-1], lanes - part.shape[-1])], -1)
    while part.shape[-1] > 1:
        half = part.shape[-1] // 2
        part = f32(part[..., :half] + part[..., half:])
    return part[..., 0]


def _decode_split(s, vv, key_begin, key_end, geo, jitter):
    """One CTA's keys [key_begin, key_end): each (warp, group) streams its keys,
    the groups merge by halving, the warps through shared memory. -> (o, lse)."""
    heads, dim = vv.shape[0], vv.shape[-1]
    W, G, NK, CH = geo["warps"], geo["groups"], geo["keys_per_group"], geo["chunk"]
    m = torch.full((heads, W, G), NEG_INF, dtype=F64)
    l_ = torch.zeros(heads, W, G, dtype=F64)
    acc = torch.zeros(heads, W, G, dim, dtype=F64)
    warp = torch.arange(W)[:, None].expand(W, G)
    grp = torch.arange(G)[None, :].expand(W, G)
    rounds = math.ceil(max(key_end - key_begin, 0) / (W * CH))
    for i in range(rounds):
        keys = torch.stack([key_begin + (i * W + warp) * CH + grp + n * G for n in range(NK)], -1)  # [W, G, NK]
        ok = keys < key_end
        idx = keys.clamp_max(max(key_end - 1, 0)).reshape(-1)
        sn = torch.where(ok, s[:, idx].view(heads, W, G, NK), torch.tensor(NEG_INF, dtype=F64))
        m_new = torch.maximum(m, sn.amax(-1))
        m_sub = torch.where(m_new == NEG_INF, torch.zeros_like(m_new), m_new)
        rescale = exp2f(f32(m - m_sub), jitter, ftz=True)
        m = m_new
        l_ = f32(l_ * rescale)
        p = exp2f(f32(sn - m_sub[..., None]), jitter, ftz=True)
        acc = f32(acc * rescale[..., None])
        vn = vv[:, idx].view(heads, W, G, NK, dim)
        for n in range(NK):
            l_ = f32(l_ + p[..., n])
            acc = fma(p[..., n, None], vn[..., n, :], acc)
    bit = 1
    while bit < G:                                     # group merges: l*f_mine + l_other*f_other
        other = torch.arange(G) ^ bit
        m_o, l_o, a_o = m[..., other], l_[..., other], acc[..., other, :]
        m_all = torch.maximum(m, m_o)
        f_mine, f_o = exp2_diff(m, m_all, jitter), exp2_diff(m_o, m_all, jitter)
        l_ = fma(l_, f_mine, f32(l_o * f_o))
        acc = fma(acc, f_mine[..., None], f32(a_o * f_o[..., None]))
        m = m_all
        bit *= 2
    m, l_, acc = m[..., 0], l_[..., 0], acc[..., 0, :]  # key group 0 of each warp
    m_all = m.amax(-1)
    l_all = torch.zeros(heads, dtype=F64)
    o = torch.zeros(heads, dim, dtype=F64)
    for w in range(W):
        f = exp2_diff(m[:, w], m_all, jitter)
        l_all = fma(l_[:, w], f, l_all)
        o = fma(acc[:, w], f[:, None], o)
    live = l_all > 0
    o = torch.where(live[:, None], f32(o / l_all.clamp_min(1e-300)[:, None]), torch.zeros_like(o))
    lse = torch.where(live, f32(m_all + log2f(l_all.clamp_min(1e-300), jitter)), torch.full_like(m_all, NEG_INF))
    return o, lse


def decode(q, k, v, *, sm_scale=None, window_left=-1, soft_cap=None, kv_chunk=0, jitter=None):
    """cuda_core_decode.cuh on one request: q [H, D], k/v [kv, Hkv, D] ->
    (o [H, D] in q's dtype, lse [H] fp32)."""
    heads, dim = q.shape
    kv_len, group = k.shape[0], heads // k.shape[1]
    sm_scale = 1.0 / math.sqrt(dim) if sm_scale is None else sm_scale
    geo = decode_geometry(dim)
    qs = _scaled_q(q, sm_scale, soft_cap)
    kk = k.to(F64).repeat_interleave(group, 1).transpose(0, 1)
    vv = v.to(F64).repeat_interleave(group, 1).transpose(0, 1)
    s = decode_logits(qs, kk) if kv_len else torch.zeros(heads, 0, dtype=F64)
    if soft_cap:
        s = _soft_cap(s, soft_cap, jitter)
    first = max(kv_len - 1 - window_left, 0) if window_left is not None and window_left >= 0 else 0
    states = [_decode_split(s, vv, max(first, b), e, geo, jitter) for b, e in _splits(kv_len, kv_chunk)]
    o, lse = states[0] if len(states) == 1 else merge_states(states, jitter)
    return to_dtype(o, q.dtype), lse.to(torch.float32)
