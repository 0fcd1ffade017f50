"""The order of the fa3 tile loop as ptxas scheduled it (SASS of CPU builds for
sm_90a), where it is left to the compiler and a measured cost rides on it.

Each step of the loop waits for its Q.K^T (giving the K slot back), runs the
softmax, waits for the P.V before it and gives that tile's V slot back to the
loader (an arrival on the slot's "empty" mbarrier). ptxas is free to move that
arrival past the softmax's exponentials, and did, every other tile: in the
batch-invariant fold kernel at head_dim 256, which then ran 6-7% slower than
normal mode with no chunk boundary crossed
(benchmarks/results/2026-11-27-h200-batch-invariant-tile-loop.md), and in every
paged kernel, d256 causal 6-7% slower for it
(benchmarks/results/2026-11-27-h200-fa3-paged-slot-release.md). The fold kernel
runs each chunk from tile 0 and the paged kernels order the exponentials after
the arrival through its token (fa3_attention.cuh); this checks that every fa3
prefill kernel, normal and fold, gives each slot back before the softmax, and
that head dim 96, on d128's tiles, multiplies only its data by Q.K^T."""

from __future__ import annotations

import dataclasses
import re

import pytest

from flashjit import jit, kernels
from flashjit.spec import KernelSpec
from helpers_cache import needs_nvcc, set_cache_env
from helpers_sass import functions, innermost_loop, sass

WAIT, EXP = "WARPGROUP.DEPBAR", "MUFU.EX2"
OPS = ["batch_prefill_ragged", "batch_prefill_paged"]
HEAD_DIMS = [64, 96, 128, 192, 256]
CAUSAL = [False, True]
# Every (op, head dim, causal), but d96 (d128's tiling and loop with six Q.K^T k-steps) causal only.
CONFIGS = [(op, d, c) for op in OPS for d in HEAD_DIMS for c in CAUSAL if d != 96 or c]
# Fa3Traits' last two arguments, kChunkFold and kHeadDimVo: normal mode's kernel and batch-invariant mode's
# (two E more where a variant's traits wrapper, Fa3QPrefetchTraits or Fa3PingPongTraits, wraps them).
KERNELS = {"normal": re.compile(r"ELb0ELi\d+EEEEE(?:EE)?v23FlashjitAttentionParamsNS_14KvMapsPagedArgE$"),
           "fold": re.compile(r"ELb1ELi\d+EEEEE(?:EE)?v23FlashjitAttentionParamsNS_14KvMapsPagedArgE$")}


def spec(op: str, head_dim: int, causal: bool) -> KernelSpec:
    return KernelSpec.make(op, "bfloat16", head_dim, use_tensor_cores=True, causal=causal, backend="fa3",
                           return_lse=True)


@pytest.fixture(scope="module")
def libraries(tmp_path_factory):
    """Every configuration's library, built in one parallel run."""
    mp = pytest.MonkeyPatch()
    set_cache_env(mp, tmp_path_factory.mktemp("cache"))
    specs = [spec(*config) for config in CONFIGS]
    try:
        results = jit.build_many(specs, arches=("sm_90a",))
    finally:
        mp.undo()
    return {s: r.entry.artifact for s, r in zip(specs, results)}


def exponentials_before_release(loop: list[str]) -> list[int]:
    """Per wgmma wait in the loop: the exponentials between it and the next
    arrival on a slot barrier."""
    out = []
    for at, ins in enumerate(loop):
        if WAIT in ins:
            after = loop[at + 1:]
            release = next(i for i, x in enumerate(after) if "SYNCS.ARRIVE" in x)
            out.append(sum(EXP in x for x in after[:release]))
    return out


@pytest.mark.nvcc
@needs_nvcc
@pytest.mark.parametrize("op,head_dim,causal", CONFIGS)
def test_fa3_gives_each_slot_back_before_the_softmax(libraries, op, head_dim, causal):
    code = functions(sass(libraries[spec(op, head_dim, causal)]))
    for kind, suffix in KERNELS.items():
        (name,) = [n for n in code if "fa3_attention_kernel" in n and suffix.search(n)]
        loop = innermost_loop(code[name], must_hold=("HGMMA", WAIT, EXP))
        counts = exponentials_before_release(loop)
        # Two tiles per iteration, each with its two waits.
        assert len(counts) == 4, (kind, counts)
        assert counts == [0, 0, 0, 0], f"{kind} kernel: exponentials before a slot is given back, per wait: {counts}"


