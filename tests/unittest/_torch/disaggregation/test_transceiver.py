"""Whole slots over NIXL (UCX, DRAM) between two managers: the drafter's sub-pages travel in the
same descriptors in unified mode, stay behind in separate mode; an incompatible peer is refused."""

import logging
from dataclasses import replace
from types import SimpleNamespace

import pytest
import torch
from disagg_helpers import pulled
from m3_helpers import executor_config, tiny_config

from tensorrt_llm._torch.disaggregation.params import TransferHandle
from tensorrt_llm._torch.disaggregation.transceiver import (
    MAX_HELD_TRANSFERS,
    KvCacheTransceiver,
    ReplayedHandleError,
    StaleTransferError,
)
from tensorrt_llm._torch.pyexecutor._util import create_kv_cache_managers
from tensorrt_llm._torch.pyexecutor.resource_manager import ResourceManagerType
from tensorrt_llm._torch.speculative.interface import Eagle3SpecConfig
from tensorrt_llm.runtime.kv_cache_manager_v2.pool import buffer_view

pytest.importorskip("nixl")
PROMPT = list(range(300))


def managers(draft_kv_cache="unified", draft_heads=4, kv_dtype="float32"):
    """What the creation site builds for a 2-layer M3 (layer 1 sparse) with a drafter of
    ``draft_heads`` KV heads: 8 slots of 128 tokens of ``kv_dtype``."""
    spec = Eagle3SpecConfig(3, "unused", draft_kv_cache=draft_kv_cache)
    runtime = executor_config(128, max_tokens=1024, max_seq_len=1024, max_batch_size=2, spec=spec)
    runtime = replace(runtime, kv_cache=replace(runtime.kv_cache, dtype=kv_dtype))
    built = create_kv_cache_managers(tiny_config(num_hidden_layers=2), runtime, (draft_heads, 8))
    return built[ResourceManagerType.KV_CACHE_MANAGER], built.get(
        ResourceManagerType.DRAFT_KV_CACHE_MANAGER
    )


def unified(draft_heads=4, kv_dtype="float32"):
    return managers("unified", draft_heads, kv_dtype)[0]


def prefilled(manager, seed):
    manager.add_sequence(0, PROMPT)
    assert manager.resize_sequence(0, len(PROMPT))
    for pool in manager.pools:
        pool.view(torch.float16).normal_(generator=torch.Generator().manual_seed(seed))
    return manager


@pytest.mark.parametrize("kv_dtype", ["float32", "fp8"])
def test_unified_slots_move_whole_with_the_drafters_subpages(kv_dtype):
    ctx = prefilled(unified(kv_dtype=kv_dtype), seed=1)
    gen = unified(kv_dtype=kv_dtype)
    gen.impl._pool._free.rotate(-3)  # different slot ids on the two sides
    gen.add_sequence(0, PROMPT)
    assert gen.resize_sequence(0, len(PROMPT))
    sender, receiver = (
        KvCacheTransceiver(ctx, "ctx-unified"),
        KvCacheTransceiver(gen, "gen-unified"),
    )
    handle = TransferHandle.model_validate_json(
        sender.export(0, 30.0).model_dump_json()
    )  # JSON only
    moved = receiver.pull(0, handle, num_blocks=3)
    assert moved == 3 * gen.slot_bytes()
    src, dst = ctx.get_batch_cache_indices([0])[0], gen.get_batch_cache_indices([0])[0]
    assert src != dst
    assert torch.equal(gen.pools[0][dst], ctx.pools[0][src])
    # every buffer of the layout arrived: the drafter's sub-pages, index-K and an FP8 cache's
    # scales (whole slots, no per-buffer code); as bytes (random FP8 bytes hold NaNs)
    (layout,) = gen.layout.pools
    held = {(buf.layer_id, buf.role.value) for buf in layout.buffers}
    draft = ctx.local_draft_layer_ids[0]
    assert {(draft, "key"), (draft, "value"), (1, "index_key")} <= held
    scales = {(1, "key_scale"), (1, "index_key_scale"), (draft, "value_scale")}
    assert (scales <= held) == (kv_dtype == "fp8")
    for buf in layout.buffers:
        got = buffer_view(gen.pools[0], layout, buf)[dst].view(torch.uint8)
        assert got.any() and torch.equal(
            got, buffer_view(ctx.pools[0], layout, buf)[src].view(torch.uint8)
        )
    assert pulled(sender) == [0]  # the context side learns which request to release


