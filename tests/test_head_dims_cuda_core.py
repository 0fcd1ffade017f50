"""The CUDA-core kernels at the head dims besides 64, 128 and 256, without a GPU:
their tilings (shared memory, the decode lane groups and the chains the
error model takes from them) against the emulation of the kernels' fp32
order (cuda_core_emulation.py), the rendered sources, and the emulated error
against the error model's bound at head dims 48, 96 and 240; and (nvcc) the
new dims' heaviest variants build without spills.

A decode key's lanes are a power of two (head_dim / 8 of them hold dims, the
rest add zeros), and a prefill lane's last 32-dim slot may be half empty: so
at head dim D each kernel computes what it computes at the next such width on
inputs padded with zero dims, which the emulation shows exactly."""

from __future__ import annotations

import math

import pytest
import torch

import cuda_core_emulation as emu
import flashjit
from flashjit import render
from flashjit.error_bound import cuda_core_bound
from flashjit.error_model import evaluate_lse, measure, profile
from flashjit.kernels import common, tiling_for
from flashjit.kernels.cuda_core import cuda_core_tiling, cuda_decode_tiling
from flashjit.reference import attention_reference
from flashjit.spec import KernelSpec

NEW_DIMS = (32, 48, 80, 96, 112, 144, 160, 192, 208, 240)
DTYPES = ("float16", "bfloat16", "float32")
# (dtype_q, dtype_kv) of the decode kernels: one dtype, or an FP8 cache under bf16 queries.
DECODE_DTYPES = [(d, d) for d in DTYPES] + [("bfloat16", "float8_e4m3fn")]


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("head_dim", NEW_DIMS)
def test_prefill_tiling_fits_and_renders(head_dim, dtype):
    spec = KernelSpec.make("batch_prefill_paged", dtype, head_dim, causal=True, sliding_window=True, soft_cap=True)
    tiling = cuda_core_tiling(spec)
    assert tiling.smem_bytes(spec) <= common.SMEM_BUDGET
    # Each dim's P.V is one chain over the keys whichever lane holds it; Q.K one fma chain over the dims.
    assert tiling.chains(spec) == {"dot_chain": head_dim, "pv_chains": 1, "l_chains": 32, "l_tail": 5,
                                   "merge_levels": 0}
    assert tiling.rescales(spec) == (32, 0)
    text = render.render(spec).text
    assert f"/*kHeadDimQK=*/{head_dim}, /*kHeadDimVO=*/{head_dim}," in text


@pytest.mark.parametrize("dtype,dtype_kv", DECODE_DTYPES, ids=lambda d: d)
@pytest.mark.parametrize("head_dim", NEW_DIMS)
def test_decode_lane_groups_follow_the_emulation(head_dim, dtype, dtype_kv):
    for op in ("single_decode", "batch_decode_paged"):
        spec = KernelSpec.make(op, dtype, head_dim, dtype_kv=dtype_kv, sliding_window=True, soft_cap=True)
        template, tiling = tiling_for(spec)
        assert template == "attention_cuda_decode.cu.jinja" and tiling == cuda_decode_tiling(spec)
        assert tiling.smem_bytes(spec) <= common.SMEM_BUDGET
        lanes, groups = tiling.lanes_per_key(spec), tiling.key_groups(spec)
        active = head_dim // tiling.dims_per_lane
        # The narrowest power of two that holds the key's dims; groups fill the warp.
        assert lanes & (lanes - 1) == 0 and lanes // 2 < active <= lanes and lanes * groups == 32
        geo = emu.decode_geometry(head_dim, tiling.dims_per_lane)
        assert (geo["lanes"], geo["groups"]) == (lanes, groups)
        assert tiling.rescales(spec) == (geo["chunk"] * geo["warps"], int(math.log2(groups)) + 1)
        levels = int(math.log2(groups))
        assert tiling.chains(spec) == {
            "dot_chain": tiling.dims_per_lane + int(math.log2(lanes)), "pv_chains": groups * geo["warps"],
            "l_chains": groups * geo["warps"], "l_tail": 2 * levels + 2 * geo["warps"], "merge_levels": levels + 1}
        text = render.render(spec).text
        assert f"/*kHeadDim=*/{head_dim}," in text and f"/*kDimsPerLane=*/{tiling.dims_per_lane}," in text


def _padded_width(head_dim: int) -> int:
    """The head dim whose decode lanes are all busy at head_dim's lane count."""
    return emu.decode_geometry(head_dim)["lanes"] * 8


def _inputs(qo: int, kv: int, head_dim: int, seed: int, dtype=torch.float32):
    g = torch.Generator().manual_seed(seed)
    q = 8 * torch.randn(qo, 4, head_dim, generator=g)      # peaked: few keys carry the weight
    k = torch.randn(kv, 2, head_dim, generator=g)
    v = torch.randn(kv, 2, head_dim, generator=g)
    return q.to(dtype), k.to(dtype), v.to(dtype)


def _pad(x: torch.Tensor, width: int) -> torch.Tensor:
    return torch.cat([x, x.new_zeros(*x.shape[:-1], width - x.shape[-1])], -1)


