"""FlashInfer 0.7's older names on the batch wrappers, which serving engines
still call: begin_forward (plan), run_return_lse (run with return_lse=True),
and the deprecated forward() / forward_return_lse(), which take the plan's
options (causal, sm_scale, window_left, logits_soft_cap, ...) at run time.
Also fast_decode_plan, FlashInfer's plan for CUDA-graph decode wrappers.

FlashInfer's forward() stores its options on the wrapper, every one of them,
defaults included, and calls run(), whose kernel reads them. Here the options
are part of the plan (they choose the kernel and fill its params), so
forward() compares them with the last plan's and, where one differs, plans
again with that plan() call's arguments and forward()'s options, then runs.
The plan() of each wrapper is decorated with `remembers_plan`, which keeps the
call (PlanCall). A re-plan reads that call's tensors (indptrs, page ids) as
they are when forward() runs, as run() reads the page ids a plan was given.
Where a re-plan cannot happen (use_cuda_graph=True, whose captured launches
keep their plan; torch.compile tracing, which cannot run plan()'s host
reads), a differing option is a ValueError naming it and the planned value.

Options compare as the kernel sees them: sm_scale None is 1/sqrt(head_dim),
window_left None is -1, logits_soft_cap None is 0, and sm_scale and the cap
compare as the float32 values the params struct holds (an engine's
head_dim ** -0.5 and the default plan's 1 / sqrt(head_dim) may differ in the
last bit of a double, never in float32). rope_scale / rope_theta act only with
fused RoPE (pos_encoding_mode other than "NONE"), which plan() refuses; they
never cause a re-plan, and a re-plan passes them on.
"""

from __future__ import annotations

import functools
import inspect
import math
import struct
from typing import NamedTuple

from ._dispatch import dispatch_modes, is_compiling

# forward()'s options that change what the kernel computes, as plan() names them.
_COMPARED = ("causal", "pos_encoding_mode", "use_fp16_qk_reduction", "window_left", "logits_soft_cap", "sm_scale")


def _float32(value):
    """value as a float32 holds it (what the params struct keeps); a value that is not one stays as given."""
    try:
        return struct.unpack("f", struct.pack("f", value))[0]
    except (TypeError, OverflowError, struct.error):
        return value


def _effective(name: str, value, head_dim):
    """An option as the kernel sees it, FlashInfer's defaults filled in."""
    if name in ("causal", "use_fp16_qk_reduction"):
        return bool(value)
    if name == "sm_scale":
        return _float32(1.0 / math.sqrt(head_dim) if value is None else value)
    if name == "window_left":
        return -1 if value is None else value
    if name == "logits_soft_cap":
        return _float32(0.0 if value is None else value)
    return value


class PlanCall(NamedTuple):
    """The last successful plan() of a wrapper: its arguments as given, where
    each parameter sits positionally, which parameters plan() has, and the
    compared options as the kernel sees them."""
    args: tuple
    kwargs: dict
    positions: dict
    parameters: frozenset
    options: dict
    head_dim: object

    def changed(self, options: dict) -> list:
        """(name, given, planned) for each compared option whose value differs from the plan's."""
        return [(name, options[name], planned) for name, planned in self.options.items()
                if _effective(name, options[name], self.head_dim) != planned]

    def with_options(self, options: dict) -> tuple[list, dict]:
        """(args, kwargs) of this call with forward()'s options in place of the planned ones."""
        args, kwargs = list(self.args), dict(self.kwargs)
        for name, value in options.items():
            if name not in self.parameters:
                continue
            index = self.positions.get(name)
            if index is not None and index < len(args):
                args[index] = value
            else:
                kwargs[name] = value
        return args, kwargs


