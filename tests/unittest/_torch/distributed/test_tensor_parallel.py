"""Several ranks on the CPU, over gloo: tensor parallelism decodes as one rank (target only and
Eagle3 with the unified and the separate draft cache), attention DP spreads the requests and
decodes as one rank, and the ranks stay together through sampling and cancellations."""

import random
import threading
import time

import pytest

from tensorrt_llm import LLM, SamplingParams
from tensorrt_llm._torch.executors.data_parallel import AttentionDpExecutor
from tensorrt_llm._torch.speculative.utils import VIEW_MODE
from tensorrt_llm.bundled import BUNDLED_DRAFT
from tensorrt_llm.evaluate.runner import run_multiturn_copy
from tensorrt_llm.evaluate.tasks import gsm8k_tiny
from tensorrt_llm.llmapi import Eagle3DecodingConfig, GenerationRequest, KvCacheConfig

pytestmark = pytest.mark.slow
GREEDY = SamplingParams(max_tokens=40, temperature=0)


def spec(draft_kv_cache: str | None) -> Eagle3DecodingConfig | None:
    if draft_kv_cache is None:
        return None
    return Eagle3DecodingConfig(
        max_draft_len=3, speculative_model=str(BUNDLED_DRAFT), draft_kv_cache=draft_kv_cache
    )


def make_llm(draft_kv_cache: str | None = "unified", kv_dtype: str = "auto", **parallel) -> LLM:
    return LLM(
        device="cpu",
        speculative_config=spec(draft_kv_cache),
        kv_cache_config=KvCacheConfig(max_tokens=128 * 32, dtype=kv_dtype),
        **parallel,
    )


def prompts(llm: LLM, count: int = 6) -> list[str]:
    rng = random.Random(3)
    return [llm.tokenizer.apply_chat_template(gsm8k_tiny(rng)[0][:1]) for _ in range(count)]


def decode(draft_kv_cache: str | None, **parallel) -> list[tuple[list[int], float | None]]:
    with make_llm(draft_kv_cache, **parallel) as llm:
        outputs = llm.generate(prompts(llm), GREEDY)
    return [(o.outputs[0].token_ids, o.outputs[0].avg_decoded_tokens_per_iter) for o in outputs]


@pytest.fixture(scope="module")
def one_rank() -> dict:
    return {mode: decode(mode) for mode in (None, "unified", "separate")}


@pytest.mark.parametrize("draft_kv_cache", [None, "unified", "separate"])
def test_tp2_decodes_the_same_tokens_and_al_as_one_rank(one_rank, draft_kv_cache):
    assert decode(draft_kv_cache, tensor_parallel_size=2) == one_rank[draft_kv_cache]


@pytest.mark.parametrize("draft_kv_cache", [None, "unified"])
def test_tp4_with_fewer_kv_heads_than_ranks_decodes_as_one_rank(one_rank, draft_kv_cache):
    """The bundled target has 2 KV heads: at TP4 each is replicated on the two ranks whose query
    heads read it (the drafter's 4 split one per rank)."""
    assert decode(draft_kv_cache, tensor_parallel_size=4) == one_rank[draft_kv_cache]


def test_each_tp_rank_caches_its_own_kv_heads_beside_the_drafters_sub_pages():
    slot_bytes = {}
    for tp in (1, 2):
        with make_llm(tensor_parallel_size=tp) as llm:
            manager = llm.kv_cache_manager  # rank 0's
            heads = [(layer.num_kv_heads, layer.index_head_dim) for layer in manager.config.layers]
            slot_bytes[tp] = manager.layout.pools[0].slot_bytes
            llm.generate(prompts(llm, 1), GREEDY)
            assert llm.executor.spec_worker.draft_kv_mode == VIEW_MODE  # unified, per rank
        if tp == 2:  # K/V heads halved; the one index-K head is replicated (the indexer is)
            assert heads == [(1, 0), (1, 32), (1, 0), (1, 32), (4, 0)]  # sparse layers 1 and 3
    # half the K/V bytes, all the index-K bytes (2 sparse layers x 128 tokens x 32 x fp32), aligned
    assert (slot_bytes[1], slot_bytes[2]) == (819200, 425984)


