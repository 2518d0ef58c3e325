"""Pulls between parallel layouts over NIXL, in one process: the bundled model's real slot layouts
at TP2 (two context ranks, each with its own agent, pools and tickets) and at TP1 / attention DP /
TP2 on the generation side. Each generation rank must end up with exactly its heads (index-K from
the context), whether its slots cross whole or through staging; a revoked ticket on any context
rank voids the pull. On the CPU (DRAM) in CI, and on GPUs (VRAM, rank r on cuda:r) where there are."""

import pytest
import torch
from disagg_helpers import bundled_manager, pulled

from tensorrt_llm._torch.disaggregation import pulls
from tensorrt_llm._torch.disaggregation.head_regroup import replicated
from tensorrt_llm._torch.disaggregation.params import TransferHandle
from tensorrt_llm._torch.disaggregation.transceiver import KvCacheTransceiver, StaleTransferError
from tensorrt_llm.runtime.kv_cache_manager_v2.pool import buffer_view

pytest.importorskip("nixl")
PROMPT = list(range(300))  # three blocks of 128 tokens
DEVICES = [
    "cpu",
    pytest.param(
        "cuda",
        marks=[
            pytest.mark.gpu,
            pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU"),
        ],
    ),
]


def manager(
    device: str,
    tp_size: int = 1,
    rank: int = 0,
    attention_dp: bool = False,
    shift: int = 3,
    kv_dtype: str = "float32",
):
    """The bundled model's unified KV manager of one rank, with ``PROMPT``'s slots allocated
    (from a free list rotated by ``shift``: the ranks of one server allocate the same slots, the
    two servers different ones)."""
    if device == "cuda":  # rank r on cuda:r, as a server places them, when there are GPUs enough
        device = f"cuda:{rank % torch.cuda.device_count()}"
    kv = bundled_manager(tp_size, rank, attention_dp, device, kv_dtype)
    kv.impl._pool._free.rotate(-shift)
    kv.add_sequence(0, PROMPT)
    assert kv.resize_sequence(0, len(PROMPT))
    return kv


def context_ranks(device: str, name: str, tp_size: int = 2, kv_dtype: str = "float32"):
    """A context server's ranks: random KV in ``PROMPT``'s slots, joined, holding request 0."""
    ranks = []
    for rank in range(tp_size):
        kv = manager(device, tp_size, rank, shift=1, kv_dtype=kv_dtype)
        for pool in kv.pools:
            generator = torch.Generator().manual_seed(10 + rank)
            pool.copy_(torch.randint(0, 256, pool.shape, dtype=torch.uint8, generator=generator))
        for buf in kv.layout.pools[0].buffers if ranks else ():  # index-K is replicated
            if replicated(buf.role):
                first = ranks[0].manager
                buffer_view(kv.pools[0], kv.layout.pools[0], buf).copy_(
                    buffer_view(first.pools[0], first.layout.pools[0], buf)
                )
        parallel = f"tp{tp_size}"
        ranks.append(KvCacheTransceiver(kv, f"{name}-r{rank}", parallel=parallel, rank=rank))
    endpoints = [t.endpoint() for t in ranks]
    for t in ranks:
        t.join_ranks(endpoints, b"k" * 32)
        t.hold(0)
    return ranks


def exported(ranks) -> TransferHandle:
    return TransferHandle.model_validate_json(ranks[0].export(0, 30.0).model_dump_json())


def heads_of(kv, buf, rank_slots):
    return buffer_view(kv.pools[0], kv.layout.pools[0], buf)[rank_slots].cpu()  # ranks' devices


def assert_holds_its_heads(gen, gen_rank: int, gen_ranks: int, ctx) -> None:
    """Every buffer of ``gen``'s slots of request 0 holds exactly the heads of its rank, as the
    context ranks ``ctx`` hold them (index-K and its scales: context rank 0's)."""
    slots = gen.get_batch_cache_indices([0])[0]
    for buf in gen.layout.pools[0].buffers:
        got = heads_of(gen, buf, slots)
        parts = []
        for t in ctx:
            kv = t.manager
            cbuf = kv.layout.placement(buf.layer_id, buf.role)[1]
            parts.append(heads_of(kv, cbuf, kv.get_batch_cache_indices([0])[0]))
        if replicated(buf.role):
            expected = parts[0]
        else:
            every_head = torch.cat(parts, dim=2)
            per_rank = every_head.shape[2] // gen_ranks
            expected = every_head[:, :, gen_rank * per_rank : (gen_rank + 1) * per_rank]
        assert torch.equal(got.view(torch.int32), expected.view(torch.int32)), (buf.layer_id, buf)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("kv_dtype", ["float32", "fp8"])  # fp8: rows and their scales
