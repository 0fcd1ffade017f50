"""The order of the fa3 tile loop as ptxas scheduled it (SASS of a CPU build for
sm_90a): where it is left to the compiler and a measured cost rides on it.

Each step of the loop waits for its Q.K^T (giving the K slot back), runs the
softmax, waits for the P.V before it and gives that tile's V slot back to the
loader. ptxas is free to move the arrival on the slot's "empty" barrier past
the softmax's exponentials, and did in the batch-invariant fold kernel at
head_dim 256 (every other tile), which then ran 6-7% slower than normal mode
with no chunk boundary crossed; with each chunk run from tile 0 it does not
(fa3_attention.cuh, benchmarks/results/2026-11-27-h200-batch-invariant-tile-loop.md)."""

from __future__ import annotations

import pytest

from flashjit import jit
from flashjit.spec import KernelSpec
from helpers_cache import needs_nvcc, set_cache_env
from helpers_sass import functions, innermost_loop, sass

WAIT, ARRIVE, EXP = "WARPGROUP.DEPBAR", "SYNCS.ARRIVE", "MUFU.EX2"


def exponentials_before_release(loop: list[str]) -> list[int]:
    """Per wgmma wait in the loop: the exponentials between it and the next
    arrival on a slot barrier."""
    out = []
    for at, ins in enumerate(loop):
        if WAIT in ins:
            after = loop[at + 1:]
            release = next(i for i, x in enumerate(after) if ARRIVE in x)
            out.append(sum(EXP in x for x in after[:release]))
    return out


@pytest.mark.nvcc
@needs_nvcc
@pytest.mark.parametrize("causal", [False, True])
def test_fa3_d256_gives_each_slot_back_before_the_softmax(monkeypatch, tmp_path, causal):
    set_cache_env(monkeypatch, tmp_path / "cache")
    spec = KernelSpec.make("batch_prefill_ragged", "bfloat16", 256, use_tensor_cores=True, causal=causal,
                           backend="fa3", return_lse=True)
    library = jit.build_many([spec], arches=("sm_90a",))[0].entry.artifact
    kernels = {name: code for name, code in functions(sass(library)).items() if "fa3_attention_kernel" in name}
    # Fa3Traits' last argument, kChunkFold: the normal kernel and batch-invariant mode's.
    assert sorted(name.endswith(("ELb0EEEEEv23FlashjitAttentionParamsNS_14KvMapsPagedArgE",
                                 "ELb1EEEEEv23FlashjitAttentionParamsNS_14KvMapsPagedArgE"))
                  for name in kernels) == [True, True]
    for name, code in kernels.items():
        loop = innermost_loop(code, must_hold=("HGMMA", WAIT, EXP))
        counts = exponentials_before_release(loop)
        # Two tiles per iteration, each with its two waits.
        assert len(counts) == 4, (name, counts)
        assert counts == [0, 0, 0, 0], f"{name}: exponentials before a slot is given back, per wait: {counts}"
