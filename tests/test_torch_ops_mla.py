"""BatchMLAPagedAttentionWrapper.run() as the torch.ops.flashjit.mla_paged_run(_out)
operators, without a GPU: schemas and mutations, tracing with fake tensors and
make_fx, torch.compile(fullgraph=True) with outputs bit-identical to eager,
re-planning under a compiled graph, opcheck, and errors that read as in eager
calls. The plan is made on the host with a stand-in kernel module, and a
stand-in launch writes a function of the inputs (test_torch_ops.py does the
same for the other wrappers). On a GPU: test_gpu_torch_ops.py."""

from __future__ import annotations

import math
from types import SimpleNamespace

import pytest
import torch
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.fx.experimental.proxy_tensor import make_fx
from torch.library import opcheck

import flashjit
from flashjit import jit
from flashjit.ops import _batch
import helpers_cache
from test_bad_input_wrappers import _workspace
from test_torch_ops import BF16, OPCHECK, _compiled_graphs, _op, _targets

# A fixture: pytest looks fixtures up by name in the test module.
no_compile = helpers_cache.no_compile

HEADS, CKV, KPE, PAGE = 16, 512, 64, 16
RUN, RUN_OUT = "flashjit.mla_paged_run.default", "flashjit.mla_paged_run_out.default"


@pytest.fixture
def mla_launch(no_compile, monkeypatch):
    """plan() with a stand-in kernel module; the launch writes a function of q_nope,
    q_pe and the first ckv element instead of attention, and records q_nope's rows."""
    monkeypatch.setattr(jit, "get_module", lambda spec: SimpleNamespace(spec=spec, rows_per_cta=16, split_align=64))
    monkeypatch.setattr(_batch, "resident_ctas", lambda module, device: 132)
    rows = []

    def launch(self, q_nope, q_pe, ckv, kpe, out, lse):
        rows.append(q_nope.shape[0])
        out.copy_(q_nope * 2 + ckv.flatten()[0])
        out[..., :KPE] += q_pe
        if lse is not None:
            lse.copy_(q_nope.float().sum(-1) - q_pe.float().sum(-1) + kpe.flatten()[0].float())
    monkeypatch.setattr(flashjit.BatchMLAPagedAttentionWrapper, "_launch_mla", launch)
    return rows


def _wrapper(batch: int = 2, qo_len: int = 1, causal: bool = False):
    w = flashjit.BatchMLAPagedAttentionWrapper(_workspace())
    w._device = torch.device("cpu")  # the plan's metadata stays on the host
    _replan(w, batch, qo_len, causal)
    return w


def _replan(w, batch: int, qo_len: int = 1, causal: bool = False) -> None:
    """batch requests of qo_len query tokens and 20 keys each, in 2 pages of 16."""
    i32 = lambda values: torch.tensor(values, dtype=torch.int32)  # noqa: E731
    w.plan(i32([qo_len * i for i in range(batch + 1)]), i32([2 * i for i in range(batch + 1)]),
           i32(list(range(2 * batch))[::-1]), i32([20] * batch), HEADS, CKV, KPE, PAGE, causal, 1 / math.sqrt(192),
           BF16, BF16)


def _inputs(batch: int = 2, qo_len: int = 1, device: str = "cpu"):
    g = torch.Generator().manual_seed(batch * 10 + qo_len)
    rows = batch * qo_len

    def randn(*shape):
        return torch.randn(*shape, generator=g).to(BF16).to(device)
    return randn(rows, HEADS, CKV), randn(rows, HEADS, KPE), randn(2 * batch, PAGE, CKV), randn(2 * batch, PAGE, KPE)


def _runs(w):
    """run() in each form: fresh outputs with and without LSE, into out=, into out= and lse=."""
    def fn(q_nope, q_pe, ckv, kpe):
        o, lse = w.run(q_nope, q_pe, ckv, kpe, return_lse=True)
        plain = w.run(q_nope, q_pe, ckv, kpe)
        out = torch.empty_like(q_nope)
        w.run(q_nope, q_pe, ckv, kpe, out=out)
        out2, lse2 = torch.empty_like(q_nope), torch.empty(q_nope.shape[:2])
        res = w.run(q_nope, q_pe, ckv, kpe, out=out2, lse=lse2, return_lse=True)
        return o * 1, lse, plain, out, out2, lse2, res[0] - out2
    return fn


def test_schemas_write_only_out_and_lse():
    for name, written in (("mla_paged_run", set()), ("mla_paged_run_out", {"out", "lse"})):
        op = _op(name)
        assert {a.name for a in op._schema.arguments if a.alias_info is not None and a.alias_info.is_write} == written
        assert [a.name for a in op._schema.arguments][:5] == ["handle", "q_nope", "q_pe", "ckv_cache", "kpe_cache"]
        assert not any(r.alias_info for r in op._schema.returns)
        assert torch.Tag.pt2_compliant_tag in op.tags


@pytest.mark.parametrize("backend", ["eager", "aot_eager", "inductor"])
@pytest.mark.parametrize("qo_len,causal", [(1, False), (4, True)], ids=["decode", "qo4_causal"])
def test_run_compiles_as_one_graph_bit_identical_to_eager(qo_len, causal, backend, mla_launch):
    w = _wrapper(qo_len=qo_len, causal=causal)
    args = _inputs(qo_len=qo_len)
    eager = _runs(w)(*args)
    launches = len(mla_launch)
    assert launches == 4 and mla_launch == [2 * qo_len] * 4
    if backend == "inductor":
        torch._dynamo.reset()
        compiled = torch.compile(_runs(w), fullgraph=True, backend="inductor")(*args)
    else:
        compiled, graphs = _compiled_graphs(_runs(w), *args, backend=backend)
        assert len(graphs) == 1 and {RUN, RUN_OUT} <= set(_targets(graphs))
    for a, b in zip(eager, compiled, strict=True):
        assert a.dtype == b.dtype and torch.equal(a, b)
    assert mla_launch[launches:] == [2 * qo_len] * 4  # the compiled graph launched each run() once
    assert (eager[0].shape, eager[1].shape, eager[1].dtype) == ((2 * qo_len, HEADS, CKV), (2 * qo_len, HEADS),
                                                                torch.float32)
    assert not eager[-1].any()  # run(out=, lse=) returned its out


