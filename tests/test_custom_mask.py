"""Custom masks without a GPU: what plan() packs for ragged and paged batches
(bit by bit against the mask, and the byte offsets of each request's segment),
the addresses the launched params carry (the stand-in GPU of
test_prepared_calls), the ValueErrors of bad masks before anything is built,
the backend choice, the prewarm selectors, the rendered source, the float64
reference's mask, and masks under tracing."""

from __future__ import annotations

import argparse
import ctypes
import dataclasses
import math
import shlex
import warnings

import pytest
import torch
from torch._subclasses.fake_tensor import FakeTensorMode

import flashjit
from flashjit import arch, cli, jit, render
from flashjit.loader import AttentionParams
from flashjit.numerics import runner
from flashjit.ops import _masks, _launch, prefill
from flashjit.reference import attention_reference, ragged_reference, request_masks
from flashjit.selection import SelectionError, flag_words, specs_from_args
from flashjit.selectors import add_arch, add_selectors, check_selectors
from flashjit.spec import KernelSpec
import test_prepared_calls
from test_prepared_calls import BF16, bf16, cuda
from test_prepared_runs import _i32, _plan, _wrapper

no_compile, gpu = test_prepared_calls.no_compile, test_prepared_calls.gpu  # fixtures
RAGGED = flashjit.BatchPrefillWithRaggedKVCacheWrapper
PAGED = flashjit.BatchPrefillWithPagedKVCacheWrapper
# A batch with a request without keys and one without queries.
QO, KV = [3, 5, 0, 1, 8], [10, 20, 7, 0, 33]


def _indptr(lengths) -> list[int]:
    out = [0]
    for n in lengths:
        out.append(out[-1] + n)
    return out


