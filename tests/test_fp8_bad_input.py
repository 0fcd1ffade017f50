"""FP8 KV caches: bad inputs to the ops are ValueErrors (NotImplementedError for
options flashjit does not take) naming the argument, raised on CPU tensors
before any device check or launch; the append's quantisation on CPU tensors
against a torch model of it, bit for bit."""

from __future__ import annotations

import math
from types import SimpleNamespace

import pytest
import torch

import flashjit
from flashjit import arch
from flashjit import jit
from flashjit.ops import _batch, _scales
from helpers_cache import no_compile  # noqa: F401 (a fixture)

pytestmark = pytest.mark.usefixtures("no_compile")

FP8 = [torch.float8_e4m3fn, torch.float8_e5m2]
FP8_MAX = {torch.float8_e4m3fn: 448.0, torch.float8_e5m2: 57344.0}


def _codes(*shape, dtype=torch.float8_e4m3fn):
    return torch.randn(*shape).to(dtype)


# ---------------------------------------------------------------------------
# single_decode_with_kv_cache: every check runs before the device check


def _decode(q=None, k=None, v=None, **kw):
    q = torch.randn(8, 128).to(torch.bfloat16) if q is None else q
    k = _codes(100, 2, 128) if k is None else k
    v = _codes(100, 2, 128) if v is None else v
    return flashjit.single_decode_with_kv_cache(q, k, v, **kw)


@pytest.mark.parametrize("kw,exc,match", [
    (dict(q=torch.randn(8, 128).to(torch.float8_e4m3fn)), ValueError,
     r"^q: expected dtype float16, bfloat16 or float32, got torch.float8_e4m3fn: FP8 is supported for the KV cache "
     r"only"),
    (dict(q=torch.randn(8, 128)), ValueError, r"^q: expected float16 or bfloat16 with an FP8 KV cache \(k is "
                                              r"torch.float8_e4m3fn\), got torch.float32"),
    (dict(k=torch.randn(100, 2, 128).to(torch.float8_e4m3fnuz)), ValueError,
     r"^k: expected dtype .* got torch.float8_e4m3fnuz: another platform's FP8 format"),
    (dict(v=torch.randn(100, 2, 128).to(torch.bfloat16)), ValueError,
     r"^v: expected dtype torch.float8_e4m3fn \(the dtype of k\), got torch.bfloat16"),
    (dict(v=_codes(100, 2, 128, dtype=torch.float8_e5m2)), ValueError,
     r"^v: expected dtype torch.float8_e4m3fn \(the dtype of k\), got torch.float8_e5m2"),
    (dict(k_scale=float("nan")), ValueError, r"^k_scale: expected a finite positive scale, got nan"),
    (dict(k_scale=float("inf")), ValueError, r"^k_scale: expected a finite positive scale, got inf"),
    (dict(v_scale=0.0), ValueError, r"^v_scale: expected a finite positive scale, got 0.0"),
    (dict(v_scale=-2.0), ValueError, r"^v_scale: expected a finite positive scale, got -2.0"),
    (dict(k_scale=1e-300), ValueError, r"^k_scale: expected a scale within float32's normal range"),
    (dict(k_scale="2"), ValueError, r"^k_scale: expected a Python float or a one-element float32 tensor, got str"),
    (dict(k_scale=True), ValueError, r"^k_scale: expected a Python float or a one-element float32 tensor"),
    (dict(v_scale=torch.tensor([1.0, 2.0])), ValueError, r"^v_scale: expected .* got a torch.float32 tensor of 2 "
                                                         r"elements"),
    (dict(q_scale=2.0), NotImplementedError, r"^q_scale=2.0: FP8 queries are not supported"),
    (dict(batch_invariant=True), ValueError, r"batch-invariant decode \(causal=True\) is not yet generated.*Nearest "
                                             r"working choice: single_decode_bf16_kve4m3_d128_fa2_cc$"),
    (dict(k_scale=0.5), ValueError, r"^q: expected a CUDA tensor"),  # everything else is right: the device check
])
def test_single_decode_bad_fp8_inputs(kw, exc, match):
    with pytest.raises(exc, match=match):
        _decode(**kw)


