"""Bad arguments to the batch wrappers: constructor, plan() and run() checks,
each a ValueError (or NotImplementedError) naming the argument, what was
expected and what came. No GPU: the workspace is a CPU buffer that claims to be
on cuda:0, and run()'s checks against a plan use a plan made on the host with
a stand-in kernel module (nothing is compiled or loaded)."""

from __future__ import annotations

import math
import re
from types import SimpleNamespace

import pytest
import torch

import flashjit
from flashjit import jit
from flashjit.ops import _batch, _checks, _launch
from helpers_cache import no_compile  # noqa: F401 (a fixture)

pytestmark = pytest.mark.usefixtures("no_compile")


class _FakeCudaTensor(torch.Tensor):
    """A CPU buffer that claims to live on cuda:0: lets the wrapper be constructed
    without a GPU so that plan()'s argument checks can run."""

    @property
    def device(self):
        return torch.device("cuda", 0)


def _on_fake_cuda(t: torch.Tensor) -> torch.Tensor:
    return torch.Tensor._make_subclass(_FakeCudaTensor, t)


def _workspace() -> torch.Tensor:
    return _on_fake_cuda(torch.empty(1 << 16, dtype=torch.uint8))


def _wrapper(**kwargs):
    return flashjit.BatchPrefillWithRaggedKVCacheWrapper(_workspace(), **kwargs)


def _bf16(*shape) -> torch.Tensor:
    return torch.randn(*shape).to(torch.bfloat16)


def test_wrapper_needs_a_cuda_workspace():
    with pytest.raises(ValueError, match=r"^float_workspace_buffer: expected a CUDA tensor"):
        flashjit.BatchPrefillWithRaggedKVCacheWrapper(torch.empty(1024, dtype=torch.uint8))


@pytest.mark.parametrize("kwargs,exc,match", [
    ({"kv_layout": "NDH"}, ValueError, r"^kv_layout"),
    ({"custom_mask_buf": torch.ones(4, dtype=torch.uint8)}, ValueError, r"^custom_mask_buf: expected a tensor on cuda:0"),
    ({"mask_indptr_buf": torch.ones(4, dtype=torch.uint8)}, ValueError, r"^mask_indptr_buf: expected a 1-D torch.int32"),
    ({"jit_args": ["x"]}, NotImplementedError, r"^jit_args"),
])
def test_wrapper_constructor_options(kwargs, exc, match):
    with pytest.raises(exc, match=match):
        _wrapper(**kwargs)


PLAN = dict(qo_indptr=[0, 3, 8], kv_indptr=[0, 10, 30], num_qo_heads=8, num_kv_heads=2, head_dim_qk=128,
            q_data_type=torch.bfloat16)


@pytest.mark.parametrize("change,exc,match", [
    ({"qo_indptr": [0, 8, 3]}, ValueError, r"^qo_indptr: expected non-decreasing"),
    ({"kv_indptr": [0, 10]}, ValueError, r"^kv_indptr: expected 3 elements \(batch_size \+ 1\), got 2"),
    ({"kv_indptr": torch.tensor([[0, 10, 30]], dtype=torch.int32)}, ValueError, r"^kv_indptr: expected a 1-D"),
    ({"qo_indptr": [-1, 3, 8]}, ValueError, r"^qo_indptr: expected non-negative"),
    ({"num_qo_heads": 6, "num_kv_heads": 4}, ValueError, r"^num_qo_heads \(6\) must be a multiple"),
    ({"num_kv_heads": 0}, ValueError, r"^num_qo_heads / num_kv_heads: expected positive"),
    ({"head_dim_qk": 100}, ValueError, r"^head_dim_qk: expected a head_dim that is a multiple of 16 from 32 to 256, "
                                       r"got 100 \(nearest generated: 96 or 112\)$"),
    ({"head_dim_vo": 64}, ValueError, r"^head_dim_vo: expected 128"),
    ({"q_data_type": torch.int8}, ValueError, r"^q_data_type: expected float16, bfloat16 or float32"),
    ({"q_data_type": "float64"}, ValueError, r"^q_data_type"),
    ({"kv_data_type": torch.float16}, ValueError, r"^kv_data_type: expected torch.bfloat16"),
    ({"o_data_type": "float32"}, ValueError, r"^o_data_type: expected torch.bfloat16"),
    ({"window_left": -2}, ValueError, r"^window_left: expected -1"),
    ({"logits_soft_cap": -5.0}, ValueError, r"^logits_soft_cap"),
    ({"sm_scale": math.nan}, ValueError, r"^sm_scale"),
    ({"custom_mask": torch.ones(3, dtype=torch.bool)}, ValueError, r"^custom_mask: expected 130 elements"),
    ({"custom_mask": torch.ones(130, dtype=torch.bool), "causal": True}, ValueError, r"^causal: expected False"),
    ({"pos_encoding_mode": "ROPE_LLAMA"}, NotImplementedError, r"^pos_encoding_mode='ROPE_LLAMA'"),
    ({"use_fp16_qk_reduction": True}, NotImplementedError, r"^use_fp16_qk_reduction=True"),
    ({"q_data_type": torch.float32, "use_tensor_cores": True}, ValueError, r"Nearest working choice"),
], ids=lambda x: "-".join(x) if isinstance(x, dict) else None)
def test_wrapper_plan_checks(change, exc, match):
    with pytest.raises(exc, match=match):
        _wrapper().plan(**{**PLAN, **change})


