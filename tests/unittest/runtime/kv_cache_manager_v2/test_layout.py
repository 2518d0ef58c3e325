"""The slot layout rules of layout.py, pinned with hand-computed offsets."""

import pytest

from tensorrt_llm.runtime.kv_cache_manager_v2 import (
    AttentionLayerConfig,
    BufferConfig,
    DataRole,
    KVCacheManagerConfig,
    plan_storage,
)


def three_size_classes(**options):
    """Target K/V with 2 heads, index-K with 1 head, a draft layer with 4 heads (all head_dim 8, fp16,
    4 tokens per block): per-block sizes 128, 64 and 256 bytes."""
    layers = (
        AttentionLayerConfig.kv(0, 2, 8, "float16"),
        AttentionLayerConfig.kv(1, 2, 8, "float16", index_key=(1, 8, "float16")),
        AttentionLayerConfig.kv(2, 4, 8, "float16", depends_on_next_token=True),
    )
    options = {"alignment_bytes": 64, "kernel_page_tokens": 2, **options}
    return KVCacheManagerConfig(tokens_per_block=4, layers=layers, num_slots=8, **options)


def test_offsets_follow_layer_order_with_aligned_keys_and_adjacent_values():
    layout = plan_storage(three_size_classes())
    (pool,) = layout.pools
    got = [(b.layer_id, b.role.value, b.offset, b.size, b.is_subpage) for b in pool.buffers]
    assert got == [
        (0, "key", 0, 128, False),
        (0, "value", 128, 128, False),
        (1, "key", 256, 128, False),
        (1, "value", 384, 128, False),
        (1, "index_key", 512, 64, True),
        (2, "key", 576, 256, True),
        (2, "value", 832, 256, True),
    ]
    # end 1088, rounded up to lcm(64, 2-token pages of 64, 32, 128 bytes) = 128
    assert pool.slot_bytes == 1152
    assert pool.page_size == 128


def test_alignment_pads_before_keys_and_index_keys_only():
    layout = plan_storage(three_size_classes(alignment_bytes=256))
    offsets = {(b.layer_id, b.role.value): b.offset for b in layout.pools[0].buffers}
    assert offsets == {
        (0, "key"): 0,
        (0, "value"): 128,
        (1, "key"): 256,
        (1, "value"): 384,
        (1, "index_key"): 512,
        (2, "key"): 768,
        (2, "value"): 1024,
    }
    assert layout.pools[0].slot_bytes == 1280


def test_slot_size_is_a_whole_number_of_kernel_pages_of_every_buffer():
    layout = plan_storage(three_size_classes(kernel_page_tokens=4))
    slot = layout.pools[0].slot_bytes
    for b in layout.pools[0].buffers:
        assert slot % b.kernel_page_bytes(4) == 0
        assert b.offset % b.itemsize == 0
    assert slot == 1280  # 1088 rounded up to lcm(64, 128, 64, 256) = 256


def test_life_cycles_get_their_own_pools():
    layers = (
        AttentionLayerConfig.kv(0, 2, 8, "float16", life_cycle="a"),
        AttentionLayerConfig.kv(1, 1, 8, "float32", life_cycle="b"),
        AttentionLayerConfig.kv(2, 2, 8, "float16", life_cycle="a"),
    )
    layout = plan_storage(
        KVCacheManagerConfig(4, layers, 4, alignment_bytes=64, kernel_page_tokens=4)
    )
    assert [p.life_cycle for p in layout.pools] == ["a", "b"]
    assert [(b.layer_id, b.offset) for b in layout.pools[0].buffers] == [
        (0, 0),
        (0, 128),
        (2, 256),
        (2, 384),
    ]
    assert layout.pool_of_layer(1) == 1 and layout.pools[1].slot_bytes == 256


def test_describe_lists_every_buffer_with_its_class():
    text = plan_storage(three_size_classes()).describe()
    assert "slot_bytes=1152" in text
    rows = [line.split() for line in text.splitlines() if line.strip()[:1].isdigit()]
    assert len(rows) == 7
    assert rows[4][:4] == ["1", "index_key", "512", "64"] and rows[4][-1] == "sub-page"
    assert rows[0][-1] == "page"


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"tokens_per_block": 6}, "tokens_per_block=6 must be a power of two"),
        ({"num_slots": 0}, "num_slots=0"),
        ({"alignment_bytes": 48}, "alignment_bytes=48"),
        ({"kernel_page_tokens": 8}, "kernel_page_tokens=8"),
        ({"layers": ()}, "layers is empty"),
    ],
)
def test_bad_engine_config_names_the_key(kwargs, message):
    base = {
        "tokens_per_block": 4,
        "layers": (AttentionLayerConfig.kv(0, 1, 4, "float16"),),
        "num_slots": 2,
    }
    with pytest.raises(ValueError, match=message):
        KVCacheManagerConfig(**{**base, **kwargs})


def test_bad_layer_configs_are_rejected_clearly():
    with pytest.raises(ValueError, match="dtype='float64'"):
        BufferConfig(DataRole.KEY, 1, 4, "float64")
    with pytest.raises(ValueError, match="needs both a 'key' and a 'value'"):
        AttentionLayerConfig(0, (BufferConfig(DataRole.KEY, 1, 4, "float16"),))
    with pytest.raises(ValueError, match="same heads"):
        AttentionLayerConfig(
            0,
            (
                BufferConfig(DataRole.KEY, 1, 4, "float16"),
                BufferConfig(DataRole.VALUE, 2, 4, "float16"),
            ),
        )
    with pytest.raises(ValueError, match="layer ids repeat"):
        KVCacheManagerConfig(4, (AttentionLayerConfig.kv(0, 1, 4, "float16"),) * 2, 2)
