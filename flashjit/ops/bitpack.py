"""Packing boolean masks into bits with FlashInfer 0.7's names and semantics:
packbits and segment_packbits.

packbits(x) is numpy.packbits of a 1-D array: element 8*b + k of x goes to bit
k of byte b, counted from the most significant bit ("big") or from the least
("little"); a last partial byte is padded with zeros. FlashInfer's default is
"big"; its prefill wrappers pack custom masks "little", one bit per (query,
key) pair. segment_packbits packs each segment x[indptr[i]:indptr[i+1]] on its
own (each starts on a byte boundary) and returns the bytes and their indptr.

Plain torch ops on the tensors' device (CPU or CUDA), nothing generated or
compiled: packbits traces under torch.compile as it is, so no torch.library
operator is registered for it; segment_packbits reads indptr on the host (the
output length depends on its values), as FlashInfer's does, and is not for
compiled graphs."""

from __future__ import annotations

import torch

BITORDERS = ("big", "little")


def _check_bitorder(bitorder) -> None:
    if bitorder not in BITORDERS:
        raise ValueError(f"bitorder: expected 'big' or 'little', got {bitorder!r}")


def _check_bits(name: str, x) -> None:
    if not isinstance(x, torch.Tensor):
        raise ValueError(f"{name}: expected a 1-D torch.Tensor, got {type(x).__name__}")
    if x.dim() != 1:
        raise ValueError(f"{name}: expected a 1-D tensor, got shape {tuple(x.shape)}")
    if x.is_complex():
        raise ValueError(f"{name}: expected a bool, integer or floating-point tensor, got {x.dtype}")


def _bit_weights(bitorder: str, device: torch.device) -> torch.Tensor:
    """The value of bit k of a byte for k = 0..7, in the order elements fill it."""
    shifts = torch.arange(8, dtype=torch.int32, device=device)
    if bitorder == "big":
        shifts = 7 - shifts
    return torch.bitwise_left_shift(torch.ones(8, dtype=torch.int32, device=device), shifts)


def _to_bytes(bits: torch.Tensor, bitorder: str) -> torch.Tensor:
    """[n, 8] bool -> [n] uint8."""
    weights = _bit_weights(bitorder, bits.device)
    return (bits.to(torch.int32) * weights).sum(dim=1).to(torch.uint8)


def packbits(x: torch.Tensor, bitorder: str = "big") -> torch.Tensor:
    """Packs the 1-D x (nonzero is 1) into uint8 of shape ((len(x) + 7) // 8,) on
    x's device, as numpy.packbits with this bitorder ("big", FlashInfer's default,
    or "little", the order custom masks take)."""
    _check_bitorder(bitorder)
    _check_bits("x", x)
    n = x.shape[0]
    bits = x.to(torch.bool)
    padded = torch.nn.functional.pad(bits.to(torch.uint8), (0, -n % 8))
    return _to_bytes(padded.view(-1, 8).to(torch.bool), bitorder)


def segment_packbits(x: torch.Tensor, indptr: torch.Tensor, bitorder: str = "big") -> tuple[torch.Tensor, torch.Tensor]:
    """Packs each segment x[indptr[i]:indptr[i+1]] as packbits does, byte-aligned.
    Returns (y uint8 on x's device, new_indptr int32 on indptr's device) with
    y[new_indptr[i]:new_indptr[i+1]] the bytes of segment i and
    new_indptr[i+1] - new_indptr[i] == (indptr[i+1] - indptr[i] + 7) // 8.
    indptr: 1-D int32/int64 on x's device, non-decreasing, indptr[0] >= 0,
    indptr[-1] <= len(x) (elements past indptr[-1] are not read)."""
    _check_bitorder(bitorder)
    _check_bits("x", x)
    offsets = _segment_offsets(indptr, x)
    starts = torch.as_tensor(offsets[:-1], dtype=torch.int64)
    lengths = torch.as_tensor(offsets[1:], dtype=torch.int64) - starts
    packed = (lengths + 7) // 8
    new_indptr = torch.zeros(len(offsets), dtype=torch.int64)
    new_indptr[1:] = torch.cumsum(packed, 0)
    total = int(new_indptr[-1])
    device = x.device
    if total == 0:
        return torch.empty(0, dtype=torch.uint8, device=device), new_indptr.to(torch.int32).to(indptr.device)
    # Byte b belongs to segment seg[b] (empty segments own no byte); its bit k is
    # element starts[seg] + 8 * (b - new_indptr[seg]) + k, zero past the segment's end.
    seg = torch.repeat_interleave(torch.arange(len(packed)), packed).to(device)
    byte_in_segment = torch.arange(total, device=device) - new_indptr.to(device)[seg]
    position = byte_in_segment[:, None] * 8 + torch.arange(8, device=device)
    inside = position < lengths.to(device)[seg][:, None]
    index = torch.where(inside, starts.to(device)[seg][:, None] + position, 0)
    bits = x.to(torch.bool)[index] & inside
    return _to_bytes(bits, bitorder), new_indptr.to(torch.int32).to(indptr.device)


def _segment_offsets(indptr, x: torch.Tensor) -> list[int]:
    """indptr's values on the host, after its checks (ValueError naming indptr)."""
    if not isinstance(indptr, torch.Tensor):
        raise ValueError(f"indptr: expected a 1-D int32 or int64 torch.Tensor, got {type(indptr).__name__}")
    if indptr.dim() != 1 or indptr.dtype not in (torch.int32, torch.int64):
        raise ValueError(f"indptr: expected a 1-D int32 or int64 tensor, got {indptr.dtype} of shape "
                         f"{tuple(indptr.shape)}")
    if indptr.device != x.device:
        raise ValueError(f"indptr: expected a tensor on {x.device} (where x is), got {indptr.device}")
    offsets = indptr.tolist()
    if not offsets:
        raise ValueError("indptr: expected at least one element (batch_size + 1), got none")
    if offsets[0] < 0:
        raise ValueError(f"indptr: expected non-negative offsets, got indptr[0] = {offsets[0]}")
    for i in range(1, len(offsets)):
        if offsets[i] < offsets[i - 1]:
            raise ValueError(f"indptr: expected non-decreasing offsets, got indptr[{i - 1}] = {offsets[i - 1]} > "
                             f"indptr[{i}] = {offsets[i]}")
    if offsets[-1] > x.shape[0]:
        raise ValueError(f"indptr: its last offset {offsets[-1]} is past the end of x ({x.shape[0]} elements)")
    return offsets