def test_wrapper_run_before_plan():
    q, k, v = _bf16(8, 8, 128), _bf16(30, 2, 128), _bf16(30, 2, 128)
    with pytest.raises(RuntimeError, match=r"run\(\) called before plan\(\)"):
        _wrapper().run(q, k, v)


# ---------------------------------------------------------------------------
# The paged wrappers: plan() checks of the page table, no GPU

def _i32(*values):
    return torch.tensor(values, dtype=torch.int32)


DECODE_PLAN = dict(indptr=_i32(0, 2, 5), indices=_i32(4, 0, 1, 2, 3), last_page_len=_i32(7, 16), num_qo_heads=8,
                   num_kv_heads=2, head_dim=128, page_size=16, q_data_type=torch.bfloat16)


@pytest.mark.parametrize("change,match", [
    ({"indptr": _i32(0, 5, 2)}, r"^indptr: expected non-decreasing"),
    ({"indptr": [0, 2, 5, 5]}, r"^last_page_len: expected 3 elements \(batch_size\), got 2"),
    ({"last_page_len": _i32(0, 16)}, r"^last_page_len: expected 1\.\.16 \(page_size\) for request 0"),
    ({"last_page_len": _i32(7, 17)}, r"^last_page_len: expected 1\.\.16 \(page_size\) for request 1"),
    ({"last_page_len": _i32(7)}, r"^last_page_len: expected 2 elements \(batch_size\), got 1"),
    ({"indices": _i32(4, 0, 1)}, r"^indices: expected at least 5 elements, got 3"),
    ({"indices": torch.tensor([4, 0, 1, 2, 3])}, r"^indices: expected a 1-D int32 tensor, got torch.int64"),
    ({"page_size": 0}, r"^page_size: expected a positive int"),
    ({"head_dim": 72}, r"^head_dim: expected a head_dim that is a multiple of 16 from 32 to 256, got 72 \(nearest "
                       r"generated: 64 or 80\)$"),
    ({"pos_encoding_mode": "ROPE_LLAMA"}, r"^pos_encoding_mode='ROPE_LLAMA'"),
    ({"q_data_type": torch.float32, "kv_data_type": torch.float16}, r"^kv_data_type: expected torch.float32"),
], ids=lambda x: "-".join(x) if isinstance(x, dict) else None)
def test_paged_decode_plan_checks(change, match):
    wrapper = flashjit.BatchDecodeWithPagedKVCacheWrapper(_workspace())
    with pytest.raises((ValueError, NotImplementedError), match=match):
        wrapper.plan(**{**DECODE_PLAN, **change})


def test_paged_prefill_plan_names_its_arguments():
    wrapper = flashjit.BatchPrefillWithPagedKVCacheWrapper(_workspace())
    with pytest.raises(ValueError, match=r"^paged_kv_last_page_len: expected 1\.\.16"):
        wrapper.plan(_i32(0, 3, 8), _i32(0, 2, 5), _i32(4, 0, 1, 2, 3), _i32(7, 0), 8, 2, 128, 16, causal=True,
                     q_data_type=torch.bfloat16)
    with pytest.raises(ValueError, match=r"^paged_kv_indptr: expected 3 elements"):
        wrapper.plan(_i32(0, 3, 8), _i32(0, 5), _i32(4, 0, 1, 2, 3), _i32(7), 8, 2, 128, 16,
                     q_data_type=torch.bfloat16)