@pytest.mark.nvcc
@needs_nvcc
@pytest.mark.parametrize("op", OPS)
def test_head_dim_96_runs_qk_over_its_data_and_pv_over_whole_blocks(libraries, op):
    """d96 runs on d128's tiles (fa3_traits.cuh kTileCols): per tile, Q.K^T takes 96 / 16 = 6 k-steps where d128
    takes 8, P.V the same 128 / 16 = 8 of m64n128k16 (V's second block half data), two tiles an iteration."""
    def loop_products(head_dim: int) -> int:
        code = functions(sass(libraries[spec(op, head_dim, True)]))
        (name,) = [n for n in code if "fa3_attention_kernel" in n and KERNELS["normal"].search(n)]
        loop = innermost_loop(code[name], must_hold=("HGMMA", WAIT, EXP))
        assert all("HGMMA.64x128x16.F32.BF16" in x for x in loop if "HGMMA" in x), name
        return sum("HGMMA" in x for x in loop)

    assert (loop_products(128), loop_products(96)) == (2 * (8 + 8), 2 * (6 + 8))


# Fa3Tiling variants (fa3_traits.cuh): field values, the traits wrapper that names the kernel, and the barrier
# instructions they add to the tile loop (none, or a turn's sync and arrival per step).
VARIANTS = {"q_buffers": (2, "Fa3QPrefetchTraits", 0), "pingpong": (True, "Fa3PingPongTraits", 2)}
NAMED_BARRIER = re.compile(r"(^|[\s}])BAR\.(SYNC|ARV)")


@pytest.mark.nvcc
@needs_nvcc
@pytest.mark.parametrize("field", VARIANTS)
def test_a_variant_keeps_the_tile_loop(libraries, monkeypatch, tmp_path, field):
    """Fa3Tiling(q_buffers=2) (the next position's Q copied while this one runs) changes the position's start;
    Fa3Tiling(pingpong=True) (the consumers' turns) adds a named-barrier sync and arrival around each step's
    products. Neither changes the tile loop otherwise: the same order, the same products, not serialized (two
    waits a step), the same length within a few instructions, no spills."""
    value, wrapper, turn_barriers = VARIANTS[field]
    shipped = spec("batch_prefill_ragged", 128, True)
    monkeypatch.setitem(kernels.fa3.FA3_TILINGS, 128,
                        dataclasses.replace(kernels.fa3.FA3_TILINGS[128], **{field: value}))
    set_cache_env(monkeypatch, tmp_path)
    (result,) = jit.build_many([shipped], arches=("sm_90a",))
    assert all(u["spill_stores"] == 0 for u in result.entry.manifest["resources"])
    loops = {}
    for name, library in (("shipped", libraries[shipped]), ("variant", result.entry.artifact)):
        code = functions(sass(library))
        for kind, suffix in KERNELS.items():
            (fn,) = [n for n in code if "fa3_attention_kernel" in n and suffix.search(n)]
            assert (wrapper in fn) == (name == "variant")
            loops[name, kind] = innermost_loop(code[fn], must_hold=("HGMMA", WAIT, EXP))
    for kind in KERNELS:
        variant, base = loops["variant", kind], loops["shipped", kind]
        assert exponentials_before_release(variant) == [0, 0, 0, 0], kind
        assert sum("HGMMA" in x for x in variant) == sum("HGMMA" in x for x in base) == 2 * (8 + 8)
        barriers = [sum(bool(NAMED_BARRIER.search(x)) for x in loop) for loop in (variant, base)]
        assert barriers == [2 * turn_barriers, 0], kind
        assert abs(len(variant) - len(base)) <= 8, (kind, len(variant), len(base))