@pytest.mark.parametrize("head_dim", [48, 80, 96, 144, 240])
def test_idle_lanes_compute_the_padded_head_dim(head_dim):
    """Decode at head dim D = decode at the lane group's full width on zero-padded
    inputs (the idle lanes' zeros are exact), bit for bit; prefill likewise
    (trailing zero dims leave the fma chain of Q.K as it is)."""
    width = _padded_width(head_dim)
    q, k, v = _inputs(1, 700, head_dim, seed=head_dim)
    scale = 1 / math.sqrt(head_dim)
    args = dict(sm_scale=scale, window_left=500, soft_cap=30.0, kv_chunk=256)
    out, lse = emu.decode(q[0], k, v, jitter=emu.Jitter(5), **args)
    wide, wide_lse = emu.decode(_pad(q[0], width), _pad(k, width), _pad(v, width), jitter=emu.Jitter(5), **args)
    assert torch.equal(out, wide[:, :head_dim]) and torch.equal(lse, wide_lse)
    q, k, v = _inputs(8, 300, head_dim, seed=head_dim + 1)
    out, lse = emu.prefill(q, k, v, causal=True, sm_scale=scale, kv_chunk=128, jitter=emu.Jitter(6))
    wide, wide_lse = emu.prefill(_pad(q, width), _pad(k, width), _pad(v, width), causal=True, sm_scale=scale,
                                 kv_chunk=128, jitter=emu.Jitter(6))
    assert torch.equal(out, wide[..., :head_dim]) and torch.equal(lse, wide_lse)


# (op, qo_len, kv_len, split-KV chunk, variant); 4 query heads over 2 KV heads
BOUND_CASES = [
    ("single_prefill", 16, 600, 256, {}),
    ("single_prefill", 20, 500, 0, {"causal": True, "window_left": 70, "soft_cap": 30.0}),
    ("single_decode", 1, 1000, 512, {}),
    ("single_decode", 1, 900, 0, {"window_left": 300, "soft_cap": 30.0}),
]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("case", BOUND_CASES, ids=lambda c: f"{c[0]}-{'-'.join(c[4]) or 'split'}")
@pytest.mark.parametrize("head_dim", [48, 96, 240])
def test_emulated_error_within_the_error_model(head_dim, case, dtype):
    op, qo, kv, chunk, variant = case
    causal = variant.get("causal", False)
    spec = KernelSpec.make(op, dtype, head_dim, causal=causal, sliding_window="window_left" in variant,
                           soft_cap="soft_cap" in variant)
    q, k, v = _inputs(qo, kv, head_dim, seed=head_dim * 31 + kv, dtype=dtype)
    kw = {"window_left": variant.get("window_left", -1), "soft_cap": variant.get("soft_cap")}
    if op == "single_decode":
        out, lse = emu.decode(q[0], k, v, kv_chunk=chunk, jitter=emu.Jitter(11), **kw)
        out, lse = out[None], lse[None]
    else:
        out, lse = emu.prefill(q, k, v, causal=causal, kv_chunk=chunk, jitter=emu.Jitter(11), **kw)
    ref, ref_lse = attention_reference(q, k, v, causal=causal, window_left=kw["window_left"],
                                       logits_soft_cap=kw["soft_cap"])
    assert flashjit.tolerance(spec, q=q, k=k, v=v, kv_len=kv).ratio(out, ref) <= 1
    _, logit = measure(q, k, v, 1 / math.sqrt(head_dim))
    assert evaluate_lse(profile(spec), kv_len=kv, logit_absmax=logit).ratio(lse, ref_lse) <= 1
    if dtype == torch.float32:  # the per-call bound, decode's chains over lane groups padded to a power of two
        bound = cuda_core_bound(spec, q, k, v, causal=causal, kv_chunk=chunk, window_left=kw["window_left"],
                                logits_soft_cap=kw["soft_cap"])
        assert bound.ratio(out) <= 1 and bound.lse_ratio(lse) <= 1


# The variants nearest the register cap: the prefill kernel at 208 and 240 dims (168
# registers at three CTAs an SM, like 256) and decode with idle lanes, an FP8 cache included.
HEAVY_SPECS = [
    KernelSpec.make("batch_prefill_paged", "bfloat16", 240, causal=True, sliding_window=True, soft_cap=True,
                    return_lse=True),
    KernelSpec.make("batch_prefill_paged", "bfloat16", 208),
    KernelSpec.make("single_decode", "bfloat16", 48, dtype_kv="float8_e4m3fn", sliding_window=True, soft_cap=True,
                    return_lse=True),
    KernelSpec.make("batch_decode_paged", "float32", 144, sliding_window=True, soft_cap=True, return_lse=True),
]


@pytest.mark.nvcc
@pytest.mark.slow
def test_heaviest_new_dims_build_without_spills(tmp_path):
    arches = ("sm_80", "sm_89", "sm_90a")
    for result in flashjit.build_many(HEAVY_SPECS, arches, root=tmp_path):
        assert result.entry is not None, result.error
        usage = result.entry.manifest["resources"]
        assert {u["arch"] for u in usage} == set(arches)
        assert any("cuda_core" in u["kernel"] for u in usage) and any("merge" in u["kernel"] for u in usage)
        spills = [u for u in usage if u["spill_stores"] or u["spill_loads"] or u["stack"]]
        assert spills == [], f"{result.spec.name} spills: {spills}"
