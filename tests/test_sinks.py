"""Attention sinks without a GPU: every op's sinks= checks (a ValueError naming
sinks before any launch), the address reaching params.sinks of each launch
and each prepared call's signature, the values read once per tensor, where
the keyword sits beside FlashInfer's arguments (and where it is refused), the
float64 reference's semantics, and the GPU test's configurations within the
sweep's. The stand-in GPU of test_prepared_calls (tensors that claim cuda:0,
launches recorded). The torch.library operators: test_torch_ops_sinks.py."""

from __future__ import annotations

import inspect
import math
import struct

import pytest
import torch

import flashjit
import sweep
import test_gpu_sinks
import test_prepared_calls
from flashjit import loader
from flashjit.ops import _sinks
from flashjit.reference import attention_reference, ragged_reference
from test_prepared_calls import BF16, _decode_args, _prefill_args, cuda
from test_prepared_runs import paged_decode, paged_prefill, ragged

# Fixtures: pytest looks them up by name in the test module.
no_compile, gpu = test_prepared_calls.no_compile, test_prepared_calls.gpu

SINKS_OFFSET = loader.AttentionParams.sinks.offset
OPS = ["single_prefill", "single_decode", "ragged", "paged_prefill", "decode", "decode_tc"]


def call_of(op: str):
    """(the op's function, its arguments): 8 query heads, 2 KV heads, head_dim 128, bf16, on the stand-in cuda:0."""
    if op == "single_prefill":
        return flashjit.single_prefill_with_kv_cache, list(_prefill_args())
    if op == "single_decode":
        return flashjit.single_decode_with_kv_cache, list(_decode_args())
    if op == "decode_tc":
        w, args = paged_decode(use_tensor_cores=True)
    else:
        w, args = {"ragged": ragged, "paged_prefill": paged_prefill, "decode": paged_decode}[op]()
    return w.run, args


def sinks_field(launch) -> int:
    """params.sinks of a recorded launch (0: null)."""
    return struct.unpack_from("=Q", launch[0], SINKS_OFFSET)[0]


def nan_at(head: int, value=math.nan):
    sinks = torch.randn(8)
    sinks[head] = value
    return cuda(sinks)


# (what is wrong, the sinks, the error): each before any launch, on every op.
BAD_SINKS = [
    ("a-list", lambda: [0.0] * 8, r"^sinks: expected a float32 torch.Tensor of 8 elements \(num_qo_heads\), got list$"),
    ("a-number", lambda: 0.5, r"^sinks: expected a float32 torch.Tensor of 8 elements \(num_qo_heads\), got float$"),
    ("bf16", lambda: cuda(torch.zeros(8, dtype=BF16)), r"^sinks: expected dtype torch.float32, got torch.bfloat16$"),
    ("fp64", lambda: cuda(torch.zeros(8, dtype=torch.float64)), r"^sinks: expected dtype torch.float32, got "
                                                                  r"torch.float64$"),
    ("kv-heads", lambda: cuda(torch.zeros(2)), r"^sinks: expected a 1-D tensor of 8 elements \(num_qo_heads\), got "
                                               r"shape \(2,\)$"),
    ("2-d", lambda: cuda(torch.zeros(1, 8)), r"^sinks: expected a 1-D tensor of 8 elements \(num_qo_heads\), got "
                                             r"shape \(1, 8\)$"),
    ("scalar", lambda: cuda(torch.tensor(1.0)), r"^sinks: expected a 1-D tensor of 8 elements .* got shape \(\)$"),
    ("strided", lambda: cuda(torch.zeros(16)[::2]), r"^sinks: expected a contiguous tensor, got strides \(2,\)$"),
    ("on-the-cpu", lambda: torch.zeros(8), r"^sinks: expected a tensor on cuda:0 \(where q is: the kernel reads it "
                                           r"there\), got cpu$"),
    ("on-cuda1", lambda: cuda(torch.zeros(8), 1), r"^sinks: expected a tensor on cuda:0 \(where q is: the kernel "
                                                  r"reads it there\), got cuda:1$"),
    ("nan", lambda: nan_at(3), r"^sinks: expected finite values or -inf \(no sink for that head\), got nan at head 3$"),
    ("plus-inf", lambda: nan_at(7, math.inf), r"^sinks: expected finite values or -inf \(no sink for that head\), "
                                              r"got inf at head 7$"),
]