@pytest.mark.parametrize("form", ["5d", "tuple"])
@pytest.mark.parametrize("layout", ["NHD", "HND"])
def test_paged_cache_geometry(layout, form):
    """What run() reads from a cache: pages, page size, heads, dim, and (token, head, page) strides."""
    pages, page_size, heads, dim = 7, 16, 2, 64
    inner = (page_size, heads, dim) if layout == "NHD" else (heads, page_size, dim)
    cache = torch.randn(pages, 2, *inner).to(torch.bfloat16)
    arg = cache if form == "5d" else (cache[:, 0].contiguous(), cache[:, 1].contiguous())
    k, v, n, ps, h, d, ks, vs = _checks.paged_kv_cache(arg, layout)
    assert (n, ps, h, d) == (pages, page_size, heads, dim)
    token, head = (1, 2) if layout == "NHD" else (2, 1)
    for t, strides in ((k, ks), (v, vs)):
        assert strides == (t.stride(token), t.stride(head), t.stride(0))
    assert torch.equal(k, cache[:, 0]) and torch.equal(v, cache[:, 1])
    if form == "5d":
        assert k.data_ptr() == cache.data_ptr() and ks[2] == cache.stride(0)
    # The launch path: the same geometry, K and V addresses without views (5-D), twice (memoised).
    for _ in range(2):
        k_src, v_src, v_offset, *geometry = _checks.paged_kv_sources(arg, layout)
        assert tuple(geometry) == (n, ps, h, d, ks, vs)
        assert k_src.data_ptr() == k.data_ptr() and v_src.data_ptr() + v_offset == v.data_ptr()


@pytest.mark.parametrize("strides,page_size,match", [
    ((2**30, 128, 0), 0, "k: expected a token stride below 2 GiB, got 2147483648 bytes"),
    ((1024, 2**30, 0), 0, "k: expected a head stride below 2 GiB"),
    ((1024, 128, 2**30), 16, "k: expected a page stride below 2 GiB"),
    ((2**29, 128, 2**29), 8, "k: expected the 8 tokens of a page to span below 4 GiB"),
])
def test_kv_strides_beyond_32_bit_offsets(strides, page_size, match):
    with pytest.raises(ValueError, match=re.escape(match)):
        _launch.check_kv_strides("k", strides, page_size, 2)
    _launch.check_kv_strides("k", (1024, 128, 16 * 1024), 16, 2)  # a usual cache passes


# ---------------------------------------------------------------------------
# run() against its plan: every mismatch names the argument, the planned value
# and what came


@pytest.fixture
def launches(no_compile, monkeypatch):
    """plan() on the host: a stand-in kernel module (the no_compile fixture
    still forbids any build), a fixed wave of CTAs; run() records its launches
    instead of reaching the device check. Returns the list of launches."""
    monkeypatch.setattr(jit, "get_module", lambda spec: SimpleNamespace(spec=spec, rows_per_cta=64, split_align=64))
    monkeypatch.setattr(_batch, "resident_ctas", lambda module, device: 132)
    calls = []
    monkeypatch.setattr(_batch.BatchAttention, "_launch", lambda self, q, *rest, **kw: calls.append(q.shape))
    return calls


def _planned(cls, *plan_args, ctor=None, **plan_kwargs):
    wrapper = cls(_workspace(), **(ctor or {}))
    wrapper._device = torch.device("cpu")  # the plan's metadata and page ids stay where they are
    wrapper.plan(*plan_args, **plan_kwargs)
    return wrapper


HEADS = dict(num_qo_heads=8, num_kv_heads=2)
QO_INDPTR, KV_INDPTR = [0, 3, 8], [0, 10, 30]  # ragged: 8 query tokens, 30 keys
PAGE_TABLE = (_i32(0, 2, 5), _i32(4, 0, 1, 2, 3), _i32(7, 16))  # paged: 2 requests, 5 pages of 16, ids 0..4
KINDS = ["ragged", "paged_prefill", "decode"]
PAGED = ["paged_prefill", "decode"]
PLANNED_ROWS = {"ragged": (8, "qo_indptr[-1]"), "paged_prefill": (8, "qo_indptr[-1]"),
                "decode": (2, "batch_size: one query token per request of indptr")}


