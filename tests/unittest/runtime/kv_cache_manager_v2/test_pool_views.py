"""An independent oracle for the per-buffer views: byte offsets computed by hand from the documented
layout (layout.py), not through the layout code."""

import torch

from tensorrt_llm.runtime.kv_cache_manager_v2 import (
    AttentionLayerConfig,
    KVCacheManagerConfig,
    plan_storage,
)
from tensorrt_llm.runtime.kv_cache_manager_v2.pool import allocate_pools, buffer_view, kv_view

SLOT = 1152  # see test_layout.test_offsets_follow_layer_order_with_aligned_keys_and_adjacent_values
TPB = 4
# (layer, role) -> (byte offset in the slot, heads, head_dim), from the rules with alignment 64:
HAND = {
    (0, "key"): (0, 2, 8),
    (0, "value"): (128, 2, 8),
    (1, "key"): (256, 2, 8),
    (1, "value"): (384, 2, 8),
    (1, "index_key"): (512, 1, 8),
    (2, "key"): (576, 4, 8),
    (2, "value"): (832, 4, 8),
}


def setup():
    layers = (
        AttentionLayerConfig.kv(0, 2, 8, "float16"),
        AttentionLayerConfig.kv(1, 2, 8, "float16", index_key=(1, 8, "float16")),
        AttentionLayerConfig.kv(2, 4, 8, "float16", depends_on_next_token=True),
    )
    layout = plan_storage(
        KVCacheManagerConfig(TPB, layers, num_slots=5, alignment_bytes=64, kernel_page_tokens=2)
    )
    (pool,) = allocate_pools(layout, 5, "cpu")
    return layout, pool


def hand_byte(slot: int, layer: int, role: str, token: int, head: int, dim: int) -> int:
    offset, heads, head_dim = HAND[(layer, role)]
    return slot * SLOT + offset + ((token * heads + head) * head_dim + dim) * 2


def test_every_view_writes_exactly_where_the_documented_layout_says():
    layout, pool = setup()
    assert layout.pools[0].slot_bytes == SLOT
    slot_layout = layout.pools[0]
    flat = pool.view(-1)
    targets = [
        (0, "key", 3, 2, 1, 5),
        (0, "value", 4, 3, 0, 7),
        (1, "key", 0, 0, 1, 0),
        (1, "value", 2, 1, 1, 3),
        (1, "index_key", 1, 3, 0, 6),
        (2, "key", 4, 0, 3, 2),
        (2, "value", 3, 3, 2, 7),
    ]
    for i, (layer, role, slot, token, head, dim) in enumerate(targets):
        before = pool.clone()
        value = torch.tensor(float(i + 1), dtype=torch.float16)
        if role == "index_key":
            _, buf = layout.placement(layer, role)
            view = buffer_view(pool, slot_layout, buf)
            assert view.shape == (5, TPB, 1, 8)
            view[slot, token, head, dim] = value
        else:
            _, key = layout.placement(layer, "key")
            view = kv_view(pool, slot_layout, key)
            assert view.shape == (5, 2, TPB, HAND[(layer, "key")][1], 8)
            view[slot, 0 if role == "key" else 1, token, head, dim] = value
        at = hand_byte(slot, layer, role, token, head, dim)
        expected = value.reshape(1).view(
            torch.uint8
        )  # the two bytes of the fp16 value, little endian
        assert torch.equal(flat[at : at + 2], expected.reshape(-1)), (layer, role)
        changed = (flat != before.view(-1)).nonzero().flatten().tolist()
        assert set(changed) <= {at, at + 1} and changed, (layer, role, changed)


def test_views_alias_the_pool_with_slot_stride():
    layout, pool = setup()
    _, key = layout.placement(2, "key")
    view = kv_view(pool, layout.pools[0], key)
    assert view.data_ptr() == pool.data_ptr() + 576
    assert view.stride(0) * 2 == SLOT  # elements of fp16
    assert view.stride(1) * 2 == 256  # V follows K by K's bytes per block
    view.fill_(1.0009765625)  # 0x3C01: both bytes non-zero
    assert (
        int((pool != 0).sum()) == 5 * 512
    )  # K and V of the draft layer in every slot, nothing else


def test_views_of_a_slice_of_slots_start_at_the_slice():
    # a staging area cut into parts (one per source rank of a transfer): a view of a part must
    # read that part, not the start of the storage
    layout, pool = setup()
    pool.copy_(torch.arange(pool.numel(), dtype=torch.int64).remainder(251).view(pool.shape))
    _, key = layout.placement(2, "key")
    part, slot = pool[2:4], layout.pools[0]
    for view in (buffer_view, kv_view):
        # bit patterns (some are NaNs as fp16)
        assert torch.equal(
            view(part, slot, key).view(torch.int16), view(pool, slot, key)[2:4].view(torch.int16)
        )
