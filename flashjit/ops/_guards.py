"""The repeat-call check of a prepared call in C: does each tensor still have
the type, dtype, device, sizes and strides that the first call checked?

torch.compile checks its compiled graphs' tensor arguments on every call with
torch._C._dynamo.guards.TensorGuards (type, dispatch keys (device type, and
autograd state), dtype, device index, requires_grad, sizes, strides). One
check of three tensors costs about 0.3 us on a CPU where reading shape,
stride(), dtype and device of each in Python and comparing the tuple costs
about 1.1 us (benchmarks/host_cost_cpu.py). It checks more than the ops'
signatures hold (the exact tensor type, requires_grad), never less: a tensor
it rejects goes down the ops' Python signature path, which finds or prepares
the call as before.

It is torch's private API: it is used only where it imports and passes the
self-test below (else a check that is never true), and always constructed
with both keyword arguments (torch 2.13 dereferences them unchecked).
"""

from __future__ import annotations

import torch

try:
    from torch._C._dynamo.guards import TensorGuards as _TensorGuards
except ImportError:  # a torch without dynamo's C guards
    _TensorGuards = None


def never(*tensors) -> bool:
    """The check where torch has no usable TensorGuards."""
    return False


def _build(tensors, token_dims):
    sizes = [[None if d == free else size for d, size in enumerate(t.shape)] for t, free in zip(tensors, token_dims)]
    strides = [list(t.stride()) for t in tensors]
    return _TensorGuards(*tensors, dynamic_dims_sizes=sizes, dynamic_dims_strides=strides).check


def _self_test() -> bool:
    """That the guards tell apart what the ops' signatures tell apart: dtype,
    strides, sizes but the free one, non-tensors; and accept a like tensor."""
    try:
        check = _build([torch.empty(4, 2, 8)], [0])
        return bool(check(torch.empty(3, 2, 8))) and not any(check(t) for t in (
            torch.empty(4, 2, 8, dtype=torch.float16), torch.empty(4, 8, 2).transpose(1, 2), torch.empty(4, 3, 8),
            torch.empty(4, 2, 16)[:, :, :8], None))
    except Exception:  # another signature or behaviour: the Python path alone
        return False


_USABLE = _TensorGuards is not None and _self_test()


def metadata_check(tensors, token_dims=None):
    """check(*tensors) -> bool, true when each tensor has the type, dtype,
    device, sizes and strides of the one in its place in `tensors` (one
    positional argument each), except the size of its dimension in
    `token_dims` (one dim index, or None, per tensor: a token count, which the
    caller reads and checks itself). `never` where guards are unusable."""
    if not _USABLE:
        return never
    try:
        return _build(tensors, token_dims or [None] * len(tensors))
    except Exception:  # a tensor the guards cannot describe: such calls take the Python path
        return never
