"""The Mapping's arithmetic, the weight shards of the parallel linears, and the JSON commands that
carry requests to the other ranks."""

import json
from types import SimpleNamespace

import pytest
import torch

from tensorrt_llm._torch.distributed.mapping import Mapping
from tensorrt_llm._torch.executors import commands, data_parallel
from tensorrt_llm._torch.executors.affinity import PrefixAffinity, choose_rank
from tensorrt_llm._torch.executors.ranks import request_from_json, submit_command
from tensorrt_llm._torch.modules.linear import ColumnParallelLinear, RowParallelLinear, shard_weight
from tensorrt_llm._torch.pyexecutor.executor import ExecutorStats
from tensorrt_llm._torch.pyexecutor.llm_request import FinishReason, LlmRequest
from tensorrt_llm.sampling_params import SamplingParams


def test_tensor_parallelism_splits_the_weights_and_attention_dp_replicates_them():
    tp = Mapping(world_size=4, tp_size=4, rank=3)
    assert (tp.attn_tp_size, tp.attn_tp_rank, tp.dp_size, tp.describe()) == (
        4,
        3,
        1,
        "tp4-ep1-moetp4",
    )
    adp = Mapping(world_size=4, tp_size=4, rank=3, enable_attention_dp=True)
    assert (adp.attn_tp_size, adp.attn_tp_rank, adp.dp_size, adp.describe()) == (
        1,
        0,
        4,
        "adp4-ep1-moetp1",
    )
    assert adp.shard(6, "num_attention_heads") == 6
    with pytest.raises(
        ValueError, match="num_attention_heads=6 is not divisible by tensor_parallel_size=4"
    ):
        tp.shard(6, "num_attention_heads")
    with pytest.raises(ValueError, match="rank=2 is not in"):
        Mapping(world_size=2, tp_size=2, rank=2)
    with pytest.raises(ValueError, match="no pipeline parallelism"):
        Mapping(world_size=4, tp_size=2)


def test_the_moe_layout_splits_experts_and_intermediates_over_the_ranks():
    # TP4 as EP2 x MoE TP2: rank r is expert group r // 2, intermediate slice r % 2
    layouts = [Mapping(4, 4, r, moe_ep_size=2) for r in range(4)]
    assert [(m.moe_tp_size, m.moe_ep_rank, m.moe_tp_rank) for m in layouts] == [
        (2, 0, 0),
        (2, 0, 1),
        (2, 1, 0),
        (2, 1, 1),
    ]
    assert [m.local_experts(8) for m in layouts] == [range(0, 4)] * 2 + [range(4, 8)] * 2
    assert layouts[3].moe_shard(32) == 16 and layouts[3].describe() == "tp4-ep2-moetp2"
    # either size alone gives the other; attention DP replicates the experts unless split whole
    assert (Mapping(2, 2, 0, moe_tp_size=1).moe_ep_size, Mapping(2, 2, 0).moe_tp_size) == (2, 2)
    adp = Mapping(2, 2, 1, enable_attention_dp=True)
    assert (adp.moe_ep_size, adp.moe_tp_size, adp.moe_all_to_all) == (1, 1, False)
    assert adp.local_experts(8) == range(0, 8)  # every rank holds every expert
    adp_ep = Mapping(2, 2, 1, enable_attention_dp=True, moe_ep_size=2)
    assert (adp_ep.local_experts(8), adp_ep.moe_all_to_all) == (range(4, 8), True)
    assert not Mapping(2, 2, 1, moe_ep_size=2).moe_all_to_all  # TP attention: one all-reduce


@pytest.mark.parametrize(
    "layout, error",
    [
        (dict(moe_ep_size=4), "moe_expert_parallel_size=4 does not divide tensor_parallel_size=2"),
        (dict(moe_tp_size=3), "moe_tensor_parallel_size=3 does not divide"),
        (dict(moe_ep_size=0), "moe_expert_parallel_size=0 must be >= 1"),
        (
            dict(moe_ep_size=1, moe_tp_size=1),
            r"moe_expert_parallel_size \* moe_tensor_parallel_size != tensor_parallel_size: "
            r"1 \* 1 != 2",
        ),
        (
            dict(enable_attention_dp=True, moe_tp_size=2),
            "moe_tensor_parallel_size=2 with enable_attention_dp: .* set "
            "moe_expert_parallel_size=2",
        ),
    ],
)
def test_a_moe_layout_that_cannot_be_served_names_the_options_and_the_rule(layout, error):
    with pytest.raises(ValueError, match=error):
        Mapping(2, 2, 0, **layout)


