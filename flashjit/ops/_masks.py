"""Custom masks (speculative decoding's token trees) with FlashInfer 0.7's
arguments: `custom_mask`, a bool tensor (True: the query sees the key) of each
request's [qo_len, kv_len] pairs, row-major, request after request; or
`packed_custom_mask`, the same bits packed little-endian, each request's
segment starting on a byte boundary, as
segment_packbits(mask, bit_indptr, bitorder="little") returns them. Where both
are given the packed one is used, as FlashInfer does.

The kernels read bit q * kv_len + key of a request's segment, which starts at
byte mask_indptr[request] (params.custom_mask and params.mask_indptr; a single
request: byte 0, no offsets). The batch wrappers pack and place the mask at
plan() and keep it (docs/masks.md); single_prefill_with_kv_cache packs it at
every call.

Every check runs before anything is compiled or launched and raises a
ValueError naming the argument: its type and dtype, its length against the
planned (query, key) pairs, causal=True beside it, its device, and (an integer
mask) values other than 0 and 1.
"""

from __future__ import annotations

from typing import NamedTuple

import torch

from .. import spec as _spec
from .bitpack import packbits, segment_packbits

_INTEGER_DTYPES = (torch.uint8, torch.int8, torch.int16, torch.int32, torch.int64)


class Mask(NamedTuple):
    """The mask argument a call uses: its name (custom_mask or packed_custom_mask) and tensor."""
    name: str
    tensor: object

    @property
    def packed(self) -> bool:
        return self.name == "packed_custom_mask"


def given(custom_mask, packed_custom_mask) -> Mask | None:
    """The mask that applies (packed_custom_mask where both are given, as FlashInfer); None: no mask."""
    if packed_custom_mask is not None:
        return Mask("packed_custom_mask", packed_custom_mask)
    if custom_mask is not None:
        return Mask("custom_mask", custom_mask)
    return None


def check_causal(mask: Mask | None, causal) -> None:
    """A mask holds the causal part itself: causal=True beside it is refused (FlashInfer ignores it)."""
    if mask is not None and causal:
        raise ValueError(f"causal: expected False with {mask.name} (the mask says which keys each query sees; "
                         f"put the causal part in it), got causal=True")


def check_cores(name: str | None, dtype: str, use_tensor_cores: bool, batch_invariant: bool = False) -> None:
    """Custom masks run on tensor cores only (spec.MASK_ON_CUDA_CORES): what chose CUDA cores, named.
    name: the mask argument given (None: no mask)."""
    if name is None or use_tensor_cores or _spec.MASK_ON_CUDA_CORES:
        return
    why = (f"{dtype} runs on CUDA cores only" if dtype not in _spec.TENSOR_CORE_DTYPES
           else "use_tensor_cores=False was requested")
    if batch_invariant and dtype not in _spec.TENSOR_CORE_DTYPES:
        why += " (batch-invariant mode runs it on the CUDA-core prefill kernel)"
    raise ValueError(f"{name}: custom masks run on the fa2 tensor cores with float16 or bfloat16, not on CUDA "
                     f"cores; got {why}. Use q in float16 or bfloat16 with use_tensor_cores left at None or True")


