"""Paged KV cache utilities with FlashInfer 0.7's names and semantics:
append_paged_kv_cache, get_batch_indices_positions and get_seq_lens.

They are plain torch ops: every value-dependent step (page lookup, slot,
request of each token) runs on the tensors' device, so a call never waits for
the device and can be captured in a CUDA graph. The host only checks structure
(ranks, shapes, dtypes, devices), which it knows without reading any tensor.
CPU tensors work too: nothing here needs a kernel of ours.

An FP8 cache (float8_e4m3fn, float8_e5m2) takes fp16/bf16 rows, quantised as
row / scale (k_scale for keys, v_scale for values; a flashjit keyword, default
1 as FlashInfer's cast): the fp32 quotient, correctly rounded, then the nearest
FP8 code (ties to even), saturated at the largest finite value (e4m3 448, e5m2
57344; infinities too); NaN stays NaN. FP8 rows of the cache's own dtype are
copied as they are (no scales then)."""

from __future__ import annotations

import torch

from ..spec import FP8_MAX, HEAD_DIMS
from . import _checks, _dispatch, _scales


def append_paged_kv_cache(append_key, append_value, batch_indices, positions, paged_kv_cache, kv_indices,
                          kv_indptr, kv_last_page_len, kv_layout: str = "NHD", *, k_scale=None,
                          v_scale=None) -> None:
    """Writes append_key/append_value [nnz, num_kv_heads, head_dim] into the paged cache:
    token i goes to page kv_indices[kv_indptr[batch_indices[i]] + positions[i] // page_size],
    slot positions[i] % page_size. paged_kv_cache is one tensor [num_pages, 2, page_size,
    num_kv_heads, head_dim] (NHD) / [num_pages, 2, num_kv_heads, page_size, head_dim] (HND),
    or a (k_cache, v_cache) tuple of [num_pages, page_size, num_kv_heads, head_dim] (NHD) /
    [num_pages, num_kv_heads, page_size, head_dim] (HND). kv_indices, kv_indptr and
    kv_last_page_len must already include the appended tokens (as in FlashInfer).
    Indices are not range-checked on the host (that would read them): an index past a
    tensor's end is a device-side error. Two tokens aimed at one slot leave either value.
    k_scale / v_scale: an FP8 cache's quantisation scales (the module docstring), Python
    floats or one-element float32 tensors (read on the device: CUDA-graph safe)."""
    if _dispatch.tracing():
        _checks.check_unsupported(k_scale=k_scale, v_scale=v_scale)
        k_cache, v_cache = _dispatch.cache_args(paged_kv_cache)
        torch.ops.flashjit.append_paged_kv_cache.default(append_key, append_value, batch_indices, positions, k_cache,
                                                         v_cache, kv_indices, kv_indptr, kv_last_page_len, kv_layout)
        return
    append_eager(append_key, append_value, batch_indices, positions, paged_kv_cache, kv_indices, kv_indptr,
                 kv_last_page_len, kv_layout, k_scale, v_scale)


