"""The public attention ops (FlashInfer-compatible names). Importing this
module imports torch; `import flashjit` alone does not load it."""

from .decode import single_decode_with_kv_cache
from .paged import BatchDecodeWithPagedKVCacheWrapper, BatchPrefillWithPagedKVCacheWrapper
from .prefill import BatchPrefillWithRaggedKVCacheWrapper, single_prefill_with_kv_cache

__all__ = ["BatchDecodeWithPagedKVCacheWrapper", "BatchPrefillWithPagedKVCacheWrapper",
           "BatchPrefillWithRaggedKVCacheWrapper", "single_decode_with_kv_cache", "single_prefill_with_kv_cache"]
