"""Argument checks shared by the ops: every bad input becomes a ValueError (or
NotImplementedError for options we do not support) that names the argument,
what was expected and what came, before any kernel runs."""

from __future__ import annotations

import math

import torch

from ..spec import ALL_HEAD_DIMS, HEAD_DIMS, head_dims_text, nearest_head_dims, or_list, wide_head_dims_text
from . import _scales

SUPPORTED_DTYPES = (torch.float16, torch.bfloat16, torch.float32)
LAYOUTS = ("NHD", "HND")


def check_tensor(name: str, t, ndim: int, kv: bool = False) -> None:
    """Type, rank, dtype and layout (check_device comes after the cross-checks,
    so that every shape mistake is reported the same way with or without a GPU).
    kv: K/V (or a KV cache), which may also be FP8."""
    if not isinstance(t, torch.Tensor):
        raise ValueError(f"{name}: expected a torch.Tensor, got {type(t).__name__}")
    if t.dim() != ndim:
        raise ValueError(f"{name}: expected {ndim} dimensions, got shape {tuple(t.shape)}")
    if t.dtype not in SUPPORTED_DTYPES and not (kv and _scales.is_fp8(t.dtype)):
        raise ValueError(f"{name}: {_scales.dtype_problem(t.dtype, kv)}")
    if t.numel() and t.stride(-1) != 1:
        raise ValueError(f"{name}: the last (head_dim) dimension must be contiguous, got strides {t.stride()}")


def check_device(name: str, t: torch.Tensor, device: torch.device | None = None) -> None:
    if t.device.type != "cuda":
        raise ValueError(f"{name}: expected a CUDA tensor, got a tensor on {t.device}")
    if device is not None and t.device != device:
        raise ValueError(f"{name}: expected a tensor on {device} (where q is), got {t.device}")


def check_vector_aligned(name: str, t: torch.Tensor) -> None:
    """K and V are copied with 16-byte vectors: base and row strides must allow it."""
    vec = 16 // t.element_size()
    if t.numel() and (t.data_ptr() % 16 or any(s % vec for s in t.stride()[:-1])):
        raise ValueError(f"{name}: expected a 16-byte aligned tensor with strides that are multiples of {vec} "
                         f"elements (e.g. .contiguous()), got data_ptr % 16 = {t.data_ptr() % 16}, "
                         f"strides {t.stride()}")


def check_kv_dtype(q_name: str, q: torch.Tensor, kv_name: str, kv: torch.Tensor) -> None:
    """K/V of q's dtype, or an FP8 cache beside fp16/bf16 q."""
    if _scales.is_fp8(kv.dtype):
        if q.dtype not in (torch.float16, torch.bfloat16):
            raise ValueError(f"{q_name}: expected float16 or bfloat16 with an FP8 KV cache ({kv_name} is {kv.dtype}), "
                             f"got {q.dtype}")
    elif kv.dtype != q.dtype:
        raise ValueError(f"{kv_name}: expected dtype {q.dtype} (the dtype of {q_name}), got {kv.dtype}")


def check_same_dtype(**tensors) -> torch.dtype:
    (first_name, first), *rest = tensors.items()
    for name, t in rest:
        if t.dtype != first.dtype:
            raise ValueError(f"{name}: expected dtype {first.dtype} (the dtype of {first_name}), got {t.dtype}")
    return first.dtype


def check_layout(kv_layout: str) -> str:
    if kv_layout not in LAYOUTS:
        raise ValueError(f"kv_layout: expected 'NHD' or 'HND', got {kv_layout!r}")
    return kv_layout


def other_layout_hint(kv_layout: str, fits_other: bool) -> str:
    """The end of a shape-mismatch message when reading the tensor in the other
    layout would have matched: a wrapper's kv_layout is fixed at construction."""
    if not fits_other:
        return ""
    other = "HND" if kv_layout == "NHD" else "NHD"
    return f"; it fits the plan read as {other}, but the wrapper was created with kv_layout={kv_layout!r}"