def test_only_a_live_transfers_id_releases_its_hold(monkeypatch, caplog):
    # issue 11, item 2: a notification naming a request id (the old format), a made-up transfer
    # id or garbage frees nothing and does not stop the real release beside it
    sender = KvCacheTransceiver(prefilled(unified(), seed=4), "ctx-notes")
    real = sender.export(0, 30.0).transfer_id
    forged = "A" * 32
    notes = {"gen": [b"pulled:0", b"hello", b"pulled:" + forged.encode(), b"pulled:\xff\x00"]}
    notes["gen"].append(b"pulled:" + real.encode())
    monkeypatch.setattr(sender.agent, "get_new_notifs", lambda: notes)
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="tensorrt_llm"):
        assert sender.pulled_request_ids() == [0]
    skipped = [r.getMessage() for r in caplog.records if r.name == "tensorrt_llm"]
    assert len(skipped) == 4 and all(m.startswith("ignoring a NIXL notification") for m in skipped)
    with caplog.at_level(logging.WARNING, logger="tensorrt_llm"):
        assert sender.pulled_request_ids() == []  # the same id again: the hold is gone


def receiving_pair(name):
    ctx = prefilled(unified(), seed=5)
    gen = unified()
    gen.add_sequence(0, PROMPT)
    assert gen.resize_sequence(0, len(PROMPT))
    return KvCacheTransceiver(ctx, f"ctx-{name}"), KvCacheTransceiver(gen, f"gen-{name}")


def test_a_handle_whose_hold_has_ended_is_refused_before_any_read():
    # issue 11, item 3: the context side frees the slots at the hold's end; a pull after it would
    # read whatever request got them next
    sender, receiver = receiving_pair("expired")
    handle = sender.export(0, hold_s=0.1)  # within the stale margin already
    with pytest.raises(StaleTransferError, match="ends in .* before the pull"):
        receiver.pull(0, handle, num_blocks=3)
    assert not receiver.manager.pools[0].any()  # nothing was read


def test_a_hold_revoked_during_the_pull_is_discarded(monkeypatch):
    # the context side timed out and freed the slots while the data was in flight: the data read
    # may be another request's, and only the ticket read back after it can tell
    sender, receiver = receiving_pair("late")
    handle = sender.export(0, hold_s=30.0)
    data_read = receiver._read_steps

    def read_then_context_frees(local, remote, mem_type, peer, notice, what, deadline, owner):
        yield from data_read(local, remote, mem_type, peer, notice, what, deadline, owner)
        if not notice:  # the data READ, not the ticket's
            sender.revoke(0)

    monkeypatch.setattr(receiver, "_read_steps", read_then_context_frees)
    with pytest.raises(StaleTransferError, match="ended the hold .* before the pull finished"):
        receiver.pull(0, handle, num_blocks=3)


def test_a_replay_on_another_generation_server_gets_no_data():
    # issue 11, acceptance 3: the first pull releases the hold, the slots go to another request,
    # then the same (validly signed) handle is sent to a second generation server
    sender, first = receiving_pair("replay-a")
    second = KvCacheTransceiver(receiving_pair("replay-b")[1].manager, "gen-replay-b2")
    handle = sender.export(0, hold_s=30.0)
    first.pull(0, handle, num_blocks=3)
    assert pulled(sender) == [0]
    sender.revoke(0)  # what the executor does before it frees the slots
    ctx = sender.manager
    ctx.free_resources(SimpleNamespace(request_id=0))
    ctx.add_sequence(1, [7] * 300)  # another request now owns the slots
    assert ctx.resize_sequence(1, 300)
    with pytest.raises(StaleTransferError, match="ended the hold"):
        second.pull(0, handle, num_blocks=3)