def decode_fp8(**parallel) -> list[tuple[list[int], float | None]]:
    """Eagle3 on the unified cache at FP8 KV (``KvCacheConfig(dtype="fp8")``): rank 0's K/V
    heads, replicated index keys and the drafter's sub-pages in float8_e4m3fn with their scales."""
    from tensorrt_llm.runtime.kv_cache_manager_v2 import DataRole

    with make_llm("unified", kv_dtype="fp8", **parallel) as llm:
        buffers = llm.kv_cache_manager.layout.pools[0].buffers
        rows = [b for b in buffers if not b.role.is_scale]
        assert {b.dtype for b in rows} == {"float8_e4m3fn"} and any(b.is_subpage for b in rows)
        scales = {b.role for b in buffers if b.role.is_scale}
        assert scales == {DataRole.KEY_SCALE, DataRole.VALUE_SCALE, DataRole.INDEX_KEY_SCALE}
        outputs = llm.generate(prompts(llm, 3), GREEDY)
    return [(o.outputs[0].token_ids, o.outputs[0].avg_decoded_tokens_per_iter) for o in outputs]


@pytest.fixture(scope="module")
def one_rank_fp8() -> list[tuple[list[int], float | None]]:
    return decode_fp8()


@pytest.mark.parametrize(
    "parallel",
    [{"tensor_parallel_size": 2}, {"tensor_parallel_size": 2, "enable_attention_dp": True}],
    ids=["tp2", "adp2"],
)
def test_an_fp8_kv_cache_decodes_as_one_rank(one_rank_fp8, parallel):
    assert decode_fp8(**parallel) == one_rank_fp8


def test_adp2_spreads_the_requests_and_decodes_as_one_rank(one_rank):
    with make_llm(tensor_parallel_size=2, enable_attention_dp=True) as llm:
        assert isinstance(llm.executor, AttentionDpExecutor)
        outputs = llm.generate(prompts(llm), GREEDY)
        stats = llm.executor.stats
        local = llm.executor.local.stats
        # both ranks decoded: rank 0's own count is part of the total, not all of it
        assert 0 < local.num_generated_tokens < stats.num_generated_tokens
        assert stats.num_generated_tokens == sum(len(o.outputs[0].token_ids) for o in outputs)
    got = [(o.outputs[0].token_ids, o.outputs[0].avg_decoded_tokens_per_iter) for o in outputs]
    assert got == one_rank["unified"]


@pytest.mark.parametrize("parallel", [{}, {"enable_attention_dp": True}], ids=["tp2", "adp2"])
def test_sampling_and_cancellations_keep_the_ranks_together(one_rank, parallel):
    import re

    from tensorrt_llm import GuidedDecodingParams

    with make_llm(tensor_parallel_size=2, guided_decoding_backend="xgrammar", **parallel) as llm:
        texts = prompts(llm)
        # a grammar compiles on every rank alike (under TP, at once: their schedules agree)
        pattern = r"[0-9]{1,3} (\+|-) [0-9]{1,3}: the sum is [0-9]{1,4}\."
        guide = GuidedDecodingParams(regex=pattern)
        guided = llm.generate(texts[:2], SamplingParams(max_tokens=40, guided_decoding=guide))
        assert all(re.fullmatch(pattern, o.outputs[0].text) for o in guided)
        sampled = SamplingParams(max_tokens=12, temperature=1.0)  # unseeded: rank 0 seeds it
        seeded = SamplingParams(max_tokens=12, temperature=1.0, seed=5)
        first = llm.generate(texts[:2], [sampled, seeded])
        assert all(len(o.outputs[0].token_ids) == 12 for o in first)
        assert llm.generate(texts[1], seeded).outputs[0].token_ids == first[1].outputs[0].token_ids
        # cancel one request mid-decode, as the server does for a client that went away
        ids, outputs, done = [], {}, threading.Event()

        def follow(output):  # on the engine loop's thread, between steps
            outputs[output.request_id] = output
            mid_decode = output.outputs[0].token_ids and not output.finished
            if len(ids) == 3 and output.request_id == ids[1] and mid_decode:
                llm.cancel(ids[1])  # (once more for each step until it lands: a no-op)
            if len(ids) == 3 and all(i in outputs and outputs[i].finished for i in ids):
                done.set()

        ids += [llm.submit(GenerationRequest(text, GREEDY), follow) for text in texts[:3]]
        assert done.wait(60)
        final = [outputs[i].outputs[0] for i in ids]
        assert final[1].finish_reason == "cancelled" and len(final[1].token_ids) < 12
        assert [final[0].token_ids, final[2].token_ids] == [
            one_rank["unified"][0][0],
            one_rank["unified"][2][0],
        ]
        # and afterwards the ranks still agree on everything
        again = llm.generate(texts, GREEDY)
    assert [o.outputs[0].token_ids for o in again] == [t for t, _ in one_rank["unified"]]


def test_the_separate_draft_cache_is_refused_under_attention_dp():
    with pytest.raises(ValueError, match="draft_kv_cache='separate' is not supported with"):
        make_llm("separate", tensor_parallel_size=2, enable_attention_dp=True)


