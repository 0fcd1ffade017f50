"""FP8 KV caches: their dtypes and the dequantisation scales k_scale / v_scale
(FlashInfer 0.7's names), checked on the host before any launch.

A scale is a Python number (checked here: finite and positive) or a
one-element float32 tensor. A CUDA tensor is read by the kernel after its grid
dependency wait, so that a CUDA graph replays with the value the tensor holds
at replay; its value is not checked on the host (that would wait for the
device), only its dtype, size and device. A CPU tensor is read here, as a
number. The ops key their prepared calls by scale_key(), which is the number,
or a CUDA tensor's address: a prepared call then passes that address.
"""

from __future__ import annotations

import math
from typing import NamedTuple

import torch

FP8_KV_DTYPES = (torch.float8_e4m3fn, torch.float8_e5m2)
# Other platforms' FP8 formats (AMD's fnuz), named in errors.
FNUZ_DTYPES = tuple(getattr(torch, name) for name in ("float8_e4m3fnuz", "float8_e5m2fnuz") if hasattr(torch, name))


class TensorScale(NamedTuple):
    """A CUDA tensor scale as a signature key holds it: what the checks need, and its address."""
    address: int
    dtype: torch.dtype
    device: torch.device
    numel: int


class ScaleArg(NamedTuple):
    """A checked scale: the number the kernel takes when address is 0, else the device address of one float."""
    value: float
    address: int


UNIT = ScaleArg(1.0, 0)
# FlashInfer's names of an MLA cache's scales (ckv, kpe), in the place of (k_scale, v_scale).
MLA_SCALE_NAMES = ("ckv_scale", "kpe_scale")
_FLOAT32_MAX = 3.4028234663852886e38


def is_fp8(dtype) -> bool:
    return dtype in FP8_KV_DTYPES


def dtype_problem(dtype, kv: bool) -> str:
    """Why a tensor dtype is refused: what is expected, what came."""
    allowed = "float16, bfloat16 or float32" + (" (or float8_e4m3fn / float8_e5m2 for an FP8 KV cache)" if kv else "")
    if dtype in FNUZ_DTYPES:
        return (f"expected dtype {allowed}, got {dtype}: another platform's FP8 format (fnuz: no negative zero, "
                f"another exponent bias); NVIDIA GPUs use float8_e4m3fn and float8_e5m2")
    if dtype in FP8_KV_DTYPES:
        return (f"expected dtype {allowed}, got {dtype}: FP8 is supported for the KV cache only; queries and "
                f"outputs are float16 or bfloat16")
    return f"expected dtype {allowed}, got {dtype}"


def scale_key(value):
    """The part of a call's signature a scale contributes (cheap: no device access)."""
    if isinstance(value, torch.Tensor):
        if value.device.type == "cpu" and value.numel() == 1 and value.dtype.is_floating_point:
            return float(value.item())
        return TensorScale(value.data_ptr(), value.dtype, value.device, value.numel())
    return value


def scale_arg(name: str, key, device: torch.device) -> ScaleArg:
    """A scale (as scale_key gave it) checked for a launch on `device`: ValueError naming `name`."""
    if key is None:
        return UNIT
    if isinstance(key, TensorScale):
        if key.numel != 1 or key.dtype != torch.float32:
            raise ValueError(f"{name}: expected a Python float or a one-element float32 tensor, got a {key.dtype} "
                             f"tensor of {key.numel} elements")
        if key.device != device:
            raise ValueError(f"{name}: expected a tensor on {device} (where q is) or on the CPU, got {key.device}")
        if key.address % 4:
            raise ValueError(f"{name}: expected a 4-byte aligned tensor, got address % 4 = {key.address % 4}")
        return ScaleArg(1.0, key.address)
    if isinstance(key, bool) or not isinstance(key, (int, float)) and not hasattr(key, "__float__"):
        raise ValueError(f"{name}: expected a Python float or a one-element float32 tensor, got "
                         f"{type(key).__name__}")
    value = float(key)
    if not (math.isfinite(value) and value > 0):
        raise ValueError(f"{name}: expected a finite positive scale, got {value}")
    if not 2.0**-126 <= value <= _FLOAT32_MAX:
        raise ValueError(f"{name}: expected a scale within float32's normal range, got {value}")
    return ScaleArg(value, 0)


def check_scales_for(kv_dtype, k_scale, v_scale, names: tuple[str, str] = ("k_scale", "v_scale")) -> None:
    """Scales belong to an FP8 cache: with a fp16/bf16/fp32 cache they are refused
    (NotImplementedError, as FlashInfer options flashjit does not take)."""
    for name, value in zip(names, (k_scale, v_scale)):
        if value is not None and not is_fp8(kv_dtype):
            raise NotImplementedError(f"{name}={value!r}: scales apply to an FP8 KV cache only (float8_e4m3fn / "
                                      f"float8_e5m2), and the cache is {kv_dtype}; for it, fold a key scale into "
                                      f"sm_scale")


def checked(kv_dtype, scales: tuple, device: torch.device, names: tuple[str, str] = ("k_scale", "v_scale")) -> tuple:
    """(k_scale, v_scale) as scale_key gave them, checked for a launch on `device`
    against a cache of kv_dtype (check_scales_for, scale_arg): two ScaleArg."""
    check_scales_for(kv_dtype, *scales, names=names)
    return tuple(scale_arg(name, key, device) for name, key in zip(names, scales))


def check_planned_dtype(name: str, got: torch.dtype, planned: torch.dtype) -> None:
    """A K/V tensor's dtype against the plan's kv_data_type: ValueError naming `name`,
    with the fix where an FP8 format is on either side."""
    if got != planned:
        hint = f"; plan with kv_data_type={got} for it" if is_fp8(got) or is_fp8(planned) else ""
        raise ValueError(f"{name}: expected dtype {planned} as planned (kv_data_type), got {got}{hint}")


def apply(params, k_scale: ScaleArg, v_scale: ScaleArg) -> None:
    """Writes checked scales into an AttentionParams."""
    params.k_scale, params.v_scale = k_scale.value, v_scale.value
    params.k_scale_ptr, params.v_scale_ptr = k_scale.address or None, v_scale.address or None
