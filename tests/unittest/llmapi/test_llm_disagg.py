"""Disaggregated context -> generation in one process (two LLMs, two NIXL agents over UCX): the
generation side pulls the prompt's slots, runs no prefill, and decodes what the aggregated LLM
decodes; the drafter's KV travels in unified mode (AL kept) and not in separate mode (AL drops)."""

import json
import os
import random
import time

import pytest

from tensorrt_llm import LLM, SamplingParams
from tensorrt_llm._torch.disaggregation.params import RequestType
from tensorrt_llm._torch.pyexecutor.llm_request import FinishReason
from tensorrt_llm.bundled import BUNDLED_DRAFT
from tensorrt_llm.evaluate.tasks import gsm8k_tiny
from tensorrt_llm.llmapi.llm import GenerationRequest
from tensorrt_llm.llmapi.llm_args import CacheTransceiverConfig, Eagle3DecodingConfig, KvCacheConfig

pytest.importorskip("nixl")
GREEDY = SamplingParams(max_tokens=100)


def make(mode, disagg, **options):
    return LLM(
        device="cpu",
        max_batch_size=16,
        kv_cache_config=KvCacheConfig(max_tokens=65536),
        speculative_config=Eagle3DecodingConfig(
            max_draft_len=3, speculative_model=str(BUNDLED_DRAFT), draft_kv_cache=mode
        ),
        cache_transceiver_config=CacheTransceiverConfig() if disagg else None,
        **options,
    )


@pytest.fixture(scope="module")
def prompts():
    rng = random.Random(5)
    llm = make("unified", False)
    return [llm.tokenizer.apply_chat_template(gsm8k_tiny(rng)[0][:1]) for _ in range(12)]


CONTEXT_ONLY = {"request_type": "context_only"}


def prefill(ctx, prompts, params):
    """The context server's part: each prompt prefilled and its KV held; the replies."""
    outputs = ctx.generate(prompts, params, disaggregated_params=CONTEXT_ONLY)
    return [o.disaggregated_params for o in outputs]


def resume(gen, replies, params):
    """The generation server's part, from the replies as a router carries them (JSON)."""
    wire = [json.loads(json.dumps(p.to_json())) for p in replies]
    return gen.generate([p["prompt_token_ids"] for p in wire], params, disaggregated_params=wire)


def al(outputs):
    return sum(o.outputs[0].avg_decoded_tokens_per_iter for o in outputs) / len(outputs)


@pytest.mark.parametrize("mode", ["unified", "separate"])
def test_generation_server_decodes_what_the_aggregated_llm_decodes(prompts, mode):
    aggregated = make(mode, False).generate(prompts, GREEDY)
    ctx, gen = make(mode, True), make(mode, True)
    params = prefill(ctx, prompts, GREEDY)
    assert all(p.request_type is RequestType.CONTEXT_ONLY for p in params)
    outputs = resume(gen, params, GREEDY)
    assert [o.outputs[0].token_ids for o in outputs] == [o.outputs[0].token_ids for o in aggregated]
    assert gen.get_stats()["num_context_tokens_computed"] == 0  # no prefill on the generation side
    assert gen.get_stats()["num_transferred_tokens"] == sum(len(p.prompt_token_ids) for p in params)
    assert ctx.disaggregated.release_pulled() == len(prompts)
    for llm in (ctx, gen):
        assert llm.kv_cache_report()["KV_CACHE_MANAGER"]["used"] == 0
        llm.kv_cache_report()  # checks integrity
    if mode == "unified":
        assert abs(al(outputs) - al(aggregated)) <= 0.05
    else:
        assert (
            al(outputs) < al(aggregated) - 0.1
        )  # the drafter's prompt KV stayed on the context side
    threads = len(os.listdir("/proc/self/task"))
    for llm in (ctx, gen):
        llm.shutdown()  # its NIXL agent ends, and the agent's progress thread with it
        assert llm.disaggregated.transceiver.agent is None
    assert len(os.listdir("/proc/self/task")) <= threads - 2


def test_the_generation_server_continues_the_grammar_from_the_first_token(prompts):
    """The context server's first token is held to the grammar; the generation server's matcher
    takes it, then holds the rest: the aggregated LLM's tokens, the constraint kept."""
    import re

    from tensorrt_llm import GuidedDecodingParams

    pattern = r"[0-9]{1,3} (\+|-) [0-9]{1,3}: the sum is [0-9]{1,4}\."
    guides = [
        GuidedDecodingParams(regex=pattern),
        GuidedDecodingParams(grammar='root ::= "The answer is " [0-9] [0-9]? [0-9]? [0-9]? "."'),
    ]
    params = [SamplingParams(max_tokens=60, guided_decoding=g) for g in guides]
    texts = prompts[:2]
    aggregated = make("unified", False, guided_decoding_backend="xgrammar").generate(texts, params)
    ctx = make("unified", True, guided_decoding_backend="xgrammar")
    gen = make("unified", True, guided_decoding_backend="xgrammar")
    outputs = resume(gen, prefill(ctx, texts, params), params)
    assert [o.outputs[0].token_ids for o in outputs] == [o.outputs[0].token_ids for o in aggregated]
    assert re.fullmatch(pattern, outputs[0].outputs[0].text)
    assert re.fullmatch(r"The answer is [0-9]{1,4}\.", outputs[1].outputs[0].text)
    assert all(o.outputs[0].finish_reason == "stop" for o in outputs)