def _valid(kind: str, kv_layout: str = "NHD", **ctor):
    """A planned wrapper and arguments its run() accepts (bf16, head_dim 128, 8 qo / 2 kv heads)."""
    ctor = {"kv_layout": kv_layout, **ctor}
    if kind == "ragged":
        w = _planned(flashjit.BatchPrefillWithRaggedKVCacheWrapper, QO_INDPTR, KV_INDPTR, **HEADS, head_dim_qk=128,
                     q_data_type=torch.bfloat16, ctor=ctor)
        kv = (30, 2, 128) if kv_layout == "NHD" else (2, 30, 128)
        return w, {"q": _bf16(8, 8, 128), "k": _bf16(*kv), "v": _bf16(*kv)}
    page = (16, 2, 128) if kv_layout == "NHD" else (2, 16, 128)
    if kind == "paged_prefill":
        w = _planned(flashjit.BatchPrefillWithPagedKVCacheWrapper, _i32(*QO_INDPTR), *PAGE_TABLE, **HEADS,
                     head_dim_qk=128, page_size=16, q_data_type=torch.bfloat16, ctor=ctor)
        rows = 8
    else:
        w = _planned(flashjit.BatchDecodeWithPagedKVCacheWrapper, *PAGE_TABLE, **HEADS, head_dim=128, page_size=16,
                     q_data_type=torch.bfloat16, ctor=ctor)
        rows = 2
    return w, {"q": _bf16(rows, 8, 128), "paged_kv_cache": _bf16(5, 2, *page)}


def _run(w, args: dict):
    args = dict(args)
    extra = args.pop("extra", ())
    tensors = [args.pop(name) for name in ("q", "k", "v", "paged_kv_cache") if name in args]
    return w.run(*tensors, *extra, **args)


@pytest.mark.parametrize("layout", ["NHD", "HND"])
@pytest.mark.parametrize("kind", KINDS)
def test_run_accepts_what_was_planned(kind, layout, launches):
    w, args = _valid(kind, layout)
    rows = args["q"].shape[0]
    out, lse = _run(w, {**args, "return_lse": True})
    assert out.shape == (rows, 8, 128) and out.dtype == torch.bfloat16 and lse.shape == (rows, 8)
    _run(w, {**args, "out": torch.empty_like(args["q"]), "lse": torch.empty(rows, 8), "return_lse": True})
    assert launches == [(rows, 8, 128)] * 2


@pytest.mark.parametrize("delta", [1, -1], ids=["more", "fewer"])
@pytest.mark.parametrize("kind", KINDS)
def test_q_rows_must_match_the_plan(kind, delta, launches):
    """3 rows against a decode plan of batch 2 used to come back with a zero row."""
    w, args = _valid(kind)
    planned, what = PLANNED_ROWS[kind]
    rows = planned + delta
    with pytest.raises(ValueError, match=rf"^q: expected {planned} rows \({re.escape(what)} as planned\), "
                                         rf"got {rows} \(shape \({rows}, 8, 128\)\)$"):
        _run(w, {**args, "q": _bf16(rows, 8, 128)})
    assert launches == []


@pytest.mark.parametrize("kind", KINDS)
def test_rows_are_checked_on_every_call(kind, launches):
    """A signature run() has validated leaves the token counts out; a later
    call with other row counts is still checked."""
    w, args = _valid(kind)
    _run(w, args)
    rows = args["q"].shape[0]
    with pytest.raises(ValueError, match=rf"^q: expected {rows} rows"):
        _run(w, {**args, "q": _bf16(rows + 1, 8, 128)})
    if kind == "ragged":
        with pytest.raises(ValueError, match=r"^k: expected 30 tokens \(kv_indptr\[-1\] as planned\) in layout NHD, "
                                             r"got 31 \(shape \(31, 2, 128\)\)$"):
            _run(w, {**args, "k": _bf16(31, 2, 128), "v": _bf16(31, 2, 128)})
    assert len(launches) == 1


def _mistake(name, kinds, change, match, exc=ValueError):
    return pytest.param(kinds, change, match, exc, id=name)