def check_no_extra_args(method: str, args: tuple) -> None:
    """FlashInfer's run() hands extra positional arguments to custom JIT kernels;
    dropping them silently would hide a call meant for another signature."""
    if args:
        raise NotImplementedError(f"{method}: got {len(args)} extra positional argument(s); FlashInfer passes them "
                                  f"to custom JIT kernels (jit_args), which flashjit does not support")


def kv_dims(name: str, t: torch.Tensor, kv_layout: str) -> tuple[int, int, int, int, int]:
    """(tokens, heads, head_dim, stride_token, stride_head) of a 3-D K or V tensor."""
    if kv_layout == "NHD":
        return t.shape[0], t.shape[1], t.shape[2], t.stride(0), t.stride(1)
    return t.shape[1], t.shape[0], t.shape[2], t.stride(1), t.stride(0)


def check_heads(num_qo_heads: int, num_kv_heads: int) -> None:
    if num_kv_heads < 1 or num_qo_heads < 1:
        raise ValueError(f"num_qo_heads / num_kv_heads: expected positive, got {num_qo_heads} / {num_kv_heads}")
    if num_qo_heads % num_kv_heads:
        raise ValueError(f"num_qo_heads ({num_qo_heads}) must be a multiple of num_kv_heads ({num_kv_heads}) "
                         f"for GQA/MQA")


def check_head_dim(name: str, head_dim: int) -> None:
    """A head dim flashjit generates for some op (spec.ALL_HEAD_DIMS; the spec
    names where 512 is generated when the call's op or cores do not take it);
    another names the nearest that are."""
    if head_dim not in ALL_HEAD_DIMS:
        wide = f" (or {wide_head_dims_text()})" if head_dim > max(HEAD_DIMS) else ""
        raise ValueError(f"{name}: expected a head_dim that is {head_dims_text()}{wide}, got {head_dim} (nearest "
                         f"generated: {or_list(nearest_head_dims(head_dim, ALL_HEAD_DIMS))})")


def check_unsupported(**options) -> None:
    """Raises NotImplementedError for FlashInfer options we do not support (value not at its default)."""
    reasons = {
        "pos_encoding_mode": "fused RoPE is not supported; apply rotary embeddings before attention",
        "use_fp16_qk_reduction": "fp16 Q.K reduction is not supported; flashjit accumulates Q.K in fp32",
        "scale_q": "FP8 queries are not supported (q is float16 or bfloat16); fold a query scale into sm_scale",
        "scale_k": "scales apply to an FP8 KV cache only; for a float16/bfloat16 cache fold it into sm_scale",
        "scale_v": "scales apply to an FP8 KV cache only",
        "q_scale": "FP8 queries are not supported (q is float16 or bfloat16); fold a query scale into sm_scale",
        "k_scale": "scales apply to an FP8 KV cache only; for a float16/bfloat16 cache fold it into sm_scale",
        "v_scale": "scales apply to an FP8 KV cache only",
    }
    defaults = {"pos_encoding_mode": "NONE", "use_fp16_qk_reduction": False}
    for name, value in options.items():
        default = defaults.get(name)
        if value is None or (default is not None and value == default):
            continue
        raise NotImplementedError(f"{name}={value!r}: {reasons[name]}")


def variant_values(sm_scale, head_dim: int, window_left: int, logits_soft_cap) -> tuple[float, int, float, bool, bool]:
    """(sm_scale, window_left, soft_cap, has_window, has_soft_cap) with FlashInfer's defaults."""
    if sm_scale is None:
        sm_scale = 1.0 / math.sqrt(head_dim)
    sm_scale = float(sm_scale)
    if not (math.isfinite(sm_scale) and sm_scale > 0):
        raise ValueError(f"sm_scale: expected a finite positive number, got {sm_scale}")
    window_left = -1 if window_left is None else int(window_left)
    if window_left < -1:
        raise ValueError(f"window_left: expected -1 (no window) or >= 0, got {window_left}")
    cap = 0.0 if logits_soft_cap is None else float(logits_soft_cap)
    if cap < 0 or not math.isfinite(cap):
        raise ValueError(f"logits_soft_cap: expected None, 0 or a positive number, got {logits_soft_cap}")
    return sm_scale, window_left, cap, window_left >= 0, cap > 0