def test_experts_or_intermediates_that_do_not_split_evenly_are_a_clear_error():
    with pytest.raises(ValueError, match="num_local_experts=6 is not divisible by moe_expert_par"):
        Mapping(4, 4, 0, moe_ep_size=4).local_experts(6)
    with pytest.raises(ValueError, match="intermediate_size=30 .* moe_tensor_parallel_size=4"):
        Mapping(4, 4, 0).moe_shard(30)
    with pytest.raises(ValueError, match="under attention DP the experts are split over every"):
        Mapping(4, 4, 0, enable_attention_dp=True, moe_ep_size=2)


def test_fewer_kv_heads_than_ranks_are_replicated_over_the_ranks_that_read_them():
    # 2 KV heads over 4 ranks: ranks 0, 1 hold head 0 and ranks 2, 3 head 1 (query heads 0-3)
    shards = [Mapping(4, 4, r).kv_head_shard(2, "num_key_value_heads") for r in range(4)]
    assert shards == [(1, 2, 0), (1, 2, 0), (1, 2, 1), (1, 2, 1)]
    assert Mapping(2, 2, 1).kv_head_shard(4, "kv") == (2, 2, 1)
    with pytest.raises(ValueError, match="num_key_value_heads=3 and tensor_parallel_size=2"):
        Mapping(2, 2, 0).kv_head_shard(3, "num_key_value_heads")
    column = ColumnParallelLinear(8, 2 * 3, Mapping(4, 4, 3), "kv", shards=(2, 1))
    full = torch.arange(6 * 8, dtype=torch.float32).reshape(6, 8)
    assert torch.equal(shard_weight(column, full), full[3:])


def test_column_shards_split_the_output_rows_and_row_shards_the_input_columns():
    full = torch.arange(8 * 6, dtype=torch.float32).reshape(8, 6)  # [out, in]
    for rank in range(2):
        mapping = Mapping(world_size=2, tp_size=2, rank=rank)
        column = ColumnParallelLinear(6, 8, mapping, "x")
        row = RowParallelLinear(8, 6, mapping, "x")
        assert column.weight.shape == (4, 6) and row.weight.shape == (6, 4)
        assert torch.equal(shard_weight(column, full), full[4 * rank : 4 * rank + 4])
        assert torch.equal(shard_weight(row, full.T), full.T[:, 4 * rank : 4 * rank + 4])
    assert shard_weight(torch.nn.Linear(6, 8), full) is full  # not split


def test_a_request_crosses_to_another_rank_intact_and_a_sampled_one_with_a_seed():
    params = SamplingParams(
        max_tokens=9, temperature=0.7, top_p=0.9, stop=["x"], logit_bias={3: 1.5}, logprobs=2
    )
    request = LlmRequest(7, [1, 2, 3], 9, params, end_ids=(2,), cache_salt="s")
    command = submit_command(request, rank=1)
    assert command.rank == 1
    wire = json.loads(json.dumps(commands.to_json(command)))  # as the control group carries it
    received = commands.from_json(wire)
    assert isinstance(received, commands.SubmitCommand) and received.rank == 1
    copy = request_from_json(received.request)
    seed = command.request["sampling_params"]["seed"]
    assert isinstance(seed, int) and request.seed == seed
    assert copy.sampling_params.logit_bias == {3: 1.5}
    assert (copy.request_id, copy.prompt_token_ids, copy.end_ids, copy.cache_salt) == (
        7,
        [1, 2, 3],
        (2,),
        "s",
    )
    assert copy.seed == request.seed  # both ranks now draw the same tokens
    greedy = LlmRequest(8, [1], 4, SamplingParams(max_tokens=4))
    assert submit_command(greedy, rank=0).request["sampling_params"]["seed"] is None