def test_compiled_run_reads_the_current_plan(mla_launch):
    """The graph holds the wrapper's handle: a new plan (another batch) needs no recompile."""
    w = _wrapper()
    torch._dynamo.reset()
    compiled = torch.compile(lambda *a: w.run(*a, return_lse=True), fullgraph=True, backend="aot_eager", dynamic=True)
    assert compiled(*_inputs())[0].shape[0] == mla_launch[-1] == 2
    _replan(w, 3, qo_len=2, causal=True)
    args = _inputs(3, qo_len=2)
    for a, b in zip(compiled(*args), w.run(*args, return_lse=True), strict=True):
        assert torch.equal(a, b)
    assert mla_launch[-2:] == [6, 6]
    with pytest.raises(ValueError, match=r"^q_nope: expected 6 rows \(qo_indptr\[-1\] as planned\), got 2"):
        compiled(*_inputs())


def test_fake_tensor_mode_and_make_fx_see_the_operators(mla_launch):
    w = _wrapper(qo_len=4, causal=True)
    with FakeTensorMode():
        # Fake CUDA tensors need no GPU; the fake kernel reads no data and no device.
        q_nope, q_pe, ckv, kpe = (torch.empty(t.shape, dtype=BF16, device="cuda") for t in _inputs(qo_len=4))
        o, lse = w.run(q_nope, q_pe, ckv, kpe, return_lse=True)
        out = torch.empty(8, HEADS, CKV, dtype=BF16, device="cuda")
        assert w.run(q_nope, q_pe, ckv, kpe, out=out) is out
    assert (o.device.type, o.shape, o.dtype, lse.shape, lse.dtype) == ("cuda", (8, HEADS, CKV), BF16, (8, HEADS),
                                                                       torch.float32)
    assert o.is_contiguous() and lse.is_contiguous() and mla_launch == []
    gm = make_fx(lambda *a: w.run(*a, return_lse=True), tracing_mode="fake")(*_inputs(qo_len=4))
    assert RUN in _targets([gm])
    gm = make_fx(lambda *a: w.run(*a, out=torch.empty(8, HEADS, CKV, dtype=BF16)), tracing_mode="fake")(
        *_inputs(qo_len=4))
    assert RUN_OUT in _targets([gm])


def test_opcheck(mla_launch):
    w = _wrapper(qo_len=4, causal=True)
    q_nope, q_pe, ckv, kpe = _inputs(qo_len=4)
    for return_lse in (False, True):
        opcheck(_op("mla_paged_run"), (w._handle, q_nope, q_pe, ckv, kpe, return_lse), test_utils=OPCHECK)
    for lse in (torch.empty(q_nope.shape[:2]), None):
        opcheck(_op("mla_paged_run_out"), (w._handle, q_nope, q_pe, ckv, kpe, torch.empty_like(q_nope), lse),
                test_utils=OPCHECK)


def test_mistakes_under_compile_read_as_in_eager(mla_launch):
    """Shape and plan mistakes surface while tracing (the fake kernel raises the
    eager message); unsupported options from the traced Python."""
    w = _wrapper()
    q_nope, q_pe, ckv, kpe = _inputs()
    bad = [
        ((q_nope[:, :8], q_pe, ckv, kpe), {}, r"q_nope: expected a torch.bfloat16 tensor of shape \[tokens, 16, 512\]"),
        ((q_nope, q_pe.float(), ckv, kpe), {}, r"q_pe: expected a torch.bfloat16 tensor of shape \(2, 16, 64\)"),
        ((q_nope, q_pe, ckv[:, :8], kpe), {}, r"ckv_cache: expected a torch.bfloat16 tensor of shape \[num_pages, 16"),
        ((q_nope, q_pe, ckv, kpe[:3]), {}, r"kpe_cache: expected 4 pages \(as ckv_cache\), got 3"),
        ((q_nope, q_pe, ckv, kpe), {"out": torch.empty(2, HEADS, CKV)}, r"out: expected a contiguous torch.bfloat16"),
        ((q_nope, q_pe, ckv, kpe), {"lse": torch.empty(2, 8), "return_lse": True}, r"lse: expected a contiguous "
         r"torch.float32 tensor of shape \(2, 16\)"),
    ]
    for args, kwargs, match in bad:
        with pytest.raises(ValueError, match=match):  # eager first: the same words
            w.run(*args, **kwargs)
        with pytest.raises(Exception, match=match):
            _compiled_graphs(lambda *a: w.run(*a, **kwargs), *args)
    with pytest.raises(Exception, match=r"profiler_buffer / kv_len / page_table: flashjit.s MLA run\(\) reads"):
        _compiled_graphs(lambda *a: w.run(*a, kv_len=torch.ones(2, dtype=torch.int32)), q_nope, q_pe, ckv, kpe)
    unplanned = flashjit.BatchMLAPagedAttentionWrapper(_workspace())
    with pytest.raises(Exception, match=r"run\(\) called before plan\(\)"):
        _compiled_graphs(lambda *a: unplanned.run(*a), q_nope, q_pe, ckv, kpe)
