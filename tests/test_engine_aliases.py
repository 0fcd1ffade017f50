"""The names engines call on FlashInfer's wrappers (ops._aliases): begin_forward,
run_return_lse, the deprecated forward() / forward_return_lse() whose options
re-plan, and fast_decode_plan. Their parameters against FlashInfer 0.7.2's
(as listed here, and against the unpacked wheel's source where it is at
.whl/site, read with ast: importing flashinfer needs a GPU); what reaches
plan() and run(); a re-plan when an option differs; the ValueError where one
cannot run. Plans made on the host with a stand-in launch (test_torch_ops)."""

from __future__ import annotations

import ast
import functools
import inspect
import math
from pathlib import Path

import pytest
import torch

import flashjit
import test_torch_ops
from flashjit.ops import _aliases
from test_bad_input_wrappers import _i32, _workspace
from test_torch_ops import BF16, KIND_OPS, _compiled_graphs, _host_wrapper, _run_inputs, _targets

# Fixtures: pytest looks them up by name in the test module.
no_compile, host_launch = test_torch_ops.no_compile, test_torch_ops.host_launch

WHEEL = Path(__file__).resolve().parent.parent / ".whl" / "site" / "flashinfer"
CLASSES = {"decode": "BatchDecodeWithPagedKVCacheWrapper", "paged_prefill": "BatchPrefillWithPagedKVCacheWrapper",
           "ragged": "BatchPrefillWithRaggedKVCacheWrapper"}
SOURCE = {"decode": "decode.py", "paged_prefill": "prefill.py", "ragged": "prefill.py"}

# FlashInfer 0.7.2's parameters (name, default; None where there is none or it is None).
_PREFILL_OPTIONS = [("causal", False), ("pos_encoding_mode", "NONE"), ("use_fp16_qk_reduction", False)]
_TAIL = [("window_left", -1), ("logits_soft_cap", None), ("sm_scale", None), ("rope_scale", None),
         ("rope_theta", None)]
_SCALES = [("k_scale", None), ("v_scale", None)]
FORWARD = {
    "decode": [("self", None), ("q", None), ("paged_kv_cache", None), ("pos_encoding_mode", "NONE"),
               ("q_scale", None), *_SCALES, *_TAIL],
    "paged_prefill": [("self", None), ("q", None), ("paged_kv_cache", None), *_PREFILL_OPTIONS, *_SCALES, *_TAIL],
    "ragged": [("self", None), ("q", None), ("k", None), ("v", None), *_PREFILL_OPTIONS, *_TAIL],
}
FAST_DECODE_PLAN = [("self", None), ("indptr", None), ("indices", None), ("last_page_len", None),
                    ("num_qo_heads", None), ("num_kv_heads", None), ("head_dim", None), ("page_size", None),
                    ("pos_encoding_mode", "NONE"), ("window_left", -1), ("logits_soft_cap", None),
                    ("q_data_type", None), ("kv_data_type", None), ("data_type", None), ("sm_scale", None),
                    ("rope_scale", None), ("rope_theta", None), ("non_blocking", True), ("fixed_split_size", None),
                    ("disable_split_kv", False), ("q_len_per_req", 1), ("global_override_indptr_cpu", None)]


def _ours(fn) -> list[tuple]:
    return [(p.name, None if p.default is inspect.Parameter.empty else p.default)
            for p in inspect.signature(fn).parameters.values()]


def _theirs(node: ast.FunctionDef) -> list[tuple]:
    a = node.args
    defaults = [None] * (len(a.args) - len(a.defaults)) + [ast.literal_eval(d) for d in a.defaults]
    assert not a.kwonlyargs and a.vararg is None and a.kwarg is None
    return [(arg.arg, d) for arg, d in zip(a.args, defaults)]


def _wheel_class(kind: str) -> ast.ClassDef:
    tree = ast.parse((WHEEL / SOURCE[kind]).read_text())
    return next(n for n in tree.body if isinstance(n, ast.ClassDef) and n.name == CLASSES[kind])


# ---------------------------------------------------------------------------
# Names and parameters


@pytest.mark.parametrize("kind", CLASSES)
def test_the_aliases_have_flashinfers_parameters(kind):
    cls = getattr(flashjit, CLASSES[kind])
    assert _ours(cls.forward) == FORWARD[kind]
    assert _ours(cls.forward_return_lse) == FORWARD[kind]
    assert cls.begin_forward is cls.plan
    run = inspect.signature(cls.run)  # FlashInfer: functools.partialmethod(run, return_lse=True)
    assert inspect.signature(cls.run_return_lse) == run.replace(parameters=[
        p.replace(default=True) if p.name == "return_lse" else p for p in run.parameters.values()])
    assert inspect.unwrap(cls.run_return_lse) is cls.run and run.parameters["return_lse"].default is False
    assert not hasattr(cls, "end_forward")  # FlashInfer 0.7.2 has none either (below)
    assert inspect.signature(cls.plan) == inspect.signature(inspect.unwrap(cls.plan))