def byte_indptr(qo_lens, kv_lens) -> list[int]:
    """Each request's segment's first byte (and the total last): ceil(qo_len * kv_len / 8) bytes per request."""
    offsets = [0]
    for qo_len, kv_len in zip(qo_lens, kv_lens):
        offsets.append(offsets[-1] + (qo_len * kv_len + 7) // 8)
    return offsets


def check_tensor(mask: Mask, pairs: int, nbytes: int, lengths: str, shape: tuple | None = None) -> None:
    """Type, dtype and length: custom_mask of `pairs` elements (a bool tensor, or
    integer 0/1; any shape of that many elements, or for a single request
    `shape` or flat), packed_custom_mask of `nbytes` uint8 (1-D). `lengths`
    says where the count comes from."""
    t = mask.tensor
    if not isinstance(t, torch.Tensor):
        raise ValueError(f"{mask.name}: expected a torch.Tensor, got {type(t).__name__}")
    if mask.packed:
        if t.dtype != torch.uint8:
            raise ValueError(f"packed_custom_mask: expected dtype torch.uint8 (bits packed little-endian, as "
                             f"segment_packbits(mask, indptr, bitorder='little') returns them), got {t.dtype}")
        if t.dim() != 1 or t.shape[0] != nbytes:
            raise ValueError(f"packed_custom_mask: expected a 1-D tensor of {nbytes} bytes (each request's "
                             f"qo_len * kv_len bits packed on its own from a byte boundary, {lengths}), got shape "
                             f"{tuple(t.shape)}")
        return
    if t.dtype != torch.bool and t.dtype not in _INTEGER_DTYPES:
        raise ValueError(f"custom_mask: expected a bool tensor (True: the query sees the key) or integer 0/1, got "
                         f"{t.dtype}; an additive float mask of 0 / -inf is (mask == 0)")
    if shape is not None and t.dim() == 2:
        if tuple(t.shape) != shape:
            raise ValueError(f"custom_mask: expected shape {shape} ([qo_len, kv_len], {lengths}) or {pairs} "
                             f"elements flat, got shape {tuple(t.shape)}")
    elif t.numel() != pairs or (shape is not None and t.dim() != 1):
        expected = f"shape {shape} or {pairs} elements flat" if shape is not None else f"{pairs} elements"
        raise ValueError(f"custom_mask: expected {expected} (one per (query, key) pair, {lengths}), got shape "
                         f"{tuple(t.shape)}")


def check_device(mask: Mask, device: torch.device, where: str, cpu_ok: bool = False) -> None:
    """The kernel reads the mask on `device` (q's, or a wrapper's); a plan may take it from the CPU (copied)."""
    t = mask.tensor
    if t.device != device and not (cpu_ok and t.device.type == "cpu"):
        also = " or the CPU" if cpu_ok else ""
        raise ValueError(f"{mask.name}: expected a tensor on {device} ({where}){also}, got {t.device}")


def check_values(mask: Mask) -> None:
    """An integer custom_mask holds 0 and 1 only: one device read (none for a
    bool or packed mask, none while a CUDA graph is being captured)."""
    t = mask.tensor
    if mask.packed or t.dtype == torch.bool or not t.numel():
        return
    if t.device.type == "cuda" and torch.cuda.is_available() and torch.cuda.is_current_stream_capturing():
        return
    bad = (t != 0) & (t != 1)
    if bool(bad.any()):
        value = int(t[bad].flatten()[0])
        raise ValueError(f"custom_mask: expected 0 or 1 in an integer mask (or a bool tensor), got {value}")


def single_bits(mask: Mask) -> torch.Tensor:
    """The packed bits of a single request's checked mask, on the mask's device (contiguous uint8)."""
    if mask.packed:
        return mask.tensor.contiguous()
    check_values(mask)
    return packbits(mask.tensor.reshape(-1) != 0, bitorder="little")


def batch_bits(mask: Mask, qo_lens: list[int], kv_lens: list[int], device: torch.device,
               lengths: str) -> tuple[torch.Tensor, list[int]]:
    """(packed bits on the mask's device, byte offsets of each request's segment)
    of a plan's mask, after every check: length against the plan's pairs
    (`lengths`: where the kv lengths come from), device (`device`, the
    wrapper's, or the CPU) and an integer mask's values."""
    offsets = byte_indptr(qo_lens, kv_lens)
    pairs = sum(q * k for q, k in zip(qo_lens, kv_lens))
    check_tensor(mask, pairs, offsets[-1], lengths)
    check_device(mask, device, "the workspace's device", cpu_ok=True)
    if offsets[-1] >= 2**31:
        raise ValueError(f"{mask.name}: {offsets[-1]} packed bytes; the kernels address masks below 2 GiB")
    if mask.packed:
        return mask.tensor.contiguous(), offsets
    check_values(mask)
    flat = mask.tensor.reshape(-1) != 0
    bit_indptr = [0]
    for qo_len, kv_len in zip(qo_lens, kv_lens):
        bit_indptr.append(bit_indptr[-1] + qo_len * kv_len)
    bits, _ = segment_packbits(flat, torch.tensor(bit_indptr, dtype=torch.int64, device=flat.device), "little")
    return bits, offsets


# Masks of up to this many (query, key) pairs get their full-key counts
# (full_keys): the count reads every bit, with a few int32 temporaries per bit.
FULL_KEYS_MAX_PAIRS = 1 << 23


def full_keys(bits: torch.Tensor, qo_lens: list[int], kv_lens: list[int], offsets: list[int]) -> torch.Tensor | None:
    """Per request, how many leading keys every query of it sees (int32, on
    bits' device, without a host sync): the kernels test the mask only on key
    tiles past that count (work.cuh CustomMask::full_keys), where a tree of draft
    tokens behind a cache has its zeros. None past FULL_KEYS_MAX_PAIRS pairs
    (every tile is tested)."""
    pairs = sum(q * k for q, k in zip(qo_lens, kv_lens))
    if pairs == 0 or pairs > FULL_KEYS_MAX_PAIRS:
        return None
    device = bits.device
    nbits = 8 * offsets[-1]
    shifts = torch.arange(8, dtype=torch.uint8, device=device)
    bit = ((bits[:offsets[-1]].view(-1, 1) >> shifts) & 1).view(-1)  # little-endian: bit j of byte i is i * 8 + j
    starts = torch.tensor([8 * o for o in offsets[:-1]], dtype=torch.int32, device=device)
    kv = torch.tensor(kv_lens, dtype=torch.int32, device=device)
    qo = torch.tensor(qo_lens, dtype=torch.int32, device=device)
    at = torch.arange(nbits, dtype=torch.int32, device=device)
    # Each bit's request: the last segment starting at or before it (an empty segment starts where the next does).
    request = torch.searchsorted(starts, at, right=True, out_int32=True) - 1
    rel, kv_of = at - starts[request], kv[request]
    zero = (bit == 0) & (rel < qo[request] * kv_of)  # a hidden pair (the bits past a segment's pairs are padding)
    key = torch.where(zero, rel % kv_of.clamp(min=1), kv_of)
    return kv.scatter_reduce(0, request.long(), key, "amin")


def check_buffer(name: str, buffer, device: torch.device) -> None:
    """A constructor's custom_mask_buf / mask_indptr_buf: a 1-D tensor (uint8 / int32) on the workspace's device."""
    if buffer is None:
        return
    dtype = torch.uint8 if name == "custom_mask_buf" else torch.int32
    if not isinstance(buffer, torch.Tensor) or buffer.dim() != 1 or buffer.dtype != dtype:
        got = f"{buffer.dtype} of shape {tuple(buffer.shape)}" if isinstance(buffer, torch.Tensor) \
            else type(buffer).__name__
        raise ValueError(f"{name}: expected a 1-D {dtype} tensor, got {got}")
    if buffer.device != device:
        raise ValueError(f"{name}: expected a tensor on {device} (the workspace's device), got {buffer.device}")
    if name == "custom_mask_buf" and not buffer.is_contiguous():
        raise ValueError(f"custom_mask_buf: expected a contiguous tensor, got strides {buffer.stride()}")
