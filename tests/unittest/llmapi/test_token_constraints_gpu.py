"""On a GPU, the token constraints inside the CUDA graphs (issue 57, item 5): under the overlap
scheduler, target-only and with Eagle3 (unified KV) on the bundled model, the graph steps give
the eager steps' tokens for requests with ``allowed_token_ids``, bad words of one and of several
tokens, and stop tokens, beside unconstrained ones; every reply keeps its constraint, and no
graph is captured after start-up."""

import random

import pytest

from tensorrt_llm import LLM, SamplingParams
from tensorrt_llm.bundled import BUNDLED_DRAFT
from tensorrt_llm.evaluate.tasks import gsm8k_tiny
from tensorrt_llm.llmapi.llm_args import Eagle3DecodingConfig, KvCacheConfig

pytestmark = pytest.mark.gpu
DIGITS = "0123456789 +=:,."
BAD = ["15", "The answer", "+"]  # two tokens, several, one


def make(speculative: bool, cuda_graphs: bool) -> LLM:
    spec = Eagle3DecodingConfig(
        max_draft_len=3, speculative_model=str(BUNDLED_DRAFT), draft_kv_cache="unified"
    )
    return LLM(
        device="cuda",
        kv_cache_config=KvCacheConfig(max_tokens=128 * 64),
        **({"speculative_config": spec} if speculative else {}),
        **({} if cuda_graphs else {"cuda_graph_config": None}),
    )


def test_constrained_graph_steps_give_the_eager_tokens_with_and_without_eagle3():
    rng = random.Random(5)
    conversations = [gsm8k_tiny(rng)[0][:1] for _ in range(8)]  # (a bucket holds 8)
    results = {}
    for speculative in (False, True):
        for graphs in (False, True):
            llm = make(speculative, graphs)
            encode = llm.tokenizer.encode
            (equals,) = encode("=")
            kinds = [
                {},
                {"allowed_token_ids": sorted(set(encode(DIGITS)))},
                {"bad": BAD},
                {"stop_token_ids": [equals]},
            ]
            sampling = [SamplingParams(max_tokens=48, **kinds[i % 4]) for i in range(8)]
            prompts = [llm.tokenizer.apply_chat_template(c) for c in conversations]
            runner = llm.executor.cuda_graph_runner
            captured = runner.num_captures if runner is not None else 0
            held = llm.kv_cache_report()["KV_CACHE_MANAGER"]["used"]  # (graphs' padding rows)
            results[speculative, graphs] = [o.outputs[0] for o in llm.generate(prompts, sampling)]
            if graphs:
                assert runner.num_captures == captured  # every bucket at start-up
                assert llm.get_stats()["num_graph_steps"] > 0
                assert llm.get_stats()["num_overlapped_steps"] > 0
            assert llm.kv_cache_report()["KV_CACHE_MANAGER"]["used"] == held
            llm.shutdown()
    want = [o.token_ids for o in results[False, False]]
    for key, outs in results.items():
        assert [o.token_ids for o in outs] == want, key
    outs = results[True, True]
    for i, out in enumerate(outs):
        if i % 4 == 1:
            assert set(out.text) <= set(DIGITS), out.text
        elif i % 4 == 2:
            assert not any(word in out.text for word in BAD), out.text
        elif i % 4 == 3:
            assert out.finish_reason == "stop" and "=" not in out.text, out.text
    unconstrained = " ".join(outs[i].text for i in range(0, 8, 4))
    assert any(word in unconstrained for word in BAD) and "=" in unconstrained
