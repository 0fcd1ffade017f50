"""flashjit: JIT-compiled attention kernels for LLM inference.

Importing flashjit is cheap: it imports neither torch nor jinja2, initialises
no CUDA context, renders and compiles nothing. Public names resolve on first use.
"""

from ._version import __version__

_LAZY = {
    "single_prefill_with_kv_cache": "flashjit.ops.prefill",
    "BatchPrefillWithRaggedKVCacheWrapper": "flashjit.ops.prefill",
    "single_decode_with_kv_cache": "flashjit.ops.decode",
    "BatchPrefillWithPagedKVCacheWrapper": "flashjit.ops.paged",
    "BatchDecodeWithPagedKVCacheWrapper": "flashjit.ops.paged",
    "BatchMLAPagedAttentionWrapper": "flashjit.ops.mla",
    "MultiLevelCascadeAttentionWrapper": "flashjit.ops.cascade",
    "append_paged_kv_cache": "flashjit.ops.append",
    "get_batch_indices_positions": "flashjit.ops.append",
    "get_seq_lens": "flashjit.ops.append",
    "fast_decode_plan": "flashjit.ops._aliases",
    "merge_state": "flashjit.ops.merge",
    "merge_state_in_place": "flashjit.ops.merge",
    "merge_states": "flashjit.ops.merge",
    "packbits": "flashjit.ops.bitpack",
    "segment_packbits": "flashjit.ops.bitpack",
    "tolerance": "flashjit.error_model",
    "Tolerance": "flashjit.error_model",
    "KernelSpec": "flashjit.spec",
    "attention_reference": "flashjit.reference",
    "ragged_reference": "flashjit.reference",
    "mla_reference": "flashjit.reference",
    "build_many": "flashjit.jit",
    "get_module": "flashjit.jit",
    "FlashjitError": "flashjit.errors",
    "BuildError": "flashjit.errors",
    "CacheError": "flashjit.errors",
    "JitDisabledError": "flashjit.errors",
    "SettingError": "flashjit.errors",
    "ToolchainError": "flashjit.errors",
    "KernelLaunchError": "flashjit.errors",
}

# Subpackages reached as attributes (flashjit.numerics.measure) without an import of their own.
_SUBPACKAGES = ("numerics",)

__all__ = ["__version__", *_LAZY, *_SUBPACKAGES]


def __getattr__(name: str):
    import importlib

    if name in _SUBPACKAGES:
        return importlib.import_module(f"flashjit.{name}")
    module_name = _LAZY.get(name)
    if module_name is None:
        raise AttributeError(f"module 'flashjit' has no attribute {name!r}")
    value = getattr(importlib.import_module(module_name), name)
    globals()[name] = value
    return value


def __dir__():
    return sorted(__all__)