# change(args) -> args; every kind in `kinds` must reject it with `match`.
RUN_MISTAKES = [
    _mistake("q-qo-heads", KINDS, lambda a: {**a, "q": a["q"][:, :4].contiguous()},
             r"^q: expected 8 qo heads \(num_qo_heads\) as planned, got 4 \(shape \(\d+, 4, 128\)\)$"),
    _mistake("q-head_dim", KINDS, lambda a: {**a, "q": a["q"][..., :64].contiguous()},
             r"^q: expected head_dim 128 as planned, got 64"),
    _mistake("q-dtype", KINDS, lambda a: {**a, "q": a["q"].half()},
             r"^q: expected dtype torch.bfloat16 as planned \(q_data_type\), got torch.float16$"),
    _mistake("q-2d", KINDS, lambda a: {**a, "q": a["q"][0]}, r"^q: expected 3 dimensions, got shape \(8, 128\)"),
    _mistake("q-not-a-tensor", KINDS, lambda a: {**a, "q": a["q"].tolist()}, r"^q: expected a torch.Tensor, got list"),
    _mistake("k-dtype", ["ragged"], lambda a: {**a, "k": a["k"].half()},
             r"^k: expected dtype torch.bfloat16 as planned \(kv_data_type\), got torch.float16$"),
    _mistake("v-dtype", ["ragged"], lambda a: {**a, "v": a["v"].float()},
             r"^v: expected dtype torch.bfloat16 as planned \(kv_data_type\), got torch.float32$"),
    _mistake("k-kv-heads", ["ragged"], lambda a: {**a, "k": _bf16(30, 4, 128)},
             r"^k: expected 2 kv heads of head_dim 128 as planned \(layout NHD\), got 4 of 128 "
             r"\(shape \(30, 4, 128\)\)$"),
    _mistake("v-kv-heads", ["ragged"], lambda a: {**a, "v": _bf16(30, 1, 128)},
             r"^v: expected 2 kv heads of head_dim 128 as planned \(layout NHD\), got 1 of 128"),
    _mistake("k-head_dim", ["ragged"], lambda a: {**a, "k": _bf16(30, 2, 64)}, r"^k: expected 2 kv heads of "
             r"head_dim 128 as planned \(layout NHD\), got 2 of 64"),
    _mistake("k-rows-short", ["ragged"], lambda a: {**a, "k": a["k"][:29], "v": a["v"][:29]},
             r"^k: expected 30 tokens \(kv_indptr\[-1\] as planned\) in layout NHD, got 29"),
    _mistake("k-rows-long", ["ragged"], lambda a: {**a, "k": _bf16(40, 2, 128), "v": _bf16(40, 2, 128)},
             r"^k: expected 30 tokens \(kv_indptr\[-1\] as planned\) in layout NHD, got 40"),
    _mistake("v-rows", ["ragged"], lambda a: {**a, "v": a["v"][:29]},
             r"^v: expected 30 tokens x 2 heads in layout NHD \(as k\), got shape \(29, 2, 128\)$"),
    _mistake("k-in-HND", ["ragged"], lambda a: {**a, "k": _bf16(2, 30, 128), "v": _bf16(2, 30, 128)},
             r"^k: expected 2 kv heads .* got 30 of 128 \(shape \(2, 30, 128\)\); it fits the plan read as HND, "
             r"but the wrapper was created with kv_layout='NHD'$"),
    _mistake("cache-dtype", PAGED, lambda a: {**a, "paged_kv_cache": a["paged_kv_cache"].half()},
             r"^paged_kv_cache: expected dtype torch.bfloat16 as planned \(kv_data_type\), got torch.float16$"),
    _mistake("cache-page-size", PAGED, lambda a: {**a, "paged_kv_cache": _bf16(5, 2, 8, 2, 128)},
             r"^paged_kv_cache: expected page_size 16, 2 kv heads and head_dim 128 as planned \(layout NHD: pages "
             r"of \[page_size, kv heads, head_dim\]\), got 8, 2 and 128 \(shape \(5, 2, 8, 2, 128\)\)$"),
    _mistake("cache-kv-heads", PAGED, lambda a: {**a, "paged_kv_cache": _bf16(5, 2, 16, 4, 128)},
             r"^paged_kv_cache: expected page_size 16, 2 kv heads .* got 16, 4 and 128"),
    _mistake("cache-head_dim", PAGED, lambda a: {**a, "paged_kv_cache": _bf16(5, 2, 16, 2, 64)},
             r"^paged_kv_cache: expected page_size 16, 2 kv heads and head_dim 128 .* got 16, 2 and 64"),
    _mistake("cache-in-HND", PAGED, lambda a: {**a, "paged_kv_cache": _bf16(5, 2, 2, 16, 128)},
             r"^paged_kv_cache: expected page_size 16,.* got 2, 16 and 128 .*; it fits the plan read as HND, but the "
             r"wrapper was created with kv_layout='NHD'$"),
    _mistake("cache-pages", PAGED, lambda a: {**a, "paged_kv_cache": a["paged_kv_cache"][:4]},
             r"^(paged_kv_)?indices: page id 4 is past the cache's 4 pages \(paged_kv_cache: expected at least 5 "
             r"pages, as planned, got shape \(4, 2, 16, 2, 128\)\)$"),
    _mistake("cache-tuple-pages", PAGED, lambda a: {**a, "paged_kv_cache": (a["paged_kv_cache"][:4, 0],
                                                                           a["paged_kv_cache"][:4, 1])},
             r"^(paged_kv_)?indices: page id 4 is past the cache's 4 pages \(paged_kv_cache: expected at least 5 "
             r"pages, as planned, got shape \(4, 16, 2, 128\) for K\)$"),
    _mistake("cache-4d", PAGED, lambda a: {**a, "paged_kv_cache": a["paged_kv_cache"][:, 0]},
             r"^paged_kv_cache: expected 5 dimensions"),
    _mistake("cache-no-kv-dim", PAGED, lambda a: {**a, "paged_kv_cache": a["paged_kv_cache"].repeat(1, 2, 1, 1, 1)},
             r"^paged_kv_cache: expected shape \[num_pages, 2, \.\.\.\]"),
    _mistake("cache-tuple-v-shape", PAGED, lambda a: {**a, "paged_kv_cache": (a["paged_kv_cache"][:, 0],
                                                                             a["paged_kv_cache"][:4, 1])},
             r"^paged_kv_cache\[1\]: expected shape \(5, 16, 2, 128\) \(as paged_kv_cache\[0\]\)"),
    _mistake("cache-tuple-v-dtype", PAGED, lambda a: {**a, "paged_kv_cache": (a["paged_kv_cache"][:, 0],
                                                                             a["paged_kv_cache"][:, 1].half())},
             r"^paged_kv_cache\[1\]: expected dtype torch.bfloat16"),
    _mistake("cache-tuple-k-dtype", PAGED, lambda a: {**a, "paged_kv_cache": (a["paged_kv_cache"][:, 0].half(),
                                                                             a["paged_kv_cache"][:, 1].half())},
             r"^paged_kv_cache: expected dtype torch.bfloat16 as planned \(kv_data_type\), got torch.float16$"),
    _mistake("out-shape", KINDS, lambda a: {**a, "out": torch.empty(a["q"].shape[0] + 1, 8, 128,
                                                                    dtype=torch.bfloat16)},
             r"^out: expected a contiguous torch.bfloat16 tensor of shape \(\d+, 8, 128\) \(q's rows x num_qo_heads x "
             r"head_dim, q's dtype\) on cpu, got torch.bfloat16 \(\d+, 8, 128\)"),
    _mistake("out-dtype", KINDS, lambda a: {**a, "out": torch.empty(a["q"].shape)},
             r"^out: expected a contiguous torch.bfloat16 tensor .* got torch.float32"),
    _mistake("out-strided", KINDS, lambda a: {**a, "out": torch.empty_like(a["q"]).transpose(0, 1)},
             r"^out: expected a contiguous .*contiguous=False$"),
    _mistake("out-not-a-tensor", KINDS, lambda a: {**a, "out": a["q"].tolist()}, r"^out: expected .* got list$"),
    _mistake("lse-shape", KINDS, lambda a: {**a, "lse": torch.empty(a["q"].shape[0], 4), "return_lse": True},
             r"^lse: expected a contiguous torch.float32 tensor of shape \(\d+, 8\) \(q's rows x num_qo_heads\)"),
    _mistake("lse-dtype", KINDS, lambda a: {**a, "lse": torch.empty(a["q"].shape[:2], dtype=torch.bfloat16),
                                            "return_lse": True},
             r"^lse: expected a contiguous torch.float32 tensor .* got torch.bfloat16"),
    _mistake("extra-positional", KINDS, lambda a: {**a, "extra": (None,)},
             r"^run\(\): got 1 extra positional argument\(s\); FlashInfer passes them to custom JIT kernels",
             NotImplementedError),
    _mistake("window_left", PAGED, lambda a: {**a, "window_left": 64},
             r"^window_left: expected -1 \(as planned\) or None, got 64$"),
    _mistake("k_scale", PAGED, lambda a: {**a, "k_scale": 0.5}, r"^k_scale=0.5: scales apply to an FP8 KV cache only",
             NotImplementedError),
    _mistake("unknown-keyword", PAGED, lambda a: {**a, "rope_scale": 2.0}, r"^\['rope_scale'\]: not supported",
             NotImplementedError),
]


