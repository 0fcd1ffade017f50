"""The public ops as torch.ops.flashjit operators: registration and mutation
annotations, tracing with fake tensors and torch.compile(fullgraph=True)
without a graph break, torch.library.opcheck, errors that read as in eager
calls, and compiled outputs bit-identical to eager ones. On the CPU the
attention kernels run on meta / fake tensors, or (wrappers) against a plan made
on the host with a stand-in launch; append and merge run for real. MLA's
operators: test_torch_ops_mla.py. On a GPU: test_gpu_torch_ops.py."""

from __future__ import annotations

import gc
from types import SimpleNamespace

import pytest
import torch
import torch._dynamo
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.fx.experimental.proxy_tensor import make_fx
from torch.library import opcheck

import flashjit
from flashjit import jit
from flashjit.ops import _batch, _dispatch, _library
import helpers_cache
from test_bad_input_wrappers import _i32, _workspace

# A fixture: pytest looks fixtures up by name in the test module.
no_compile = helpers_cache.no_compile

BF16 = torch.bfloat16
OPCHECK = ("test_schema", "test_faketensor", "test_aot_dispatch_dynamic")
# The arguments each operator writes (its schema's (a!) annotations).
MUTATED = {"append_paged_kv_cache": {"k_cache", "v_cache"}, "merge_state_in_place": {"v", "s"},
           **{f"{op}_run_out": {"out", "lse"} for op in ("batch_prefill_ragged", "batch_prefill_paged",
                                                         "batch_decode_paged", "mla_paged")}}
KIND_OPS = {"ragged": "batch_prefill_ragged", "paged_prefill": "batch_prefill_paged", "decode": "batch_decode_paged"}


def _op(name: str):
    return getattr(torch.ops.flashjit, name).default


def _compiled_graphs(fn, *args, backend="eager", **kwargs):
    """(result, [FX graphs]) of fn compiled with fullgraph=True (which raises on a graph break)."""
    graphs = []

    def record(gm, example_inputs):
        graphs.append(gm)
        if backend == "eager":
            return gm.forward
        from torch._dynamo.backends.debugging import aot_eager
        return aot_eager(gm, example_inputs)

    torch._dynamo.reset()
    result = torch.compile(fn, fullgraph=True, backend=record, **kwargs)(*args)
    return result, graphs


def _targets(graphs) -> list[str]:
    return [str(n.target) for gm in graphs for n in gm.graph.nodes if n.op == "call_function"]


# ---------------------------------------------------------------------------
# Registration


def test_every_public_op_is_an_operator_with_its_mutations():
    assert set(_library.OP_NAMES) == {"single_prefill", "single_decode", "append_paged_kv_cache", "merge_state",
                                      "merge_state_in_place", "merge_states", *MUTATED, "mla_paged_run",
                                      *(f"{op}_run" for op in KIND_OPS.values())}
    for name in _library.OP_NAMES:
        op = _op(name)
        written = {a.name for a in op._schema.arguments if a.alias_info is not None and a.alias_info.is_write}
        assert written == MUTATED.get(name, set()), name
        assert not any(r.alias_info for r in op._schema.returns), f"{name}: an output aliases an input"
        assert torch.Tag.pt2_compliant_tag in op.tags, name


def test_eager_calls_do_not_go_through_the_dispatcher(monkeypatch):
    """Eager calls run the Python body: the operator's kernel is never entered."""
    entered = []
    monkeypatch.setattr(_library._eager, "merge_state", lambda *a: entered.append(a) or (a[0].clone(), a[1].clone()))
    v, s = torch.randn(3, 2, 64), torch.randn(3, 2)
    out, lse = flashjit.merge_state(v, s, v, s)
    assert entered == [] and torch.allclose(out, v) and torch.allclose(lse, s + 1)
    torch.ops.flashjit.merge_state(v, s, v, s)
    assert len(entered) == 1


# ---------------------------------------------------------------------------
# Single-request attention on meta / fake tensors


