"""Rebuilding one parallel layout's slots from another's, on the real slot layouts of the bundled
model (target layers, MSA index-K, the Eagle3 draft layer) at TP1 and TP2: each rank gets exactly
its heads, and the round trip is exact to the byte in every buffer."""

import pytest
import torch
from disagg_helpers import bundled_manager

from tensorrt_llm._torch.disaggregation.head_regroup import (
    RankSlots,
    peer_layouts,
    regroup_heads,
    replicated,
    source_ranks,
)
from tensorrt_llm._torch.disaggregation.params import LayoutFingerprint, PoolFingerprint
from tensorrt_llm.runtime.kv_cache_manager_v2.pool import buffer_view

NUM_SLOTS = 3


def slot_layout(tp_size: int, rank: int, kv_dtype: str = "float32"):
    """The bundled model's unified slot layout on one rank of a TP layout."""
    (pool,) = bundled_manager(tp_size, rank, kv_dtype=kv_dtype).layout.pools
    return pool


def random_slots(layout, seed: int) -> RankSlots:
    generator = torch.Generator().manual_seed(seed)
    data = torch.randint(
        0, 256, (NUM_SLOTS, layout.slot_bytes), dtype=torch.uint8, generator=generator
    )
    return RankSlots(data, layout)


def empty(layout, rank: int, tp_size: int) -> RankSlots:
    return RankSlots(
        torch.zeros(NUM_SLOTS, layout.slot_bytes, dtype=torch.uint8), layout, rank, tp_size
    )