def check_indptr(name: str, indptr, batch_size: int | None = None) -> list[int]:
    """Host copy of an indptr (CPU or CUDA tensor, or a sequence): 1-D, non-negative, non-decreasing."""
    if isinstance(indptr, torch.Tensor):
        if indptr.dim() != 1:
            raise ValueError(f"{name}: expected a 1-D tensor, got shape {tuple(indptr.shape)}")
        if indptr.dtype not in (torch.int32, torch.int64):
            raise ValueError(f"{name}: expected an int32 or int64 tensor, got {indptr.dtype}")
        values = indptr.tolist()
    else:
        values = [int(x) for x in indptr]
    if len(values) < 1:
        raise ValueError(f"{name}: expected at least one element (batch_size + 1), got none")
    if batch_size is not None and len(values) != batch_size + 1:
        raise ValueError(f"{name}: expected {batch_size + 1} elements (batch_size + 1), got {len(values)}")
    if values[0] < 0:
        raise ValueError(f"{name}: expected non-negative offsets, got {name}[0] = {values[0]}")
    for i in range(1, len(values)):
        if values[i] < values[i - 1]:
            raise ValueError(f"{name}: expected non-decreasing offsets, got {name}[{i - 1}] = {values[i - 1]} > "
                             f"{name}[{i}] = {values[i]}")
    if values[-1] >= 2**31:
        raise ValueError(f"{name}: offsets must fit in int32, got {values[-1]}")
    return values


def check_same_device(device: torch.device, reference: str, **tensors) -> None:
    """Every tensor on `device`, where the tensor named `reference` is."""
    for name, t in tensors.items():
        if t.device != device:
            raise ValueError(f"{name}: expected a tensor on {device} (where {reference} is), got {t.device}")


def unpack_paged_cache(paged_kv_cache) -> tuple[torch.Tensor, torch.Tensor, str]:
    """(k_cache, v_cache, the name to report K cache mistakes under), 4-D views
    of one 5-D cache [pages, 2, ...] or the two tensors of a (k, v) tuple."""
    if isinstance(paged_kv_cache, torch.Tensor):
        check_tensor("paged_kv_cache", paged_kv_cache, 5, kv=True)
        if paged_kv_cache.shape[1] != 2:
            raise ValueError(f"paged_kv_cache: expected shape [num_pages, 2, ...] (K and V in dimension 1), "
                             f"got shape {tuple(paged_kv_cache.shape)}")
        # Views: writing through them writes the caller's tensor.
        return paged_kv_cache[:, 0], paged_kv_cache[:, 1], "paged_kv_cache"
    if not isinstance(paged_kv_cache, (tuple, list)) or len(paged_kv_cache) != 2:
        got = f"a {type(paged_kv_cache).__name__} of {len(paged_kv_cache)}" \
            if isinstance(paged_kv_cache, (tuple, list)) else type(paged_kv_cache).__name__
        raise ValueError(f"paged_kv_cache: expected a 5-D tensor or a (k_cache, v_cache) tuple, got {got}")
    k_cache, v_cache = paged_kv_cache
    check_tensor("paged_kv_cache[0]", k_cache, 4, kv=True)
    check_tensor("paged_kv_cache[1]", v_cache, 4, kv=True)
    if v_cache.shape != k_cache.shape:
        raise ValueError(f"paged_kv_cache[1]: expected shape {tuple(k_cache.shape)} (as paged_kv_cache[0]), "
                         f"got {tuple(v_cache.shape)}")
    check_same_dtype(**{"paged_kv_cache[0]": k_cache, "paged_kv_cache[1]": v_cache})
    check_same_device(k_cache.device, "paged_kv_cache[0]", **{"paged_kv_cache[1]": v_cache})
    return k_cache, v_cache, "paged_kv_cache[0]"


