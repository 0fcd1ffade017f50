"""The opt-in FP8 decode variant that reads codes straight into mma fragments
(Fa2Tiling.fp8_in_registers, fa2/fa2_fp8_frags.cuh) without a GPU: the field
renders into the traits only where set (the shipped tiling's source is as
before), the smem mirror, the header's layout claims replayed lane by lane
against the PTX mma.m16n8k16 fragment layouts (Q.K^T and P.V of the permuted
head dims and keys, the epilogue's columns, conflict-free 16-byte loads), and
with nvcc: no spills on sm_80 / sm_89 / sm_90a and a main loop without the
widening pass's stores and ldmatrix."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest

import flashjit
from flashjit import render
from flashjit.kernels import fa2
from flashjit.spec import KernelSpec

SHIPPED = fa2.FA2_FP8_DECODE_TILINGS[128]
VARIANT = dataclasses.replace(SHIPPED, fp8_in_registers=True)


def decode_spec(q="bfloat16", kv="e4m3", head_dim=128, **flags):
    return KernelSpec.make("batch_decode_paged", q, head_dim, dtype_kv=kv, use_tensor_cores=True, **flags)


@pytest.fixture
def variant(monkeypatch):
    monkeypatch.setitem(fa2.FA2_FP8_DECODE_TILINGS, 128, VARIANT)


def test_shipped_tiling_leaves_the_field_off():
    assert not SHIPPED.fp8_in_registers
    assert "kFp8InRegs" not in render.render(decode_spec()).text


def test_the_field_renders_into_the_traits(variant):
    text = render.render(decode_spec()).text
    assert "/*kCustomMask=*/false, /*kFp8InRegs=*/true>;" in text
    # 16-bit caches never take the FP8 table; a d96 FP8 cache renders the flag, which its traits ignore.
    assert "kFp8InRegs" not in render.render(decode_spec(kv="bfloat16")).text


def test_smem_of_the_variant():
    """Q (16 rows of 256 bytes) and two stages of 64 code rows of K and V, no widened
    tiles; the four warps' merge (68 floats a lane) needs 2 KB past the stages."""
    spec = decode_spec()
    assert VARIANT.smem_bytes(spec) == 4096 + max(2 * 64 * 256, 4 * 68 * 32 * 4) == 38912
    assert SHIPPED.smem_bytes(spec) == 4096 + 2 * 64 * 256 + 64 * 512
    assert VARIANT.smem_bytes(decode_spec(head_dim=96)) == SHIPPED.smem_bytes(decode_spec(head_dim=96))


# ---------------------------------------------------------------------------
# The header's layouts, lane by lane (formulas as in fa2_fp8_frags.cuh)


def swizzle(row):
    return (((row >> 2) & 3) << 1) ^ ((row & 1) << 2)


def code_at(row, chunk):  # Fp8FragTile::at
    return row * 128 + ((chunk ^ swizzle(row)) << 4)


