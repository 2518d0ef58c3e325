"""On a GPU, guided decoding inside the CUDA graphs, under the overlap scheduler, with Eagle3
(unified KV) on the bundled model: the graph steps give the eager steps' tokens under each
constraint, beside unconstrained requests, every reply matches its constraint, the drafts are
masked by the grammars in both, and no graph is captured after start-up."""

import random
import re

import pytest

from tensorrt_llm import LLM, GuidedDecodingParams, SamplingParams
from tensorrt_llm.bundled import BUNDLED_DRAFT
from tensorrt_llm.evaluate.tasks import gsm8k_tiny
from tensorrt_llm.llmapi.llm_args import Eagle3DecodingConfig, KvCacheConfig

pytestmark = pytest.mark.gpu
SUM = r"[0-9]{1,3} (\+|-) [0-9]{1,3}: the sum is [0-9]{1,4}\."
ANSWER = r"The answer is [0-9]{1,4}\."
GUIDES = [
    GuidedDecodingParams(regex=SUM),
    GuidedDecodingParams(grammar='root ::= "The answer is " [0-9] [0-9]? [0-9]? [0-9]? "."'),
    None,
]


def make(cuda_graphs: bool) -> LLM:
    return LLM(
        device="cuda",
        guided_decoding_backend="xgrammar",
        speculative_config=Eagle3DecodingConfig(
            max_draft_len=3, speculative_model=str(BUNDLED_DRAFT), draft_kv_cache="unified"
        ),
        kv_cache_config=KvCacheConfig(max_tokens=128 * 64),
        **({} if cuda_graphs else {"cuda_graph_config": None}),
    )


def test_guided_graph_steps_give_the_eager_tokens_with_eagle3_and_the_overlap():
    rng = random.Random(11)
    conversations = [gsm8k_tiny(rng)[0][:1] for _ in range(12)]
    sampling = [
        SamplingParams(max_tokens=48, temperature=0, guided_decoding=GUIDES[i % 3])
        for i in range(12)
    ]
    results = {}
    for graphs in (False, True):
        llm = make(graphs)
        prompts = [llm.tokenizer.apply_chat_template(c) for c in conversations]
        runner = llm.executor.cuda_graph_runner
        captured = runner.num_captures if runner is not None else 0
        results[graphs] = [o.outputs[0] for o in llm.generate(prompts, sampling)]
        if graphs:
            assert runner.num_captures == captured  # every bucket at start-up
            assert llm.get_stats()["num_graph_steps"] > 0
            assert llm.get_stats()["num_overlapped_steps"] > 0
        llm.shutdown()
    assert [o.token_ids for o in results[True]] == [o.token_ids for o in results[False]]
    # the drafts are masked by the grammars in the graph steps too (the second part eager)
    al = {g: [o.avg_decoded_tokens_per_iter for o in results[g][:2]] for g in results}
    assert sum(al[True]) >= 0.8 * sum(al[False]), al
    for i, out in enumerate(results[True]):
        if i % 3 == 0:
            assert re.fullmatch(SUM, out.text) and out.finish_reason == "stop", out.text
        elif i % 3 == 1:
            assert re.fullmatch(ANSWER, out.text) and out.finish_reason == "stop", out.text