def test_tickets_are_reused_once_revoked():
    sender = KvCacheTransceiver(prefilled(unified(), seed=6), "ctx-tickets")
    first = sender.export(0, 30.0)
    assert sender._tickets[(first.ticket_address - sender._tickets.data_ptr()) // 8] == first.ticket
    again = sender.export(0, 30.0)  # a second export of the request ends its first transfer
    assert again.ticket != first.ticket and len(sender._holds) == 1
    sender.revoke(0)
    sender.revoke(0)  # idempotent
    assert not sender._tickets.any() and len(sender._free_tickets) == MAX_HELD_TRANSFERS


def test_a_handle_serves_one_pull():
    # a replayed handle: the first pull's notification may already have freed the slots
    sender, receiver = receiving_pair("replay")
    handle = sender.export(0, hold_s=30.0)
    receiver.pull(0, handle, num_blocks=3)
    with pytest.raises(ReplayedHandleError, match="already pulled"):
        receiver.pull(0, handle, num_blocks=3)


def test_an_incompatible_peer_is_refused_with_the_difference():
    ctx = prefilled(unified(draft_heads=4), seed=2)
    gen = unified(draft_heads=2)
    gen.add_sequence(0, PROMPT)
    gen.resize_sequence(0, len(PROMPT))
    receiver = KvCacheTransceiver(gen, "gen-mismatch")
    with pytest.raises(
        ValueError,
        match="incompatible KV cache layout on peer 'ctx-mismatch': pool 0 layer 2 key: 4 heads",
    ):
        receiver.pull(0, KvCacheTransceiver(ctx, "ctx-mismatch").export(0, 30.0), num_blocks=3)


@pytest.mark.parametrize(
    ("ctx_dtype", "gen_dtype"),
    [("fp8", "bfloat16"), ("bfloat16", "fp8"), ("bfloat16", "float16"), ("float32", "bfloat16")],
)
def test_servers_of_different_kv_dtypes_are_refused_naming_both(ctx_dtype, gen_dtype):
    # issue 58, item 4: bf16 and fp16 slots have the same bytes, so only the dtype tells them
    # apart (fp8's slots hold scale buffers too); the refusal names which server has which,
    # before any slot is read
    ctx = prefilled(unified(kv_dtype=ctx_dtype), seed=7)
    gen = unified(kv_dtype=gen_dtype)
    gen.add_sequence(0, PROMPT)
    assert gen.resize_sequence(0, len(PROMPT))
    sender = KvCacheTransceiver(ctx, f"ctx-{ctx_dtype}")
    receiver = KvCacheTransceiver(gen, f"gen-{gen_dtype}")
    handle = TransferHandle.model_validate_json(sender.export(0, 30.0).model_dump_json())
    assert handle.fingerprint.kv_dtype == ctx_dtype
    with pytest.raises(ValueError) as refused:
        receiver.pull(0, handle, num_blocks=3)
    assert str(refused.value) == (
        f"incompatible KV cache layout on peer 'ctx-{ctx_dtype}': context server KV dtype "
        f"{ctx_dtype}, generation server KV dtype {gen_dtype}: KV cannot be transferred between "
        "different KV dtypes; start both with the same kv_cache_config.dtype"
    )
    assert not gen.pools[0].any()  # nothing was read


def test_separate_mode_moves_the_target_only():
    def prefilled_pair(seed=None):
        target, draft = managers("separate")
        for m in (target, draft):
            m.add_sequence(0, PROMPT)
            m.resize_sequence(0, len(PROMPT))
            if seed is not None:
                m.pools[0].view(torch.float16).normal_(
                    generator=torch.Generator().manual_seed(seed)
                )
        return target, draft

    ctx_target, ctx_draft = prefilled_pair(seed=3)
    gen_target, gen_draft = prefilled_pair()
    sender, receiver = (
        KvCacheTransceiver(ctx_target, "ctx-sep"),
        KvCacheTransceiver(gen_target, "gen-sep"),
    )
    receiver.pull(0, sender.export(0, 30.0), num_blocks=3)
    slots = gen_target.get_batch_cache_indices([0])[0]
    assert torch.equal(
        gen_target.pools[0][slots], ctx_target.pools[0][ctx_target.get_batch_cache_indices([0])[0]]
    )
    draft_slots = gen_draft.get_batch_cache_indices([0])[0]
    assert not gen_draft.pools[0][draft_slots].any()  # nothing moved the separate drafter's KV


def test_a_release_frees_the_hold_without_a_read():
    sender, receiver = receiving_pair("release")
    handle = sender.export(0, hold_s=30.0)
    receiver.release(handle)
    assert pulled(sender) == [0]
    assert not receiver.manager.pools[0].any()  # nothing was read


def test_a_read_nixl_cannot_cancel_keeps_what_it_writes_until_it_ends(monkeypatch):
    # a pull given up while its READ is in flight (a cancel, a timeout): NIXL may refuse to
    # release a transfer it cannot cancel; the slots, staging and ticket row it may still write
    # are then not reused until it has ended
    sender, receiver = receiving_pair("parked")
    handle = sender.export(0, hold_s=30.0)
    agent, in_flight = receiver.agent, {"left": 3}
    state, release, start = agent.check_xfer_state, agent.release_xfer_handle, agent.transfer

    def transfer(xfer):  # (a READ over loopback may end before the call returns)
        started = start(xfer)
        return "PROC" if in_flight["left"] else started

    def check_state(xfer):
        if in_flight["left"]:
            in_flight["left"] -= 1
            return "PROC"
        return state(xfer)

    def release_unless_in_flight(xfer):
        if in_flight["left"]:
            raise RuntimeError("NIXL_ERR_REPOST_ACTIVE")
        release(xfer)

    monkeypatch.setattr(agent, "transfer", transfer)
    monkeypatch.setattr(agent, "check_xfer_state", check_state)
    monkeypatch.setattr(agent, "release_xfer_handle", release_unless_in_flight)
    pull = receiver.pull_steps(0, handle, num_blocks=3)
    next(pull)  # the data READ is in flight
    rows = len(receiver._free_ticket_rows)
    pull.close()  # given up: the READ cannot be cancelled
    assert not receiver.settle(0) and len(receiver._parked[0]) == 1
    while not receiver.settle(0):  # until the READ ends
        pass
    assert not receiver._parked and len(receiver._free_ticket_rows) == rows
    assert handle.transfer_id not in receiver._pulling