def same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Equal byte for byte (random bytes read as floats hold NaNs, which never compare equal)."""
    return torch.equal(a.view(torch.uint8), b.view(torch.uint8))


def buffers_equal(a: RankSlots, b: RankSlots) -> bool:
    return all(
        same_bits(buffer_view(a.slots, a.layout, buf), buffer_view(b.slots, b.layout, buf))
        for buf in a.layout.buffers
    )


@pytest.mark.parametrize("kv_dtype", ["float32", "fp8"])  # fp8: rows and their scales
def test_tp1_slots_split_into_tp2_ranks_and_back_exactly(kv_dtype):
    whole = random_slots(slot_layout(1, 0, kv_dtype), seed=1)
    halves = [empty(slot_layout(2, r, kv_dtype), r, 2) for r in range(2)]
    for half in halves:
        regroup_heads([whole], half)
    # rank r holds K/V heads r of the target's 2 and heads 2r, 2r+1 of the drafter's 4 (and
    # their scales); index-K (and its scales) whole
    for buf in halves[1].layout.buffers:
        got = buffer_view(halves[1].slots, halves[1].layout, buf)
        full = buffer_view(whole.slots, whole.layout, whole.buffer(buf.layer_id, buf.role))
        expected = full if replicated(buf.role) else full[:, :, buf.num_heads : 2 * buf.num_heads]
        assert same_bits(got, expected), (buf.layer_id, buf.role)
    rebuilt = empty(whole.layout, 0, 1)
    regroup_heads(halves, rebuilt)
    assert buffers_equal(rebuilt, whole)


def test_equal_layouts_copy_rank_to_rank():
    sources = [random_slots(slot_layout(2, r), seed=r) for r in range(2)]
    sources = [RankSlots(s.slots, s.layout, r, 2) for r, s in enumerate(sources)]
    for buf in sources[0].layout.buffers:  # index-K is the same on every rank (replicated)
        if buf.role.value == "index_key":
            buffer_view(sources[1].slots, sources[1].layout, buf).copy_(
                buffer_view(sources[0].slots, sources[0].layout, buf)
            )
    for r in range(2):
        dest = empty(sources[r].layout, r, 2)
        regroup_heads(sources, dest)
        assert buffers_equal(dest, sources[r])


def test_a_head_no_source_holds_is_an_error():
    half = slot_layout(2, 0)
    dest = empty(slot_layout(1, 0), 0, 1)
    with pytest.raises(ValueError, match=r"heads \[1\] are held by none of source ranks \[0\]"):
        regroup_heads([empty(half, 0, 2)], dest)
    with pytest.raises(ValueError, match="distinct ranks of one layout"):
        regroup_heads([empty(half, 0, 2), empty(half, 0, 2)], dest)
    with pytest.raises(ValueError, match="slots must be"):
        RankSlots(torch.zeros(2, 8, dtype=torch.uint8), half)


@pytest.mark.parametrize(
    ("dest_rank", "dest_tp", "source_tp", "expected"),
    [(0, 1, 2, [0, 1]), (1, 2, 1, [0]), (1, 2, 2, [1]), (1, 2, 4, [2, 3]), (2, 4, 2, [1])],
)
def test_source_ranks_are_those_holding_the_destinations_heads(
    dest_rank, dest_tp, source_tp, expected
):
    assert source_ranks(dest_rank, dest_tp, source_tp) == expected


def fingerprint_of(
    tp_size: int, attention_dp: bool = False, kv_dtype: str = "float32"
) -> LayoutFingerprint:
    layout = slot_layout(1 if attention_dp else tp_size, 0, kv_dtype)
    pool = PoolFingerprint(
        slot_bytes=layout.slot_bytes,
        buffers=[(b.layer_id, b.role.value, b.offset, b.size, b.dtype) for b in layout.buffers],
    )
    parallel = f"{'adp' if attention_dp else 'tp'}{tp_size}"
    return LayoutFingerprint.build(kv_dtype, 128, [0, 1, 2, 3], [3], [pool], parallel=parallel)


def test_a_peers_layout_is_rebuilt_from_its_fingerprint():
    # a TP1 generation rank rebuilds a TP2 context rank's slot layout exactly
    layouts, whole = peer_layouts(fingerprint_of(2), fingerprint_of(1), (slot_layout(1, 0),))
    (rebuilt,), real = layouts, slot_layout(2, 0)
    assert not whole and rebuilt.slot_bytes == real.slot_bytes

    def geometry(layout):
        return [(b.layer_id, b.role, b.offset, b.size, b.num_heads) for b in layout.buffers]

    assert geometry(rebuilt) == geometry(real)
    # TP1 -> attention DP: each rank holds every head, slots cross whole
    assert peer_layouts(fingerprint_of(1), fingerprint_of(2, True), (slot_layout(1, 0),))[1]
    assert peer_layouts(fingerprint_of(2), fingerprint_of(2), (slot_layout(2, 0),))[1]


def test_layouts_no_regrouping_bridges_are_refused():
    theirs = fingerprint_of(2).model_copy(update={"tokens_per_block": 64})
    with pytest.raises(ValueError, match="tokens_per_block: local 128 vs peer 64"):
        peer_layouts(theirs, fingerprint_of(1), (slot_layout(1, 0),))
    # the bundled model's 2 KV heads replicated over 4 ranks: 1 head x 4 ranks is not 2 x 1
    replicated = fingerprint_of(2).model_copy(update={"parallel": "tp4"})
    with pytest.raises(ValueError, match="replicated over ranks"):
        peer_layouts(replicated, fingerprint_of(1), (slot_layout(1, 0),))


def test_a_peer_of_another_kv_dtype_is_refused_naming_both():
    # issue 58: a TP2 float32 context rank and a TP1 bfloat16 generation rank: heads can be
    # regrouped, dtypes cannot (and the refusal says which server has which, not every buffer)
    mine = fingerprint_of(1, kv_dtype="bfloat16")
    with pytest.raises(ValueError) as refused:
        peer_layouts(fingerprint_of(2), mine, (slot_layout(1, 0, "bfloat16"),))
    assert str(refused.value) == (
        "context server KV dtype float32, generation server KV dtype bfloat16: KV cannot be "
        "transferred between different KV dtypes; start both with the same kv_cache_config.dtype"
    )