def test_cpu_tensor_scales_are_read_as_numbers():
    with pytest.raises(ValueError, match=r"^k_scale: expected a finite positive scale, got -1.0"):
        _decode(k_scale=torch.tensor(-1.0))
    assert _scales.scale_key(torch.tensor([0.5])) == 0.5
    with pytest.raises(ValueError, match=r"^v_scale: expected .* got a torch.int64 tensor of 1 elements"):
        _scales.scale_arg("v_scale", _scales.TensorScale(64, torch.int64, torch.device("cuda", 0), 1),
                          torch.device("cuda", 0))
    with pytest.raises(ValueError, match=r"^v_scale: expected a tensor on cuda:0 \(where q is\) or on the CPU, got "
                                         r"cuda:1"):
        _scales.scale_arg("v_scale", _scales.TensorScale(64, torch.float32, torch.device("cuda", 1), 1),
                          torch.device("cuda", 0))
    assert _scales.scale_arg("k_scale", _scales.TensorScale(64, torch.float32, torch.device("cuda", 0), 1),
                             torch.device("cuda", 0)) == (1.0, 64)


@pytest.mark.parametrize("name", ["k_scale", "v_scale"])
def test_scales_with_a_16_bit_cache_are_not_taken(name):
    k = torch.randn(100, 2, 128).to(torch.bfloat16)
    with pytest.raises(NotImplementedError, match=rf"^{name}=0.5: scales apply to an FP8 KV cache only"):
        _decode(k=k, v=k, **{name: 0.5})


def test_fp8_prefill_on_cuda_cores_is_not_yet_generated():
    q = torch.randn(5, 8, 128).to(torch.bfloat16)
    with pytest.raises(ValueError, match=r"an FP8 KV cache for CUDA-core single_prefill is not yet generated"):
        flashjit.single_prefill_with_kv_cache(q, _codes(100, 2, 128), _codes(100, 2, 128), use_tensor_cores=False)


def test_single_prefill_scale_names_are_flashinfers():
    """single_prefill takes FlashInfer's scale_k / scale_v, checked and named as such."""
    q = torch.randn(5, 8, 128).to(torch.bfloat16)
    with pytest.raises(ValueError, match=r"^scale_k: expected a finite positive scale, got -1.0"):
        flashjit.single_prefill_with_kv_cache(q, _codes(100, 2, 128), _codes(100, 2, 128), scale_k=-1.0)
    with pytest.raises(NotImplementedError, match=r"^scale_v=2.0: scales apply to an FP8 KV cache only"):
        flashjit.single_prefill_with_kv_cache(q, q, q, scale_v=2.0)
    with pytest.raises(NotImplementedError, match=r"^scale_q=2.0: FP8 queries are not supported"):
        flashjit.single_prefill_with_kv_cache(q, _codes(100, 2, 128), _codes(100, 2, 128), scale_q=2.0)


# ---------------------------------------------------------------------------
# The paged decode wrapper: plan() and run() against the plan


class _FakeCudaTensor(torch.Tensor):
    """A CPU buffer that claims to live on cuda:0: a wrapper without a GPU."""

    @property
    def device(self):
        return torch.device("cuda", 0)


@pytest.fixture
def launches(monkeypatch):
    """plan() with a stand-in kernel module; run() records (q shape, scales) instead of launching."""
    monkeypatch.setattr(jit, "get_module", lambda spec: SimpleNamespace(spec=spec, rows_per_cta=64, split_align=64))
    monkeypatch.setattr(_batch, "resident_ctas", lambda module, device: 132)
    calls = []
    monkeypatch.setattr(_batch.BatchAttention, "_launch", lambda self, q, *rest, **kw: calls.append((q.shape, rest[-1])))
    return calls


def _wrapper(kv_data_type=torch.float8_e4m3fn, q_data_type=torch.bfloat16, **plan_kw):
    workspace = torch.Tensor._make_subclass(_FakeCudaTensor, torch.empty(1 << 16, dtype=torch.uint8))
    w = flashjit.BatchDecodeWithPagedKVCacheWrapper(workspace)
    w._device = torch.device("cpu")
    w.plan(torch.tensor([0, 2, 5], dtype=torch.int32), torch.arange(5, dtype=torch.int32),
           torch.tensor([3, 16], dtype=torch.int32), 8, 2, 128, 16, q_data_type=q_data_type,
           kv_data_type=kv_data_type, **plan_kw)
    return w