def remembers_plan(plan):
    """Decorates a wrapper's plan(): once it returns, the wrapper keeps the call
    as its `_plan_call` (a PlanCall) for forward() to plan again from."""
    parameters = list(inspect.signature(plan).parameters.values())[1:]  # without self
    positions = {p.name: i for i, p in enumerate(parameters) if p.kind is p.POSITIONAL_OR_KEYWORD}
    defaults = {p.name: p.default for p in parameters}
    names = frozenset(defaults)
    compared = tuple(name for name in _COMPARED if name in names)
    head_dim_name = "head_dim" if "head_dim" in names else "head_dim_qk"

    def value_of(name, args, kwargs):
        if name in kwargs:
            return kwargs[name]
        index = positions.get(name)
        return args[index] if index is not None and index < len(args) else defaults[name]

    @functools.wraps(plan)
    def plan_and_remember(self, *args, **kwargs):
        result = plan(self, *args, **kwargs)
        head_dim = value_of(head_dim_name, args, kwargs)
        options = {name: _effective(name, value_of(name, args, kwargs), head_dim) for name in compared}
        self._plan_call = PlanCall(args, kwargs, positions, names, options, head_dim)
        return result

    return plan_and_remember


def _returning_lse(run):
    """FlashInfer's `run_return_lse = functools.partialmethod(run, return_lse=True)`
    as a plain function, which dynamo traces (it cannot trace partialmethod's
    __get__): run with return_lse=True unless the call says otherwise, and
    run's signature with that default."""
    @functools.wraps(run)
    def run_return_lse(self, *args, **kwargs):
        return run(self, *args, **{"return_lse": True, **kwargs})

    signature = inspect.signature(run)
    run_return_lse.__signature__ = signature.replace(parameters=[
        p.replace(default=True) if p.name == "return_lse" else p for p in signature.parameters.values()])
    return run_return_lse


class EngineAliases:
    """Base of the per-wrapper alias mixins below. A wrapper class that inherits
    one (before its plan()/run() base) gets FlashInfer's class attributes
    `begin_forward = plan` and `run_return_lse` (run with return_lse=True),
    bound to its own plan and run; subclasses of that wrapper inherit them,
    as FlashInfer's do."""

    _plan_call: PlanCall | None = None

    def __init_subclass__(cls, **kwargs):
        super().__init_subclass__(**kwargs)
        if hasattr(cls, "plan") and hasattr(cls, "run") and not hasattr(cls, "begin_forward"):
            cls.begin_forward = cls.plan
            cls.run_return_lse = _returning_lse(cls.run)

    def _adopt(self, options: dict) -> None:
        """forward()'s options become the plan's: nothing to do where they match
        it, a re-plan where one differs, a ValueError where a re-plan cannot run."""
        call = self._plan_call
        if call is None:  # no plan yet: run() says so
            return
        changed = call.changed(options)
        if not changed:
            return
        name, given, planned = changed[0]
        if self._use_cuda_graph:
            why = "with use_cuda_graph=True a captured graph keeps the plan it was captured with"
        elif is_compiling() or dispatch_modes():
            why = "plan() reads its tables on the host, which cannot run while torch.compile traces"
        else:
            args, kwargs = call.with_options(options)
            type(self).plan(self, *args, **kwargs)  # the class's plan: an engine may replace the instance's
            return
        raise ValueError(f"{name}: forward() was given {given!r}, the plan has {planned!r}, and forward() cannot "
                         f"plan again: {why}; pass {name}={given!r} to plan() instead")