def test_heads_that_do_not_split_evenly_are_a_clear_error():
    with pytest.raises(
        ValueError, match=r"num_attention_heads=4 is not divisible by tensor_parallel_size=3"
    ):
        make_llm(None, tensor_parallel_size=3)


@pytest.mark.parametrize("parallel", [{}, {"enable_attention_dp": True}], ids=["tp2", "adp2"])
def test_a_rank_that_dies_ends_the_requests_with_an_error_not_a_hang(parallel):
    llm = make_llm(tensor_parallel_size=2, **parallel)
    follower = llm._followers._processes[0]
    outputs, done = {}, threading.Event()

    def follow(output):  # on the engine loop's thread, between steps
        if not outputs:  # after the first step: rank 1 dies
            follower.kill()
            follower.join()
        outputs[output.request_id] = output
        if len(outputs) == 4 and all(o.finished for o in outputs.values()):
            done.set()

    for text in prompts(llm, 4):
        llm.submit(GenerationRequest(text, GREEDY), follow)
    assert done.wait(60)
    assert llm.lost_rank() == "rank 1 exited (code -9)"
    assert [o.outputs[0].finish_reason for o in outputs.values()] == ["error"] * 4
    assert llm.get_stats()["active_requests"] == 0
    started = time.monotonic()
    llm.shutdown()
    assert time.monotonic() - started < 10


def test_adp2_keeps_each_conversation_on_one_rank_so_reused_turns_keep_their_al():
    """The AL table's multi-turn rows under attention DP: turns 2-4 land where turn 1 ran, reuse
    its KV (the drafter's included) and decode as one rank does."""
    results = {}
    for name, parallel in (("one", {}), ("adp2", {"enable_attention_dp": True})):
        with make_llm(tensor_parallel_size=2 if parallel else 1, **parallel) as llm:
            results[name] = run_multiturn_copy(llm, 4, progress=lambda _: None)
    one, adp2 = results["one"], results["adp2"]
    assert [t.token_ids for t in adp2] == [t.token_ids for t in one]
    assert [t.reused_tokens for t in adp2] == [t.reused_tokens for t in one]
    assert sum(t.reused_tokens for t in adp2[1:]) > 0  # the later turns hit the cache
    assert [t.al for t in adp2] == pytest.approx([t.al for t in one])


def test_adp2_sends_a_later_turn_to_the_rank_that_holds_its_prefix():
    """Two conversations opened one after the other both land on rank 0 (both ranks idle each
    time); their next turns, sent together, would split over the ranks by load alone, and the one
    sent to rank 1 would find nothing to reuse."""
    openings = [f"Remember the list {i}: " + "red moon 4821 fish gold " * 12 for i in range(2)]
    reused = {}
    for name, parallel in (("one", {}), ("adp2", {"enable_attention_dp": True})):
        with make_llm(tensor_parallel_size=2 if parallel else 1, **parallel) as llm:
            for text in openings:
                llm.generate(text, GREEDY)
            before = llm.executor.stats.num_reused_tokens
            llm.generate([text + " And again?" for text in openings], GREEDY)
            reused[name] = llm.executor.stats.num_reused_tokens - before
    assert reused["adp2"] == reused["one"] >= 2 * 128


@pytest.mark.parametrize(
    "parallel",
    [
        {"tensor_parallel_size": 2},
        {"tensor_parallel_size": 2, "enable_attention_dp": True, "moe_expert_parallel_size": 2},
    ],
    ids=["tp2", "adp2-ep2"],
)
def test_mtp_decodes_as_one_rank(tmp_path, parallel):
    """MiniMax-M3's MTP module as the drafter: its attention heads split over the ranks, its
    MoE's tokens exchanged between them (a rank with no rows takes part in each chain step's
    exchange), the same tokens and AL as one rank."""
    import sys
    from pathlib import Path

    sys.path.insert(0, str(Path(__file__).parents[2] / "llmapi"))
    from llm_helpers import write_tiny_checkpoint

    from tensorrt_llm import MTPDecodingConfig

    model_dir = write_tiny_checkpoint(tmp_path, seed=5, num_mtp_modules=1)
    texts = ["hello world", "the cat sat on", "abc abc abc abc", "zz top"]
    params = SamplingParams(max_tokens=16, temperature=0)

    def run(**options):
        spec = MTPDecodingConfig(max_draft_len=3)
        with LLM(model=str(model_dir), device="cpu", speculative_config=spec, **options) as llm:
            outputs = llm.generate(texts, params)
        return [(o.outputs[0].token_ids, o.outputs[0].avg_decoded_tokens_per_iter) for o in outputs]

    assert run(**parallel) == run()
