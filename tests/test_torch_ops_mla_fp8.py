"""An FP8 MLA cache's scales through the torch.ops.flashjit.mla_paged_run(_out)
operators, on the CPU: the schemas carry ckv_scale / kpe_scale (floats) and
ckv_scale_tensor / kpe_scale_tensor (one-element tensors), a compiled run()
(fullgraph=True) passes tensor scales as graph inputs, so a new value in the
same tensor reaches the launch without a recompile, FakeTensorMode, make_fx and
meta tensors trace both forms, and the eager scale errors surface while
tracing, before any launch. The plan is made on the host and a stand-in launch
applies the scales it is given (test_torch_ops_fp8.py does the same for the
attention operators). On a GPU: test_gpu_fp8_compile.py."""

from __future__ import annotations

import math
from types import SimpleNamespace

import pytest
import torch
import torch._dynamo
import torch._dynamo.testing
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.fx.experimental.proxy_tensor import make_fx
from torch.library import opcheck

import flashjit
from flashjit import jit
from flashjit.ops import _batch, _dispatch, _scales
import helpers_cache
from test_bad_input_wrappers import _workspace
from test_torch_ops import BF16, OPCHECK, _compiled_graphs, _op, _targets

# A fixture: pytest looks fixtures up by name in the test module.
no_compile = helpers_cache.no_compile

E4M3 = torch.float8_e4m3fn
HEADS, CKV, KPE, PAGE = 16, 512, 64, 16
RUN, RUN_OUT = "flashjit.mla_paged_run.default", "flashjit.mla_paged_run_out.default"
SCALE_ARGS = [("ckv_scale", "Optional[float]"), ("kpe_scale", "Optional[float]"),
              ("ckv_scale_tensor", "Optional[Tensor]"), ("kpe_scale_tensor", "Optional[Tensor]")]


@pytest.fixture
def scaled_launch(no_compile, monkeypatch):
    """plan() with a stand-in kernel module; the launch writes q_nope * ckv_scale + the
    first kpe code * kpe_scale (the scales as the kernel would read them) and records them."""
    monkeypatch.setattr(jit, "get_module", lambda spec: SimpleNamespace(spec=spec, rows_per_cta=16, split_align=64))
    monkeypatch.setattr(_batch, "resident_ctas", lambda module, device: 132)
    seen = []

    def launch(self, q_nope, q_pe, ckv, kpe, out, lse, scales=(_scales.UNIT, _scales.UNIT)):
        ckv_scale, kpe_scale = (s.value for s in scales)
        seen.append((ckv_scale, kpe_scale))
        out.copy_(q_nope.float() * ckv_scale + kpe.flatten()[0].float() * kpe_scale)
        if lse is not None:
            lse.copy_(q_pe.float().sum(-1) + ckv.flatten()[0].float())
    monkeypatch.setattr(flashjit.BatchMLAPagedAttentionWrapper, "_launch_mla", launch)
    return seen


def _fp8_mla(kv_dtype=E4M3, device="cpu"):
    """Two decode requests of 20 keys in 2 pages of 16, planned on the host; inputs on `device`."""
    w = flashjit.BatchMLAPagedAttentionWrapper(_workspace())
    w._device = torch.device("cpu")  # the plan's metadata stays on the host
    i32 = lambda values: torch.tensor(values, dtype=torch.int32)  # noqa: E731
    w.plan(i32([0, 1, 2]), i32([0, 2, 4]), i32([3, 2, 1, 0]), i32([20, 20]), HEADS, CKV, KPE, PAGE, False,
           1 / math.sqrt(192), BF16, kv_dtype)
    g = torch.Generator().manual_seed(3)
    q_nope, q_pe = (torch.randn(2, HEADS, d, generator=g).to(BF16) for d in (CKV, KPE))
    ckv, kpe = (torch.randn(4, PAGE, d, generator=g).mul(8).to(kv_dtype) for d in (CKV, KPE))
    return w, *(t.to(device) for t in (q_nope, q_pe, ckv, kpe))


def _expected(q_nope, kpe, ckv_scale: float, kpe_scale: float):
    return (q_nope.float() * ckv_scale + kpe.flatten()[0].float() * kpe_scale).to(q_nope.dtype)


@pytest.mark.parametrize("name", ["mla_paged_run", "mla_paged_run_out"])
def test_mla_operators_take_the_scales_with_defaults(name):
    args = {a.name: a for a in _op(name)._schema.arguments}
    assert [(n, str(args[n].type)) for n, _ in SCALE_ARGS] == SCALE_ARGS
    assert all(args[n].has_default_value() and args[n].default_value is None for n, _ in SCALE_ARGS)
    assert not any(args[n].alias_info for n, _ in SCALE_ARGS), "a scale is read, never written"


