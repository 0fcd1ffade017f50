"""Attention sinks through the torch.ops.flashjit operators, on the CPU: every
attention operator's schema ends with `Tensor? sinks=None`; a compiled run
(fullgraph=True) passes the sinks tensor as a graph input, so values written
into it reach the launch without a recompile; the fake kernels refuse sinks
of the wrong dtype, shape or device while tracing. Wrappers are planned on the
host and a stand-in launch reads the sinks through the address it is given,
as the kernel does. On a GPU: test_gpu_sinks.py."""

from __future__ import annotations

import ctypes
import math
from types import SimpleNamespace

import pytest
import torch
import torch._dynamo
import torch._dynamo.testing
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.library import opcheck

import flashjit
from flashjit import jit
from flashjit.ops import _batch
import helpers_cache
from test_torch_ops import BF16, OPCHECK, _compiled_graphs, _op, _targets
from test_torch_ops_fp8 import ATTENTION_OPERATORS, _compile
from test_bad_input_wrappers import _i32, _workspace

# A fixture: pytest looks fixtures up by name in the test module.
no_compile = helpers_cache.no_compile


@pytest.fixture
def sink_launch(no_compile, monkeypatch):
    """plan() with a stand-in kernel module; the launch reads num_qo_heads floats
    at the sinks address (as the kernel would) and writes q * 2 + their sum,
    recording what it read (None: no sinks)."""
    monkeypatch.setattr(jit, "get_module", lambda spec: SimpleNamespace(spec=spec, rows_per_cta=64, split_align=64))
    monkeypatch.setattr(_batch, "resident_ctas", lambda module, device: 132)
    seen = []

    def launch(self, q, k, v, k_strides, v_strides, out, lse, v_offset=0, scales=None, sinks=0):
        values = list((ctypes.c_float * q.shape[1]).from_address(sinks)) if sinks else None
        seen.append(values)
        out.copy_(q.float() * 2 + (sum(values) if values else 0.0))
        if lse is not None:
            lse.copy_(q.float().sum(-1))
    monkeypatch.setattr(_batch.BatchAttention, "_launch", launch)
    return seen


def _decode(kind: str = "decode"):
    """A paged decode (or, kind="ragged", a ragged prefill) planned on the host: 8 query heads, 2 KV heads."""
    if kind == "ragged":
        w = flashjit.BatchPrefillWithRaggedKVCacheWrapper(_workspace())
        w._device = torch.device("cpu")
        w.plan([0, 3, 6], [0, 20, 40], 8, 2, 128, causal=True, q_data_type=BF16)
        return w, (torch.randn(6, 8, 128).to(BF16), torch.randn(40, 2, 128).to(BF16), torch.randn(40, 2, 128).to(BF16))
    w = flashjit.BatchDecodeWithPagedKVCacheWrapper(_workspace())
    w._device = torch.device("cpu")  # the plan's metadata stays on the host
    w.plan(_i32(0, 2, 4), _i32(0, 1, 2, 3), _i32(4, 4), 8, 2, 128, 16, q_data_type=BF16)
    return w, (torch.randn(2, 8, 128).to(BF16), torch.randn(4, 2, 16, 2, 128).to(BF16))


@pytest.mark.parametrize("name", ATTENTION_OPERATORS)
def test_attention_operators_end_with_the_sinks(name):
    args = _op(name)._schema.arguments
    sinks = args[-1]
    assert (sinks.name, str(sinks.type), args[-2].name) == ("sinks", "Optional[Tensor]", "v_scale_tensor")
    assert sinks.has_default_value() and sinks.default_value is None
    assert sinks.alias_info is None, "the sinks are read, never written"


def test_mla_operators_take_no_sinks():
    for name in ("mla_paged_run", "mla_paged_run_out"):
        assert "sinks" not in {a.name for a in _op(name)._schema.arguments}


@pytest.mark.parametrize("kind", ["decode", "ragged"])
@pytest.mark.parametrize("backend", ["aot_eager", "inductor"])
def test_compiled_run_reads_the_values_its_sinks_hold(kind, backend, sink_launch):
    """One graph, the sinks a graph input: each call launches with the values it holds then."""
    w, inputs = _decode(kind)
    sinks = torch.zeros(8)

    def step(sinks, *inputs):
        o, lse = w.run(*inputs, return_lse=True, sinks=sinks)
        out = torch.empty_like(inputs[0])
        w.run(*inputs, out=out, sinks=sinks)
        return o, lse, out, w.run(*inputs)

    torch._dynamo.reset()
    counter = torch._dynamo.testing.CompileCounterWithBackend(backend)
    compiled = torch.compile(step, fullgraph=True, backend=counter)
    for values in ([0.5] * 8, [float(h) for h in range(8)], [-math.inf] + [1.0] * 7):
        sinks.copy_(torch.tensor(values))
        o, lse, out, plain = compiled(sinks, *inputs)
        assert sink_launch[-3:] == [values, values, None]
        assert torch.equal(o, (inputs[0].float() * 2 + sum(values)).to(BF16)) and torch.equal(out, o)
        eager = step(sinks, *inputs)
        assert all(torch.equal(a, b) for a, b in zip(eager, (o, lse, out, plain), strict=True))
    assert counter.frame_count == 1, "new sink values recompiled the graph"