@pytest.mark.parametrize("what,make,match", BAD_SINKS, ids=[c[0] for c in BAD_SINKS])
@pytest.mark.parametrize("op", OPS)
def test_bad_sinks_are_refused_before_any_launch(op, what, make, match, gpu):
    fn, args = call_of(op)
    modules = gpu.modules
    with pytest.raises(ValueError, match=match):
        fn(*args, sinks=make())
    assert gpu.launches == [] and gpu.modules == modules, "a launch (or, single ops, a kernel load) came first"
    fn(*args, sinks=cuda(torch.full((8,), -math.inf)))  # -inf everywhere: no sink, accepted
    assert len(gpu.launches) == 1


def test_shape_mistakes_read_the_same_without_a_device(no_compile):
    """Single ops check the sinks' structure before q's device: a CPU call names sinks, not q."""
    q, k, v = torch.randn(4, 8, 128).to(BF16), torch.randn(16, 2, 128).to(BF16), torch.randn(16, 2, 128).to(BF16)
    with pytest.raises(ValueError, match=r"^sinks: expected dtype torch.float32"):
        flashjit.single_prefill_with_kv_cache(q, k, v, sinks=torch.zeros(8, dtype=BF16))
    with pytest.raises(ValueError, match=r"^sinks: expected a 1-D tensor of 8 elements"):
        flashjit.single_decode_with_kv_cache(q[0], k, v, sinks=torch.zeros(2))
    with pytest.raises(ValueError, match=r"^q: expected a CUDA tensor"):  # right sinks: the device check
        flashjit.single_decode_with_kv_cache(q[0], k, v, sinks=torch.zeros(8))


@pytest.mark.parametrize("op", OPS)
def test_sinks_reach_params_by_address_and_keep_out_of_other_signatures(op, gpu):
    """The address is the signature's: runs without sinks (and their fast slots)
    pass null before and after, another tensor passes its own address."""
    fn, args = call_of(op)
    sinks, other = cuda(torch.randn(8)), cuda(torch.zeros(8))
    for given in (None, None, sinks, sinks, None, other, sinks, None):
        fn(*args, sinks=given)
    expected = [0, 0, sinks.data_ptr(), sinks.data_ptr(), 0, other.data_ptr(), sinks.data_ptr(), 0]
    assert [sinks_field(launch) for launch in gpu.launches] == expected
    assert sinks.data_ptr() % 4 == 0


@pytest.mark.parametrize("op", ["ragged", "paged_prefill", "decode"])
def test_runs_into_out_and_lse_take_the_sinks_too(op, gpu):
    fn, args = call_of(op)
    sinks = cuda(torch.randn(8))
    q = args[0]
    out, lse = cuda(torch.empty(q.shape, dtype=BF16)), cuda(torch.empty(q.shape[:2]))
    fn(*args, out=out)
    fn(*args, out=out, sinks=sinks)
    fn(*args, out=out, lse=lse, return_lse=True, sinks=sinks)
    fn(*args, out=out)
    assert [sinks_field(launch) for launch in gpu.launches] == [0, sinks.data_ptr(), sinks.data_ptr(), 0]


@pytest.mark.parametrize("op", OPS)
def test_values_are_read_once_per_tensor(op, gpu, monkeypatch):
    """One device read when a sinks tensor is first seen; values written in place
    later are not checked (the kernel reads them as they are); a new tensor is."""
    reads = []
    check_values = _sinks.check_values
    monkeypatch.setattr(_sinks, "check_values", lambda t: reads.append(t.data_ptr()) or check_values(t))
    fn, args = call_of(op)
    sinks = cuda(torch.zeros(8))
    fn(*args, sinks=sinks)
    sinks[2] = math.nan
    fn(*args, sinks=sinks)
    fn(*args, sinks=sinks)
    assert reads == [sinks.data_ptr()] and len(gpu.launches) == 3
    with pytest.raises(ValueError, match=r"^sinks: expected finite values or -inf .* got nan at head 2$"):
        fn(*args, sinks=cuda(sinks.clone()))
    assert len(reads) == 2 and len(gpu.launches) == 3


