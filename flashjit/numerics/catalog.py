"""The cases `flashjit numerics` knows, without torch: the CLI builds its
parser from these names, and `import flashjit.numerics` stays cheap."""

from __future__ import annotations

PEAKED_SCALE = 8.0        # q x 8: a few keys take almost all of the softmax weight
OUTLIER_FRACTION = 0.01   # of V's (token, head) vectors ...
OUTLIER_SCALE = 20.0      # ... multiplied by 20: max|v| (which the bound scales with) is set by few keys
LONG_KV = 32768
LONG_KV_MAX = 131072

# name -> what it draws. The hard ones are every case but "normal".
CASES = {
    "normal": "N(0,1) q, k, v",
    "peaked": f"q x {PEAKED_SCALE:g} (peaked softmax)",
    "v_outliers": f"{OUTLIER_FRACTION:.0%} of V's vectors x {OUTLIER_SCALE:g}",
    "long": f"kv_len {LONG_KV} with few queries",
    "long128k": f"kv_len {LONG_KV_MAX} with few queries (with --long)",
    "skewed": "batch ops: one long request among many short ones",
    "near_empty": "kv_len 1 and qo_len 1 rows",
}
DEFAULT_CASES = tuple(c for c in CASES if c != "long128k")


def path_of(spec) -> str:
    """cc (CUDA cores), or the tensor-core backend."""
    return spec.backend if spec.use_tensor_cores else "cc"


def describe(spec) -> dict:
    """The configuration's columns of a row."""
    return {"config": spec.name, "op": spec.op, "dtype": spec.dtype_q, "kv_dtype": spec.dtype_kv,
            "head_dim": spec.head_dim_qk, "head_dim_vo": spec.head_dim_vo, "path": path_of(spec), "causal": spec.causal,
            "window": spec.sliding_window, "soft_cap": spec.soft_cap}


def not_generated(exc: ValueError) -> str | None:
    """What KernelSpec.validate() said, where it refused a configuration that is not
    generated yet (an FP8 KV cache on an op or backend that does not read one); else None."""
    text = str(exc)
    if "not yet generated" not in text:
        return None
    return text.split(": ", 1)[-1].split(". Supported:", 1)[0]