def test_fast_decode_plan_has_flashinfers_parameters():
    assert _ours(flashjit.fast_decode_plan) == FAST_DECODE_PLAN
    assert "fast_decode_plan" in flashjit.__all__


@pytest.mark.skipif(not WHEEL.is_dir(), reason="the unpacked FlashInfer 0.7.2 wheel is not at .whl/site")
@pytest.mark.parametrize("kind", CLASSES)
def test_the_listed_parameters_are_the_wheels(kind):
    body = {n.name: n for n in _wheel_class(kind).body if isinstance(n, ast.FunctionDef)}
    assert _theirs(body["forward"]) == FORWARD[kind]
    assert _theirs(body["forward_return_lse"]) == FORWARD[kind]
    assigned = {ast.unparse(n) for n in _wheel_class(kind).body if isinstance(n, ast.Assign)}
    assert {"begin_forward = plan", "run_return_lse = functools.partialmethod(run, return_lse=True)"} <= assigned
    assert "end_forward" not in ast.unparse(_wheel_class(kind))
    if kind == "decode":
        tree = ast.parse((WHEEL / "decode.py").read_text())
        fast = next(n for n in tree.body if isinstance(n, ast.FunctionDef) and n.name == "fast_decode_plan")
        assert _theirs(fast) == FAST_DECODE_PLAN


# ---------------------------------------------------------------------------
# What reaches plan() and run()


def _spy_run(w) -> list:
    calls, run = [], w.run

    def spy(*args, **kwargs):
        calls.append((args, kwargs))
        return run(*args, **kwargs)
    w.run = spy
    return calls


RUN_KEYWORDS = {"decode": {"q_scale": None, "k_scale": None, "v_scale": None},
                "paged_prefill": {"k_scale": None, "v_scale": None}, "ragged": {}}


@pytest.mark.parametrize("kind", CLASSES)
def test_forward_with_the_planned_options_runs_the_plan(kind, host_launch):
    w = _host_wrapper(kind)
    plan = w._plan
    args = _run_inputs(kind)
    calls = _spy_run(w)
    causal = {"causal": True} if kind == "ragged" else {}  # _host_wrapper plans ragged with causal=True
    out = w.forward(*args, sm_scale=128 ** -0.5, **causal)
    out2, lse = w.forward_return_lse(*args, window_left=-1, logits_soft_cap=0.0, **causal)
    assert w._plan is plan  # 128 ** -0.5 is the planned default in float32; a cap of 0 is none
    assert calls == [(tuple(args), RUN_KEYWORDS[kind]), (tuple(args), {**RUN_KEYWORDS[kind], "return_lse": True})]
    assert torch.equal(out, out2) and torch.equal(lse, args[0].float().sum(-1))
    assert host_launch == [args[0].shape[0]] * 2


@pytest.mark.parametrize("kind", CLASSES)
def test_run_return_lse_is_run_with_lse(kind, host_launch):
    w = _host_wrapper(kind)
    args = _run_inputs(kind)
    out, lse = w.run_return_lse(*args)
    expect_out, expect_lse = w.run(*args, return_lse=True)
    assert torch.equal(out, expect_out) and torch.equal(lse, expect_lse)
    assert torch.equal(w.run_return_lse(*args, return_lse=False), expect_out)  # the call's keyword wins, as in partial


@pytest.mark.parametrize("kind", CLASSES)
def test_begin_forward_plans_and_is_remembered(kind, host_launch):
    w = _host_wrapper(kind)
    test_torch_ops._replan(w, kind, 3)  # through plan(); begin_forward is the same function
    call = w._plan_call
    assert len(call.args) >= 4 and call.kwargs["q_data_type"] is BF16
    assert w._plan.qo_tokens == (3 if kind == "decode" else 9)
    getattr(w, "begin_forward")(*call.args, **call.kwargs)
    assert w._plan_call == call and w._plan.qo_tokens == (3 if kind == "decode" else 9)


def test_forward_before_plan_says_so(host_launch):
    w = flashjit.BatchDecodeWithPagedKVCacheWrapper(_workspace())
    with pytest.raises(RuntimeError, match=r"run\(\) called before plan\(\)"):
        w.forward(*_run_inputs("decode"), sm_scale=0.5)


# ---------------------------------------------------------------------------
# A differing option re-plans