def test_generation_only_requests_wait_for_slots_instead_of_failing(prompts):
    # issue 11, item 7: a generation server with room for two requests at a time used to fail
    # the third with "no KV slots"; now each waits until the KV it needs to completion fits
    ctx = make("unified", True)
    gen = LLM(
        device="cpu",
        max_batch_size=16,
        kv_cache_config=KvCacheConfig(max_tokens=128 * 5),
        speculative_config=Eagle3DecodingConfig(
            max_draft_len=3, speculative_model=str(BUNDLED_DRAFT)
        ),
        cache_transceiver_config=CacheTransceiverConfig(),
    )
    short = SamplingParams(max_tokens=24)
    wanted = [o.outputs[0].token_ids for o in make("unified", False).generate(prompts[:6], short)]
    outputs = resume(gen, prefill(ctx, prompts[:6], short), short)
    assert [o.outputs[0].token_ids for o in outputs] == wanted
    assert all(o.outputs[0].finish_reason == "length" for o in outputs)
    assert gen.kv_cache_report()["KV_CACHE_MANAGER"]["used"] == 0


def test_a_request_cancelled_before_its_pull_frees_the_context_servers_hold(prompts):
    # a generation-only request that leaves the queue unpulled tells the context server, which
    # frees its hold at once instead of after transfer_timeout_s (60 s here)
    ctx = make("unified", True)
    gen = LLM(
        device="cpu",
        kv_cache_config=KvCacheConfig(max_tokens=128 * 3),
        speculative_config=Eagle3DecodingConfig(
            max_draft_len=3, speculative_model=str(BUNDLED_DRAFT)
        ),
        cache_transceiver_config=CacheTransceiverConfig(),
    )
    short = SamplingParams(max_tokens=24)
    replies = prefill(ctx, prompts[:6], short)
    assert len(ctx.kv_cache_report()) and ctx.get_stats()["held_for_transfer"] == 6
    # the first request's KV to completion fills the generation server's cache (a long answer:
    # seconds of decoding), so the other five wait for slots, unpulled, until cancelled
    long = SamplingParams(max_tokens=200, ignore_eos=True)
    finished = {}
    submitted = [
        gen.submit(
            GenerationRequest(reply.prompt_token_ids, long if i == 0 else short, reply.to_json()),
            lambda out: finished.update({out.request_id: out}) if out.finished else None,
        )
        for i, reply in enumerate(replies)
    ]
    for request_id in submitted[1:]:
        gen.cancel(request_id)
    deadline = time.monotonic() + 10
    while ctx.get_stats()["held_for_transfer"] and time.monotonic() < deadline:
        ctx.disaggregated.release_pulled()  # the first one's pull, the releases of the others
        time.sleep(0.05)
    assert ctx.get_stats()["held_for_transfer"] == 0
    assert [finished[i].outputs[0].finish_reason for i in submitted[1:]] == ["cancelled"] * 5
    gen.cancel(submitted[0])
    gen.shutdown()


def test_the_overlap_scheduler_keeps_the_generation_servers_tokens(prompts):
    """Target only (Eagle3 outside the CUDA graphs reads each step at once): the generation
    server with the overlap scheduler decodes what it decodes without it, greedy and seeded."""

    def target_only(disagg: bool, overlap: bool = True) -> LLM:
        return LLM(
            device="cpu",
            max_batch_size=16,
            kv_cache_config=KvCacheConfig(max_tokens=128 * 32),
            cache_transceiver_config=CacheTransceiverConfig() if disagg else None,
            disable_overlap_scheduler=not overlap,
        )

    params = [SamplingParams(max_tokens=30, ignore_eos=True)] * 3 + [
        SamplingParams(max_tokens=30, temperature=0.8, top_p=0.9, seed=i, ignore_eos=True)
        for i in range(3)
    ]
    ctx = target_only(True)
    got = {}
    for overlap in (True, False):
        gen = target_only(True, overlap)
        outputs = resume(gen, prefill(ctx, prompts[:6], params), params)
        got[overlap] = [o.outputs[0].token_ids for o in outputs]
        assert ctx.disaggregated.release_pulled() == 6
        assert gen.kv_cache_report()["KV_CACHE_MANAGER"]["used"] == 0
        gen.shutdown()
    assert got[True] == got[False]
    aggregated = target_only(False).generate(prompts[:3], params[:3])
    assert got[True][:3] == [o.outputs[0].token_ids for o in aggregated]
    assert all(len(t) == 30 for t in got[True])