def test_scale_operands_name_mla_scales():
    t = torch.tensor([0.5])
    assert _dispatch.scale_operands(t, 2, _scales.MLA_SCALE_NAMES) == (None, 2.0, t, None)
    with pytest.raises(ValueError, match=r"^kpe_scale: expected a Python float or a one-element float32 tensor, "
                                         r"got str"):
        _dispatch.scale_operands(1.0, "2", _scales.MLA_SCALE_NAMES)


@pytest.mark.parametrize("backend", ["aot_eager", "inductor"])
def test_compiled_mla_reads_new_values_of_its_scale_tensors(backend, scaled_launch):
    """One graph, the scale tensors its inputs: each call launches with the values they hold then."""
    w, q_nope, q_pe, ckv, kpe = _fp8_mla()
    ckv_scale, kpe_scale = torch.tensor([0.5]), torch.tensor([2.0])

    def step(q_nope, q_pe, ckv, kpe, ckv_scale, kpe_scale):
        o, lse = w.run(q_nope, q_pe, ckv, kpe, ckv_scale=ckv_scale, kpe_scale=kpe_scale, return_lse=True)
        out = torch.empty_like(q_nope)
        w.run(q_nope, q_pe, ckv, kpe, out=out, ckv_scale=ckv_scale, kpe_scale=kpe_scale)
        return o, lse, out

    torch._dynamo.reset()
    counter = torch._dynamo.testing.CompileCounterWithBackend(backend)
    compiled = torch.compile(step, fullgraph=True, backend=counter)
    for cs, ks in ((0.5, 2.0), (0.125, 4.0), (3.0, 0.75)):
        ckv_scale.fill_(cs)
        kpe_scale.fill_(ks)
        o, lse, out = compiled(q_nope, q_pe, ckv, kpe, ckv_scale, kpe_scale)
        assert scaled_launch[-2:] == [(cs, ks)] * 2
        assert torch.equal(o, _expected(q_nope, kpe, cs, ks)) and torch.equal(out, o)
        eager = step(q_nope, q_pe, ckv, kpe, ckv_scale, kpe_scale)
        assert all(torch.equal(a, b) for a, b in zip(eager, (o, lse, out), strict=True))
    assert counter.frame_count == 1, "a new scale value recompiled the graph"


def test_the_graph_passes_the_scale_tensors_to_the_operators(scaled_launch):
    w, *inputs = _fp8_mla()
    _, graphs = _compiled_graphs(lambda q_nope, q_pe, ckv, kpe, cs, ks: w.run(q_nope, q_pe, ckv, kpe, ckv_scale=cs,
                                                                                kpe_scale=ks),
                                 *inputs, torch.tensor([0.5]), torch.tensor([2.0]))
    calls = [n for gm in graphs for n in gm.graph.nodes if n.op == "call_function" and str(n.target) == RUN]
    assert len(calls) == 1
    ckv_tensor, kpe_tensor = calls[0].args[-2:]
    assert (ckv_tensor.op, ckv_tensor.name, kpe_tensor.op, kpe_tensor.name) == ("placeholder", "l_cs_",
                                                                                "placeholder", "l_ks_")


def test_number_scales_compile_as_constants(scaled_launch):
    w, q_nope, q_pe, ckv, kpe = _fp8_mla(torch.float8_e5m2)
    torch._dynamo.reset()
    compiled = torch.compile(lambda *a: w.run(*a, ckv_scale=0.25, kpe_scale=3), fullgraph=True, backend="aot_eager")
    assert torch.equal(compiled(q_nope, q_pe, ckv, kpe), _expected(q_nope, kpe, 0.25, 3.0))
    assert scaled_launch[-1] == (0.25, 3.0)
    assert torch.equal(compiled(q_nope, q_pe, ckv, kpe), w.run(q_nope, q_pe, ckv, kpe, ckv_scale=0.25, kpe_scale=3.0))


