import pytest

from tensorrt_llm.runtime.kv_cache_manager_v2 import (
    AttentionLayerConfig,
    KVCacheManager,
    KVCacheManagerConfig,
)


def make_manager(
    num_slots: int = 8,
    tokens_per_block: int = 4,
    *,
    draft: bool = False,
    enable_block_reuse: bool = True,
    max_blocks_per_seq: int | None = None,
) -> KVCacheManager:
    layers = [AttentionLayerConfig.kv(0, 1, 4, "float32")]
    if draft:
        layers.append(AttentionLayerConfig.kv(1, 2, 4, "float32", depends_on_next_token=True))
    return KVCacheManager(
        KVCacheManagerConfig(
            tokens_per_block=tokens_per_block,
            layers=tuple(layers),
            num_slots=num_slots,
            enable_block_reuse=enable_block_reuse,
            alignment_bytes=16,
            kernel_page_tokens=1,
            max_blocks_per_seq=max_blocks_per_seq,
        )
    )


@pytest.fixture
def manager() -> KVCacheManager:
    return make_manager()


@pytest.fixture
def new_manager():
    """The ``make_manager`` factory, for tests that need a non-default manager."""
    return make_manager


@pytest.fixture(autouse=True)
def integrity_after_every_step(monkeypatch):
    """Every engine call in these tests is followed by ``check_integrity()`` of every manager."""
    from tensorrt_llm.runtime.kv_cache_manager_v2.kv_cache import KVCache

    managers: list[KVCacheManager] = []
    original_init = KVCacheManager.__init__

    def recording_init(self, *args, **kwargs):
        original_init(self, *args, **kwargs)
        managers.append(self)

    monkeypatch.setattr(KVCacheManager, "__init__", recording_init)

    def checked(cls, name):
        original = getattr(cls, name)

        def wrapper(self, *args, **kwargs):
            result = original(self, *args, **kwargs)
            for manager in managers:
                manager.check_integrity()
            return result

        monkeypatch.setattr(cls, name, wrapper)

    for name in ("resize", "commit", "close"):
        checked(KVCache, name)
    for name in ("create_kv_cache", "evict"):
        checked(KVCacheManager, name)
