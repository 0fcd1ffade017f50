"""Bad arguments to the ops: a ValueError (or NotImplementedError) naming the
argument, raised before any device check, compile or launch. No GPU needed:
the inputs are CPU tensors, so a check that ran the device test first would
report 'expected a CUDA tensor' instead of the real mistake."""

from __future__ import annotations

import math
import re

import pytest
import torch

import flashjit
from flashjit import build, jit
from flashjit.ops import _checks, _launch
from helpers_cache import is_empty, set_cache_env

DTYPES = [torch.float16, torch.bfloat16, torch.float32]
OPS = ["prefill", "decode"]


@pytest.fixture(autouse=True)
def no_compile(monkeypatch, tmp_path):
    """Any attempt to build or load a kernel fails the test; the cache stays empty."""
    root = set_cache_env(monkeypatch, tmp_path / "cache")

    def forbidden(*args, **kwargs):
        raise AssertionError("a kernel was built or loaded for a bad input")

    monkeypatch.setattr(jit, "build_many", forbidden)
    monkeypatch.setattr(jit, "get_module", forbidden)
    monkeypatch.setattr(build, "run_builds", forbidden)
    yield root
    assert is_empty(root), f"the cache {root} was written: {list(root.rglob('*'))}"


def inputs(op: str, dtype=torch.float16, head_dim: int = 128, qo_len: int = 5, kv_len: int = 33,
           qo_heads: int = 4, kv_heads: int = 2):
    """Valid CPU tensors for op (NHD)."""
    q_shape = (qo_len, qo_heads, head_dim) if op == "prefill" else (qo_heads, head_dim)
    q = torch.randn(q_shape).to(dtype)
    k = torch.randn(kv_len, kv_heads, head_dim).to(dtype)
    v = torch.randn(kv_len, kv_heads, head_dim).to(dtype)
    return q, k, v


def call(op: str, q, k, v, **kwargs):
    fn = flashjit.single_prefill_with_kv_cache if op == "prefill" else flashjit.single_decode_with_kv_cache
    return fn(q, k, v, **kwargs)


def _noncontig_last(t: torch.Tensor) -> torch.Tensor:
    wide = torch.zeros(*t.shape[:-1], 2 * t.shape[-1], dtype=t.dtype)
    wide[..., ::2] = t
    return wide[..., ::2]


# ---------------------------------------------------------------------------
# CPU tensors


@pytest.mark.parametrize("head_dim", [64, 128, 256])
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("op", OPS)
def test_cpu_tensors_are_rejected_naming_the_argument(op, dtype, head_dim):
    q, k, v = inputs(op, dtype, head_dim)
    with pytest.raises(ValueError, match=r"^q: expected a CUDA tensor, got a tensor on cpu"):
        call(op, q, k, v)


@pytest.mark.parametrize("op", OPS)
def test_cpu_kv_is_named_too(op, monkeypatch):
    """With q accepted, the first CPU tensor among k, v is named."""
    q, k, v = inputs(op)
    real = _checks.check_device

    def q_is_on_gpu(name, t, device=None):
        if name != "q":
            real(name, t, device)

    monkeypatch.setattr(_checks, "check_device", q_is_on_gpu)
    with pytest.raises(ValueError, match=r"^k: expected a CUDA tensor, got a tensor on cpu"):
        call(op, q, k, v)


# ---------------------------------------------------------------------------
# Structure and cross-checks come before the device check


def _case(name, mutate, match, exc=ValueError):
    return pytest.param(mutate, match, exc, id=name)