def _qkv(device="meta", qo=7, kv=40, heads=(8, 2), dim=128):
    return (torch.randn(qo, heads[0], dim, device=device, dtype=BF16),
            torch.randn(kv, heads[1], dim, device=device, dtype=BF16),
            torch.randn(kv, heads[1], dim, device=device, dtype=BF16))


def _single_ops(q, k, v):
    o, lse = flashjit.single_prefill_with_kv_cache(q, k, v, causal=True, return_lse=True)
    d = flashjit.single_decode_with_kv_cache(q[-1], k, v, window_left=16)
    return o * 2, lse, d


@pytest.mark.parametrize("backend", ["eager", "aot_eager"])
def test_single_ops_compile_as_one_graph(backend):
    (o, lse, d), graphs = _compiled_graphs(_single_ops, *_qkv(), backend=backend)
    assert len(graphs) == 1
    assert {"flashjit.single_prefill.default", "flashjit.single_decode.default"} <= set(_targets(graphs))
    assert (o.shape, o.dtype, lse.shape, lse.dtype, d.shape, d.dtype) == (
        (7, 8, 128), BF16, (7, 8), torch.float32, (8, 128), BF16)
    assert o.is_contiguous() and lse.is_contiguous()


def test_dynamic_shapes_trace_once():
    calls = [_qkv(qo=qo, kv=kv) for qo, kv in ((7, 40), (3, 20), (11, 64))]
    torch._dynamo.reset()
    counts = torch._dynamo.utils.counters
    counts.clear()
    compiled = torch.compile(_single_ops, fullgraph=True, backend="aot_eager", dynamic=True)
    for q, k, v in calls:
        o, lse, d = compiled(q, k, v)
        assert o.shape == q.shape and lse.shape == q.shape[:2] and d.shape == q.shape[1:]
    assert counts["stats"]["unique_graphs"] == 1


def test_fake_tensor_mode_and_make_fx_see_the_operators():
    with FakeTensorMode():
        # Fake CUDA tensors need no GPU (as long as nothing views them on a CPU-only torch).
        q, k, v = (torch.empty(t.shape, dtype=BF16, device="cuda") for t in _qkv())
        o, lse = flashjit.single_prefill_with_kv_cache(q, k, v, return_lse=True)
        q1 = torch.empty(8, 128, dtype=BF16, device="cuda")
        d, d_lse = flashjit.single_decode_with_kv_cache(q1, k, v, return_lse=True)
    assert (o.device.type, o.shape, lse.shape, d.shape, d_lse.shape) == ("cuda", (7, 8, 128), (7, 8), (8, 128), (8,))
    gm = make_fx(lambda q, k, v: flashjit.single_prefill_with_kv_cache(q, k, v), tracing_mode="fake")(*_qkv("cpu"))
    assert "flashjit.single_prefill.default" in _targets([gm])


def test_opcheck_single_ops_on_meta():
    q, k, v = _qkv()
    for return_lse in (False, True):
        opcheck(_op("single_prefill"), (q, k, v, "NHD", True, None, -1, None, "auto", return_lse, None, None),
                test_utils=OPCHECK)
        opcheck(_op("single_decode"), (q[0], k, v, "NHD", False, 0.1, -1, 30.0, "auto", return_lse, None),
                test_utils=OPCHECK)


def test_errors_under_compile_read_as_in_eager():
    """Structural mistakes surface while tracing (fake kernel), option mistakes
    from the traced Python, device mistakes when the compiled graph runs."""
    q, k, v = _qkv(heads=(8, 3))
    with pytest.raises(Exception, match=r"num_qo_heads \(8\) must be a multiple of num_kv_heads \(3\)"):
        _compiled_graphs(lambda q, k, v: flashjit.single_prefill_with_kv_cache(q, k, v), q, k, v)
    q, k, v = _qkv()
    with pytest.raises(Exception, match=r"scale_q=1.0: FP8 queries are not supported"):
        _compiled_graphs(lambda q, k, v: flashjit.single_prefill_with_kv_cache(q, k, v, scale_q=1.0), q, k, v)
    with pytest.raises(ValueError, match=r"^q: expected a CUDA tensor, got a tensor on cpu"):
        _compiled_graphs(lambda q, k, v: flashjit.single_decode_with_kv_cache(q[0], k, v), *_qkv("cpu"))