def test_an_image_prompt_resumes_from_its_kv_without_the_image(tmp_path):
    """A tiny random M3 with a vision tower: the generation side gets token ids and the context
    server's image digests (never the image), encodes nothing, computes no prompt token, and
    decodes the aggregated LLM's tokens with its AL. Two images behind the same text share no
    block on the generation side: each prompt is pulled whole."""
    import numpy as np
    from llm_helpers import write_tiny_eagle3, write_tiny_vl_checkpoint

    target = write_tiny_vl_checkpoint(tmp_path / "m3-vl")
    draft = write_tiny_eagle3(tmp_path / "eagle3", target)

    def make_vl(disagg):
        return LLM(
            target,
            device="cpu",
            kv_cache_config=KvCacheConfig(tokens_per_block=16, max_tokens=4096),
            speculative_config=Eagle3DecodingConfig(
                max_draft_len=3, speculative_model=str(draft), draft_kv_cache="unified"
            ),
            cache_transceiver_config=CacheTransceiverConfig() if disagg else None,
        )

    rng = np.random.RandomState(0)
    images = [rng.randint(0, 255, (32, 48, 3), dtype=np.uint8) for _ in range(2)]
    text = "<|user|>see ]<]image[>[ and tell<|end|><|assistant|>"  # the image in block 0
    prompts = [{"prompt": text, "multi_modal_data": {"image": [image]}} for image in images]
    params = SamplingParams(max_tokens=24, temperature=0, ignore_eos=True)
    aggregated = make_vl(False).generate(prompts, params)
    assert aggregated[0].outputs[0].token_ids != aggregated[1].outputs[0].token_ids
    ctx, gen = make_vl(True), make_vl(True)
    replies = prefill(ctx, prompts, params)
    assert [len(r.images) for r in replies] == [1, 1]
    assert replies[0].images[0].digest != replies[1].images[0].digest
    outputs = [resume(gen, [reply], params)[0] for reply in replies]  # one after the other
    for got, expected in zip(outputs, aggregated, strict=True):
        assert got.outputs[0].finish_reason is FinishReason.LENGTH, got.outputs[0].stop_reason
        assert got.outputs[0].token_ids == expected.outputs[0].token_ids
        assert got.outputs[0].avg_decoded_tokens_per_iter == pytest.approx(
            expected.outputs[0].avg_decoded_tokens_per_iter, abs=0.05
        )
    stats = gen.get_stats()
    assert stats["num_context_tokens_computed"] == 0 and stats["images_encoded"] == 0
    assert stats["num_transferred_tokens"] == sum(len(r.prompt_token_ids) for r in replies)
    assert ctx.disaggregated.release_pulled() == 2
    for llm in (ctx, gen):
        assert llm.kv_cache_report()["KV_CACHE_MANAGER"]["used"] == 0


def test_the_mtp_modules_kv_travels_with_the_prompts(tmp_path):
    """MTP unified: the module's layer is one more sparse layer of the slots, so the pulled slots
    carry its KV; the generation server decodes the aggregated tokens with the same acceptance
    request by request (its drafts read the same KV)."""
    import sys
    from pathlib import Path

    sys.path.insert(0, str(Path(__file__).parent))
    from llm_helpers import write_tiny_checkpoint

    from tensorrt_llm import MTPDecodingConfig

    model_dir = write_tiny_checkpoint(tmp_path, seed=5, num_mtp_modules=1)
    texts = ["abc abc abc abc abc", "the cat sat on the mat", "hello world hello world"]
    params = SamplingParams(max_tokens=24, temperature=0)

    def mtp(disagg: bool) -> LLM:
        return LLM(
            model=str(model_dir),
            device="cpu",
            speculative_config=MTPDecodingConfig(max_draft_len=3),
            cache_transceiver_config=CacheTransceiverConfig() if disagg else None,
        )

    aggregated = mtp(False).generate(texts, params)
    ctx, gen = mtp(True), mtp(True)
    outputs = resume(gen, prefill(ctx, texts, params), params)
    assert [o.outputs[0].token_ids for o in outputs] == [o.outputs[0].token_ids for o in aggregated]
    assert gen.get_stats()["num_context_tokens_computed"] == 0
    want = [o.outputs[0].avg_decoded_tokens_per_iter for o in aggregated]
    assert [o.outputs[0].avg_decoded_tokens_per_iter for o in outputs] == want
    assert max(want) > 1.0  # (some drafts accepted: the KV they read matters)
    for llm in (ctx, gen):
        llm.shutdown()