MISTAKES = [
    _case("q-int32", lambda op, q, k, v: (q.to(torch.int32), k, v), r"^q: expected dtype float16, bfloat16 or "
          r"float32, got torch.int32"),
    _case("q-float64", lambda op, q, k, v: (q.double(), k, v), r"^q: expected dtype .*float64"),
    _case("k-float64", lambda op, q, k, v: (q, k.double(), v), r"^k: expected dtype .*float64"),
    _case("v-int32", lambda op, q, k, v: (q, k, v.to(torch.int32)), r"^v: expected dtype .*int32"),
    _case("q-not-a-tensor", lambda op, q, k, v: (q.tolist(), k, v), r"^q: expected a torch.Tensor, got list"),
    _case("k-dtype-differs-from-q", lambda op, q, k, v: (q, k.to(torch.bfloat16), v),
          r"^k: expected dtype torch.float16 \(the dtype of q\), got torch.bfloat16"),
    _case("v-dtype-differs-from-q", lambda op, q, k, v: (q, k, v.float()),
          r"^v: expected dtype torch.float16 \(the dtype of q\), got torch.float32"),
    _case("q-ndim", lambda op, q, k, v: (q[None], k, v), r"^q: expected [23] dimensions"),
    _case("k-ndim", lambda op, q, k, v: (q, k[None], v), r"^k: expected 3 dimensions"),
    _case("v-ndim", lambda op, q, k, v: (q, k, v[0]), r"^v: expected 3 dimensions"),
    _case("k-head_dim", lambda op, q, k, v: (q, k[..., :64].contiguous(), v), r"^k: expected head_dim 128"),
    _case("v-head_dim", lambda op, q, k, v: (q, k, v[..., :64].contiguous()), r"^v: expected head_dim 128"),
    _case("head_dim-96", lambda op, q, k, v: (q[..., :96].contiguous(), k[..., :96].contiguous(),
                                              v[..., :96].contiguous()),
          r"head_dim.*\(64, 128, 256\), got 96 \(nearest supported: (64|128)\)"),
    _case("head_dim-32", lambda op, q, k, v: (q[..., :32].contiguous(), k[..., :32].contiguous(),
                                              v[..., :32].contiguous()), r"head_dim.*got 32"),
    _case("v-tokens", lambda op, q, k, v: (q, k, v[:-1]), r"^v: expected 33 tokens x 2 heads"),
    _case("v-heads", lambda op, q, k, v: (q, k, v[:, :1]), r"^v: expected 33 tokens x 2 heads"),
    _case("qo-heads-not-multiple-of-kv-heads", lambda op, q, k, v: (q[..., :3, :].contiguous(), k, v),
          r"^num_qo_heads \(3\) must be a multiple of num_kv_heads \(2\)"),
    _case("q-last-dim-strided", lambda op, q, k, v: (_noncontig_last(q), k, v),
          r"^q: the last \(head_dim\) dimension must be contiguous"),
    _case("k-last-dim-strided", lambda op, q, k, v: (q, _noncontig_last(k), v),
          r"^k: the last \(head_dim\) dimension must be contiguous"),
    _case("v-last-dim-strided", lambda op, q, k, v: (q, k, _noncontig_last(v)),
          r"^v: the last \(head_dim\) dimension must be contiguous"),
]


@pytest.mark.parametrize("mutate,match,exc", MISTAKES)
@pytest.mark.parametrize("dtype", [torch.float16], ids=str)
@pytest.mark.parametrize("op", OPS)
def test_shape_and_dtype_mistakes_name_the_argument(op, dtype, mutate, match, exc):
    q, k, v = mutate(op, *inputs(op, dtype))
    with pytest.raises(exc, match=match) as info:
        call(op, q, k, v)
    assert "CUDA" not in str(info.value), "the device check ran before the argument checks"


@pytest.mark.parametrize("head_dim", [64, 128, 256])
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("op", OPS)
def test_gqa_mistake_for_every_dtype_and_head_dim(op, dtype, head_dim):
    q, k, v = inputs(op, dtype, head_dim, qo_heads=6, kv_heads=4)
    with pytest.raises(ValueError, match=r"^num_qo_heads \(6\) must be a multiple of num_kv_heads \(4\)"):
        call(op, q, k, v)


@pytest.mark.parametrize("op", OPS)
def test_bad_kv_layout(op):
    q, k, v = inputs(op)
    with pytest.raises(ValueError, match=r"^kv_layout: expected 'NHD' or 'HND', got 'NDH'"):
        call(op, q, k, v, kv_layout="NDH")


@pytest.mark.parametrize("op", OPS)
def test_hnd_tensors_are_read_as_hnd(op):
    """NHD tensors (33 tokens x 2 heads) passed as HND read as 2 tokens x 33 heads."""
    q, k, v = inputs(op)
    with pytest.raises(ValueError, match=r"num_qo_heads \(4\) must be a multiple of num_kv_heads \(33\)"):
        call(op, q, k, v, kv_layout="HND")
    # Correct HND tensors pass every argument check and stop at the device check.
    with pytest.raises(ValueError, match=r"^q: expected a CUDA tensor"):
        call(op, q, k.transpose(0, 1).contiguous(), v.transpose(0, 1).contiguous(), kv_layout="HND")


# ---------------------------------------------------------------------------
# Options we do not support


@pytest.mark.parametrize("option,value", [
    ("custom_mask", torch.ones(5, 33, dtype=torch.bool)),
    ("packed_custom_mask", torch.ones(21, dtype=torch.uint8)),
    ("pos_encoding_mode", "ROPE_LLAMA"),
    ("pos_encoding_mode", "ALIBI"),
    ("use_fp16_qk_reduction", True),
    ("scale_q", 1.0), ("scale_k", torch.ones(1)), ("scale_v", 0.5),
])
def test_prefill_unsupported_options(option, value):
    q, k, v = inputs("prefill")
    with pytest.raises(NotImplementedError, match=rf"^{option}="):
        call("prefill", q, k, v, **{option: value})