# ---------------------------------------------------------------------------
# Batch wrappers: plans made on the host, a stand-in launch


@pytest.fixture
def host_launch(no_compile, monkeypatch):
    """plan() with a stand-in kernel module; the launch writes a function of q and
    the first K element instead of attention, and records q's row count."""
    monkeypatch.setattr(jit, "get_module", lambda spec: SimpleNamespace(spec=spec, rows_per_cta=64, split_align=64))
    monkeypatch.setattr(_batch, "resident_ctas", lambda module, device: 132)
    rows = []

    def launch(self, q, k, v, k_strides, v_strides, out, lse, v_offset=0, scales=None):
        rows.append(q.shape[0])
        out.copy_(q * 2 + k.flatten()[0])
        if lse is not None:
            lse.copy_(q.float().sum(-1))
    monkeypatch.setattr(_batch.BatchAttention, "_launch", launch)
    return rows


def _host_wrapper(kind: str, batch: int = 2):
    cls = {"ragged": flashjit.BatchPrefillWithRaggedKVCacheWrapper,
           "paged_prefill": flashjit.BatchPrefillWithPagedKVCacheWrapper,
           "decode": flashjit.BatchDecodeWithPagedKVCacheWrapper}[kind]
    w = cls(_workspace())
    w._device = torch.device("cpu")  # the plan's metadata stays on the host
    _replan(w, kind, batch)
    return w


def _replan(w, kind: str, batch: int) -> None:
    """batch requests of 3 query tokens (decode: 1) and 20 keys in 2 pages of 16 each."""
    qo = [3 * i for i in range(batch + 1)]
    table = (_i32(*range(0, 2 * batch + 1, 2)), _i32(*range(2 * batch)), _i32(*[4] * batch))
    if kind == "ragged":
        w.plan(qo, [20 * i for i in range(batch + 1)], 8, 2, 128, causal=True, q_data_type=BF16)
    elif kind == "paged_prefill":
        w.plan(_i32(*qo), *table, 8, 2, 128, 16, q_data_type=BF16)
    else:
        w.plan(*table, 8, 2, 128, 16, q_data_type=BF16)


def _run_inputs(kind: str, batch: int = 2):
    rows = batch if kind == "decode" else 3 * batch
    q = torch.randn(rows, 8, 128).to(BF16)
    if kind == "ragged":
        return q, torch.randn(20 * batch, 2, 128).to(BF16), torch.randn(20 * batch, 2, 128).to(BF16)
    return q, torch.randn(2 * batch, 2, 16, 2, 128).to(BF16)


def _runs(w):
    """run() in each form: fresh outputs with LSE, into a given out, and (paged) a (K, V) tuple."""
    def fn(q, *kv):
        o, lse = w.run(q, *kv, return_lse=True)
        out = torch.empty_like(q)
        w.run(q, *kv, out=out)
        if len(kv) == 1:
            return o, lse, out, w.run(q, (kv[0][:, 0], kv[0][:, 1]))
        return o, lse, out
    return fn


@pytest.mark.parametrize("backend", ["eager", "aot_eager"])
@pytest.mark.parametrize("kind", ["ragged", "paged_prefill", "decode"])
def test_wrapper_run_compiles_and_matches_eager(kind, backend, host_launch):
    w = _host_wrapper(kind)
    args = _run_inputs(kind)
    eager = _runs(w)(*args)
    eager_launches = len(host_launch)
    compiled, graphs = _compiled_graphs(_runs(w), *args, backend=backend)
    assert len(graphs) == 1
    op = KIND_OPS[kind]
    assert {f"flashjit.{op}_run.default", f"flashjit.{op}_run_out.default"} <= set(_targets(graphs))
    for a, b in zip(eager, compiled, strict=True):
        assert torch.equal(a, b)
    assert host_launch == [args[0].shape[0]] * (2 * eager_launches)


