"""Attention sinks (gpt-oss): one float32 logit per query head, in natural-log
units beside the scaled (and soft-capped) logits, checked on the host before
any launch.

The kernels read the tensor through its address (params.sinks, null: no sink)
when they run, so a CUDA graph replays with the values it holds at replay.
The ops key their prepared calls by key(): the address and what the checks
read of the tensor (dtype, device, shape, strides), no device access. The
checks run when the prepared call of a new key is built, the first call with
that tensor: its structure, its device (q's), and its values, which are read
then (one device sync; not while a CUDA graph is being captured, where a read
would break the capture): NaN and +inf are refused, -inf is no sink for that
head. Values written into the tensor later are not checked again.
"""

from __future__ import annotations

import math
from typing import NamedTuple

import torch


class SinksKey(NamedTuple):
    """A sinks tensor as a prepared call's signature holds it."""
    address: int
    dtype: torch.dtype
    device: torch.device
    shape: tuple
    stride: tuple


class NotATensor(NamedTuple):
    """What key() makes of anything else (hashable, and compared safely inside a signature)."""
    type_name: str


def key(sinks):
    """The part of a call's signature the sinks argument contributes (None: no sinks)."""
    if sinks is None:
        return None
    if isinstance(sinks, torch.Tensor):
        return SinksKey(sinks.data_ptr(), sinks.dtype, sinks.device, sinks.shape, sinks.stride())
    return NotATensor(type(sinks).__name__)


def check_structure(sinks_key, num_qo_heads: int) -> None:
    """Type, dtype, shape and layout, from a key (no tensor data): a ValueError naming sinks."""
    if sinks_key is None:
        return
    if not isinstance(sinks_key, SinksKey):
        raise ValueError(f"sinks: expected a float32 torch.Tensor of {num_qo_heads} elements (num_qo_heads), got "
                         f"{sinks_key.type_name}")
    if sinks_key.dtype != torch.float32:
        raise ValueError(f"sinks: expected dtype torch.float32, got {sinks_key.dtype}")
    if len(sinks_key.shape) != 1 or sinks_key.shape[0] != num_qo_heads:
        raise ValueError(f"sinks: expected a 1-D tensor of {num_qo_heads} elements (num_qo_heads), got shape "
                         f"{tuple(sinks_key.shape)}")
    if num_qo_heads > 1 and sinks_key.stride[0] != 1:
        raise ValueError(f"sinks: expected a contiguous tensor, got strides {tuple(sinks_key.stride)}")


def check_device(sinks_key, device: torch.device) -> None:
    """The kernel reads the sinks on q's device: a tensor elsewhere (the CPU included) is refused."""
    if sinks_key is not None and sinks_key.device != device:
        raise ValueError(f"sinks: expected a tensor on {device} (where q is: the kernel reads it there), got "
                         f"{sinks_key.device}")


def check_values(sinks: torch.Tensor) -> None:
    """NaN and +inf refused, -inf (no sink for that head) allowed; one device read."""
    if torch.cuda.is_available() and torch.cuda.is_current_stream_capturing():
        return
    for head, value in enumerate(sinks.tolist()):
        if math.isnan(value) or value == math.inf:
            raise ValueError(f"sinks: expected finite values or -inf (no sink for that head), got {value} at "
                             f"head {head}")


def checked_address(sinks, num_qo_heads: int, device: torch.device) -> int:
    """Every check of a call's sinks (key's, then its values); the address the
    params take (0: no sinks)."""
    sinks_key = key(sinks)
    if sinks_key is None:
        return 0
    check_structure(sinks_key, num_qo_heads)
    check_device(sinks_key, device)
    check_values(sinks)
    return sinks_key.address


def operand(sinks):
    """sinks as the torch.ops.flashjit operators take it (a Tensor or None), for traced calls;
    anything else gets the eager ValueError."""
    if sinks is not None and not isinstance(sinks, torch.Tensor):
        raise ValueError(f"sinks: expected a float32 torch.Tensor of num_qo_heads elements, got "
                         f"{type(sinks).__name__}")
    return sinks


def check_fake(sinks, num_qo_heads: int, device: torch.device) -> None:
    """The checks a fake kernel can make (no address, no values): structure and device."""
    if sinks is None:
        return
    fake = SinksKey(0, sinks.dtype, sinks.device, sinks.shape, sinks.stride())
    check_structure(fake, num_qo_heads)
    check_device(fake, device)