def paged_kv_cache(paged_kv_cache, kv_layout: str) -> tuple:
    """(k, v, num_pages, page_size, num_kv_heads, head_dim, k_strides, v_strides)
    of a paged cache (see unpack_paged_cache) in kv_layout: NHD pages are
    [page_size, heads, dim], HND [heads, page_size, dim]; strides are (token, head, page)."""
    check_layout(kv_layout)
    k, v, _ = unpack_paged_cache(paged_kv_cache)
    num_pages = k.shape[0]
    if kv_layout == "NHD":
        page_size, heads, dim = k.shape[1], k.shape[2], k.shape[3]
        ks, vs = (k.stride(1), k.stride(2), k.stride(0)), (v.stride(1), v.stride(2), v.stride(0))
    else:
        heads, page_size, dim = k.shape[1], k.shape[2], k.shape[3]
        ks, vs = (k.stride(2), k.stride(1), k.stride(0)), (v.stride(2), v.stride(1), v.stride(0))
    return k, v, num_pages, page_size, heads, dim, ks, vs


def paged_kv_sources(cache, kv_layout: str) -> tuple:
    """(k_src, v_src, v_offset_bytes, num_pages, page_size, num_kv_heads, head_dim,
    k_strides, v_strides): what a launch reads. For one 5-D cache, k_src and v_src
    are the cache itself and V starts v_offset_bytes after K; for a (K, V) tuple,
    the two tensors and 0. Runs on a call signature's first call only (repeat
    calls reuse the prepared launch: _calls.py). Raises ValueError as
    paged_kv_cache does."""
    k, v, *geometry = paged_kv_cache(cache, kv_layout)
    if isinstance(cache, torch.Tensor):
        return (cache, cache, cache.stride(1) * cache.element_size(), *geometry)
    return (k, v, 0, *geometry)


def int_tensor(name: str, t, length: int | None = None, *, exact: bool = False, what: str = "") -> torch.Tensor:
    """A 1-D int32 tensor (the kernels read int32 index tables); with `length`,
    at least that many elements, or exactly that many when `exact` (`what` says
    where the count comes from)."""
    if not isinstance(t, torch.Tensor):
        raise ValueError(f"{name}: expected a 1-D int32 torch.Tensor, got {type(t).__name__}")
    if t.dim() != 1:
        raise ValueError(f"{name}: expected a 1-D int32 tensor, got shape {tuple(t.shape)}")
    if t.dtype != torch.int32:
        raise ValueError(f"{name}: expected a 1-D int32 tensor, got {t.dtype}")
    if length is not None and exact and t.shape[0] != length:
        raise ValueError(f"{name}: expected {length} elements{what}, got {t.shape[0]}")
    if length is not None and not exact and t.shape[0] < length:
        raise ValueError(f"{name}: expected at least {length} elements{what}, got {t.shape[0]}")
    return t


def last_page_lens(name: str, values: list[int], pages: list[int], page_size: int) -> None:
    """A request with pages fills 1..page_size slots of its last one (a request
    without pages has no keys, whatever its entry says)."""
    for i, (last, n) in enumerate(zip(values, pages)):
        if n > 0 and not 1 <= last <= page_size:
            raise ValueError(f"{name}: expected 1..{page_size} (page_size) for request {i}, which has "
                             f"{n} pages, got {last}")


def page_ids(name: str, indices, count: int, device) -> int:
    """The first `count` page ids of a page table on the wrapper's `device`,
    none negative; returns the largest (-1 when there are none), which run()
    compares with the cache it is given."""
    if indices.device != device:
        raise ValueError(f"{name}: expected a tensor on {device} (the workspace's device), got {indices.device}")
    if not count:
        return -1
    low, high = (int(x) for x in torch.aminmax(indices[:count]))
    if low < 0:
        raise ValueError(f"{name}: expected page ids >= 0, got {low}")
    return high