def test_the_graph_passes_the_sinks_tensor_to_the_operator(sink_launch):
    w, (q, cache) = _decode()
    _, graphs = _compiled_graphs(lambda q, c, s: w.run(q, c, sinks=s), q, cache, torch.zeros(8))
    calls = [n for gm in graphs for n in gm.graph.nodes if n.op == "call_function"
             and str(n.target) == "flashjit.batch_decode_paged_run.default"]
    assert len(calls) == 1
    sinks = calls[0].args[-1]
    assert (sinks.op, sinks.name) == ("placeholder", "l_s_")


def test_opcheck_with_sinks(sink_launch):
    w, (q, cache) = _decode()
    sinks = torch.randn(8)
    for return_lse in (False, True):
        opcheck(_op("batch_decode_paged_run"), (w._handle, q, cache, None, return_lse, None, None, None, None, None,
                                                sinks), test_utils=OPCHECK)
    out, lse = torch.empty_like(q), torch.empty(q.shape[:2])
    opcheck(_op("batch_decode_paged_run_out"), (w._handle, q, cache, None, out, lse, None, None, None, None, None,
                                                sinks), test_utils=OPCHECK)


@pytest.mark.parametrize("sinks,match", [
    (torch.zeros(8, dtype=BF16), r"sinks: expected dtype torch.float32, got torch.bfloat16"),
    (torch.zeros(2), r"sinks: expected a 1-D tensor of 8 elements \(num_qo_heads\), got shape \(2,\)"),
    (torch.zeros(16)[::2], r"sinks: expected a contiguous tensor, got strides \(2,\)"),
    (torch.tensor([math.nan] + [0.0] * 7), r"sinks: expected finite values or -inf .* got nan at head 0"),
], ids=["dtype", "shape", "strided", "nan"])
def test_sinks_mistakes_under_compile_read_as_in_eager(sinks, match, sink_launch):
    w, (q, cache) = _decode()
    with pytest.raises(Exception, match=match):
        _compile(lambda q, c, s: w.run(q, c, sinks=s), q, cache, sinks)
    with pytest.raises(Exception, match=r"sinks: expected a float32 torch.Tensor of num_qo_heads elements, got list"):
        _compile(lambda q, c: w.run(q, c, sinks=[0.0] * 8), q, cache)
    assert sink_launch == [], "nothing was launched"


def test_single_ops_trace_their_sinks_on_fake_tensors():
    with FakeTensorMode():
        # Fake CUDA tensors need no GPU (as long as nothing views them on a CPU-only torch).
        q = torch.empty(7, 8, 128, dtype=BF16, device="cuda")
        k, v = (torch.empty(40, 2, 128, dtype=BF16, device="cuda") for _ in range(2))
        q1, sinks = torch.empty(8, 128, dtype=BF16, device="cuda"), torch.empty(8, device="cuda")
        o, lse = flashjit.single_prefill_with_kv_cache(q, k, v, return_lse=True, sinks=sinks)
        d, d_lse = flashjit.single_decode_with_kv_cache(q1, k, v, return_lse=True, sinks=sinks)
        assert (o.shape, lse.shape, d.shape, d_lse.shape) == ((7, 8, 128), (7, 8), (8, 128), (8,))
        for bad, match in ((torch.empty(8, device="cpu"), r"^sinks: expected a tensor on cuda:0 \(where q is"),
                           (torch.empty(4, device="cuda"), r"^sinks: expected a 1-D tensor of 8 elements"),
                           (torch.empty(8, dtype=torch.float16, device="cuda"), r"^sinks: expected dtype")):
            with pytest.raises(ValueError, match=match):
                flashjit.single_prefill_with_kv_cache(q, k, v, sinks=bad)
            with pytest.raises(ValueError, match=match):
                flashjit.single_decode_with_kv_cache(q1, k, v, sinks=bad)


def test_single_decode_compiles_with_its_sinks_on_meta():
    q = torch.randn(8, 128, device="meta", dtype=BF16)
    k, v = (torch.empty(40, 2, 128, device="meta", dtype=BF16) for _ in range(2))
    (o, lse), graphs = _compiled_graphs(
        lambda q, k, v, s: flashjit.single_decode_with_kv_cache(q, k, v, return_lse=True, sinks=s),
        q, k, v, torch.empty(8, device="meta"))
    assert (o.shape, lse.shape) == ((8, 128), (8,))
    assert "flashjit.single_decode.default" in _targets(graphs)
    node = next(n for gm in graphs for n in gm.graph.nodes if str(n.target) == "flashjit.single_decode.default")
    assert node.args[-1].op == "placeholder"