def _q():
    return torch.randn(2, 8, 128).to(torch.bfloat16)


@pytest.mark.parametrize("kv", FP8, ids=str)
def test_fp8_plan_and_run_pass_the_scales(kv, launches):
    w = _wrapper(kv)
    short = {torch.float8_e4m3fn: "e4m3", torch.float8_e5m2: "e5m2"}[kv]
    assert w._plan.module.spec.name == f"batch_decode_paged_bf16_kv{short}_d128_fa2_cc_lse"
    cache = torch.randn(6, 2, 16, 2, 128).to(kv)
    w.run(_q(), cache)
    w.run(_q(), cache, k_scale=0.5, v_scale=torch.tensor([3.0]))
    assert [scales for _, scales in launches] == [(_scales.UNIT, _scales.UNIT),
                                                  (_scales.ScaleArg(0.5, 0), _scales.ScaleArg(3.0, 0))]


@pytest.mark.parametrize("plan_kv,cache_dtype,match", [
    (torch.float8_e4m3fn, torch.bfloat16, r"^paged_kv_cache: expected dtype torch.float8_e4m3fn as planned "
                                          r"\(kv_data_type\), got torch.bfloat16; plan with kv_data_type=torch.bfloat16"),
    (torch.bfloat16, torch.float8_e4m3fn, r"^paged_kv_cache: expected dtype torch.bfloat16 as planned "
                                          r"\(kv_data_type\), got torch.float8_e4m3fn; plan with kv_data_type="
                                          r"torch.float8_e4m3fn"),
    (torch.float8_e4m3fn, torch.float8_e5m2, r"^paged_kv_cache: expected dtype torch.float8_e4m3fn as planned"),
])
def test_cache_against_the_planned_kv_dtype(plan_kv, cache_dtype, match, launches):
    w = _wrapper(plan_kv)
    with pytest.raises(ValueError, match=match):
        w.run(_q(), torch.randn(6, 2, 16, 2, 128).to(cache_dtype))
    assert launches == []


@pytest.mark.parametrize("kw,exc,match", [
    (dict(k_scale=-1.0), ValueError, r"^k_scale: expected a finite positive scale, got -1.0"),
    (dict(v_scale=float("nan")), ValueError, r"^v_scale: expected a finite positive scale"),
    (dict(q_scale=1.0), NotImplementedError, r"^q_scale=1.0: FP8 queries are not supported"),
])
def test_run_scale_mistakes(kw, exc, match, launches):
    with pytest.raises(exc, match=match):
        _wrapper().run(_q(), torch.randn(6, 2, 16, 2, 128).to(torch.float8_e4m3fn), **kw)
    assert launches == []


@pytest.mark.parametrize("plan_kw,exc,match", [
    (dict(kv_data_type=torch.float8_e4m3fnuz), ValueError, r"^kv_data_type: .*another platform's FP8 format"),
    (dict(q_data_type=torch.float8_e4m3fn), ValueError, r"^q_data_type: .*FP8 is supported for the KV cache only"),
    (dict(q_data_type=torch.float32), ValueError, r"^q_data_type: expected float16 or bfloat16 with an FP8 KV "
                                                  r"cache \(kv_data_type=torch.float8_e4m3fn\), got torch.float32"),
    (dict(kv_data_type=torch.float16), ValueError, r"^kv_data_type: expected torch.bfloat16 \(as q_data_type\) or "
                                                   r"an FP8 format"),
    (dict(kv_data_type="fp8_e5m2", batch_invariant=True), ValueError, r"batch-invariant decode"),
])
def test_plan_mistakes(plan_kw, exc, match, launches):
    kv = plan_kw.pop("kv_data_type", torch.float8_e4m3fn)
    with pytest.raises(exc, match=match):
        _wrapper(kv, **plan_kw)