@pytest.mark.parametrize("kind", ["ragged", "decode"])
def test_compiled_run_reads_the_current_plan(kind, host_launch):
    """The graph holds the wrapper's handle, not its plan: plan() between calls is honoured."""
    w = _host_wrapper(kind)
    torch._dynamo.reset()
    compiled = torch.compile(lambda q, *kv: w.run(q, *kv), fullgraph=True, backend="aot_eager", dynamic=True)
    assert compiled(*_run_inputs(kind)).shape[0] == host_launch[-1]
    _replan(w, kind, 3)
    q, *kv = _run_inputs(kind, 3)
    assert torch.equal(compiled(q, *kv), w.run(q, *kv))
    with pytest.raises(ValueError, match=r"^q: expected \d+ rows"):  # the old batch no longer fits the plan
        compiled(*_run_inputs(kind, 2))


@pytest.mark.parametrize("kind", ["ragged", "paged_prefill", "decode"])
def test_opcheck_wrapper_ops(kind, host_launch):
    w = _host_wrapper(kind)
    q, *kv = _run_inputs(kind)
    op = KIND_OPS[kind]
    k, v = kv if kind == "ragged" else (kv[0], None)
    paged = () if kind == "ragged" else (None,)
    for return_lse in (False, True):
        opcheck(_op(f"{op}_run"), (w._handle, q, k, v, return_lse, *paged), test_utils=OPCHECK)
    out, lse = torch.empty_like(q), torch.empty(q.shape[:2])
    opcheck(_op(f"{op}_run_out"), (w._handle, q, k, v, out, lse, *paged), test_utils=OPCHECK)


def test_wrapper_mistakes_under_compile(host_launch):
    w = _host_wrapper("decode")
    q, cache = _run_inputs("decode")
    with pytest.raises(Exception, match=r"q: expected 8 qo heads \(num_qo_heads\) as planned, got 4"):
        _compiled_graphs(lambda q, c: w.run(q, c), q[:, :4].contiguous(), cache)
    with pytest.raises(Exception, match=r"out: expected a contiguous torch.bfloat16 tensor"):
        _compiled_graphs(lambda q, c: w.run(q, c, out=torch.empty(q.shape)), q, cache)
    unplanned = flashjit.BatchDecodeWithPagedKVCacheWrapper(_workspace())
    with pytest.raises(Exception, match=r"run\(\) called before plan\(\)"):
        _compiled_graphs(lambda q, c: unplanned.run(q, c), q, cache)


def test_a_collected_wrappers_handle_is_refused(host_launch):
    w = _host_wrapper("decode")
    handle, args = w._handle, _run_inputs("decode")
    del w
    gc.collect()
    with pytest.raises(RuntimeError, match=rf"no live wrapper has handle {handle}"):
        torch.ops.flashjit.batch_decode_paged_run(handle, *args, None, False, None)


# ---------------------------------------------------------------------------
# append and merge: real kernels on the CPU (torch ops)


def _append_case(form: str):
    from test_append_merge import paged_batch

    b = paged_batch(4, "NHD", form, BF16, "cpu", heads=2, dim=64)
    batch_indices, positions = flashjit.get_batch_indices_positions(
        b["append_indptr"], torch.tensor(b["seq"], dtype=torch.int32), b["nnz"])
    return b, (b["key"], b["value"], batch_indices, positions)


def _clone_cache(cache):
    return tuple(t.clone() for t in cache) if isinstance(cache, tuple) else cache.clone()