@pytest.mark.parametrize("kind", ["paged_prefill", "ragged"])
def test_changed_options_replan_and_defaults_count(kind, host_launch):
    w = _host_wrapper(kind)
    args = _run_inputs(kind)
    w.forward(*args, causal=True, sm_scale=0.25, window_left=8, logits_soft_cap=30.0)
    plan = w._plan
    assert plan.module.spec.causal and plan.scalars == (0.25, 8, 30.0)
    assert {k: w._plan_call.kwargs[k] for k in ("causal", "sm_scale", "window_left", "logits_soft_cap")} == {
        "causal": True, "sm_scale": 0.25, "window_left": 8, "logits_soft_cap": 30.0}
    w.forward_return_lse(*args, causal=True, sm_scale=0.25, window_left=8, logits_soft_cap=30.0)
    assert w._plan is plan  # the same options again: no re-plan
    w.forward(*args)  # FlashInfer's forward sets every option, defaults too: no mask, 1/sqrt(d), no window
    assert not w._plan.module.spec.causal and w._plan.scalars == (1 / math.sqrt(128), -1, 0.0)
    assert host_launch == [args[0].shape[0]] * 3


def test_decode_sm_scale_that_differs_in_float32_replans(host_launch):
    w = _host_wrapper("decode")
    args = _run_inputs("decode")
    before, call = w._plan, w._plan_call
    w.forward(*args, sm_scale=1 / math.sqrt(128) * (1 + 2 ** -20))
    assert w._plan is not before and w._plan.scalars[0] == 1 / math.sqrt(128) * (1 + 2 ** -20)
    assert w._plan_call.args == call.args  # the same tables, planned again
    assert w._plan_call.kwargs["sm_scale"] == 1 / math.sqrt(128) * (1 + 2 ** -20)


def test_an_option_given_positionally_to_plan_is_replaced_in_place(host_launch):
    w = flashjit.BatchPrefillWithRaggedKVCacheWrapper(_workspace())
    w._device = torch.device("cpu")
    w.plan([0, 3, 6], [0, 20, 40], 8, 2, 128, None, None, None, True, "NONE", False, 4, q_data_type=BF16)
    assert w._plan.module.spec.causal and w._plan.scalars[1] == 4
    w.forward(*_run_inputs("ragged"), causal=False, window_left=4)
    assert not w._plan.module.spec.causal and w._plan.scalars[1] == 4
    assert w._plan_call.args[8] is False and w._plan_call.args[11] == 4
    assert "causal" not in w._plan_call.kwargs and "window_left" not in w._plan_call.kwargs


def test_a_replan_plan_refuses_leaves_the_plan(host_launch):
    w = _host_wrapper("decode")
    plan, call = w._plan, w._plan_call
    with pytest.raises(NotImplementedError, match=r"^pos_encoding_mode='ROPE_LLAMA': fused RoPE"):
        w.forward(*_run_inputs("decode"), pos_encoding_mode="ROPE_LLAMA")
    assert w._plan is plan and w._plan_call is call


# ---------------------------------------------------------------------------
# Where a re-plan cannot run


def _graph_wrapper(kind: str):
    cls = getattr(flashjit, CLASSES[kind])
    w = cls(_workspace(), use_cuda_graph=True)
    w._device = torch.device("cpu")
    w._page_buffer = torch.zeros(16, dtype=torch.int32)
    test_torch_ops._replan(w, kind, 2)
    return w


@pytest.mark.parametrize("kind", CLASSES)
def test_cuda_graph_wrappers_refuse_a_changed_option_naming_it(kind, host_launch):
    w = _graph_wrapper(kind)
    plan = w._plan
    args = _run_inputs(kind)
    causal = {"causal": True} if kind == "ragged" else {}
    w.forward(*args, sm_scale=128 ** -0.5, **causal)  # the planned options: runs
    assert w._plan is plan and len(host_launch) == 1
    with pytest.raises(ValueError, match=r"^window_left: forward\(\) was given 16, the plan has -1, and forward\(\) "
                                         r"cannot plan again: with use_cuda_graph=True .*; pass window_left=16 to "
                                         r"plan\(\) instead$"):
        w.forward(*args, window_left=16, **causal)
    if kind != "decode":
        with pytest.raises(ValueError, match=r"^causal: forward\(\) was given False, the plan has True"
                           if kind == "ragged" else r"^causal: forward\(\) was given True, the plan has False"):
            w.forward_return_lse(*args, causal=kind != "ragged")
    assert w._plan is plan and len(host_launch) == 1


@pytest.mark.parametrize("kind", CLASSES)
def test_aliases_compile_to_the_run_operators(kind, host_launch):
    w = _host_wrapper(kind)
    args = _run_inputs(kind)
    causal = {"causal": True} if kind == "ragged" else {}

    def fn(*a):
        return w.forward(*a, sm_scale=128 ** -0.5, **causal), *w.forward_return_lse(*a, **causal), \
            *w.run_return_lse(*a)
    eager = fn(*args)
    compiled, graphs = _compiled_graphs(fn, *args)
    assert len(graphs) == 1 and f"flashjit.{KIND_OPS[kind]}_run.default" in _targets(graphs)
    for a, b in zip(eager, compiled, strict=True):
        assert torch.equal(a, b)