def test_fake_tensor_mode_make_fx_and_meta_trace_both_forms(scaled_launch):
    w, *inputs = _fp8_mla()
    with FakeTensorMode():
        # Fake CUDA tensors need no GPU; the fake kernel reads no data.
        q_nope, q_pe, ckv, kpe = (torch.empty(t.shape, dtype=t.dtype, device="cuda") for t in inputs)
        o, lse = w.run(q_nope, q_pe, ckv, kpe, ckv_scale=0.5, kpe_scale=2.0, return_lse=True)
        scale = torch.empty(1, device="cuda")
        out = torch.empty(2, HEADS, CKV, dtype=BF16, device="cuda")
        assert w.run(q_nope, q_pe, ckv, kpe, out=out, ckv_scale=scale, kpe_scale=scale) is out
    assert (o.device.type, o.shape, o.dtype, lse.shape) == ("cuda", (2, HEADS, CKV), BF16, (2, HEADS))
    for scales in ((0.5, 2.0), (torch.tensor([0.5]), torch.tensor([2.0]))):
        gm = make_fx(lambda *a: w.run(*a[:4], ckv_scale=a[4], kpe_scale=a[5], return_lse=True),
                     tracing_mode="fake")(*inputs, *scales)
        assert RUN in _targets([gm])
        gm = make_fx(lambda *a: w.run(*a[:4], out=torch.empty(2, HEADS, CKV, dtype=BF16), ckv_scale=a[4],
                                      kpe_scale=a[5]), tracing_mode="fake")(*inputs, *scales)
        assert RUN_OUT in _targets([gm])
    meta = [t.to("meta") for t in inputs]
    for scales in ({"ckv_scale": 0.5, "kpe_scale": 2.0},
                   {"ckv_scale": torch.tensor([0.5], device="meta"), "kpe_scale": torch.ones(1, device="meta")}):
        (o, lse), graphs = _compiled_graphs(lambda *a: w.run(*a, return_lse=True, **scales), *meta)
        assert (o.device.type, o.shape, o.dtype, lse.shape) == ("meta", (2, HEADS, CKV), BF16, (2, HEADS))
        assert RUN in _targets(graphs)
    assert scaled_launch == [], "tracing launched nothing"


def test_opcheck_fp8_mla_with_scales(scaled_launch):
    """test_schema compares the inputs before and after with allclose, which the
    CPU does not compute on FP8 (test_torch_ops_mla.py runs it on a bf16 cache)."""
    w, *inputs = _fp8_mla()
    checks = tuple(t for t in OPCHECK if t != "test_schema")
    tensors = (None, None, torch.tensor([0.5]), torch.tensor([2.0]))
    for return_lse in (False, True):
        opcheck(_op("mla_paged_run"), (w._handle, *inputs, return_lse, *tensors), test_utils=checks)
    opcheck(_op("mla_paged_run"), (w._handle, *inputs, True, 0.5, 2.0), test_utils=checks)
    out, lse = torch.empty_like(inputs[0]), torch.empty(inputs[0].shape[:2])
    opcheck(_op("mla_paged_run_out"), (w._handle, *inputs, out, lse, *tensors), test_utils=checks)
    opcheck(_op("mla_paged_run_out"), (w._handle, *inputs, out, None, 0.25), test_utils=checks)


@pytest.mark.parametrize("scales,match", [
    (dict(ckv_scale=float("nan")), r"^ckv_scale: expected a finite positive scale, got nan"),
    (dict(kpe_scale=-2.0), r"^kpe_scale: expected a finite positive scale, got -2.0"),
    (dict(ckv_scale=1e-300), r"^ckv_scale: expected a scale within float32's normal range"),
    (dict(ckv_scale="2"), r"^ckv_scale: expected a Python float or a one-element float32 tensor, got str"),
    (dict(kpe_scale=torch.ones(2)), r"^kpe_scale: expected .* got a torch.float32 tensor of 2 elements"),
    (dict(ckv_scale=torch.ones(1, device="meta")), r"^ckv_scale: expected a tensor on cpu \(where q is\) or on "
                                                   r"the CPU, got meta"),
    (dict(ckv_scale=1e30, kpe_scale=1e-30), r"^ckv_scale: expected ckv_scale / kpe_scale within float32's normal "
                                            r"range"),
], ids=["nan", "negative", "subnormal", "str", "two_elements", "other_device", "ratio"])
def test_scale_mistakes_under_compile_read_as_in_eager(scales, match, scaled_launch):
    w, *inputs = _fp8_mla()
    with pytest.raises(ValueError, match=match):  # eager first: the same words
        w.run(*inputs, **scales)
    with pytest.raises(Exception, match=match[1:]):
        _compiled_graphs(lambda *a: w.run(*a, **scales), *inputs, backend="aot_eager")
    assert scaled_launch == [], "nothing was launched"


@pytest.mark.parametrize("name", ["ckv_scale", "kpe_scale"])
def test_scales_with_a_16_bit_cache_are_not_taken_while_tracing(name, scaled_launch):
    w, *inputs = _fp8_mla(BF16)
    for scale in (0.5, torch.tensor([0.5])):
        with pytest.raises(Exception, match=rf"{name}=.*: scales apply to an FP8 KV cache only"):
            _compiled_graphs(lambda *a: w.run(*a[:4], **{name: a[4]}), *inputs, scale)
    assert scaled_launch == []