def test_fp8_prefill_runs_fa3_on_sm90a_and_fa2_elsewhere():
    spec = flashjit.KernelSpec.make("batch_prefill_paged", "bfloat16", 128, dtype_kv="e5m2", use_tensor_cores=True,
                                    backend="fa3", causal=True, return_lse=True).validate()
    assert spec.name == "batch_prefill_paged_bf16_kve5m2_d128_fa3_tc_causal_lse"
    for op in ("single_prefill", "batch_prefill_ragged", "batch_prefill_paged"):
        backend, tc, reason = arch.choose_backend(op, "bfloat16", None, "auto", targets=("sm_90a",),
                                                  kv_dtype="float8_e5m2", head_dim=128)
        assert (backend, tc) == ("fa3", True), reason
        assert arch.choose_backend(op, "bfloat16", None, "auto", targets=("sm_89",), kv_dtype="float8_e5m2")[0] == "fa2"


# ---------------------------------------------------------------------------
# append_paged_kv_cache into an FP8 cache (CPU tensors: the torch path)


def _append_case(kv_dtype, layout="NHD", form="5d", rows_dtype=torch.float16, page_size=4):
    """Three requests' appended rows over shuffled pages of a cache of random codes (a float32 NHD copy too)."""
    kv_lens, appended, num_kv, head_dim = [9, 3, 6], [4, 3, 5], 2, 64
    pages = [math.ceil(n / page_size) for n in kv_lens]
    num_pages = sum(pages) + 1
    indptr = torch.tensor([0, *torch.tensor(pages).cumsum(0).tolist()], dtype=torch.int32)
    indices = torch.randperm(num_pages)[:sum(pages)].to(torch.int32)
    last = torch.tensor([(n - 1) % page_size + 1 for n in kv_lens], dtype=torch.int32)
    nnz = sum(appended)
    batch_indices, positions = flashjit.get_batch_indices_positions(
        torch.tensor([0, *torch.tensor(appended).cumsum(0).tolist()], dtype=torch.int32),
        flashjit.get_seq_lens(indptr, last, page_size), nnz)
    magnitude = torch.pow(2.0, torch.randint(-20, 18, (2, nnz, num_kv, head_dim)).float())
    key, value = (torch.randn(2, nnz, num_kv, head_dim) * magnitude).to(rows_dtype)
    key[0, 0, :6] = torch.tensor([float("inf"), -float("inf"), float("nan"), 0.0, -0.0, 1e4]).to(rows_dtype)
    before = torch.randn(num_pages, 2, page_size, num_kv, head_dim).to(kv_dtype)  # NHD
    cache = before.view(torch.uint8).transpose(2, 3).contiguous().view(kv_dtype) if layout == "HND" \
        else before.view(torch.uint8).clone().view(kv_dtype)
    if form == "tuple":
        cache = (cache.view(torch.uint8)[:, 0].contiguous().view(kv_dtype),
                 cache.view(torch.uint8)[:, 1].contiguous().view(kv_dtype))
    page = indices.long()[indptr.long()[batch_indices.long()] + positions.long() // page_size]
    slot = positions.long() % page_size
    return SimpleNamespace(key=key, value=value, batch_indices=batch_indices, positions=positions, cache=cache,
                           indices=indices, indptr=indptr, last=last, before=before, page=page, slot=slot)


def _quantized(rows, kv_dtype, scale):
    """The documented model: fp32 quotient correctly rounded, clamped, nearest FP8 code."""
    return ((rows.double() / float(torch.tensor(scale, dtype=torch.float32))).float()
            .clamp(-FP8_MAX[kv_dtype], FP8_MAX[kv_dtype]).to(kv_dtype))


@pytest.mark.parametrize("scales", [(None, None), (0.3, 2.5), (torch.tensor([0.3]), torch.tensor(2.5))],
                         ids=["none", "floats", "cpu-tensors"])
@pytest.mark.parametrize("layout,form", [("NHD", "5d"), ("HND", "5d"), ("NHD", "tuple"), ("HND", "tuple")])
@pytest.mark.parametrize("rows_dtype", [torch.float16, torch.bfloat16], ids=str)
@pytest.mark.parametrize("kv", FP8, ids=str)
def test_append_quantises_into_fp8_caches(kv, rows_dtype, layout, form, scales):
    c = _append_case(kv, layout, form, rows_dtype)
    flashjit.append_paged_kv_cache(c.key, c.value, c.batch_indices, c.positions, c.cache, c.indices, c.indptr,
                                   c.last, layout, k_scale=scales[0], v_scale=scales[1])
    got = torch.stack([t.view(torch.uint8) for t in c.cache], 1) if form == "tuple" else c.cache.view(torch.uint8)
    got = got.transpose(2, 3) if layout == "HND" else got
    expected = c.before.view(torch.uint8).clone()
    ks, vs = (1.0 if s is None else float(s) for s in scales)
    expected[c.page, 0, c.slot] = _quantized(c.key, kv, ks).view(torch.uint8)
    expected[c.page, 1, c.slot] = _quantized(c.value, kv, vs).view(torch.uint8)
    nan = torch.isnan(expected.view(kv).float())
    assert torch.equal(torch.isnan(got.view(kv).float()), nan) and nan.sum() == 1
    assert torch.equal(got[~nan], expected[~nan])
    assert (expected.view(kv).float().abs() == FP8_MAX[kv]).any(), "saturation was exercised"


def test_fp8_rows_into_an_fp8_cache_are_copied():
    c = _append_case(torch.float8_e5m2)
    key, value = c.key.to(torch.float8_e5m2), c.value.to(torch.float8_e5m2)
    flashjit.append_paged_kv_cache(key, value, c.batch_indices, c.positions, c.cache, c.indices, c.indptr, c.last)
    assert torch.equal(c.cache.view(torch.uint8)[c.page, 0, c.slot], key.view(torch.uint8))
    assert torch.equal(c.cache.view(torch.uint8)[c.page, 1, c.slot], value.view(torch.uint8))
    with pytest.raises(ValueError, match=r"^k_scale: scales quantise float16/bfloat16 rows into an FP8 cache; rows "
                                         r"of the cache's dtype \(torch.float8_e5m2\) are copied as they are"):
        flashjit.append_paged_kv_cache(key, value, c.batch_indices, c.positions, c.cache, c.indices, c.indptr,
                                       c.last, k_scale=2.0)


@pytest.mark.parametrize("change,match", [
    (dict(key_dtype=torch.float32), r"^append_key: expected dtype torch.float8_e4m3fn \(the dtype of "
                                    r"paged_kv_cache\) \(or float16/bfloat16 rows, quantised into an FP8 cache\), got "
                                    r"torch.float32"),
    (dict(key_dtype=torch.float8_e5m2), r"^append_key: expected dtype torch.float8_e4m3fn"),
    (dict(k_scale=0.0), r"^k_scale: expected a finite positive scale, got 0.0"),
    (dict(v_scale=float("nan")), r"^v_scale: expected a finite positive scale, got nan"),
    (dict(v_scale=torch.tensor([1.0, 2.0])), r"^v_scale: expected a Python float or a one-element float32 tensor"),
])
def test_append_fp8_mistakes_write_nothing(change, match):
    c = _append_case(torch.float8_e4m3fn)
    before = c.cache.view(torch.uint8).clone()
    key_dtype = change.pop("key_dtype", None)
    key = c.key if key_dtype is None else c.key.float().to(key_dtype)
    value = c.value if key_dtype is None else c.value.float().to(key_dtype)
    with pytest.raises(ValueError, match=match):
        flashjit.append_paged_kv_cache(key, value, c.batch_indices, c.positions, c.cache, c.indices, c.indptr,
                                       c.last, **change)
    assert torch.equal(c.cache.view(torch.uint8), before)


def test_append_scales_with_a_16_bit_cache_are_refused():
    c = _append_case(torch.float8_e4m3fn)
    cache = torch.zeros(c.before.shape, dtype=torch.float16)
    with pytest.raises(ValueError, match=r"^k_scale: scales quantise float16/bfloat16 rows into an FP8 cache"):
        flashjit.append_paged_kv_cache(c.key, c.value, c.batch_indices, c.positions, cache, c.indices, c.indptr,
                                       c.last, k_scale=0.5)