@pytest.mark.parametrize("option,value", [("pos_encoding_mode", "ROPE_LLAMA"), ("q_scale", 1.0),
                                          ("k_scale", 2.0), ("v_scale", 0.5)])
def test_decode_unsupported_options(option, value):
    q, k, v = inputs("decode")
    with pytest.raises(NotImplementedError, match=rf"^{option}="):
        call("decode", q, k, v, **{option: value})


def test_default_options_are_accepted():
    """The FlashInfer defaults of the unsupported options are not errors."""
    q, k, v = inputs("prefill")
    with pytest.raises(ValueError, match="CUDA tensor"):
        call("prefill", q, k, v, pos_encoding_mode="NONE", use_fp16_qk_reduction=False, custom_mask=None)


# ---------------------------------------------------------------------------
# Scalar arguments and indptr (the checks the ops and wrappers share)


@pytest.mark.parametrize("window_left", [-2, -100])
def test_window_left_below_minus_one(window_left):
    with pytest.raises(ValueError, match=rf"^window_left: expected -1 \(no window\) or >= 0, got {window_left}"):
        _checks.variant_values(None, 128, window_left, None)


@pytest.mark.parametrize("cap", [-1.0, -1e-9, math.inf, math.nan])
def test_bad_soft_cap(cap):
    with pytest.raises(ValueError, match=r"^logits_soft_cap: expected None, 0 or a positive number"):
        _checks.variant_values(None, 128, -1, cap)


@pytest.mark.parametrize("scale", [math.inf, math.nan, 0.0, -0.125])
def test_bad_sm_scale(scale):
    with pytest.raises(ValueError, match=r"^sm_scale: expected a finite positive number"):
        _checks.variant_values(scale, 128, -1, None)


def test_variant_values_defaults():
    assert _checks.variant_values(None, 64, None, None) == (1 / 8, -1, 0.0, False, False)
    assert _checks.variant_values(0.5, 64, 0, 30.0) == (0.5, 0, 30.0, True, True)
    assert _checks.variant_values(None, 256, -1, 0) == (1 / 16, -1, 0.0, False, False)


@pytest.mark.parametrize("indptr,batch,match", [
    pytest.param([0, 5, 3], None, r"^qo_indptr: expected non-decreasing offsets, got qo_indptr\[1\] = 5 > "
                                  r"qo_indptr\[2\] = 3", id="not-monotone"),
    pytest.param(torch.tensor([0, 5, 3], dtype=torch.int32), None, r"non-decreasing", id="not-monotone-tensor"),
    pytest.param([-1, 3], None, r"^qo_indptr: expected non-negative offsets", id="negative"),
    pytest.param(torch.tensor([-4, 3], dtype=torch.int64), None, r"non-negative", id="negative-tensor"),
    pytest.param([0, 3, 7], 3, r"^qo_indptr: expected 4 elements \(batch_size \+ 1\), got 3", id="wrong-length"),
    pytest.param([], None, r"^qo_indptr: expected at least one element", id="empty"),
    pytest.param(torch.zeros(2, 3, dtype=torch.int32), None, r"^qo_indptr: expected a 1-D tensor, got shape "
                                                             r"\(2, 3\)", id="2-D"),
    pytest.param(torch.tensor([0.0, 1.0]), None, r"^qo_indptr: expected an int32 or int64 tensor", id="float"),
    pytest.param([0, 2**31], None, r"^qo_indptr: offsets must fit in int32", id="overflow"),
])
def test_check_indptr(indptr, batch, match):
    with pytest.raises(ValueError, match=match):
        _checks.check_indptr("qo_indptr", indptr, batch_size=batch)


def test_check_indptr_accepts_valid_offsets():
    assert _checks.check_indptr("kv_indptr", torch.tensor([0, 0, 4, 9], dtype=torch.int32)) == [0, 0, 4, 9]
    assert _checks.check_indptr("kv_indptr", [0, 3], batch_size=1) == [0, 3]


@pytest.mark.parametrize("dtype", [torch.float32], ids=str)
@pytest.mark.parametrize("op", ["single_prefill", "single_decode", "batch_prefill_ragged"])
def test_fp32_with_tensor_cores_names_what_is_supported(op, dtype):
    with pytest.raises(ValueError) as info:
        _launch.select_spec(op, dtype, 128, backend="auto", use_tensor_cores=True, causal=False, window=False,
                            soft_cap=False, return_lse=False)
    message = str(info.value)
    assert "float16" in message and "bfloat16" in message and "Nearest working choice" in message


