"""Bad arguments to the ops: a ValueError (or NotImplementedError) naming the
argument, raised before any device check, compile or launch. No GPU needed:
the inputs are CPU tensors, so a check that ran the device test first would
report 'expected a CUDA tensor' instead of the real mistake. The batch
wrappers' checks are in test_bad_input_wrappers.py."""

from __future__ import annotations

import math

import pytest
import torch

import flashjit
from flashjit.ops import _checks, _launch
from helpers_cache import no_compile  # noqa: F401 (a fixture)

pytestmark = pytest.mark.usefixtures("no_compile")

DTYPES = [torch.float16, torch.bfloat16, torch.float32]
OPS = ["prefill", "decode"]


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


@pytest.mark.parametrize("head_dim", [32, 64, 96, 128, 256])
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
    _case("head_dim-100", lambda op, q, k, v: (q[..., :100].contiguous(), k[..., :100].contiguous(),
                                               v[..., :100].contiguous()),
          r"^q.shape\[-1\] \(head_dim\): expected a head_dim that is a multiple of 16 from 32 to 256, got 100 "
          r"\(nearest generated: 96 or 112\)$"),
    _case("head_dim-24", lambda op, q, k, v: (q[..., :24].contiguous(), k[..., :24].contiguous(),
                                              v[..., :24].contiguous()), r"head_dim.*got 24 \(nearest generated: 32\)"),
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


@pytest.mark.parametrize("head_dim", [32, 64, 96, 128, 256])
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
