"""The KV-cache dtypes of the paged-decode benchmark (decode.py): their names on
the command line, the per-tensor quantisation of a bf16 cache into FP8, the
implementation labels and the FP8/bf16 speed ratios the report prints.

An FP8 row reads the same N(0, 1) cache as its bf16 row, quantised per tensor:
scale = amax(|cache|) / the format's largest finite value (448 e4m3, 57344
e5m2), held as a float32 as the kernels hold it; codes = cache / scale in
float32, saturated at that value, rounded to the format. Outputs are checked
against float32 attention over the dequantised cache (codes * scale): the
quantisation is the user's choice, the kernel's error is what is checked.

Importing this module imports no torch (the CLI reads kv_dtype_arg to build its
parser); the functions that need it import it."""

from __future__ import annotations

import argparse
import math

from ..spec import FP8_MAX, canonical_dtype

BF16_KV = "bf16"
# Short name (as the tables print it) of each KV dtype the benchmark runs, by canonical name.
KV_DTYPES = {"bfloat16": BF16_KV, "float8_e4m3fn": "e4m3", "float8_e5m2": "e5m2"}
# The row whose FP8/bf16 speed ratio the report prints (docs: the B64 L4k GQA 32/8 target).
RATIO_ROW = "GQA 64x4k 32/8"
RATIO_TARGET = 1.8  # FP8 requests per second over bf16's, per implementation, on RATIO_ROW
COPY_TARGET = 0.9  # FP8 K+V bytes read per second over the copy bandwidth
NOT_GENERATED = "not yet generated"  # what KernelSpec.validate() says of an FP8 configuration it lacks


def kv_dtype_arg(text: str) -> str:
    """argparse type of --kv-dtype: bf16, or an FP8 format in any spelling flashjit
    accepts (e4m3, fp8_e4m3, float8_e4m3fn, e5m2, ...); returns the short name."""
    try:
        name = canonical_dtype(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None
    if name not in KV_DTYPES:
        raise argparse.ArgumentTypeError(f"{text}: the decode benchmark's queries are bf16; choose a KV dtype of "
                                         f"{', '.join(KV_DTYPES.values())} (or their long names)")
    return KV_DTYPES[name]


def kv_dtypes_of(values) -> tuple[str, ...]:
    """--kv-dtype's values (short names), repeats dropped; None or empty: bf16 alone."""
    return tuple(dict.fromkeys(values or ())) or (BF16_KV,)


def canonical_of(short: str) -> str:
    """'e4m3' -> 'float8_e4m3fn' (KernelSpec's and torch's name)."""
    return next(name for name, s in KV_DTYPES.items() if s == short)


def torch_dtype(short: str):
    import torch

    return getattr(torch, canonical_of(short))


def is_fp8(short: str) -> bool:
    return short != BF16_KV


def impl_label(lib: str, tc: bool, kv: str) -> str:
    """'flashjit tc=False' for the bf16 cache (the label of the tables before FP8), 'flashjit tc=False e4m3' else."""
    return f"{lib} tc={tc}" + (f" {kv}" if is_fp8(kv) else "")


def impl_labels(libs, kv_dtypes) -> list[str]:
    """Every cell's label in table order: each KV dtype, each library, CUDA cores then tensor cores."""
    return [impl_label(lib, tc, kv) for kv in kv_dtypes for lib in libs for tc in (False, True)]


def per_tensor_scale(cache, short: str) -> float:
    """amax(|cache|) / the format's largest finite value, rounded to float32; 1 for an all-zero cache."""
    import torch

    amax = float(cache.abs().amax()) if cache.numel() else 0.0
    if amax == 0.0 or not math.isfinite(amax):
        return 1.0
    return float(torch.tensor(amax / FP8_MAX[canonical_of(short)], dtype=torch.float32))


def quantise(cache, short: str):
    """(FP8 codes of cache, the float32 scale): cache / scale in float32, saturated at
    the format's largest finite value (torch's cast gives inf past it for e5m2),
    converted to the format (nearest, ties to even). Whole tensor at once."""
    scale = per_tensor_scale(cache, short)
    limit = FP8_MAX[canonical_of(short)]
    return cache.float().div_(scale).clamp_(-limit, limit).to(torch_dtype(short)), scale


def dequantise(codes, scale: float):
    """The values an FP8 cache stands for: codes * scale in float32."""
    return codes.float() * scale


def is_not_generated(exc: BaseException) -> bool:
    """A flashjit configuration that is refused because it is not generated yet (a skipped cell, not a failure)."""
    return isinstance(exc, ValueError) and NOT_GENERATED in str(exc)


def speed_ratios(section: dict, row: str = RATIO_ROW) -> list[dict]:
    """Per FP8 KV dtype and implementation that timed both caches on `row`: bf16 µs / FP8 µs
    (FP8 requests per second over bf16's). Plain Python: records as decode.run wrote them."""
    timed = {rec["impl"]: rec["us"] for rec in section.get("decode", []) if rec["row"] == row and rec.get("us")}
    out = []
    for kv in section.get("kv_dtypes", [BF16_KV]):
        if not is_fp8(kv):
            continue
        for lib in section["libs"]:
            for tc in (False, True):
                base, fp8 = timed.get(impl_label(lib, tc, BF16_KV)), timed.get(impl_label(lib, tc, kv))
                if base and fp8:
                    out.append({"row": row, "kv_dtype": kv, "impl": impl_label(lib, tc, BF16_KV), "bf16_us": base,
                                "fp8_us": fp8, "ratio": base / fp8})
    return out