class DecodeAliases(EngineAliases):
    """BatchDecodeWithPagedKVCacheWrapper's forward() / forward_return_lse() (FlashInfer 0.7.2's parameters)."""

    def forward(self, q, paged_kv_cache, pos_encoding_mode: str = "NONE", q_scale=None, k_scale=None, v_scale=None,
                window_left: int = -1, logits_soft_cap=None, sm_scale=None, rope_scale=None, rope_theta=None):
        """Deprecated in FlashInfer (use plan() and run()): the options replace the
        planned ones, defaults included (module docstring), then run()."""
        self._adopt({"pos_encoding_mode": pos_encoding_mode, "window_left": window_left,
                     "logits_soft_cap": logits_soft_cap, "sm_scale": sm_scale, "rope_scale": rope_scale,
                     "rope_theta": rope_theta})
        return self.run(q, paged_kv_cache, q_scale=q_scale, k_scale=k_scale, v_scale=v_scale)

    def forward_return_lse(self, q, paged_kv_cache, pos_encoding_mode: str = "NONE", q_scale=None, k_scale=None,
                           v_scale=None, window_left: int = -1, logits_soft_cap=None, sm_scale=None, rope_scale=None,
                           rope_theta=None):
        """forward() returning (out, lse), as run(..., return_lse=True)."""
        self._adopt({"pos_encoding_mode": pos_encoding_mode, "window_left": window_left,
                     "logits_soft_cap": logits_soft_cap, "sm_scale": sm_scale, "rope_scale": rope_scale,
                     "rope_theta": rope_theta})
        return self.run(q, paged_kv_cache, q_scale=q_scale, k_scale=k_scale, v_scale=v_scale, return_lse=True)


class PagedPrefillAliases(EngineAliases):
    """BatchPrefillWithPagedKVCacheWrapper's forward() / forward_return_lse() (FlashInfer 0.7.2's parameters)."""

    def forward(self, q, paged_kv_cache, causal: bool = False, pos_encoding_mode: str = "NONE",
                use_fp16_qk_reduction: bool = False, k_scale=None, v_scale=None, window_left: int = -1,
                logits_soft_cap=None, sm_scale=None, rope_scale=None, rope_theta=None):
        """Deprecated in FlashInfer (use plan() and run()): the options replace the
        planned ones, defaults included (causal=False too; module docstring), then run()."""
        self._adopt(_prefill_options(causal, pos_encoding_mode, use_fp16_qk_reduction, window_left, logits_soft_cap,
                                     sm_scale, rope_scale, rope_theta))
        return self.run(q, paged_kv_cache, k_scale=k_scale, v_scale=v_scale)

    def forward_return_lse(self, q, paged_kv_cache, causal: bool = False, pos_encoding_mode: str = "NONE",
                           use_fp16_qk_reduction: bool = False, k_scale=None, v_scale=None, window_left: int = -1,
                           logits_soft_cap=None, sm_scale=None, rope_scale=None, rope_theta=None):
        """forward() returning (out, lse), as run(..., return_lse=True)."""
        self._adopt(_prefill_options(causal, pos_encoding_mode, use_fp16_qk_reduction, window_left, logits_soft_cap,
                                     sm_scale, rope_scale, rope_theta))
        return self.run(q, paged_kv_cache, k_scale=k_scale, v_scale=v_scale, return_lse=True)


class RaggedPrefillAliases(EngineAliases):
    """BatchPrefillWithRaggedKVCacheWrapper's forward() / forward_return_lse() (FlashInfer 0.7.2's parameters)."""

    def forward(self, q, k, v, causal: bool = False, pos_encoding_mode: str = "NONE",
                use_fp16_qk_reduction: bool = False, window_left: int = -1, logits_soft_cap=None, sm_scale=None,
                rope_scale=None, rope_theta=None):
        """Deprecated in FlashInfer (use plan() and run()): the options replace the
        planned ones, defaults included (causal=False too; module docstring), then run()."""
        self._adopt(_prefill_options(causal, pos_encoding_mode, use_fp16_qk_reduction, window_left, logits_soft_cap,
                                     sm_scale, rope_scale, rope_theta))
        return self.run(q, k, v)

    def forward_return_lse(self, q, k, v, causal: bool = False, pos_encoding_mode: str = "NONE",
                           use_fp16_qk_reduction: bool = False, window_left: int = -1, logits_soft_cap=None,
                           sm_scale=None, rope_scale=None, rope_theta=None):
        """forward() returning (out, lse), as run(..., return_lse=True)."""
        self._adopt(_prefill_options(causal, pos_encoding_mode, use_fp16_qk_reduction, window_left, logits_soft_cap,
                                     sm_scale, rope_scale, rope_theta))
        return self.run(q, k, v, return_lse=True)


