"""Merging attention states with FlashInfer 0.7's names and semantics:
merge_state, merge_state_in_place and merge_states.

A state is (v, s): the attention output over one segment of the keys and s, the
base-2 log-sum-exp of that segment's logits. Merging weighs each v by
2^s / sum 2^s, which equals attention over the union of the segments. The
arithmetic is float32 torch ops on the tensors' device (no host sync, CUDA-graph
capturable, CPU tensors work too); the host only checks structure."""

from __future__ import annotations

import torch

from . import _checks, _dispatch

_NEG_INF = float("-inf")


def _check_v(name: str, t, ndim: int) -> None:
    if not isinstance(t, torch.Tensor):
        raise ValueError(f"{name}: expected a torch.Tensor, got {type(t).__name__}")
    if t.dim() != ndim:
        raise ValueError(f"{name}: expected {ndim} dimensions, got shape {tuple(t.shape)}")
    if t.dtype not in _checks.SUPPORTED_DTYPES:
        raise ValueError(f"{name}: expected dtype float16, bfloat16 or float32, got {t.dtype}")


def _check_s(name: str, t, shape: tuple, v_name: str, float32_only: bool = False) -> None:
    if not isinstance(t, torch.Tensor):
        raise ValueError(f"{name}: expected a torch.Tensor, got {type(t).__name__}")
    if tuple(t.shape) != tuple(shape):
        raise ValueError(f"{name}: expected shape {tuple(shape)} ({v_name}'s shape without head_dim), "
                         f"got {tuple(t.shape)}")
    if float32_only and t.dtype != torch.float32:
        # It is written in place: a converted copy would drop the update.
        raise ValueError(f"{name}: expected dtype torch.float32 (it is updated in place), got {t.dtype}")
    if t.dtype not in _checks.SUPPORTED_DTYPES:
        raise ValueError(f"{name}: expected a float32 log-sum-exp (float16/bfloat16 are converted), got {t.dtype}")


def check_pair(v_name, v, s_name, s, ov_name, ov, os_name, os, s_float32_only=False) -> None:
    _check_v(v_name, v, 3)
    _check_v(ov_name, ov, 3)
    if ov.shape != v.shape:
        raise ValueError(f"{ov_name}: expected shape {tuple(v.shape)} (as {v_name}), got {tuple(ov.shape)}")
    _checks.check_same_dtype(**{v_name: v, ov_name: ov})
    _check_s(s_name, s, v.shape[:2], v_name, float32_only=s_float32_only)
    _check_s(os_name, os, v.shape[:2], v_name)
    _checks.check_same_device(v.device, v_name, **{s_name: s, ov_name: ov, os_name: os})


