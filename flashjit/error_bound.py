"""A sound error bound for one call of a CUDA-core kernel, computed from the
call's own inputs: the data-dependent bound of docs/numerics-fp32.md.

`flashjit.tolerance()` gives an (rtol, atol) pair from magnitudes alone. This
module gives, for one call, a bound per output element (and per LSE) that
holds for every rounding the kernel may do, and that is far tighter, because
it uses what magnitudes cannot: the softmax weights, the partial sums in the
order the kernel adds them, and the exact fp32 query the kernel scales.

How (every step in the order of cuda_core_attention.cuh / cuda_core_decode.cuh):
  - q' = fl32(q * fl32(fl32(sm_scale) * fl32(log2 e))) is one IEEE multiply, so
    it is computed exactly here; o' and lse' are the exact attention with the
    logits q'.k. |o' - ref| is then known, not bounded.
  - Each logit's fp32 dot product errs by at most sum_t min(u|S_t|, |q'_t k_t|)
    over its partial sums S_t in the kernel's order; the subtraction s - m, exp2
    (2 ulp) and every rescale or merge a key's weight passes through add
    relative errors. Together they move weight j by a factor e^delta_j; the
    output then moves by at most sum_j w_j delta_j |v_j - o| (first order; the
    row sum l and the accumulator see the same p, so only the ratio counts).
  - P.V: each fma errs by at most min(u|A_k|, |p_k v_k|), A_k the partial sum
    after it (a float a is itself a candidate for fl(a + x)), each rescale
    multiply by u|A|; the row sum l likewise, relative to l; then the merges,
    the split-KV merge and the final roundings.
The terms are first order in u; the sum is multiplied by 1 + kappa, kappa four
times the largest relative first-order quantity, which covers the products of
two of them. Sound for any rounding (no probabilistic assumption); the cost
is a few passes of the size of the attention itself, so it is for tests and
`flashjit numerics`, not for a serving path.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from .kernels.cuda_core import cuda_decode_tiling
from .reference import attention_reference
from .spec import DECODE_OPS, DTYPES, KernelSpec

U = 2.0**-24
LN2 = math.log(2.0)
EXP2_REL = 4 * U           # exp2f and ex2.approx: 2 ulp, at most 4u of the result
DECODE_KEYS_PER_GROUP, DECODE_WARPS = 4, 4   # cuda_core_decode.cuh (kernels/cuda_core.py CudaDecodeTiling)
PREFILL_KEYS_PER_TILE = 32
F64 = torch.float64


@dataclass
class ElementBound:
    """The float64 reference of one call and a bound on |out - ref| per element
    (and on |lse - ref_lse| per row)."""

    ref: torch.Tensor
    ref_lse: torch.Tensor
    bound: torch.Tensor
    lse_bound: torch.Tensor

    @staticmethod
    def _ratio(out, ref, bound) -> float:
        out, ref = out.double(), ref.double()
        err = torch.where(out == ref, torch.zeros_like(ref), (out - ref).abs())
        ratio = torch.where(err == 0, torch.zeros_like(err), err / bound)
        return float(ratio.nan_to_num(math.inf).max()) if ratio.numel() else 0.0

    def ratio(self, out) -> float:
        """max |out - ref| / bound over the elements (<= 1: within); inf for NaN."""
        return self._ratio(out, self.ref, self.bound)

    def lse_ratio(self, lse) -> float:
        return self._ratio(lse, self.ref_lse, self.lse_bound)

    def assert_close(self, out, what: str = "output") -> float:
        r = self.ratio(out)
        if not r <= 1.0:
            raise AssertionError(f"{what} exceeds its data-dependent bound: max err/bound = {r:.3f}")
        return r


def _f32(x):
    return x.to(torch.float32).to(F64)


def kernel_q(q, sm_scale: float, soft_cap: bool):
    """The fp32 query the kernels stage: q * sm_scale * log2(e) (sm_scale alone
    with a soft-cap), each factor and the product rounded to fp32."""
    scale = _f32(torch.tensor(sm_scale, dtype=F64))
    if not soft_cap:
        scale = _f32(scale * _f32(torch.tensor(1.0 / LN2, dtype=F64)))
    return _f32(q.to(F64) * scale.to(q.device))


def half_ulp(x):
    """The most round-to-nearest to fp32 can err by on any result of magnitude
    at most x: half an ulp of x's binade (2^-150 among the subnormals). Between
    u|x|/2 and u|x|: u|x| is the usual first-order bound."""
    _, e = torch.frexp(x)
    return torch.where(x < 2.0**-126, torch.full_like(x, 2.0**-150), torch.ldexp(torch.ones_like(x), e - 25))


def _dot_error(qs, k, lanes: int, dims_per_lane: int = 8):
    """Bound on the fp32 dot products' rounding, per (row, key): prefill
    (lanes 0) chains fma over all dims; decode chains dims_per_lane dims per lane (8; 16 at head dim 512), then
    halves the `lanes` of a key's group (its idle lanes add exact zeros).
    A first pass with u|S| bounds how far any partial sum can be off; the second
    takes half an ulp of the partial sums moved by that much."""
    out = torch.empty(qs.shape[0], k.shape[0], dtype=F64, device=qs.device)
    step = max(1, (1 << 23) // max(1, qs.shape[0] * qs.shape[1]))
    for j0 in range(0, k.shape[0], step):
        prod = qs[:, None, :] * k[None, j0:j0 + step, :]
        if lanes:
            prod = prod.unflatten(-1, (-1, dims_per_lane))
            if lanes != prod.shape[-2]:
                prod = torch.nn.functional.pad(prod, (0, 0, 0, lanes - prod.shape[-2]))
        part = prod.cumsum(-1)
        slack = None
        for first_pass in (True, False):
            def rounding(a, extra_dims):
                return U * a if first_pass else half_ulp(a + slack.view(*slack.shape, *([1] * extra_dims)))
            # fl(a + x) errs by at most |x|: a itself is a candidate.
            err = torch.minimum(rounding(part.abs(), part.dim() - 2), prod.abs()).sum(-1)
            if lanes:
                err = err.sum(-1)
                sums = part[..., -1]
                while sums.shape[-1] > 1:     # lane partials by halving: min(round(a+b), |a|, |b|)
                    half = sums.shape[-1] // 2
                    a, b = sums[..., :half], sums[..., half:]
                    sums = a + b
                    err = err + torch.minimum(rounding(sums.abs(), 1), torch.minimum(a.abs(), b.abs())).sum(-1)
            slack = err
        out[:, j0:j0 + step] = err
    return out


def _splits(n: int, kv_chunk: int):
    if not kv_chunk or kv_chunk >= n:
        return [(0, n)]
    return [(b, min(b + kv_chunk, n)) for b in range(0, n, kv_chunk)]


@dataclass
class Chains:
    """The fp32 accumulation chains of one request: idx [C, L] the keys of each
    chain in the order the kernel adds them (-1: none), `step` keys per
    online-softmax step, split_of [C] the split-KV chunk of each chain."""

    idx: torch.Tensor
    split_of: torch.Tensor
    step: int
    groups: int


def chains(spec: KernelSpec, n: int, kv_chunk: int, first: int, device) -> Chains:
    """Prefill: one chain per split, 32-key tiles. Decode: per split, one chain
    per (warp, key group): warp w takes chunks w, w + 4, ... of 4 * groups keys
    from the split's first key, group g keys g, g + groups, ... of each chunk."""
    rows, split_of = [], []
    if spec.op not in DECODE_OPS:
        step, groups = PREFILL_KEYS_PER_TILE, 1
        for c, (b, e) in enumerate(_splits(n, kv_chunk)):
            rows.append(torch.arange(b, e))
            split_of.append(c)
    else:
        tiling = cuda_decode_tiling(spec)  # the shipped tiling: its lane groups, padded to a power of two
        step, groups = tiling.keys_per_group, tiling.key_groups(spec)
        chunk, warps = groups * step, tiling.warps
        for c, (b, e) in enumerate(_splits(n, kv_chunk)):
            begin = max(first, b)
            rounds = -(-max(e - begin, 0) // (chunk * warps))
            w, g, i, t = torch.meshgrid(torch.arange(warps), torch.arange(groups), torch.arange(rounds),
                                        torch.arange(step), indexing="ij")
            keys = begin + i * chunk * warps + w * chunk + g + t * groups
            keys = torch.where(keys < e, keys, -1).reshape(warps * groups, rounds * step)
            rows += list(keys)
            split_of += [c] * (warps * groups)
    width = -(-max([len(r) for r in rows] + [1]) // step) * step
    idx = torch.full((len(rows), width), -1, dtype=torch.long)
    for c, r in enumerate(rows):
        idx[c, :len(r)] = r
    return Chains(idx.to(device), torch.tensor(split_of, device=device), step, groups)


def _gather(x, idx, fill):
    """x [..., n] at idx [C, L] (-1 -> fill) -> [..., C, L]."""
    out = x[..., idx.clamp_min(0)]
    return torch.where(idx >= 0, out, torch.full_like(out, fill))


def _halving(parts, err_fn):
    """Sums parts [..., G] by halving (xor butterflies); err_fn(a, b, a+b) adds the error of each add."""
    err = torch.zeros_like(parts[..., 0])
    while parts.shape[-1] > 1:
        half = parts.shape[-1] // 2
        a, b = parts[..., :half], parts[..., half:]
        parts = a + b
        err = err + err_fn(a, b, parts).sum(-1)
    return parts[..., 0], err


class _Rows:
    """The bound for a block of query rows of one head against one request's keys."""

    def __init__(self, spec: KernelSpec, qs, k, v, visible, soft_cap, ch: Chains):
        self.decode = spec.op in DECODE_OPS
        self.dim = qs.shape[-1]
        z = qs @ k.T
        tiling = cuda_decode_tiling(spec)
        e = _dot_error(qs, k, tiling.lanes_per_key(spec) if self.decode else 0, tiling.dims_per_lane)
        if soft_cap:   # cap * tanh(z / cap) * fl32(log2 e); tanhf 2 ulp, three roundings
            log2e = float(_f32(torch.tensor(1.0 / LN2, dtype=F64)))
            t = torch.tanh(z / soft_cap)
            dx = e + U * z.abs()
            slope = torch.clamp(1 - t * t + 2 * dx / soft_cap, max=1.0)
            s = soft_cap * t * log2e
            e = log2e * slope * dx + 6 * U * s.abs()
        else:
            s = z
        s = s.masked_fill(~visible, -math.inf)
        e = e.masked_fill(~visible, 0.0)
        self.live = visible.any(-1)
        m = s.amax(-1, keepdim=True).masked_fill(~self.live[:, None], 0.0)
        p = torch.exp2(s - m)
        l_rel = p.sum(-1, keepdim=True)
        w = p / l_rel.clamp_min(1e-300)
        o = w @ v
        self.o, self.lse = o, (m + torch.log2(l_rel.clamp_min(1e-300)))[:, 0].masked_fill(~self.live, -math.inf)
        e_max = e.amax(-1, keepdim=True)
        # Per-key relative weight error: logit error, the subtraction s - m, exp2.
        delta = LN2 * (e + U * (m - s + 2 * e_max).masked_fill(~visible, 0.0)) + EXP2_REL
        idx, split_of, step, groups = ch.idx, ch.split_of, ch.step, ch.groups
        rows, C, L = w.shape[0], idx.shape[0], idx.shape[1]
        S = L // step
        wc, sc = _gather(w, idx, 0.0), _gather(s, idx, -math.inf)          # [R, C, L]
        # Rescales: a step moves the running max (maybe, within the logit errors): 4u + u|dm| more
        # on every earlier key of the chain, and one more rounding of the accumulators.
        step_max = sc.unflatten(-1, (S, step)).amax(-1)                     # [R, C, S]
        run = step_max.cummax(-1).values
        before = torch.cat([torch.full_like(run[..., :1], -math.inf), run[..., :-1]], -1)
        moves = (step_max > before - 2 * e_max[..., None]) & (before > -math.inf)
        rho = torch.where(moves, EXP2_REL + LN2 * U * (run - before + 2 * e_max[..., None]), torch.zeros_like(run))
        later = rho.flip(-1).cumsum(-1).flip(-1) - rho                      # steps after this one
        delta_c = _gather(delta, idx, 0.0) + later.repeat_interleave(step, -1)
        # Merges of the decode chains (key groups by halving, then warps) and of the splits.
        chain_max = sc.amax(-1)                                            # [R, C]
        n_split = int(split_of.max()) + 1
        split_max = torch.full((rows, n_split), -math.inf, dtype=F64, device=k.device)
        split_max = split_max.scatter_reduce(1, split_of.expand(rows, C), chain_max, "amax")
        if self.decode:
            levels = groups.bit_length() - 1 + 1
            gap = torch.where(chain_max > -math.inf, split_max[:, split_of] - chain_max, 0.0)
            delta_c = delta_c + (levels * EXP2_REL + LN2 * U * levels * (gap + 2 * e_max))[..., None]
        self.delta_max = float((delta_c * (wc > 0)).amax()) if delta_c.numel() else 0.0
        # Output terms, per element: weights, the P.V chain, its rescales.
        vc = v[idx.clamp_min(0)] * (idx >= 0)[..., None]                     # [C, L, dv]
        x = wc[..., None] * vc
        acc = x.cumsum(-2)
        weights = (wc * delta_c)[..., None] * (vc - o[:, None, None, :]).abs()
        weights = (weights * (wc > 0)[..., None]).sum((1, 2))
        absx = x.abs()
        acc_steps = acc.unflatten(2, (S, step))[:, :, :, -1]                # after each step [R, C, S, dv]
        mult_before = torch.cat([torch.zeros_like(acc_steps[:, :, :1]), acc_steps[:, :, :-1]], 2).abs()
        # How far the kernel's partial sums can be from these (normalised, first pass with u|A|):
        # roundings so far, and the weights' own relative errors.
        err_u = torch.minimum(U * acc.abs(), absx).cumsum(2)
        mult_u = (U * mult_before * moves[..., None]).cumsum(2).repeat_interleave(step, 2)
        off = err_u + mult_u + (self.delta_max + 2 * LN2 * e_max[..., None, None]) * absx.cumsum(2)
        # The kernel holds acc unnormalised, relative to the running max: frame = l * 2^(m - run).
        frame = torch.where(run > -math.inf, l_rel[..., None] * torch.exp2((m[..., None] - run).clamp(max=900.0)),
                            1.0)
        f_pos = frame.repeat_interleave(step, -1)[..., None]
        chain_err = torch.minimum(half_ulp(f_pos * (acc.abs() + off)) / f_pos, absx).sum(2)   # [R, C, dv]
        off_steps = off.unflatten(2, (S, step))[:, :, :, -1]
        off_before = torch.cat([torch.zeros_like(off_steps[:, :, :1]), off_steps[:, :, :-1]], 2)
        f_step = frame[..., None]
        chain_err = chain_err + (half_ulp(f_step * (mult_before + off_before)) / f_step
                                 * moves[..., None]).sum(2)
        totals = acc[:, :, -1]                                              # [R, C, dv]
        lam = wc.cumsum(-1)
        if self.decode:   # l: multiply (if the max moved), then one add per key
            l_err = torch.minimum(U * lam, wc).sum(-1)
            moves_next = torch.cat([moves[..., 1:], torch.zeros_like(moves[..., :1])], -1)
            l_err = l_err + (U * lam.unflatten(-1, (S, step))[..., -1] * moves_next).sum(-1)
        else:             # l per lane (key j -> lane j mod 32): one fma per tile
            wl = wc.unflatten(-1, (S, step))                                # [R, C, S, 32]
            lanes = wl.cumsum(2)
            err = torch.where(moves[..., None], U * lanes, torch.minimum(U * lanes, wl))
            l_err = err.sum((2, 3))
            _, tree = _halving(lanes[:, :, -1], lambda a, b, ab: torch.minimum(U * ab, torch.minimum(a, b)))
            l_err = l_err + tree
        self._finish(spec, totals, lam[..., -1], l_err, chain_err, weights, split_of, groups, chain_max, delta_c,
                     wc, n_split, e_max)

    def _finish(self, spec, totals, chain_w, l_err, chain_err, weights, split_of, groups,
                chain_max, delta_c, wc, n_split, e_max):
        rows, dv = totals.shape[0], totals.shape[-1]
        o, dev = self.o, totals.device
        u_out = DTYPES[spec.dtype_o][2] if spec.dtype_o != "float32" else 0.0
        acc_err = chain_err.sum(1)
        l_abs = l_err.sum(1)
        split_a = torch.zeros(rows, n_split, dv, dtype=F64, device=dev)
        split_w = torch.zeros(rows, n_split, dtype=F64, device=dev)
        split_a.index_add_(1, split_of, totals)
        split_w.index_add_(1, split_of, chain_w)
        if self.decode:   # per split: key groups merge by halving, then the warps in order
            for c in range(n_split):
                sel = (split_of == c).nonzero()[:, 0]
                a = totals[:, sel].unflatten(1, (DECODE_WARPS, groups))
                lw = chain_w[:, sel].unflatten(1, (DECODE_WARPS, groups))
                wa, ea = _halving(a.transpose(-1, -2), lambda x, y, xy: U * (y.abs() + xy.abs()))
                wl, el = _halving(lw, lambda x, y, xy: U * (y + xy))
                acc_err = acc_err + ea.sum(1) + (U * wa.cumsum(1).abs()).sum(1)
                l_abs = l_abs + el.sum(1) + (U * wl.cumsum(1)).sum(1)
        norm = 1 if self.decode else 2        # o / l (decode) or acc * fl(1/l)
        bound = weights + acc_err + l_abs[:, None] * o.abs()
        lse_terms = ((wc * delta_c).sum((1, 2)) + l_abs) / LN2
        l_rel = (self.lse - chain_max.amax(-1)).nan_to_num(0.0).abs()
        if n_split == 1:
            bound = bound + norm * U * o.abs()
            lse_terms = lse_terms + 2 * U * l_rel + U * self.lse.abs()
        else:             # fp32 partial states, merged by merge_states.cuh
            lse_c = self.lse[:, None] + torch.log2(split_w.clamp_min(1e-300))
            max_c = torch.full_like(split_w, -math.inf).scatter_reduce(1, split_of.expand(rows, -1), chain_max, "amax")
            log_l = (lse_c - max_c).abs()
            big_m = lse_c.amax(-1, keepdim=True)
            d_c = LN2 * U * (2 * log_l + lse_c.abs() + (big_m - lse_c) + 6 * e_max) + EXP2_REL
            d_c = torch.where(split_w > 0, d_c, torch.zeros_like(d_c))
            pieces = n_split + 4
            bound = (bound + norm * U * split_a.abs().sum(1)
                     + (d_c[..., None] * (split_a - split_w[..., None] * o[:, None, :]).abs()).sum(1)
                     + U * pieces * split_a.abs().sum(1) + (U * pieces + 2 * U) * o.abs())
            lse_terms = (lse_terms + (split_w * d_c).sum(1) / LN2 + U * pieces / LN2
                         + 2 * U * (lse_c.amax(-1) - self.lse).abs() + U * self.lse.abs())
        kappa = 4 * (self.delta_max + float(l_abs.amax()) + U * (wc.shape[-1] * wc.shape[-2] + self.dim + 64))
        # Rounding to the output dtype: u_out of the kernel's fp32 value, which is o plus its own error;
        # below the smallest normal, half the subnormal spacing (fp32's own, from acc * fl(1/l), too).
        floor = {"float16": 2.0**-25, "bfloat16": 2.0**-134}.get(spec.dtype_o, 0.0) + 2.0**-148
        self.bound = (bound + u_out * o.abs()) * (1 + kappa) + u_out * bound + floor
        self.lse_bound = lse_terms * (1 + kappa)


def cuda_core_bound(spec: KernelSpec, q, k, v, *, causal: bool = False, sm_scale: float | None = None,
                    window_left: int = -1, logits_soft_cap: float | None = None, kv_chunk: int = 0,
                    rows_per_block: int | None = None) -> ElementBound:
    """The reference and the bound of a CUDA-core kernel's call on one request:
    q [qo, H, D] (decode: one row), k/v [kv, Hkv, D] (NHD); kv_chunk: the keys
    per split-KV chunk the launch used (0: not split)."""
    if spec.use_tensor_cores:
        raise ValueError(f"{spec.name}: the data-dependent bound models the CUDA-core kernels only")
    if q.dim() == 2:
        q = q[None]
    qo_len, heads, dim = q.shape
    n, group = k.shape[0], heads // max(k.shape[1], 1)
    sm_scale = 1.0 / math.sqrt(dim) if sm_scale is None else sm_scale
    ref, ref_lse = attention_reference(q, k, v, causal=causal, sm_scale=sm_scale, window_left=window_left,
                                       logits_soft_cap=logits_soft_cap)
    bound = torch.zeros_like(ref)
    lse_bound = torch.zeros_like(ref_lse)
    if n == 0 or qo_len == 0:
        return ElementBound(ref, ref_lse, bound, lse_bound)
    decode = spec.op in DECODE_OPS
    first = max(n - 1 - window_left, 0) if decode and window_left is not None and window_left >= 0 else 0
    qs = kernel_q(q, sm_scale, bool(logits_soft_cap))
    ch = chains(spec, n, kv_chunk, first, q.device)
    i = torch.arange(qo_len, device=q.device)[:, None]
    j = torch.arange(n, device=q.device)[None, :]
    visible = torch.ones(qo_len, n, dtype=torch.bool, device=q.device)
    if causal and not decode:
        visible &= j <= i + n - qo_len
    if window_left is not None and window_left >= 0:
        visible &= j >= i + n - qo_len - window_left
    budget = (1 << 31) if q.is_cuda else (1 << 27)
    block = rows_per_block or max(1, budget // (8 * 6 * max(n, 1) * max(dim, v.shape[-1])))
    for h in range(heads):
        kh, vh = k[:, h // group].to(F64), v[:, h // group].to(F64)
        for r0 in range(0, qo_len, block):
            part = _Rows(spec, qs[r0:r0 + block, h], kh, vh, visible[r0:r0 + block], logits_soft_cap, ch)
            o_true, lse_true = ref[r0:r0 + block, h], ref_lse[r0:r0 + block, h]
            live = part.live[:, None]
            slack = 2.0**-40 * (vh.abs().amax() + o_true.abs())
            bound[r0:r0 + block, h] = torch.where(live, (part.o - o_true).abs() + part.bound + slack, 0.0)
            lse_gap = (part.lse - lse_true).nan_to_num(0.0).abs()
            lse_bound[r0:r0 + block, h] = torch.where(part.live, lse_gap + part.lse_bound + 2.0**-40 * (
                lse_true.nan_to_num(0.0).abs() + 1), 0.0)
    return ElementBound(ref, ref_lse, bound, lse_bound)


def ragged_cuda_core_bound(spec: KernelSpec, q, k, v, qo_indptr, kv_indptr, *, kv_chunk: int = 0,
                           **kwargs) -> ElementBound:
    """cuda_core_bound per request of a packed NHD batch (decode: one query row per request)."""
    parts = []
    for b in range(len(qo_indptr) - 1):
        qs, qe, ks, ke = (int(x) for x in (qo_indptr[b], qo_indptr[b + 1], kv_indptr[b], kv_indptr[b + 1]))
        parts.append(cuda_core_bound(spec, q[qs:qe], k[ks:ke], v[ks:ke], kv_chunk=kv_chunk, **kwargs))
    return ElementBound(*(torch.cat([getattr(p, f) for p in parts]) for f in ("ref", "ref_lse", "bound",
                                                                               "lse_bound")))