def test_every_rank_command_crosses_as_json_and_a_bad_one_is_an_error_naming_it():
    sent = [
        commands.CancelCommand(1, 7),
        commands.ReleaseCommand([3, 4]),
        commands.ShutdownCommand(),
    ]
    assert [commands.from_json(json.loads(json.dumps(commands.to_json(c)))) for c in sent] == sent
    assert [commands.is_for(c, 0) for c in sent] == [False, True, True]
    with pytest.raises(ValueError, match="rank command of kind 'reboot'; known: "):
        commands.from_json({"kind": "reboot", "rank": 0})
    with pytest.raises(ValueError, match="rank command 'cancel': .*request_id"):
        commands.from_json({"kind": "cancel", "rank": 0})


def test_prefix_affinity_finds_the_rank_of_the_longest_block_aligned_prefix():
    affinity = PrefixAffinity(tokens_per_block=4, capacity=6)
    first, other = list(range(10)), [9] * 8
    assert affinity.rank_for(first) is None
    affinity.record(first, 1)  # blocks [0..3], [0..7]
    affinity.record(first[:4] + [7] * 4, 0)  # the same first block, then another
    assert affinity.rank_for(first + [5, 5]) == 1  # two blocks in common with rank 1's
    assert affinity.rank_for(first[:4] + [7] * 4 + [1]) == 0
    assert affinity.rank_for(first[:3]) is None  # no full block
    assert affinity.rank_for(other) is None
    for i in range(3):  # bounded: the oldest prefixes go first
        affinity.record([100 + i] * 8, 0)
    assert affinity.rank_for(first) is None


def test_a_preferred_rank_is_kept_until_it_is_half_a_batch_ahead():
    assert choose_rank([3, 1], preferred=0, slack=2) == 0
    assert choose_rank([4, 1], preferred=0, slack=2) == 1
    assert choose_rank([2, 2, 1], preferred=None, slack=2) == 2
    assert choose_rank([1, 1], preferred=None, slack=2) == 0


def test_a_follower_reports_a_request_that_a_failed_step_ended(monkeypatch):
    """Attention DP: a request ended by a failed step is gone from the follower's executor, but
    its end still reaches rank 0's shadow (which would otherwise wait forever)."""
    sent = []
    monkeypatch.setattr(data_parallel, "gather_json", lambda report, world: sent.append(report))
    request = LlmRequest(3, [1, 2], 4, SamplingParams(max_tokens=4))
    no_moe = SimpleNamespace(expert_tokens=lambda: None)
    executor = SimpleNamespace(active=[request], stats=ExecutorStats(), model_engine=no_moe)
    reporter = data_parallel.ProgressReporter(executor, Mapping(2, 2, 1, True))
    reporter.before_step([])
    request.output_token_ids.append(7)  # the step made a token
    reporter.after_step()
    reporter.before_step([])
    request.finish(FinishReason.ERROR)  # the next step failed: the executor ended and dropped it
    executor.active = []
    reporter.after_step()
    reporter.after_step()  # reported once
    shadow = LlmRequest(3, [1, 2], 4, SamplingParams(max_tokens=4))
    for report in sent:
        for update in report["requests"]:
            data_parallel.apply_update(shadow, update)
    assert [len(r["requests"]) for r in sent] == [1, 1, 0]
    assert shadow.output_token_ids == [7] and shadow.finish_reason is FinishReason.ERROR


def test_attention_dp_refuses_context_only_requests_with_a_clear_error():
    local = SimpleNamespace(
        kv_cache_manager=SimpleNamespace(tokens_per_block=128),
        scheduler=SimpleNamespace(max_batch_size=4),
    )
    executor = data_parallel.AttentionDpExecutor(local, Mapping(2, 2, 0, True), lambda: None)
    request = LlmRequest(3, [1, 2], 4, SamplingParams(max_tokens=4), context_only=True)
    with pytest.raises(ValueError, match="context-only requests need a context server without"):
        executor.enqueue_request(request)