@pytest.mark.parametrize("backend", ["aot_eager", "inductor"])
@pytest.mark.parametrize("form", ["5d", "tuple"])
def test_append_compiled_writes_the_cache_as_eager(form, backend):
    """The write is visible to what the graph reads after it (the (a!) annotation orders them)."""
    b, args = _append_case(form)

    def fn(key, value, batch_indices, positions, cache):
        flashjit.append_paged_kv_cache(key, value, batch_indices, positions, cache, b["kv_indices"], b["kv_indptr"],
                                       b["last"])
        first = cache[0] if isinstance(cache, tuple) else cache
        return first.float().sum(dim=(-1, -2))

    eager_cache, compiled_cache = _clone_cache(b["cache"]), _clone_cache(b["cache"])
    eager = fn(*args, eager_cache)
    torch._dynamo.reset()
    compiled = torch.compile(fn, fullgraph=True, backend=backend)(*args, compiled_cache)
    assert torch.equal(eager, compiled)
    for e, c, before in zip(*(x if isinstance(x, tuple) else (x,) for x in (eager_cache, compiled_cache, b["cache"]))):
        assert torch.equal(e, c) and not torch.equal(c, before)


def _states(dtype=BF16, seq=6, heads=4, dim=64, n=3):
    g = torch.Generator().manual_seed(3)
    return (torch.randn(seq, n, heads, dim, generator=g).to(dtype), torch.randn(seq, n, heads, generator=g) * 4)


def _merges(v, s):
    a, b = flashjit.merge_state(v[:, 0], s[:, 0], v[:, 1], s[:, 1])
    c, d = flashjit.merge_states(v, s)
    e, f = v[:, 2].clone(), s[:, 2].clone()
    flashjit.merge_state_in_place(e, f, a, b, mask=torch.arange(v.shape[0]) % 2 == 0)
    return a, b, c, d, e, f


@pytest.mark.parametrize("backend", ["aot_eager", "inductor"])
def test_merge_compiled_is_bit_identical(backend):
    """Through the operators, inductor cannot re-fuse the merge arithmetic into other rounding."""
    v, s = _states()
    eager = _merges(v, s)
    _, graphs = _compiled_graphs(_merges, v, s)
    assert {"flashjit.merge_state.default", "flashjit.merge_states.default",
            "flashjit.merge_state_in_place.default"} <= set(_targets(graphs))
    torch._dynamo.reset()
    compiled = torch.compile(_merges, fullgraph=True, backend=backend)(v, s)
    for a, b in zip(eager, compiled, strict=True):
        assert torch.equal(a, b)


def test_merge_with_gradients_traces_the_torch_ops():
    """The operators have no autograd formula: inputs that need gradients keep the differentiable body."""
    v, s = _states(torch.float32)
    grads = []
    for compile_it in (False, True):
        vg, sg = v.clone().requires_grad_(), s.clone().requires_grad_()
        fn = lambda v, s: flashjit.merge_states(v, s)[0].square().sum()  # noqa: E731
        torch._dynamo.reset()
        (torch.compile(fn, fullgraph=True, backend="aot_eager") if compile_it else fn)(vg, sg).backward()
        grads.append((vg.grad, sg.grad))
    assert all(torch.allclose(a, b, rtol=1e-5, atol=1e-6) for a, b in zip(*grads))
    assert grads[0][1].abs().sum() > 0


def test_opcheck_append_and_merge():
    for form in ("5d", "tuple"):
        b, args = _append_case(form)
        k, v = _dispatch.cache_args(_clone_cache(b["cache"]))
        opcheck(_op("append_paged_kv_cache"), (*args, k, v, b["kv_indices"], b["kv_indptr"], b["last"], "NHD"),
                test_utils=OPCHECK)
    v, s = _states()
    opcheck(_op("merge_state"), (v[:, 0], s[:, 0], v[:, 1], s[:, 1]), test_utils=OPCHECK)
    opcheck(_op("merge_states"), (v, s), test_utils=OPCHECK)
    opcheck(_op("merge_state_in_place"), (v[:, 0].clone(), s[:, 0].clone(), v[:, 1], s[:, 1], None),
            test_utils=OPCHECK)