def _prefill_options(causal, pos_encoding_mode, use_fp16_qk_reduction, window_left, logits_soft_cap, sm_scale,
                     rope_scale, rope_theta) -> dict:
    return {"causal": causal, "pos_encoding_mode": pos_encoding_mode, "use_fp16_qk_reduction": use_fp16_qk_reduction,
            "window_left": window_left, "logits_soft_cap": logits_soft_cap, "sm_scale": sm_scale,
            "rope_scale": rope_scale, "rope_theta": rope_theta}


def fast_decode_plan(self, indptr, indices, last_page_len, num_qo_heads: int, num_kv_heads: int, head_dim: int,
                     page_size: int, pos_encoding_mode: str = "NONE", window_left: int = -1, logits_soft_cap=None,
                     q_data_type=None, kv_data_type=None, data_type=None, sm_scale=None, rope_scale=None,
                     rope_theta=None, non_blocking: bool = True, fixed_split_size: int | None = None,
                     disable_split_kv: bool = False, q_len_per_req: int = 1, global_override_indptr_cpu=None) -> None:
    """FlashInfer's plan for a BatchDecodeWithPagedKVCacheWrapper `self`, which
    engines install as `wrapper.begin_forward = partial(fast_decode_plan,
    wrapper)` on CUDA-graph decode wrappers. FlashInfer's version reuses the
    kernel module of an earlier plan() and skips copies into the graph
    buffers; flashjit's plan() already rewrites a graph-mode wrapper's
    metadata in place (ops._batch), so this is that wrapper's plan() with
    FlashInfer's argument rules: data_type stands for q_data_type and
    kv_data_type where they are None; global_override_indptr_cpu, a host
    copy of indptr, is read instead of indptr (no device-to-host copy); with
    use_tensor_cores and page_size 1 every last page holds one key, as
    FlashInfer assumes. Valid wherever FlashInfer's is, and before a first
    plan() too. q_len_per_req: 1 (one query token per request)."""
    if getattr(self, "_op", None) != "batch_decode_paged":
        raise TypeError(f"fast_decode_plan: expected a BatchDecodeWithPagedKVCacheWrapper, got {type(self).__name__}")
    if not isinstance(q_len_per_req, int) or q_len_per_req < 1:
        raise ValueError(f"q_len_per_req: expected an int >= 1, got {q_len_per_req!r}")
    if q_len_per_req > 1:
        raise NotImplementedError(f"q_len_per_req={q_len_per_req}: flashjit's decode wrapper takes one query token "
                                  f"per request; plan BatchPrefillWithPagedKVCacheWrapper with a qo_indptr instead")
    if data_type is not None:
        q_data_type = data_type if q_data_type is None else q_data_type
        kv_data_type = data_type if kv_data_type is None else kv_data_type
    elif q_data_type is None:
        q_data_type = "float16"
    if self.use_tensor_cores and page_size == 1 and hasattr(last_page_len, "new_ones"):
        last_page_len = last_page_len.new_ones(last_page_len.shape, device="cpu")
    indptr = indptr if global_override_indptr_cpu is None else global_override_indptr_cpu
    # The class's plan: an engine replaces the instance's begin_forward (or plan) with this function.
    type(self).plan(self, indptr, indices, last_page_len, num_qo_heads, num_kv_heads, head_dim, page_size,
                    pos_encoding_mode=pos_encoding_mode, window_left=window_left, logits_soft_cap=logits_soft_cap,
                    q_data_type=q_data_type, kv_data_type=kv_data_type, sm_scale=sm_scale, rope_scale=rope_scale,
                    rope_theta=rope_theta, non_blocking=non_blocking, fixed_split_size=fixed_split_size,
                    disable_split_kv=disable_split_kv)
