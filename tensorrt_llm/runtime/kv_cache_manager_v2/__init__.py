"""The KV cache engine: slot-coalesced storage, prefix reuse and eviction.

Everything here but ``pool`` is plain Python (no torch), so the block life cycle can be reasoned
about and tested without a device.
"""

from tensorrt_llm.runtime.kv_cache_manager_v2.config import (
    DEFAULT_LIFE_CYCLE,
    DTYPE_SIZES,
    AttentionLayerConfig,
    BufferConfig,
    DataRole,
    KVCacheManagerConfig,
)
from tensorrt_llm.runtime.kv_cache_manager_v2.kv_cache import (
    AllocationResult,
    AllocationStatus,
    KVCache,
)
from tensorrt_llm.runtime.kv_cache_manager_v2.layout import (
    BufferPlacement,
    SlotLayout,
    StorageLayout,
    plan_storage,
)
from tensorrt_llm.runtime.kv_cache_manager_v2.manager import KVCacheManager, KVCacheStats

__all__ = [
    "DEFAULT_LIFE_CYCLE",
    "DTYPE_SIZES",
    "AllocationResult",
    "AllocationStatus",
    "AttentionLayerConfig",
    "BufferConfig",
    "BufferPlacement",
    "DataRole",
    "KVCache",
    "KVCacheManager",
    "KVCacheManagerConfig",
    "KVCacheStats",
    "SlotLayout",
    "StorageLayout",
    "plan_storage",
]
