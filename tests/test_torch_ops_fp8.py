"""FP8 KV-cache scales through the torch.ops.flashjit operators, on the CPU: the
attention operators' schemas carry k_scale / v_scale (floats) and
k_scale_tensor / v_scale_tensor (one-element tensors), a compiled paged decode
(fullgraph=True) passes tensor scales as graph inputs, so a new value in the
same tensor reaches the launch without a recompile, and the eager scale errors
surface while tracing. The plan is made on the host and a stand-in launch
applies the scales it is given. On a GPU: test_gpu_fp8_compile.py."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch
import torch._dynamo
import torch._dynamo.testing
from torch.library import opcheck

import flashjit
from flashjit import jit
from flashjit.ops import _batch, _dispatch
import helpers_cache
from test_bad_input_wrappers import _i32, _workspace
from test_torch_ops import BF16, OPCHECK, _compiled_graphs, _op, _targets

# A fixture: pytest looks fixtures up by name in the test module.
no_compile = helpers_cache.no_compile

E4M3 = torch.float8_e4m3fn
SCALE_ARGS = [("k_scale", "Optional[float]"), ("v_scale", "Optional[float]"), ("k_scale_tensor", "Optional[Tensor]"),
              ("v_scale_tensor", "Optional[Tensor]")]
ATTENTION_OPERATORS = ["single_prefill", "single_decode"] + [
    f"{op}_{form}" for op in ("batch_prefill_ragged", "batch_prefill_paged", "batch_decode_paged")
    for form in ("run", "run_out")]


@pytest.fixture
def scaled_launch(no_compile, monkeypatch):
    """plan() with a stand-in kernel module; the launch writes q * v_scale + K's first
    code * k_scale (the scales as the kernel would read them) and records them."""
    monkeypatch.setattr(jit, "get_module", lambda spec: SimpleNamespace(spec=spec, rows_per_cta=64, split_align=64))
    monkeypatch.setattr(_batch, "resident_ctas", lambda module, device: 132)
    seen = []

    def launch(self, q, k, v, k_strides, v_strides, out, lse, v_offset=0, scales=None):
        k_scale, v_scale = (s.value for s in scales)
        seen.append((k_scale, v_scale))
        out.copy_(q.float() * v_scale + k.flatten()[0].float() * k_scale)
        if lse is not None:
            lse.copy_(q.float().sum(-1))
    monkeypatch.setattr(_batch.BatchAttention, "_launch", launch)
    return seen


def _fp8_decode(kv_dtype=E4M3):
    """A CUDA-core paged decode planned on the host for an FP8 cache: 2 requests of 2 pages."""
    w = flashjit.BatchDecodeWithPagedKVCacheWrapper(_workspace())
    w._device = torch.device("cpu")  # the plan's metadata stays on the host
    w.plan(_i32(0, 2, 4), _i32(0, 1, 2, 3), _i32(4, 4), 8, 2, 128, 16, q_data_type=BF16, kv_data_type=kv_dtype)
    q = torch.randn(2, 8, 128).to(BF16)
    cache = torch.randn(4, 2, 16, 2, 128).mul(8).to(kv_dtype)
    return w, q, cache


def _expected(q, cache, k_scale: float, v_scale: float):
    return (q.float() * v_scale + cache.flatten()[0].float() * k_scale).to(q.dtype)


@pytest.mark.parametrize("name", ATTENTION_OPERATORS)
def test_attention_operators_take_the_scales_with_defaults(name):
    schema = _op(name)._schema
    args = {a.name: a for a in schema.arguments}
    assert [(n, str(args[n].type)) for n, _ in SCALE_ARGS] == SCALE_ARGS
    assert all(args[n].has_default_value() and args[n].default_value is None for n, _ in SCALE_ARGS)
    assert not any(args[n].alias_info for n, _ in SCALE_ARGS), "a scale is read, never written"


def test_scale_operands_split_numbers_from_tensors():
    t = torch.tensor([0.5])
    assert _dispatch.scale_operands(None, None) == (None, None, None, None)
    assert _dispatch.scale_operands(2, 0.25) == (2.0, 0.25, None, None)
    k_number, v_number, k_tensor, v_tensor = _dispatch.scale_operands(t, 3.0)
    assert (k_number, v_number, k_tensor, v_tensor is None) == (None, 3.0, t, True)
    with pytest.raises(ValueError, match=r"^v_scale: expected a Python float or a one-element float32 tensor, got "
                                         r"bool"):
        _dispatch.scale_operands(1.0, True)


@pytest.mark.parametrize("backend", ["aot_eager", "inductor"])
def test_compiled_decode_reads_new_values_of_its_scale_tensors(backend, scaled_launch):
    """One graph, the scale tensors its inputs: each call launches with the values they hold then."""
    w, q, cache = _fp8_decode()
    k_scale, v_scale = torch.tensor([0.5]), torch.tensor([2.0])

    def step(q, cache, k_scale, v_scale):
        o, lse = w.run(q, cache, k_scale=k_scale, v_scale=v_scale, return_lse=True)
        out = torch.empty_like(q)
        w.run(q, cache, k_scale=k_scale, v_scale=v_scale, out=out)
        return o, lse, out

    torch._dynamo.reset()
    counter = torch._dynamo.testing.CompileCounterWithBackend(backend)
    compiled = torch.compile(step, fullgraph=True, backend=counter)
    for ks, vs in ((0.5, 2.0), (0.125, 4.0), (3.0, 0.75)):
        k_scale.fill_(ks)
        v_scale.fill_(vs)
        o, lse, out = compiled(q, cache, k_scale, v_scale)
        assert scaled_launch[-2:] == [(ks, vs)] * 2
        assert torch.equal(o, _expected(q, cache, ks, vs)) and torch.equal(out, o)
        eager = step(q, cache, k_scale, v_scale)
        assert all(torch.equal(a, b) for a, b in zip(eager, (o, lse, out), strict=True))
    assert counter.frame_count == 1, "a new scale value recompiled the graph"


def test_the_graph_passes_the_scale_tensors_to_the_operators(scaled_launch):
    w, q, cache = _fp8_decode()
    _, graphs = _compiled_graphs(lambda q, c, ks, vs: w.run(q, c, k_scale=ks, v_scale=vs), q, cache,
                                 torch.tensor([0.5]), torch.tensor([2.0]))
    calls = [n for gm in graphs for n in gm.graph.nodes if n.op == "call_function"
             and str(n.target) == "flashjit.batch_decode_paged_run.default"]
    assert len(calls) == 1
    k_tensor, v_tensor = calls[0].args[-2:]
    assert (k_tensor.op, k_tensor.name, v_tensor.op, v_tensor.name) == ("placeholder", "l_ks_", "placeholder", "l_vs_")


def test_number_scales_compile_as_constants(scaled_launch):
    w, q, cache = _fp8_decode(torch.float8_e5m2)
    torch._dynamo.reset()
    compiled = torch.compile(lambda q, c: w.run(q, c, k_scale=0.25, v_scale=3), fullgraph=True, backend="aot_eager")
    assert torch.equal(compiled(q, cache), _expected(q, cache, 0.25, 3.0))
    assert scaled_launch[-1] == (0.25, 3.0)
    assert torch.equal(compiled(q, cache), w.run(q, cache, k_scale=0.25, v_scale=3.0))


def test_opcheck_fp8_decode_with_scale_tensors(scaled_launch):
    """test_schema compares the inputs before and after with allclose, which the
    CPU does not compute on FP8 (test_torch_ops.py runs it on every operator)."""
    w, q, cache = _fp8_decode()
    checks = tuple(t for t in OPCHECK if t != "test_schema")
    scales = (None, None, torch.tensor([0.5]), torch.tensor([2.0]))
    for return_lse in (False, True):
        opcheck(_op("batch_decode_paged_run"), (w._handle, q, cache, None, return_lse, None, *scales),
                test_utils=checks)
    opcheck(_op("batch_decode_paged_run"), (w._handle, q, cache, None, True, None, 0.5, 2.0), test_utils=checks)
    out, lse = torch.empty_like(q), torch.empty(q.shape[:2])
    opcheck(_op("batch_decode_paged_run_out"), (w._handle, q, cache, None, out, lse, None, *scales),
            test_utils=checks)


def _compile(fn, *args):
    torch._dynamo.reset()
    return torch.compile(fn, fullgraph=True, backend="aot_eager")(*args)


def test_scale_mistakes_under_compile_read_as_in_eager(scaled_launch):
    w, q, cache = _fp8_decode()
    with pytest.raises(Exception, match=r"k_scale: expected a Python float or a one-element float32 tensor, got a "
                                        r"torch.float32 tensor of 2 elements"):
        _compile(lambda q, c, s: w.run(q, c, k_scale=s), q, cache, torch.ones(2))
    with pytest.raises(Exception, match=r"v_scale: expected a finite positive scale, got -1.0"):
        _compile(lambda q, c: w.run(q, c, v_scale=-1.0), q, cache)
    with pytest.raises(Exception, match=r"k_scale: expected a Python float or a one-element float32 tensor, got "
                                        r"str"):
        _compile(lambda q, c: w.run(q, c, k_scale="1"), q, cache)
    plain = flashjit.BatchDecodeWithPagedKVCacheWrapper(_workspace())
    plain._device = torch.device("cpu")
    plain.plan(_i32(0, 2, 4), _i32(0, 1, 2, 3), _i32(4, 4), 8, 2, 128, 16, q_data_type=BF16)
    with pytest.raises(Exception, match=r"k_scale=.*: scales apply to an FP8 KV cache only"):
        _compile(lambda q, c, s: plain.run(q, c, k_scale=s), q, cache.to(BF16), torch.tensor([0.5]))
    assert scaled_launch == [], "nothing was launched"


def test_single_decode_traces_its_scales_on_meta():
    q = torch.randn(8, 128, device="meta", dtype=BF16)
    k, v = (torch.empty(40, 2, 128, device="meta", dtype=E4M3) for _ in range(2))
    (o, lse), graphs = _compiled_graphs(
        lambda q, k, v, s: flashjit.single_decode_with_kv_cache(q, k, v, k_scale=s, v_scale=0.5, return_lse=True),
        q, k, v, torch.tensor([0.25], device="meta"))
    assert (o.shape, o.dtype, lse.shape) == ((8, 128), BF16, (8,))
    assert "flashjit.single_decode.default" in _targets(graphs)
    with pytest.raises(Exception, match=r"v_scale=0.5: scales apply to an FP8 KV cache only"):
        _compile(lambda q, k, v: flashjit.single_decode_with_kv_cache(q, k, v, v_scale=0.5), q, k.to(BF16),
                 v.to(BF16))