def _scales(s: torch.Tensor, dim: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(weight of each state, merged log-sum-exp) from float32 states stacked along dim."""
    m = s.amax(dim, keepdim=True)
    # Where every state is empty (s = -inf), exp2(-inf - -inf) would be NaN; with m = 0
    # the weights are exactly 0, the total 0 and the merged s log2(0) = -inf.
    m = m.masked_fill(m == _NEG_INF, 0.0)
    w = torch.exp2(s - m)
    total = w.sum(dim, keepdim=True)
    merged_s = (m + torch.log2(total)).squeeze(dim)
    return w / torch.where(total > 0, total, 1.0), merged_s


def _weighted(v: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """scale * v in float32, exactly 0 where the weight is 0: an empty state's v may hold
    anything (NaN from 0/0 included) and must not reach the result through 0 * NaN."""
    scale = scale.unsqueeze(-1)
    return torch.where(scale > 0, v.float() * scale, 0.0)


def _merge_two(v_a, s_a, v_b, s_b) -> tuple[torch.Tensor, torch.Tensor]:
    scale, merged_s = _scales(torch.stack((s_a.float(), s_b.float()), dim=-1), -1)
    merged_v = _weighted(v_a, scale[..., 0]) + _weighted(v_b, scale[..., 1])
    return merged_v, merged_s


def merge_state(v_a, s_a, v_b, s_b) -> tuple[torch.Tensor, torch.Tensor]:
    """Merges two states: v_a/v_b [seq_len, num_heads, head_dim], s_a/s_b [seq_len, num_heads]
    (base-2 log-sum-exp, float32). Returns (v in v_a's dtype, s in float32); a row where
    both states are empty (s = -inf) merges to v = 0, s = -inf."""
    if _dispatch.tracing() and not _needs_grad(v_a, s_a, v_b, s_b):
        return torch.ops.flashjit.merge_state.default(v_a, s_a, v_b, s_b)
    return merge_state_eager(v_a, s_a, v_b, s_b)


def _needs_grad(*tensors) -> bool:
    """The operators have no autograd formula: a traced call that needs gradients
    traces the torch ops of the eager body instead."""
    return torch.is_grad_enabled() and any(isinstance(t, torch.Tensor) and t.requires_grad for t in tensors)


def merge_state_eager(v_a, s_a, v_b, s_b) -> tuple[torch.Tensor, torch.Tensor]:
    check_pair("v_a", v_a, "s_a", s_a, "v_b", v_b, "s_b", s_b)
    merged_v, merged_s = _merge_two(v_a, s_a, v_b, s_b)
    return merged_v.to(v_a.dtype), merged_s


def merge_state_in_place(v, s, v_other, s_other, mask=None) -> None:
    """Merges (v_other, s_other) into (v, s), both [seq_len, num_heads(, head_dim)]; s must
    be float32 since it is written. Rows where the bool mask [seq_len] is False keep
    their state (FlashInfer uses this to capture one graph for a varying batch)."""
    if _dispatch.tracing() and not _needs_grad(v, s, v_other, s_other):
        torch.ops.flashjit.merge_state_in_place.default(v, s, v_other, s_other, mask)
        return
    merge_state_in_place_eager(v, s, v_other, s_other, mask)


def check_in_place(v, s, v_other, s_other, mask) -> None:
    check_pair("v", v, "s", s, "v_other", v_other, "s_other", s_other, s_float32_only=True)
    if mask is not None:
        if not isinstance(mask, torch.Tensor) or mask.dtype != torch.bool or tuple(mask.shape) != (v.shape[0],):
            got = f"{mask.dtype} {tuple(mask.shape)}" if isinstance(mask, torch.Tensor) else type(mask).__name__
            raise ValueError(f"mask: expected a bool tensor of shape ({v.shape[0]},) (seq_len, from v), got {got}")
        _checks.check_same_device(v.device, "v", mask=mask)


def merge_state_in_place_eager(v, s, v_other, s_other, mask=None) -> None:
    check_in_place(v, s, v_other, s_other, mask)
    merged_v, merged_s = _merge_two(v, s, v_other, s_other)
    if mask is not None:
        merged_v = torch.where(mask[:, None, None], merged_v, v.float())
        merged_s = torch.where(mask[:, None], merged_s, s)
    v.copy_(merged_v)
    s.copy_(merged_s)


def merge_states(v, s) -> tuple[torch.Tensor, torch.Tensor]:
    """Merges num_states states: v [seq_len, num_states, num_heads, head_dim], s [seq_len,
    num_states, num_heads] (float32). Returns v [seq_len, num_heads, head_dim] in v's dtype
    and s [seq_len, num_heads] in float32; empty rows (all s = -inf, or no state) give
    v = 0, s = -inf."""
    if _dispatch.tracing() and not _needs_grad(v, s):
        return torch.ops.flashjit.merge_states.default(v, s)
    return merge_states_eager(v, s)


def check_states(v, s) -> None:
    _check_v("v", v, 4)
    _check_s("s", s, v.shape[:3], "v")
    _checks.check_same_device(v.device, "v", s=s)


def merge_states_eager(v, s) -> tuple[torch.Tensor, torch.Tensor]:
    check_states(v, s)
    seq_len, num_states, num_heads, head_dim = v.shape
    if num_states == 0:  # a shape, known on the host: no state is an empty segment
        return (torch.zeros(seq_len, num_heads, head_dim, dtype=v.dtype, device=v.device),
                torch.full((seq_len, num_heads), _NEG_INF, dtype=torch.float32, device=v.device))
    scale, merged_s = _scales(s.float(), 1)
    return _weighted(v, scale).sum(1).to(v.dtype), merged_s