def test_values_are_not_read_while_a_graph_is_captured(monkeypatch):
    """A read would break the capture: the first run (a warm-up) checks them."""
    with pytest.raises(ValueError, match=r"got nan at head 0"):
        _sinks.check_values(torch.tensor([math.nan, 0.0]))
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", lambda: True)
    _sinks.check_values(torch.tensor([math.nan, 0.0]))


def test_keys_are_cheap_and_hashable():
    t = torch.zeros(8)
    key = _sinks.key(t)
    assert key == _sinks.SinksKey(t.data_ptr(), torch.float32, torch.device("cpu"), (8,), (1,))
    assert hash(key) == hash(_sinks.key(t)) and key != _sinks.key(torch.zeros(8))
    assert _sinks.key(None) is None and _sinks.key([1.0]) == _sinks.NotATensor("list")


# ---------------------------------------------------------------------------
# Where the keyword sits


def _parameters(fn) -> dict:
    return inspect.signature(fn).parameters


def test_the_keyword_sits_where_flashinfer_puts_it():
    """Paged run(): right after window_left (FlashInfer 0.7.2); the others, which
    have no sinks in FlashInfer, take it by keyword only."""
    for cls in (flashjit.BatchDecodeWithPagedKVCacheWrapper, flashjit.BatchPrefillWithPagedKVCacheWrapper):
        names = list(_parameters(cls.run))
        assert names[names.index("window_left") + 1] == "sinks"
    for fn in (flashjit.BatchPrefillWithRaggedKVCacheWrapper.run, flashjit.single_prefill_with_kv_cache,
               flashjit.single_decode_with_kv_cache):
        sinks = _parameters(fn)["sinks"]
        assert sinks.kind is inspect.Parameter.KEYWORD_ONLY and sinks.default is None, fn
        assert "sinks" in fn.__doc__ and "LSE includes it" in " ".join(fn.__doc__.split()), fn


@pytest.mark.parametrize("cls", ["MultiLevelCascadeAttentionWrapper", "BatchMLAPagedAttentionWrapper"])
def test_ops_without_sinks_refuse_the_keyword(cls):
    run = getattr(flashjit, cls).run
    parameters = _parameters(run).values()
    assert "sinks" not in _parameters(run)
    assert all(p.kind is not inspect.Parameter.VAR_KEYWORD for p in parameters)
    required = sum(p.default is inspect.Parameter.empty for p in parameters)
    with pytest.raises(TypeError, match=r"unexpected keyword argument 'sinks'"):
        run(*[None] * required, sinks=torch.zeros(8))


# ---------------------------------------------------------------------------
# The float64 reference


def _inputs(qo_len=5, kv_len=40, heads=(4, 2), dim=32, seed=0):
    gen = torch.Generator().manual_seed(seed)
    q = torch.randn(qo_len, heads[0], dim, generator=gen, dtype=torch.float64)
    k, v = (torch.randn(kv_len, heads[1], dim, generator=gen, dtype=torch.float64) for _ in range(2))
    return q, k, v


@pytest.mark.parametrize("kw", [{}, {"causal": True}, {"window_left": 7, "causal": True}, {"logits_soft_cap": 2.0}],
                         ids=["full", "causal", "window", "softcap"])