def _random_mask(qo_lens, kv_lens, seed=0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.rand(sum(q * k for q, k in zip(qo_lens, kv_lens)), generator=g) < 0.5


def _params(launch) -> AttentionParams:
    return AttentionParams.from_buffer_copy(launch[0][:ctypes.sizeof(AttentionParams)])


def _mask_fields(p: AttentionParams) -> tuple:
    return p.custom_mask, p.mask_indptr, p.mask_full_keys


def _full_keys(mask: torch.Tensor, qo_lens, kv_lens) -> list[int]:
    """Per request, the keys before the first hidden pair of any of its queries (all of them if none)."""
    out = []
    for qo, kv, part in zip(qo_lens, kv_lens, request_masks(mask, qo_lens, kv_lens)):
        hidden = [int((~part[q]).nonzero()[0]) for q in range(qo) if not part[q].all()]
        out.append(min(hidden, default=kv))
    return out


def _offsets(w, batch: int) -> list[int]:
    first = (w._plan.mask[1] - w._ints.data_ptr()) // 4
    return w._ints[first:first + batch + 1].tolist()


def _assert_bits(bits: torch.Tensor, offsets: list[int], mask: torch.Tensor, qo_lens, kv_lens) -> None:
    """Bit q * kv_len + key of request r's segment, little-endian in its byte, is mask's pair (q, key)."""
    values = bits.tolist()
    for r, (qo, kv, part) in enumerate(zip(qo_lens, kv_lens, request_masks(mask, qo_lens, kv_lens))):
        assert offsets[r + 1] - offsets[r] == (qo * kv + 7) // 8
        for q in range(qo):
            for key in range(kv):
                bit = q * kv + key
                assert (values[offsets[r] + bit // 8] >> (bit % 8)) & 1 == int(part[q, key]), (r, q, key)


# ---------------------------------------------------------------------------
# What plan() packs


def test_byte_offsets_of_each_requests_segment():
    assert _masks.byte_indptr(QO, KV) == [0, 4, 17, 17, 17, 50]


def _ragged(mask=None, packed=None, **kw):
    return _wrapper(RAGGED, _indptr(QO), _indptr(KV), 8, 2, 128, q_data_type=BF16, custom_mask=mask,
                    packed_custom_mask=packed, **kw)


def test_a_ragged_plan_packs_each_request_on_its_own(gpu):
    mask = _random_mask(QO, KV)
    w = _ragged(mask)
    assert w._plan.module.spec.custom_mask and w._plan.module.spec.name.endswith("_mask_lse")
    offsets = _offsets(w, len(QO))
    assert offsets == _masks.byte_indptr(QO, KV) and w._plan.mask[0] == w._mask_bits.data_ptr()
    _assert_bits(w._mask_bits, offsets, mask, QO, KV)


@pytest.mark.parametrize("page_size", [1, 16])
def test_a_paged_plan_packs_each_request_on_its_own(gpu, page_size):
    """Request i's kv_len: (pages_i - 1) * page_size + last_page_len_i (none without pages)."""
    pages, last = [2, 3, 0, 1, 1], [page_size, 1, 1, page_size // 2 + 1, 1]
    kv_lens = [(n - 1) * page_size + l if n else 0 for n, l in zip(pages, last)]
    qo = [3, 5, 2, 4, 8]
    mask = _random_mask(qo, kv_lens, seed=page_size)
    w = _wrapper(PAGED, _i32(*_indptr(qo)), _i32(*_indptr(pages)), _i32(*range(sum(pages))), _i32(*last), 8, 2, 128,
                 page_size, q_data_type=BF16, custom_mask=mask)
    _assert_bits(w._mask_bits, _offsets(w, len(qo)), mask, qo, kv_lens)


def test_a_packed_mask_is_kept_as_given_and_wins_over_custom_mask(gpu):
    mask = _random_mask(QO, KV, seed=3)
    packed, _ = flashjit.segment_packbits(mask, torch.tensor(_indptr([q * k for q, k in zip(QO, KV)])), "little")
    w = _ragged(torch.zeros(1, dtype=torch.bool), packed)  # custom_mask of the wrong length: not read
    assert w._mask_bits is packed  # on the device already: the caller's tensor, in-place changes reach runs
    assert torch.equal(_ragged(mask)._mask_bits, packed)


def test_an_integer_mask_of_zeros_and_ones_packs_as_bool(gpu):
    mask = _random_mask(QO, KV, seed=4)
    assert torch.equal(_ragged(mask.to(torch.int32))._mask_bits, _ragged(mask)._mask_bits)


def _tree_mask(qo_lens, kv_lens, hidden: list[tuple[int, int, int]]) -> torch.Tensor:
    """Every pair visible but (request, query, key) of `hidden`."""
    parts = [torch.ones(qo, kv, dtype=torch.bool) for qo, kv in zip(qo_lens, kv_lens)]
    for r, q, key in hidden:
        parts[r][q, key] = False
    return torch.cat([p.flatten() for p in parts])


@pytest.mark.parametrize("seed", range(12))
def test_full_keys_count_the_keys_every_query_sees(seed):
    """From the packed bits, per request: random masks, masks with a few hidden
    pairs (a tree behind its cache), requests without queries or keys."""
    g = torch.Generator().manual_seed(seed)
    batch = int(torch.randint(1, 7, (1,), generator=g))
    qo = [int(x) for x in torch.randint(0, 9, (batch,), generator=g)]
    kv = [int(x) for x in torch.randint(0, 70, (batch,), generator=g)]
    if seed % 2:
        mask = _random_mask(qo, kv, seed) | (torch.rand(sum(q * k for q, k in zip(qo, kv)), generator=g) < 0.9)
    else:
        hidden = [(r, int(torch.randint(0, qo[r], (1,), generator=g)), int(torch.randint(0, kv[r], (1,), generator=g)))
                  for r in range(batch) if qo[r] and kv[r] and seed % 4 == 0]
        mask = _tree_mask(qo, kv, hidden)
    offsets = _masks.byte_indptr(qo, kv)
    bits, _ = flashjit.segment_packbits(mask, torch.tensor(_indptr([q * k for q, k in zip(qo, kv)])), "little")
    counts = _masks.full_keys(bits, qo, kv, offsets)
    if sum(q * k for q, k in zip(qo, kv)) == 0:
        assert counts is None
    else:
        assert counts.dtype == torch.int32 and counts.tolist() == _full_keys(mask, qo, kv)


def test_full_keys_are_left_out_past_their_size_limit(monkeypatch):
    bits, _ = flashjit.segment_packbits(torch.ones(24, dtype=torch.bool), torch.tensor([0, 24]), "little")
    assert _masks.full_keys(bits, [3], [8], [0, 3]).tolist() == [8]
    monkeypatch.setattr(_masks, "FULL_KEYS_MAX_PAIRS", 23)
    assert _masks.full_keys(bits, [3], [8], [0, 3]) is None


def test_a_plan_places_the_full_key_counts(gpu):
    """A draft tree of 3 tokens behind each request's cache: the keys before the
    tree's first hidden pair; the params carry their address."""
    hidden = [(0, 0, 8), (1, 2, 15), (4, 1, 30), (4, 7, 25)]
    w = _ragged(_tree_mask(QO, KV, hidden))
    assert w._plan.mask[2] == w._mask_full.data_ptr()
    assert w._mask_full.tolist() == [8, 15, 7, 0, 25]


# ---------------------------------------------------------------------------
# The addresses in the launched params


def test_batch_params_carry_the_mask_and_its_offsets(gpu):
    w = _ragged(_random_mask(QO, KV))
    q, k, v = bf16(sum(QO), 8, 128), bf16(sum(KV), 2, 128), bf16(sum(KV), 2, 128)
    w.run(q, k, v)
    w.run(q, k, v)  # the fast slot: the same fixed bytes
    for launch in gpu.launches:
        assert _mask_fields(_params(launch)) == w._plan.mask
    _plan(w, _indptr(QO), _indptr(KV), 8, 2, 128, q_data_type=BF16, custom_mask=_random_mask(QO, KV, seed=9))
    w.run(q, k, v)
    assert _mask_fields(_params(gpu.launches[-1])) == w._plan.mask
    _plan(w, _indptr(QO), _indptr(KV), 8, 2, 128, q_data_type=BF16)
    w.run(q, k, v)
    assert _mask_fields(_params(gpu.launches[-1])) == (None, None, None) and w._mask_bits is None


def test_the_operator_run_of_a_masked_plan_carries_it(gpu):
    """torch.ops.flashjit's run() reads the wrapper's plan, mask included."""
    w = _ragged(_random_mask(QO, KV))
    q, k, v = bf16(sum(QO), 8, 128), bf16(sum(KV), 2, 128), bf16(sum(KV), 2, 128)
    torch.ops.flashjit.batch_prefill_ragged_run.default(w._handle, q, k, v, False)
    assert _mask_fields(_params(gpu.launches[-1])) == w._plan.mask


def test_single_prefill_params_carry_the_packed_mask_and_no_offsets(gpu):
    q, k, v = bf16(5, 8, 128), bf16(33, 2, 128), bf16(33, 2, 128)
    packed = cuda(flashjit.packbits(_random_mask([5], [33]), "little"))
    flashjit.single_prefill_with_kv_cache(q, k, v, packed_custom_mask=packed)
    p = _params(gpu.launches[-1])
    assert p.custom_mask == packed.data_ptr() and p.mask_indptr is None and p.mask_full_keys is None
    assert len(prefill._prepared) == 0  # a masked call is prepared for itself, never kept
    flashjit.single_prefill_with_kv_cache(q, k, v)
    assert _params(gpu.launches[-1]).custom_mask is None


# ---------------------------------------------------------------------------
# Bad masks: ValueErrors naming the argument, before anything is built


PAIRS = sum(q * k for q, k in zip(QO, KV))


@pytest.mark.parametrize("kwargs,match", [
    ({"custom_mask": torch.ones(PAIRS + 1, dtype=torch.bool)},
     rf"^custom_mask: expected {PAIRS} elements \(one per \(query, key\) pair, kv lengths from kv_indptr\), got"),
    ({"packed_custom_mask": torch.ones(49, dtype=torch.uint8)},
     r"^packed_custom_mask: expected a 1-D tensor of 50 bytes \(each request's qo_len \* kv_len bits packed"),
    ({"packed_custom_mask": torch.ones(50, dtype=torch.int8)}, r"^packed_custom_mask: expected dtype torch.uint8"),
    ({"custom_mask": torch.ones(PAIRS)}, r"^custom_mask: expected a bool tensor .* got torch.float32"),
    ({"custom_mask": torch.full((PAIRS,), 2)}, r"^custom_mask: expected 0 or 1 in an integer mask .* got 2"),
    ({"custom_mask": [True] * PAIRS}, r"^custom_mask: expected a torch.Tensor, got list"),
    ({"custom_mask": torch.ones(PAIRS, dtype=torch.bool), "causal": True}, r"^causal: expected False with custom_mask"),
    ({"custom_mask": cuda(torch.ones(PAIRS, dtype=torch.bool), 1)},
     r"^custom_mask: expected a tensor on cuda:0 \(the workspace's device\) or the CPU, got cuda:1"),
    ({"custom_mask": torch.ones(PAIRS, dtype=torch.bool), "q_data_type": torch.float32},
     r"^custom_mask: custom masks run on the fa2 tensor cores with float16 or bfloat16, not on CUDA cores; got "
     r"float32 runs on CUDA cores only"),
    ({"custom_mask": torch.ones(PAIRS, dtype=torch.bool), "q_data_type": torch.float32, "batch_invariant": True},
     r"^custom_mask: .*batch-invariant mode runs it on the CUDA-core prefill kernel"),
    ({"packed_custom_mask": torch.ones(50, dtype=torch.uint8), "use_tensor_cores": False},
     r"^packed_custom_mask: custom masks run on the fa2 tensor cores .* got use_tensor_cores=False was requested"),
])
def test_bad_masks_of_a_plan(no_compile, kwargs, match):
    plan = dict(qo_indptr=_indptr(QO), kv_indptr=_indptr(KV), num_qo_heads=8, num_kv_heads=2, head_dim_qk=128,
                q_data_type=BF16)
    with pytest.raises(ValueError, match=match):
        RAGGED(cuda(torch.empty(1 << 16, dtype=torch.uint8))).plan(**{**plan, **kwargs})


def test_a_paged_plans_mask_names_where_its_lengths_come_from(no_compile):
    w = PAGED(cuda(torch.empty(1 << 16, dtype=torch.uint8)))
    indices = cuda(torch.arange(3, dtype=torch.int32))
    with pytest.raises(ValueError, match=r"^custom_mask: expected 72 elements \(one per \(query, key\) pair, kv "
                                         r"lengths from paged_kv_indptr, paged_kv_last_page_len and page_size\)"):
        w.plan(_i32(0, 2, 4), _i32(0, 2, 3), indices, _i32(16, 4), 8, 2, 128, 16, q_data_type=BF16,
               custom_mask=torch.ones(41, dtype=torch.bool))  # 2 x 32 + 2 x 4 pairs


def test_cuda_graphs_need_a_mask_buffer_large_enough(gpu):
    plan = (_indptr(QO), _indptr(KV), 8, 2, 128)
    with pytest.raises(ValueError, match=r"^custom_mask_buf: use_cuda_graph=True with custom_mask needs a uint8 "
                                         r"buffer given at construction"):
        _wrapper(RAGGED, *plan, ctor={"use_cuda_graph": True}, q_data_type=BF16, custom_mask=_random_mask(QO, KV))
    small = {"use_cuda_graph": True, "custom_mask_buf": cuda(torch.zeros(49, dtype=torch.uint8))}
    with pytest.raises(ValueError, match=r"^custom_mask_buf: expected room for the 50 bytes"):
        _wrapper(RAGGED, *plan, ctor=small, q_data_type=BF16, custom_mask=_random_mask(QO, KV))


def test_a_cuda_graph_plan_writes_the_mask_buffer_in_place(gpu, monkeypatch):
    """The bits into custom_mask_buf, the full-key counts into one tensor of the
    wrapper's own: both addresses stay what a captured launch keeps, new lengths
    and masks too; zeros where the counts are left out (every tile tested)."""
    buffer = cuda(torch.zeros(64, dtype=torch.uint8))
    w = RAGGED(cuda(torch.empty(1 << 16, dtype=torch.uint8)), use_cuda_graph=True, custom_mask_buf=buffer)
    kv_lens, first = KV, None
    for seed in (1, 2, 3):
        mask = _random_mask(QO, kv_lens, seed) | (torch.rand(sum(q * k for q, k in zip(QO, kv_lens))) < 0.8)
        w._device = torch.device("cpu")
        w.plan(_indptr(QO), _indptr(kv_lens), 8, 2, 128, q_data_type=BF16, custom_mask=mask)
        assert w._plan.mask[0] == buffer.data_ptr() and w._plan.mask[2] == w._mask_full.data_ptr()
        first = first or w._plan.mask[2]
        assert w._plan.mask[2] == first
        _assert_bits(buffer, _offsets(w, len(QO)), mask, QO, kv_lens)
        assert w._mask_full.tolist() == _full_keys(mask, QO, kv_lens)
        kv_lens = [n + 2 * (n > 0) for n in kv_lens]  # the next step's lengths
    monkeypatch.setattr(_masks, "FULL_KEYS_MAX_PAIRS", 0)
    w.plan(_indptr(QO), _indptr(KV), 8, 2, 128, q_data_type=BF16, custom_mask=_random_mask(QO, KV))
    assert w._plan.mask[2] == first and w._mask_full.tolist() == [0] * len(QO)


@pytest.mark.parametrize("kwargs,match", [
    ({"custom_mask": torch.ones(5, 34, dtype=torch.bool)},
     r"^custom_mask: expected shape \(5, 33\) \(\[qo_len, kv_len\], q's 5 tokens x k's 33\) or 165 elements flat"),
    ({"custom_mask": torch.ones(164, dtype=torch.bool)}, r"^custom_mask: expected shape \(5, 33\) or 165 elements flat"),
    ({"packed_custom_mask": torch.ones(20, dtype=torch.uint8)}, r"^packed_custom_mask: expected a 1-D tensor of 21 bytes"),
    ({"custom_mask": torch.ones(5, 33, dtype=torch.bool), "causal": True}, r"^causal: expected False with custom_mask"),
    ({"custom_mask": torch.ones(5, 33, dtype=torch.bool), "use_tensor_cores": False},
     r"^custom_mask: custom masks run on the fa2 tensor cores"),
])
def test_bad_masks_of_single_prefill(no_compile, kwargs, match):
    q, k, v = (torch.randn(*shape).to(BF16) for shape in ((5, 8, 128), (33, 2, 128), (33, 2, 128)))
    with pytest.raises(ValueError, match=match):
        flashjit.single_prefill_with_kv_cache(q, k, v, **kwargs)


def test_single_prefill_reads_the_mask_where_q_is(gpu):
    q, k, v = bf16(5, 8, 128), bf16(33, 2, 128), bf16(33, 2, 128)
    with pytest.raises(ValueError, match=r"^custom_mask: expected a tensor on cuda:0 \(where q is: the kernel reads "
                                         r"it there\), got cpu"):
        flashjit.single_prefill_with_kv_cache(q, k, v, custom_mask=torch.ones(5, 33, dtype=torch.bool))
    assert not gpu.launches


def test_masks_are_no_operands_of_the_traced_single_prefill():
    with FakeTensorMode():
        q, k, v = (torch.empty(*shape, dtype=BF16, device="cuda") for shape in ((5, 8, 128), (33, 2, 128),
                                                                                (33, 2, 128)))
        with pytest.raises(NotImplementedError, match=r"^custom_mask: single_prefill_with_kv_cache takes no custom "
                                                      r"mask under torch.compile"):
            flashjit.single_prefill_with_kv_cache(q, k, v, custom_mask=torch.ones(5, 33, dtype=torch.bool))


# ---------------------------------------------------------------------------
# The backend and the configuration


def test_auto_runs_fa2_with_a_mask_and_an_explicit_fa3_falls_back_or_raises(monkeypatch):
    monkeypatch.setattr(arch, "_warned_fallbacks", set())
    op = "batch_prefill_ragged"
    assert arch.choose_backend(op, "bfloat16", None, "auto", targets=("sm_90a",))[0] == "fa3"
    backend, tc, reason = arch.choose_backend(op, "bfloat16", None, "auto", targets=("sm_90a",), custom_mask=True)
    assert (backend, tc) == ("fa2", True) and reason.endswith("fa2 (mma.sync), as fa3 has no custom masks")
    with pytest.warns(UserWarning, match="fa3 has no custom masks: running fa2"):
        assert arch.choose_backend(op, "bfloat16", None, "fa3", targets=("sm_90a",), custom_mask=True)[0] == "fa2"
    with pytest.raises(ValueError, match=r"^backend='fa3' cannot run here: fa3 has no custom masks"):
        arch.choose_backend(op, "bfloat16", None, "fa3", targets=("sm_90a",), strict=True, custom_mask=True)


def test_select_spec_names_the_mask_configuration(monkeypatch):
    monkeypatch.setenv("FLASHJIT_CUDA_ARCH_LIST", "9.0a")
    spec = _launch.select_spec("single_prefill", torch.float16, 128, backend="auto", use_tensor_cores=None,
                               causal=False, window=False, soft_cap=False, return_lse=False,
                               custom_mask="custom_mask")
    assert spec == KernelSpec.make("single_prefill", "float16", 128, use_tensor_cores=True, custom_mask=True)
    assert spec.name == "single_prefill_f16_d128_fa2_tc_mask"


def test_the_rendered_source_reads_the_mask():
    spec = KernelSpec.make("batch_prefill_paged", "bfloat16", 128, use_tensor_cores=True, return_lse=True,
                           custom_mask=True).validate()
    assert "/*kCustomMask=*/true" in render.render(spec, ("sm_80",)).text
    assert "/*kCustomMask=*/false" in render.render(spec.replace(custom_mask=False), ("sm_80",)).text


def _selection(*argv):
    parser = argparse.ArgumentParser()
    add_selectors(parser)
    add_arch(parser)
    args = parser.parse_args([*argv, "--arch", "sm_80", "sm_90a"])
    check_selectors(args)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return specs_from_args(args, args.arch)


def test_the_mask_selector():
    names = [s.name for s in _selection("--mask", "custom")]
    # The default preset's causal prefill, as a mask holds its own, its e4m3 part's too.
    assert names == [f"batch_prefill_{kind}_bf16_d{d}_fa2_tc_mask_lse" for kind in ("ragged", "paged")
                     for d in (64, 128, 256)] + ["batch_prefill_paged_bf16_kve4m3_d128_fa2_tc_mask_lse"]
    both = {s.name for s in _selection("--mask", "both", "--op", "single_prefill", "--dtype", "fp16",
                                       "--head-dim", "64", "--causal", "off")}
    assert both == {"single_prefill_f16_d64_fa2_tc", "single_prefill_f16_d64_fa3_tc", "single_prefill_f16_d64_fa2_tc_mask"}
    spec = _selection("--mask", "custom", "--op", "single_prefill", "--head-dim", "128")[0]
    assert "--causal off --mask custom --window off" in flag_words(spec)


def test_the_prewarm_command_of_a_mask_configuration_builds_it():
    """The command a FLASHJIT_DISABLE_JIT miss names selects exactly that kernel."""
    spec = KernelSpec.make("batch_prefill_paged", "float16", 64, use_tensor_cores=True, return_lse=True,
                           custom_mask=True)
    args = cli.build_parser().parse_args(shlex.split(jit.prewarm_command(spec, ("sm_90a",)))[1:])
    assert cli.specs_from_args(args, ("sm_90a",)) == [spec]


@pytest.mark.parametrize("argv,match", [
    (["--mask", "on"], r"^--mask: on is not a choice; choose off, custom or both"),
    (["--mask", "custom", "--causal", "on", "--op", "batch_prefill_ragged"], r"a custom mask holds the causal part"),
    (["--mask", "custom", "--dtype", "fp32", "--op", "single_prefill"], r"--mask custom runs on the fa2 tensor cores"),
    (["--mask", "custom", "--op", "batch_decode_paged"], r"batch_decode_paged takes no custom mask"),
])
def test_the_mask_selector_says_what_it_cannot_build(argv, match):
    with pytest.raises(SelectionError, match=match):
        _selection(*argv)


# ---------------------------------------------------------------------------
# The float64 reference


def _qkv(qo=6, kv=9, heads=(4, 2), dim=16):
    g = torch.Generator().manual_seed(0)
    return (torch.randn(qo, heads[0], dim, generator=g), torch.randn(kv, heads[1], dim, generator=g),
            torch.randn(kv, heads[1], dim, generator=g))


def test_the_reference_applies_the_mask():
    q, k, v = _qkv()
    full = torch.ones(6, 9, dtype=torch.bool)
    for a, b in zip(attention_reference(q, k, v, mask=full), attention_reference(q, k, v)):
        assert torch.equal(a, b)
    causal = full.tril(9 - 6)
    for a, b in zip(attention_reference(q, k, v, mask=causal), attention_reference(q, k, v, causal=True)):
        assert torch.equal(a, b)
    hidden = full.clone()
    hidden[2] = False
    hidden[4, :5] = False
    o, lse = attention_reference(q, k, v, mask=hidden)
    assert (o[2] == 0).all() and torch.isneginf(lse[2]).all()
    o4, _ = attention_reference(q[4:5], k[5:], v[5:])
    assert torch.allclose(o[4], o4[0], rtol=1e-12, atol=1e-12)


def test_the_ragged_reference_takes_a_mask_per_request():
    q, k, v = _qkv(qo=8, kv=12)
    qo_lens, kv_lens = [3, 0, 5], [4, 2, 6]
    mask = _random_mask(qo_lens, kv_lens)
    parts = request_masks(mask, qo_lens, kv_lens)
    assert [tuple(p.shape) for p in parts] == [(3, 4), (0, 2), (5, 6)]
    o, lse = ragged_reference(q, k, v, _indptr(qo_lens), _indptr(kv_lens), masks=parts)
    o2, lse2 = attention_reference(q[3:], k[6:], v[6:], mask=parts[2])
    assert torch.equal(o[3:], o2) and torch.equal(lse[3:], lse2)
    with pytest.raises(ValueError, match=r"^mask: expected 42 elements"):
        request_masks(torch.ones(43, dtype=torch.bool), qo_lens, kv_lens)
    assert math.isinf(float(ragged_reference(q[:1], k[:1], v[:1], [0, 1], [0, 1],
                                             masks=[torch.zeros(1, 1, dtype=torch.bool)])[1][0, 0]))


def test_numerics_draws_a_mask_per_call_and_measures_against_it():
    spec = KernelSpec.make("batch_prefill_ragged", "bfloat16", 64, use_tensor_cores=True, return_lse=True,
                           custom_mask=True)
    (p,) = runner.problems(spec, "near_empty", torch.Generator().manual_seed(0), device="cpu")
    assert p.mask.dtype == torch.bool and p.mask.numel() == sum(q * k for q, k in zip(p.qo_lens, p.kv_lens))
    ref, lse = runner.reference(spec, p)
    masked = ragged_reference(p.q, p.k, p.v, _indptr(p.qo_lens), _indptr(p.kv_lens),
                              masks=request_masks(p.mask, p.qo_lens, p.kv_lens))
    assert torch.equal(ref, masked[0]) and torch.equal(lse, masked[1])
    assert not torch.equal(ref, runner.reference(spec, dataclasses.replace(p, mask=None))[0])
