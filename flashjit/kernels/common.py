"""Limits every backend's tiling is sized against."""

from __future__ import annotations

# Dynamic shared memory one CTA may use on every target (SM89 allows 99 KB).
SMEM_BUDGET = 96 * 1024
DTYPE_BYTES = {"float16": 2, "bfloat16": 2, "float32": 4, "float8_e4m3fn": 1, "float8_e5m2": 1}

# Shared memory per SM (bytes) and what the driver reserves per CTA, per arch.
SMEM_PER_SM = {"sm_80": 164 * 1024, "sm_86": 100 * 1024, "sm_89": 100 * 1024, "sm_90a": 228 * 1024,
               "sm_100a": 228 * 1024, "sm_120": 100 * 1024}
SMEM_RESERVED_PER_CTA = 1024


def row_pitch(head_dim: int) -> int:
    """Bytes of a 16-bit row of a swizzled shared-memory tile: whole 128-byte
    lines (64 columns), as fa2's kPitchBytes and fa3's kPitchBytes take them."""
    return -(-2 * head_dim // 128) * 128