@pytest.mark.parametrize("kinds,change,match,exc", RUN_MISTAKES)
def test_run_checks_its_inputs_against_the_plan(kinds, change, match, exc, launches):
    for kind in kinds:
        w, args = _valid(kind)
        with pytest.raises(exc, match=match):
            _run(w, change(args))
    assert launches == []


@pytest.mark.parametrize("kind", KINDS)
def test_nhd_inputs_to_an_hnd_wrapper(kind, launches):
    w, args = _valid(kind, "HND")
    if kind == "ragged":
        nhd, match = _bf16(30, 2, 128), (r"^k: expected 2 kv heads of head_dim 128 as planned \(layout HND\), got 30 "
                                         r"of 128 .*; it fits the plan read as NHD, but the wrapper was created with "
                                         r"kv_layout='HND'$")
        args = {**args, "k": nhd, "v": nhd}
    else:
        args = {**args, "paged_kv_cache": _bf16(5, 2, 16, 2, 128)}
        match = (r"^paged_kv_cache: .* \(layout HND: pages of \[kv heads, page_size, head_dim\]\), got 2, 16 and 128 "
                 r".*; it fits the plan read as NHD, but the wrapper was created with kv_layout='HND'$")
    with pytest.raises(ValueError, match=match):
        _run(w, args)
    assert launches == []