@pytest.mark.parametrize(
    ("gen_tp", "gen_rank", "attention_dp"),
    [(1, 0, False), (2, 1, True), (2, 0, False), (2, 1, False)],
    ids=["to-tp1", "to-adp2-rank1", "to-tp2-rank0", "to-tp2-rank1"],
)
def test_a_generation_rank_gets_exactly_its_heads_from_tp2(
    device, kv_dtype, gen_tp, gen_rank, attention_dp
):
    name = f"{kv_dtype}-{gen_tp}-{gen_rank}-{attention_dp}"
    ctx = context_ranks(device, f"ctx-{name}", kv_dtype=kv_dtype)
    gen = manager(device, gen_tp, gen_rank, attention_dp, kv_dtype=kv_dtype)
    parallel = f"{'adp' if attention_dp else 'tp'}{gen_tp}"
    receiver = KvCacheTransceiver(gen, f"gen-{name}", parallel=parallel, rank=gen_rank)
    handle = exported(ctx)
    whole = receiver.check_peer(handle)[1]
    assert whole == (gen_tp == 2 and not attention_dp)  # TP2 -> TP2: rank to rank, no staging
    receiver.pull(0, handle, num_blocks=3)
    ranks = 1 if attention_dp else gen_tp
    assert_holds_its_heads(gen, 0 if attention_dp else gen_rank, ranks, ctx)
    assert pulled(ctx[0]) == [0]  # the notification reaches context rank 0, which releases


@pytest.mark.parametrize("device", DEVICES)
def test_tp1_splits_into_tp2_ranks_in_chunks(device, monkeypatch):
    monkeypatch.setattr(pulls, "STAGING_BLOCKS", 2)  # 3 blocks: two rounds
    ctx = context_ranks(device, "ctx-tp1-split", tp_size=1)
    handle = exported(ctx)  # both generation ranks pull with it, then rank 0 confirms
    for rank in range(2):
        gen = manager(device, 2, rank)
        receiver = KvCacheTransceiver(gen, f"gen-split-{rank}", parallel="tp2", rank=rank)
        assert not receiver.check_peer(handle)[1]
        receiver.pull(0, handle, num_blocks=3, confirm=False)
        assert_holds_its_heads(gen, rank, 2, ctx)
    assert ctx[0].pulled_request_ids() == []  # nobody confirmed yet
    receiver.confirm(handle)
    assert pulled(ctx[0]) == [0]


def test_a_ticket_revoked_on_any_context_rank_voids_the_pull():
    ctx = context_ranks("cpu", "ctx-revoked")
    receiver = KvCacheTransceiver(manager("cpu"), "gen-revoked")
    handle = exported(ctx)
    ctx[1].revoke(0)  # rank 1 freed its slots (rank 0 told it to, or a step failed there)
    with pytest.raises(StaleTransferError, match="ended the hold"):
        receiver.pull(0, handle, num_blocks=3)


def test_context_ranks_hold_in_step_and_rank_0_writes_every_ranks_ticket():
    ctx = context_ranks("cpu", "ctx-tickets")
    handle = ctx[0].export(0, 30.0)
    assert [s.agent_name for s in handle.sources()] == ["ctx-tickets-r0", "ctx-tickets-r1"]
    for t, source in zip(ctx, handle.sources()):
        index = (source.ticket_address - t._tickets.data_ptr()) // 8
        assert int(t._tickets[index]) == source.ticket  # what that rank itself wrote
    with pytest.raises(ValueError, match="request 0 was exported already"):
        ctx[0].export(0, 30.0)  # a second export would need every rank to hold again
    with pytest.raises(ValueError, match="request 5 is not held"):
        ctx[0].export(5, 30.0)