def test_a_changed_option_under_compile_is_refused(host_launch):
    w = _host_wrapper("decode")
    plan = w._plan
    with pytest.raises(Exception, match=r"sm_scale: forward\(\) was given 0.5, the plan has 0.0883883\d*, .*"
                                        r"while torch.compile traces"):
        _compiled_graphs(lambda q, c: w.forward(q, c, sm_scale=0.5), *_run_inputs("decode"))
    assert w._plan is plan


# ---------------------------------------------------------------------------
# fast_decode_plan


_TABLE = (_i32(0, 2, 4), _i32(4, 0, 1, 2), _i32(7, 16))


def _decode_wrapper(**ctor):
    w = flashjit.BatchDecodeWithPagedKVCacheWrapper(_workspace(), **ctor)
    w._device = torch.device("cpu")
    return w


def test_fast_decode_plan_is_plan_with_flashinfers_dtype_rules(host_launch):
    fast, plain = _decode_wrapper(), _decode_wrapper()
    flashjit.fast_decode_plan(fast, *_TABLE, 8, 2, 128, 16, data_type=BF16, window_left=5)
    plain.plan(*_TABLE, 8, 2, 128, 16, q_data_type=BF16, kv_data_type=BF16, window_left=5)
    for field in ("q_dtype", "qo_tokens", "page_size", "max_page", "scalars", "num_work", "work"):
        assert getattr(fast._plan, field) == getattr(plain._plan, field), field
    assert fast._plan.module.spec == plain._plan.module.spec
    flashjit.fast_decode_plan(fast, *_TABLE, 8, 2, 128, 16)  # no dtypes: float16, as FlashInfer
    assert fast._plan.q_dtype == torch.float16 and fast._plan.module.spec.dtype_kv == "float16"


def test_fast_decode_plan_installed_over_begin_forward_or_plan(host_launch):
    w = _decode_wrapper()
    w.begin_forward = functools.partial(flashjit.fast_decode_plan, w)
    w.begin_forward(*_TABLE, 8, 2, 128, 16, q_data_type=BF16)
    w.plan = functools.partial(flashjit.fast_decode_plan, w)  # the class's plan runs, not this one again
    w.plan(*_TABLE, 8, 2, 128, 16, q_data_type=BF16)
    assert w._plan.q_dtype == BF16 and w._plan_call.args[:3] == _TABLE


def test_fast_decode_plan_reads_the_host_indptr_override(host_launch):
    w = _decode_wrapper()
    flashjit.fast_decode_plan(w, _i32(0, 0, 0), *_TABLE[1:], 8, 2, 128, 16, q_data_type=BF16,
                              global_override_indptr_cpu=_TABLE[0])
    assert w._plan.max_page == 4  # pages 4, 0, 1, 2: the override's four, not the indptr's none
    assert w._plan_call.args[0] is _TABLE[0]


def test_fast_decode_plan_with_pages_of_one_key_holds_one_per_last_page(host_launch):
    """With use_tensor_cores and page_size 1, FlashInfer takes every last page as full."""
    args = (_TABLE[0], _TABLE[1], _i32(0, 0), 8, 2, 128, 1)
    flashjit.fast_decode_plan(_decode_wrapper(use_tensor_cores=True), *args, q_data_type=BF16)
    with pytest.raises(ValueError, match=r"^last_page_len: expected 1..1 \(page_size\) for request 0"):
        flashjit.fast_decode_plan(_decode_wrapper(), *args, q_data_type=BF16)


@pytest.mark.parametrize("q_len_per_req,error,match", [
    (2, NotImplementedError, r"^q_len_per_req=2: flashjit's decode wrapper takes one query token per request"),
    (0, ValueError, r"^q_len_per_req: expected an int >= 1, got 0$"),
])
def test_fast_decode_plan_takes_one_token_per_request(q_len_per_req, error, match, host_launch):
    w = _decode_wrapper()
    with pytest.raises(error, match=match):
        flashjit.fast_decode_plan(w, *_TABLE, 8, 2, 128, 16, q_len_per_req=q_len_per_req)
    assert w._plan is None


def test_fast_decode_plan_wants_a_decode_wrapper(host_launch):
    w = _host_wrapper("paged_prefill")
    with pytest.raises(TypeError, match=r"^fast_decode_plan: expected a BatchDecodeWithPagedKVCacheWrapper, got "
                                        r"BatchPrefillWithPagedKVCacheWrapper$"):
        flashjit.fast_decode_plan(w, *_TABLE, 8, 2, 128, 16)
    assert _aliases.fast_decode_plan is flashjit.fast_decode_plan