def test_cuda_graph_plans_accept_the_captured_buffers(launches):
    """With use_cuda_graph=True, q may hold up to the query tokens of the first
    plan() and k/v more keys than a later plan reads (the captured buffers)."""
    w, args = _valid("ragged", use_cuda_graph=True)
    w.plan([0, 2, 5], [0, 5, 20], **HEADS, head_dim_qk=128, q_data_type=torch.bfloat16)
    _run(w, args)                                          # the 8-row, 30-key buffers of the first plan
    _run(w, {**args, "q": args["q"][:5], "k": args["k"][:20], "v": args["v"][:20]})
    assert launches == [(8, 8, 128), (5, 8, 128)]
    with pytest.raises(ValueError, match=r"^q: expected 5 to 8 rows \(qo_indptr\[-1\] as planned, up to the 8 query "
                                         r"tokens use_cuda_graph=True fixed at the first plan\(\)\), got 9"):
        _run(w, {**args, "q": _bf16(9, 8, 128)})
    with pytest.raises(ValueError, match=r"^q: expected 5 to 8 rows .* got 4"):
        _run(w, {**args, "q": args["q"][:4]})
    with pytest.raises(ValueError, match=r"^k: expected at least 20 tokens \(kv_indptr\[-1\] as planned\) in layout "
                                         r"NHD, got 19"):
        _run(w, {**args, "k": args["k"][:19], "v": args["v"][:19]})


def test_cuda_graph_decode_keeps_its_batch(launches):
    page_ids = _on_fake_cuda(torch.zeros(16, dtype=torch.int32))
    w, args = _valid("decode", use_cuda_graph=True, paged_kv_indices_buffer=page_ids)
    _run(w, args)
    with pytest.raises(ValueError, match=r"^q: expected 2 rows \(batch_size: one query token per request of indptr "
                                         r"as planned\), got 3"):
        _run(w, {**args, "q": _bf16(3, 8, 128)})
    assert launches == [(2, 8, 128)]
