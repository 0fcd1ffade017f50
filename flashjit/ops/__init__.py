"""The public attention ops (FlashInfer-compatible names). Importing this
module imports torch and registers the ops as torch.ops.flashjit.* (see
_library, the layer above the op modules); `import flashjit` alone does neither."""

from .append import append_paged_kv_cache
from .bitpack import packbits, segment_packbits
from .cascade import MultiLevelCascadeAttentionWrapper
from .decode import single_decode_with_kv_cache
from .merge import merge_state, merge_state_in_place, merge_states
from .mla import BatchMLAPagedAttentionWrapper
from .paged import BatchDecodeWithPagedKVCacheWrapper, BatchPrefillWithPagedKVCacheWrapper
from .prefill import BatchPrefillWithRaggedKVCacheWrapper, single_prefill_with_kv_cache

from . import _library  # last: the top layer, it imports the op modules above

_library.register()

__all__ = ["BatchDecodeWithPagedKVCacheWrapper", "BatchMLAPagedAttentionWrapper", "BatchPrefillWithPagedKVCacheWrapper",
           "BatchPrefillWithRaggedKVCacheWrapper", "MultiLevelCascadeAttentionWrapper", "append_paged_kv_cache",
           "merge_state", "merge_state_in_place", "merge_states", "packbits", "segment_packbits",
           "single_decode_with_kv_cache", "single_prefill_with_kv_cache"]