def test_reference_sinks_of_minus_inf_are_no_sinks(kw):
    q, k, v = _inputs()
    out, lse = attention_reference(q, k, v, **kw)
    out_inf, lse_inf = attention_reference(q, k, v, sinks=torch.full((4,), -math.inf), **kw)
    assert torch.equal(out_inf, out) and torch.equal(lse_inf, lse)
    mixed = torch.tensor([-math.inf, 0.5, -math.inf, 2.0])
    out_mixed, lse_mixed = attention_reference(q, k, v, sinks=mixed, **kw)
    assert torch.equal(out_mixed[:, ::2], out[:, ::2]) and torch.equal(lse_mixed[:, ::2], lse[:, ::2])
    assert (lse_mixed[:, 1::2] > lse[:, 1::2]).all()


def test_reference_rows_without_keys_give_zero_and_the_sink():
    """Causal with more queries than keys: the first rows see no key."""
    q, k, v = _inputs(qo_len=12, kv_len=4)
    sinks = torch.tensor([0.25, -3.0, 30.0, -math.inf])
    out, lse = attention_reference(q, k, v, causal=True, sinks=sinks)
    assert (out[:8] == 0).all() and (out[8:, :3] != 0).all()
    assert torch.allclose(lse[:8, :3], (sinks[:3].double() * math.log2(math.e)).expand(8, 3), rtol=1e-15, atol=0)
    assert torch.isneginf(lse[:8, 3]).all() and torch.isfinite(lse[8:]).all()


@pytest.mark.parametrize("sink", [30.0, 1.5, -4.0])
def test_reference_sink_scales_each_row_by_its_share(sink):
    """o with a sink = o without * (1 - p_sink), p_sink = e^s / (e^s + sum e^logits);
    the LSE is logaddexp(LSE, s) (in log2 units); the sink is neither scaled by
    sm_scale nor soft-capped."""
    for kw in ({}, {"logits_soft_cap": 1.0, "sm_scale": 0.3}):
        q, k, v = _inputs(seed=int(sink))
        out, lse = attention_reference(q, k, v, **kw)
        out_s, lse_s = attention_reference(q, k, v, sinks=torch.full((4,), sink), **kw)
        ln2 = math.log(2.0)
        assert torch.allclose(lse_s * ln2, torch.logaddexp(lse * ln2, torch.tensor(sink, dtype=torch.float64)),
                              rtol=1e-14, atol=0)
        share = torch.sigmoid(lse * ln2 - sink)  # 1 - p_sink
        assert torch.allclose(out_s / share[..., None], out, rtol=0, atol=1e-13)  # |out| ~ 1: float64 roundings
        if sink == 30.0:
            assert float(share.max()) < 1e-9, "a sink of 30 dominates rows of 40 unit-scale logits"


def test_ragged_reference_takes_the_sinks_per_request():
    q, k, v = _inputs(qo_len=9, kv_len=50)
    sinks = torch.tensor([0.5, -1.0, 2.0, 0.0])
    out, lse = ragged_reference(q, k, v, [0, 4, 9], [0, 20, 50], causal=True, sinks=sinks)
    first, first_lse = attention_reference(q[:4], k[:20], v[:20], causal=True, sinks=sinks)
    assert torch.equal(out[:4], first) and torch.equal(lse[:4], first_lse)


# ---------------------------------------------------------------------------
# The GPU test's configurations


def test_the_gpu_tests_use_only_configurations_the_sweep_builds(monkeypatch):
    monkeypatch.setattr(sweep, "fa3_runs_here", lambda: True)
    monkeypatch.delenv("FLASHJIT_PREWARM_FP8", raising=False)
    monkeypatch.delenv("FLASHJIT_PREWARM_OPS", raising=False)
    used, built = test_gpu_sinks.used_specs(), set(sweep.all_specs())
    missing = [s.name for s in used if s not in built]
    assert not missing, f"test_gpu_sinks.py uses configurations the sweep does not build: {missing}"
    assert {s.op for s in used} == {"single_prefill", "single_decode", "batch_prefill_ragged", "batch_prefill_paged",
                                    "batch_decode_paged"}
    assert {s.backend for s in used if s.use_tensor_cores} == {"fa2", "fa3"}
    assert {s.head_dim_qk for s in used} == set(sweep.HEAD_DIMS) and any(s.sliding_window for s in used)
    assert test_gpu_sinks.pytestmark.name == "gpu"