@pytest.mark.parametrize("backend", ["fa1", "cudnn", ""])
def test_unknown_backend(backend):
    with pytest.raises(ValueError, match=r"^backend: expected 'auto', 'fa2' or 'fa3'"):
        _launch.select_spec("single_prefill", torch.bfloat16, 128, backend=backend, use_tensor_cores=None,
                            causal=False, window=False, soft_cap=False, return_lse=False)


# ---------------------------------------------------------------------------
# The ragged wrapper: constructor and plan() checks, no GPU


class _FakeCudaTensor(torch.Tensor):
    """A CPU buffer that claims to live on cuda:0: lets the wrapper be constructed
    without a GPU so that plan()'s argument checks can run."""

    @property
    def device(self):
        return torch.device("cuda", 0)


def _wrapper(**kwargs):
    workspace = torch.Tensor._make_subclass(_FakeCudaTensor, torch.empty(1024, dtype=torch.uint8))
    return flashjit.BatchPrefillWithRaggedKVCacheWrapper(workspace, **kwargs)


def test_wrapper_needs_a_cuda_workspace():
    with pytest.raises(ValueError, match=r"^float_workspace_buffer: expected a CUDA tensor"):
        flashjit.BatchPrefillWithRaggedKVCacheWrapper(torch.empty(1024, dtype=torch.uint8))


@pytest.mark.parametrize("kwargs,exc,match", [
    ({"kv_layout": "NDH"}, ValueError, r"^kv_layout"),
    ({"custom_mask_buf": torch.ones(4, dtype=torch.uint8)}, NotImplementedError, r"^custom_mask="),
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
    ({"head_dim_qk": 96}, ValueError, r"^head_dim_qk: expected a head_dim in \(64, 128, 256\), got 96"),
    ({"head_dim_vo": 64}, ValueError, r"^head_dim_vo: expected 128"),
    ({"q_data_type": torch.int8}, ValueError, r"^q_data_type: expected float16, bfloat16 or float32"),
    ({"q_data_type": "float64"}, ValueError, r"^q_data_type"),
    ({"kv_data_type": torch.float16}, ValueError, r"^kv_data_type: expected torch.bfloat16"),
    ({"o_data_type": "float32"}, ValueError, r"^o_data_type: expected torch.bfloat16"),
    ({"window_left": -2}, ValueError, r"^window_left: expected -1"),
    ({"logits_soft_cap": -5.0}, ValueError, r"^logits_soft_cap"),
    ({"sm_scale": math.nan}, ValueError, r"^sm_scale"),
    ({"custom_mask": torch.ones(3, dtype=torch.bool)}, NotImplementedError, r"^custom_mask="),
    ({"pos_encoding_mode": "ROPE_LLAMA"}, NotImplementedError, r"^pos_encoding_mode='ROPE_LLAMA'"),
    ({"use_fp16_qk_reduction": True}, NotImplementedError, r"^use_fp16_qk_reduction=True"),
    ({"q_data_type": torch.float32, "use_tensor_cores": True}, ValueError, r"Nearest working choice"),
], ids=lambda x: "-".join(x) if isinstance(x, dict) else None)
def test_wrapper_plan_checks(change, exc, match):
    with pytest.raises(exc, match=match):
        _wrapper().plan(**{**PLAN, **change})


def test_wrapper_run_before_plan():
    q, k, v = inputs("prefill")
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
    ({"head_dim": 80}, r"^head_dim: expected a head_dim in \(64, 128, 256\), got 80"),
    ({"pos_encoding_mode": "ROPE_LLAMA"}, r"^pos_encoding_mode='ROPE_LLAMA'"),
    ({"q_data_type": torch.float32, "kv_data_type": torch.float16}, r"^kv_data_type: expected torch.float32"),
], ids=lambda x: "-".join(x) if isinstance(x, dict) else None)
def test_paged_decode_plan_checks(change, match):
    workspace = torch.Tensor._make_subclass(_FakeCudaTensor, torch.empty(1024, dtype=torch.uint8))
    wrapper = flashjit.BatchDecodeWithPagedKVCacheWrapper(workspace)
    with pytest.raises((ValueError, NotImplementedError), match=match):
        wrapper.plan(**{**DECODE_PLAN, **change})


def test_paged_prefill_plan_names_its_arguments():
    workspace = torch.Tensor._make_subclass(_FakeCudaTensor, torch.empty(1024, dtype=torch.uint8))
    wrapper = flashjit.BatchPrefillWithPagedKVCacheWrapper(workspace)
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