def append_eager(append_key, append_value, batch_indices, positions, paged_kv_cache, kv_indices, kv_indptr,
                 kv_last_page_len, kv_layout: str, k_scale=None, v_scale=None) -> None:
    """append_paged_kv_cache's eager body."""
    k_cache, v_cache, page_size = check_append(append_key, append_value, batch_indices, positions, paged_kv_cache,
                                               kv_indices, kv_indptr, kv_last_page_len, kv_layout)
    scales = _check_append_scales(k_cache, append_key, k_scale, v_scale)
    head_dim = append_key.shape[2]
    quantize = k_cache.dtype != append_key.dtype
    if k_cache.device.type == "cuda" and head_dim in HEAD_DIMS and _vector_aligned(append_key, append_value) \
            and _vector_aligned(k_cache, v_cache, vector_bytes=8 if quantize else 16):
        _append_kernel(append_key, append_value, batch_indices, positions, k_cache, v_cache, kv_indices, kv_indptr,
                       kv_layout, page_size, scales)
        return
    if quantize:  # a CUDA tensor scale stays a tensor (no host read); a number or CPU tensor is a float
        k_by, v_by = (value if arg.address else arg.value for value, arg in zip((k_scale, v_scale), scales))
        append_key = quantize_rows(append_key, k_cache.dtype, k_by)
        append_value = quantize_rows(append_value, k_cache.dtype, v_by)
    if _scales.is_fp8(k_cache.dtype):  # indexing copies bytes whatever the platform implements for FP8
        k_cache, v_cache = k_cache.view(torch.uint8), v_cache.view(torch.uint8)
        append_key, append_value = append_key.view(torch.uint8), append_value.view(torch.uint8)
    # CPU tensors, head dims we generate no kernel for, or layouts the kernel
    # cannot copy in 16-byte vectors: torch ops.
    page = kv_indices[kv_indptr[batch_indices] + positions // page_size]
    slot = positions % page_size
    if kv_layout == "HND":
        # A transposed view puts (page, slot) first in both layouts, and it writes through.
        k_cache, v_cache = k_cache.transpose(1, 2), v_cache.transpose(1, 2)
    k_cache.index_put_((page, slot), append_key)
    v_cache.index_put_((page, slot), append_value)


def check_append(append_key, append_value, batch_indices, positions, paged_kv_cache, kv_indices, kv_indptr,
                 kv_last_page_len, kv_layout: str) -> tuple:
    """Every structural check of append_paged_kv_cache (nothing reads a tensor);
    returns (k_cache, v_cache, page_size), the caches as 4-D views."""
    _checks.check_layout(kv_layout)
    k_cache, v_cache, cache_name = _checks.unpack_paged_cache(paged_kv_cache)
    _checks.check_tensor("append_key", append_key, 3, kv=True)
    _checks.check_tensor("append_value", append_value, 3, kv=True)
    if append_value.shape != append_key.shape:
        raise ValueError(f"append_value: expected shape {tuple(append_key.shape)} (as append_key), "
                         f"got {tuple(append_value.shape)}")
    nnz, num_kv_heads, head_dim = append_key.shape
    if kv_layout == "NHD":
        _, page_size, cache_heads, cache_dim = k_cache.shape
        layout_shape = "[num_pages, page_size, num_kv_heads, head_dim]"
    else:
        _, cache_heads, page_size, cache_dim = k_cache.shape
        layout_shape = "[num_pages, num_kv_heads, page_size, head_dim]"
    if (cache_heads, cache_dim) != (num_kv_heads, head_dim):
        raise ValueError(f"{cache_name}: expected {num_kv_heads} heads x head_dim {head_dim} (as append_key) in "
                         f"the {kv_layout} layout {layout_shape}, got shape {tuple(k_cache.shape)} for K "
                         f"(heads {cache_heads}, head_dim {cache_dim}); is kv_layout right?")
    if page_size < 1:
        raise ValueError(f"{cache_name}: expected page_size >= 1, got shape {tuple(k_cache.shape)}")
    quantised = _scales.is_fp8(k_cache.dtype) and append_key.dtype in (torch.float16, torch.bfloat16)
    if k_cache.dtype != append_key.dtype and not quantised:
        fp8 = " (or float16/bfloat16 rows, quantised into an FP8 cache)" if _scales.is_fp8(k_cache.dtype) else ""
        raise ValueError(f"append_key: expected dtype {k_cache.dtype} (the dtype of {cache_name}){fp8}, got "
                         f"{append_key.dtype}")
    _checks.check_same_dtype(append_key=append_key, append_value=append_value)
    per_token = " (one per appended token, as append_key)"
    _checks.int_tensor("batch_indices", batch_indices, nnz, exact=True, what=per_token)
    _checks.int_tensor("positions", positions, nnz, exact=True, what=per_token)
    _checks.int_tensor("kv_indices", kv_indices)
    _check_indptr_like("kv_indptr", kv_indptr)
    _checks.int_tensor("kv_last_page_len", kv_last_page_len, kv_indptr.shape[0] - 1, exact=True,
                       what=f" (batch_size, from kv_indptr's {kv_indptr.shape[0]} elements)")
    _checks.check_same_device(k_cache.device, cache_name, append_key=append_key, append_value=append_value,
                       batch_indices=batch_indices, positions=positions, kv_indices=kv_indices,
                       kv_indptr=kv_indptr, kv_last_page_len=kv_last_page_len)
    return k_cache, v_cache, page_size


_modules: dict = {}  # (row dtype, cache dtype, head_dim) -> the loaded append kernel


def _check_append_scales(k_cache, append_key, k_scale, v_scale) -> tuple:
    """(k_scale, v_scale) checked (ops._scales.ScaleArg): scales quantise fp16/bf16 rows into an FP8 cache."""
    if k_cache.dtype == append_key.dtype:
        for name, value in (("k_scale", k_scale), ("v_scale", v_scale)):
            if value is not None:
                raise ValueError(f"{name}: scales quantise float16/bfloat16 rows into an FP8 cache; rows of the "
                                 f"cache's dtype ({k_cache.dtype}) are copied as they are, so give none")
        return _scales.UNIT, _scales.UNIT
    return tuple(_scales.scale_arg(name, _scales.scale_key(value), k_cache.device)
                 for name, value in (("k_scale", k_scale), ("v_scale", v_scale)))


def quantize_rows(rows: torch.Tensor, fp8_dtype: torch.dtype, scale) -> torch.Tensor:
    """What the append kernel writes, in torch: fp32(rows) / scale, correctly rounded,
    clamped to the format's largest finite value (NaN stays NaN), to the nearest FP8 code."""
    limit = FP8_MAX[str(fp8_dtype).removeprefix("torch.")]
    scale = 1.0 if scale is None else scale
    if isinstance(scale, torch.Tensor):
        scale = scale.to(device=rows.device, dtype=torch.float32)
        quotient = rows.float() / scale  # tensor by tensor: a true division on every device
    else:
        # A float64 quotient of the two fp32 operands, rounded once to fp32, is the
        # correctly rounded fp32 quotient (53 >= 2 * 24 + 2 bits).
        quotient = (rows.double() / float(torch.tensor(float(scale), dtype=torch.float32))).float()
    return quotient.clamp(-limit, limit).to(fp8_dtype)


def _vector_aligned(*tensors, vector_bytes: int = 16) -> bool:
    """Bases and row strides (all but the last, contiguous, dimension) in whole vectors of vector_bytes."""
    for t in tensors:
        vec = vector_bytes // t.element_size()
        if t.data_ptr() % vector_bytes or t.stride(-1) != 1 or any(s % vec for s in t.stride()[:-1]):
            return False
    return True


def _append_kernel(key, value, batch_indices, positions, k_cache, v_cache, kv_indices, kv_indptr, kv_layout: str,
                   page_size: int, scales: tuple = (_scales.UNIT, _scales.UNIT)) -> None:
    """One launch of the generated append kernel on torch's current stream."""
    from ..loader import AppendParams
    from ._launch import run_on

    nnz, heads, head_dim = key.shape
    if nnz == 0:
        return
    module = _modules.get((key.dtype, k_cache.dtype, head_dim))
    if module is None:
        from .. import jit
        from ..spec import KernelSpec

        module = _modules[(key.dtype, k_cache.dtype, head_dim)] = jit.get_module(
            KernelSpec.make("append_paged", key.dtype, head_dim, dtype_kv=k_cache.dtype).validate())
    p = AppendParams()
    p.key, p.value, p.k_cache, p.v_cache = key.data_ptr(), value.data_ptr(), k_cache.data_ptr(), v_cache.data_ptr()
    p.batch_indices, p.positions = batch_indices.data_ptr(), positions.data_ptr()
    p.kv_indices, p.kv_indptr = kv_indices.data_ptr(), kv_indptr.data_ptr()
    p.nnz, p.num_heads, p.page_size = nnz, heads, page_size
    p.key_stride_n, p.key_stride_h = key.stride(0), key.stride(1)
    p.value_stride_n, p.value_stride_h = value.stride(0), value.stride(1)
    # NHD caches are [pages, slots, heads, dim]; HND [pages, heads, slots, dim].
    slot_dim, head_dim_index = (1, 2) if kv_layout == "NHD" else (2, 1)
    p.k_stride_page, p.k_stride_slot, p.k_stride_h = (k_cache.stride(0), k_cache.stride(slot_dim),
                                                      k_cache.stride(head_dim_index))
    p.v_stride_page, p.v_stride_slot, p.v_stride_h = (v_cache.stride(0), v_cache.stride(slot_dim),
                                                      v_cache.stride(head_dim_index))
    (p.k_scale, p.k_scale_ptr), (p.v_scale, p.v_scale_ptr) = ((s.value, s.address or None) for s in scales)
    run_on(module, bytes(p), k_cache.device.index)


def get_batch_indices_positions(append_indptr, seq_lens, nnz: int, batch_indices=None,
                                positions=None) -> tuple[torch.Tensor, torch.Tensor]:
    """For each of the nnz appended tokens, its request (the b with append_indptr[b] <= i <
    append_indptr[b + 1]) and its position in that request's KV sequence, the appended
    tokens being the last ones: positions[i] = seq_lens[b] - append_indptr[b + 1] + i.
    Entries past append_indptr[-1] get batch index -1 and position 0. int32 outputs,
    written into batch_indices / positions when given."""
    _check_indptr_like("append_indptr", append_indptr)
    batch_size = append_indptr.shape[0] - 1
    if not isinstance(seq_lens, torch.Tensor) or seq_lens.dim() != 1 or seq_lens.dtype not in (torch.int32,
                                                                                                torch.int64):
        got = f"{seq_lens.dtype} {tuple(seq_lens.shape)}" if isinstance(seq_lens, torch.Tensor) \
            else type(seq_lens).__name__
        raise ValueError(f"seq_lens: expected a 1-D int32 or int64 tensor, got {got}")
    if seq_lens.shape[0] != batch_size:
        raise ValueError(f"seq_lens: expected {batch_size} elements (batch_size, from append_indptr), "
                         f"got {seq_lens.shape[0]}")
    nnz = _host_int("nnz", nnz, minimum=0)
    device = append_indptr.device
    _checks.check_same_device(device, "append_indptr", seq_lens=seq_lens)
    for name, out in (("batch_indices", batch_indices), ("positions", positions)):
        if out is not None:
            _checks.int_tensor(name, out, nnz, exact=True)
            _checks.check_same_device(device, "append_indptr", **{name: out})

    token = torch.arange(nnz, dtype=torch.int32, device=device)
    if batch_size == 0:
        request = torch.full((nnz,), -1, dtype=torch.int32, device=device)
        pos = torch.zeros(nnz, dtype=torch.int32, device=device)
    else:
        ends = append_indptr[1:]
        # The number of requests that end at or before token i is its request.
        request = torch.searchsorted(ends, token, right=True, out_int32=True)
        valid = token < append_indptr[-1]
        safe = request.clamp(max=batch_size - 1)
        pos = (seq_lens[safe].to(torch.int32) - ends[safe] + token).masked_fill(~valid, 0)
        request = request.masked_fill(~valid, -1)
    if batch_indices is None:
        batch_indices = request
    else:
        batch_indices.copy_(request)
    if positions is None:
        positions = pos
    else:
        positions.copy_(pos)
    return batch_indices, positions


def get_seq_lens(kv_indptr, kv_last_page_len, page_size: int) -> torch.Tensor:
    """Tokens of each request in the paged cache: (pages - 1) * page_size + kv_last_page_len
    (a request with no page counts kv_last_page_len alone, as in FlashInfer)."""
    _check_indptr_like("kv_indptr", kv_indptr)
    _checks.int_tensor("kv_last_page_len", kv_last_page_len, kv_indptr.shape[0] - 1, exact=True,
                       what=" (batch_size, from kv_indptr)")
    page_size = _host_int("page_size", page_size, minimum=1)
    _checks.check_same_device(kv_indptr.device, "kv_indptr", kv_last_page_len=kv_last_page_len)
    return torch.clamp(kv_indptr[1:] - kv_indptr[:-1] - 1, min=0) * page_size + kv_last_page_len


def _host_int(name: str, value, minimum: int) -> int:
    """A host integer (a tensor here would need a sync to read, which this module never does)."""
    if isinstance(value, (bool, torch.Tensor)) or not hasattr(value, "__index__") or value.__index__() < minimum:
        raise ValueError(f"{name}: expected a Python int >= {minimum}, got {value!r}")
    return value.__index__()


def _check_indptr_like(name: str, t) -> None:
    _checks.int_tensor(name, t)
    if t.shape[0] < 1:
        raise ValueError(f"{name}: expected batch_size + 1 elements, got none")