def key_row(key):  # Fp8Frags::key_row
    return 4 * ((key % 8) // 2) + 2 * (key // 8) + key % 2


def o_dim(nt, t, e):  # Fp8Frags::o_dim
    return 16 * (2 * t + e % 2) + nt


def mma(acc, a, b0, b1):
    """acc[lane] += A.B with A, B gathered from the lanes' registers (PTX ISA,
    mma.m16n8k16 .f16/.bf16: a[0..3] = A[g][2t..], A[g+8][2t..], A[g][2t+8..],
    A[g+8][2t+8..]; b0 = B[2t, 2t+1][g], b1 = B[2t+8, 2t+9][g])."""
    A, B = np.zeros((16, 16), np.int64), np.zeros((16, 8), np.int64)
    for lane in range(32):
        g, t = divmod(lane, 4)
        A[g, 2 * t:2 * t + 2], A[g + 8, 2 * t:2 * t + 2] = a[lane][0], a[lane][1]
        A[g, 2 * t + 8:2 * t + 10], A[g + 8, 2 * t + 8:2 * t + 10] = a[lane][2], a[lane][3]
        B[2 * t:2 * t + 2, g], B[2 * t + 8:2 * t + 10, g] = b0[lane], b1[lane]
    c = A @ B
    for lane in range(32):
        g, t = divmod(lane, 4)
        acc[lane] += [c[g, 2 * t], c[g, 2 * t + 1], c[g + 8, 2 * t], c[g + 8, 2 * t + 1]]


def test_fragments_compute_qk_and_pv_of_the_true_keys_and_dims():
    rng = np.random.default_rng(0)
    q, k, v = (rng.integers(-8, 8, (16, 128)) for _ in range(3))  # rows: query rows / the warp's 16 keys

    def code_tile(x):  # the cp.async copies: chunk c of row r at code_at(r, c)
        tile = np.zeros(16 * 128, np.int64)
        for r in range(16):
            for c in range(8):
                tile[code_at(r, c):code_at(r, c) + 16] = x[r, 16 * c:16 * c + 16]
        return tile

    k_tile, v_tile = code_tile(k), code_tile(v)
    s = np.zeros((2, 32, 4), np.int64)
    for kk in range(8):  # scores: Q's permuted A fragments (load_q), 16-byte loads of K
        h, st = divmod(kk, 4)
        a, b0, b1 = [], {j: [] for j in range(2)}, {j: [] for j in range(2)}
        for lane in range(32):
            g, t = divmod(lane, 4)
            dim = 64 * h + 16 * t + 4 * st
            a.append([q[g, dim:dim + 2], q[g + 8, dim:dim + 2], q[g, dim + 2:dim + 4], q[g + 8, dim + 2:dim + 4]])
            for j in range(2):
                word = code_at(key_row(8 * j + g), 4 * h + t) + 4 * st
                b0[j].append(k_tile[word:word + 2])
                b1[j].append(k_tile[word + 2:word + 4])
        for j in range(2):
            mma(s[j], a, b0[j], b1[j])
    logits = q @ k.T  # [row][code row]
    for lane in range(32):
        g, t = divmod(lane, 4)
        for j in range(2):
            for e in range(4):  # the mask's key of s[j][e]: key_row(8j + 2t + e % 2)
                assert s[j, lane, e] == logits[g + 8 * (e // 2), key_row(8 * j + 2 * t + e % 2)]
    # P = S (exact), as exp_to_p packs it; O += P.V from 16-byte loads of four code rows a lane.
    pa = [[s[0, lane, 0:2], s[0, lane, 2:4], s[1, lane, 0:2], s[1, lane, 2:4]] for lane in range(32)]
    o = np.zeros((16, 32, 4), np.int64)
    for word in range(4):
        for a_ in range(4):
            b0, b1 = [], []
            for lane in range(32):
                g, t = divmod(lane, 4)
                codes = [v_tile[code_at(4 * t + i, g) + 4 * word + a_] for i in range(4)]
                b0.append(codes[0:2])
                b1.append(codes[2:4])
            mma(o[4 * word + a_], pa, b0, b1)
    out = logits @ v
    for lane in range(32):
        g, t = divmod(lane, 4)
        for nt in range(16):
            for e in range(4):
                assert o[nt, lane, e] == out[g + 8 * (e // 2), o_dim(nt, t, e)]
    # The epilogue's 16-byte staging chunk 2 (2t + e) + n / 8 holds dims 8 * chunk .. + 7 in order.
    for lane in range(32):
        g, t = divmod(lane, 4)
        for e in range(2):
            for n in (0, 8):
                chunk = 2 * (2 * t + e) + n // 8
                assert [o_dim(n + i, t, e) for i in range(8)] == list(range(8 * chunk, 8 * chunk + 8))


def worst_conflict(offsets):
    """Ways of the worst bank conflict of one warp's 16-byte shared loads (a quarter warp a wavefront)."""
    return max(9 - len({off % 128 // 16 for off in offsets[p:p + 8]}) for p in range(0, 32, 8))


def test_code_tile_loads_and_copies_are_free_of_bank_conflicts():
    k_loads = [[code_at(key_row(8 * j + lane // 4), 4 * h + lane % 4) for lane in range(32)]
               for h in range(2) for j in range(2)]
    v_loads = [[code_at(4 * (lane % 4) + i, lane // 4) for lane in range(32)] for i in range(4)]
    copies = [[code_at(4 * p + lane // 8, lane % 8) for lane in range(32)] for p in range(4)]
    assert {worst_conflict(x) for x in k_loads + v_loads + copies} == {1}


# ---------------------------------------------------------------------------
# Compiled (nvcc)

ARCHES = ("sm_80", "sm_89", "sm_90a")
SPECS = [decode_spec(q, kv) for q in ("bfloat16", "float16") for kv in ("e4m3", "e5m2")] + \
    [decode_spec(q, kv, sliding_window=True, soft_cap=True, return_lse=True)
     for q in ("bfloat16", "float16") for kv in ("e4m3", "e5m2")]
# Where the variant still spills at the 168-register cap (Q's fragments take 32 registers): on
# sm_80 (software conversions) with bf16 queries or window, soft-cap and LSE; on sm_90a with bf16
# queries and those flags (24 bytes). Plain decode on sm_89 / sm_90a and fp16 there spill nothing.


def spills_known(spec, arch):
    heavy = spec.soft_cap
    return (arch == "sm_80" and (spec.dtype_q == "bfloat16" or heavy)) or \
        (arch == "sm_90a" and spec.dtype_q == "bfloat16" and heavy)


@pytest.mark.nvcc
@pytest.mark.slow
def test_variant_builds_without_spills_and_drops_the_widening_pass(variant, tmp_path):
    from helpers_sass import functions, innermost_loop, sass

    results = flashjit.build_many(SPECS, ARCHES, root=tmp_path)
    for result in results:
        assert result.entry is not None, result.error
        usage = [u for u in result.entry.manifest["resources"] if "fa2_attention_kernel" in u["kernel"]]
        assert {u["arch"] for u in usage} == set(ARCHES)
        spills = [u for u in usage if (u["spill_stores"] or u["spill_loads"] or u["stack"])
                  and not spills_known(result.spec, u["arch"])]
        assert spills == [], result.spec.name
        for name, code in functions(sass(result.entry.artifact)).items():
            if "fa2_attention_kernel" in name:
                loop = innermost_loop(code, must_hold=("HMMA",))
                assert not [i for i in loop if i.startswith(("LDSM", "STS", "BAR"))], result.spec.name
