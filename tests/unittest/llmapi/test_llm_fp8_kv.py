"""The bundled model with an FP8 KV cache (``KvCacheConfig(dtype="fp8")``), on the CPU: every row of
every slot (the target's K, V and index keys, the Eagle3 drafter's sub-pages, the MTP module's
layer) in float8_e4m3fn with its scales; Eagle3 and MTP lossless against target only at the same KV
dtype and still accepting; a reused prefix giving the cold reply, the drafter's FP8 rows and scales
in the reused blocks byte for byte what a cold prefill writes."""

import pytest
import torch

from tensorrt_llm import LLM, SamplingParams
from tensorrt_llm._torch.attention_backend.kv_quant import dequantize_rows
from tensorrt_llm.bundled import BUNDLED_DRAFT, BUNDLED_TARGET
from tensorrt_llm.evaluate.tasks import evaluation_problems
from tensorrt_llm.llmapi.llm_args import Eagle3DecodingConfig, KvCacheConfig, MTPDecodingConfig
from tensorrt_llm.runtime.kv_cache_manager_v2 import DataRole

GREEDY = SamplingParams(max_tokens=24, temperature=0.0)
SPECS = {
    "eagle3": Eagle3DecodingConfig(
        max_draft_len=3, speculative_model=str(BUNDLED_DRAFT), draft_kv_cache="unified"
    ),
    "mtp": MTPDecodingConfig(max_draft_len=3),
}


def make(spec=None, dtype="fp8") -> LLM:
    kv = KvCacheConfig(dtype=dtype, max_tokens=8192)
    return LLM(str(BUNDLED_TARGET), device="cpu", kv_cache_config=kv, speculative_config=spec)


@pytest.fixture(scope="module")
def prompts() -> list[str]:
    """Two held-out gsm8k-tiny problems as the bundled model's chat template renders them, and a
    conversation of both (the first answered): a prompt of more than one 128-token block."""
    llm = make()
    try:
        (first, answer), (second, _) = evaluation_problems("gsm8k-tiny", 2)
        both = [first[0], {"role": "assistant", "content": f"{answer}."}, second[0]]
        render = llm.tokenizer.apply_chat_template
        return [render(first[:1]), render(second[:1]), render(both)]
    finally:
        llm.shutdown()


def tokens(outputs) -> list[list[int]]:
    return [o.outputs[0].token_ids for o in outputs]


@pytest.fixture(scope="module")
def target_only(prompts) -> list[list[int]]:
    llm = make()
    try:
        return tokens(llm.generate(prompts, GREEDY))
    finally:
        llm.shutdown()


@pytest.mark.parametrize("drafter", ["eagle3", "mtp"])
def test_every_row_is_fp8_and_speculation_is_lossless_at_fp8(prompts, target_only, drafter):
    llm = make(SPECS[drafter])
    try:
        layout = llm.kv_cache_manager.layout
        data = [b for p in layout.pools for b in p.buffers if not b.role.is_scale]
        scales = {(b.layer_id, b.role) for p in layout.pools for b in p.buffers if b.role.is_scale}
        assert {b.dtype for b in data} == {"float8_e4m3fn"}
        assert {(b.layer_id, b.role.scale) for b in data} == scales  # each row has its scale
        draft_layer = max(b.layer_id for b in data)  # the drafter's, sub-pages or the MTP layer
        assert (draft_layer, DataRole.VALUE_SCALE) in scales
        out = llm.generate(prompts, GREEDY)
        assert tokens(out) == target_only
        assert min(o.outputs[0].avg_decoded_tokens_per_iter for o in out) > 1.5
    finally:
        llm.shutdown()


def _draft_kv(llm, request_tokens: list[int], num_blocks: int) -> dict[str, torch.Tensor]:
    """The drafter's K and V in the committed blocks of the request's first ``num_blocks`` blocks:
    per role, the FP8 rows' bytes and the rows dequantized with their scales (float32)."""
    manager = llm.kv_cache_manager
    draft_layer = llm.model_config.num_hidden_layers
    pool, _ = manager.layout.placement(draft_layer, DataRole.KEY)
    slots = [node.slot for node in manager.impl._match_prefix(request_tokens, None)][:num_blocks]
    assert len(slots) == num_blocks
    data = manager.pools[pool.pool_index][torch.tensor(slots)]
    buffers = {b.role: b for b in pool.buffers if b.layer_id == draft_layer}
    kv = {}
    for role in (DataRole.KEY, DataRole.VALUE):
        rows, scales = buffers[role], buffers[role.scale]
        raw = data[:, rows.offset : rows.offset + rows.size].contiguous()
        fp8 = raw.view(torch.float8_e4m3fn).view(-1, rows.num_heads, rows.head_dim)
        scale = data[:, scales.offset : scales.offset + scales.size].contiguous()
        kv[f"{role} bytes"] = raw
        kv[str(role)] = dequantize_rows(fp8, scale.view(torch.float32).view(-1, rows.num_heads))
    return kv


def test_a_reused_prefix_gives_the_cold_reply_with_the_drafters_fp8_kv(prompts):
    llm = make(SPECS["eagle3"])
    cold_llm = make(SPECS["eagle3"])
    try:
        second = llm.tokenizer.encode(prompts[2])
        first = second[:140]  # its first 128-token block is committed, and reused by the second
        assert len(second) > 140
        cold = cold_llm.generate([second], GREEDY)[0]
        llm.generate([first], GREEDY)
        before = llm.get_stats()["num_reused_tokens"]
        warm = llm.generate([second], GREEDY)[0]
        assert llm.get_stats()["num_reused_tokens"] - before == 128
        assert warm.outputs[0].token_ids == cold.outputs[0].token_ids
        assert warm.outputs[0].avg_decoded_tokens_per_iter == pytest.approx(
            cold.outputs[0].avg_decoded_tokens_per_iter
        )
        ids = warm.prompt_token_ids
        # the reused block holds the drafter's FP8 K and V of those tokens as a cold prefill
        # writes them: a prefill of another length rounds its fp32 GEMMs in another order, so an
        # element near an e4m3 rounding boundary may land one step (at most 1/8) away
        warm_kv, cold_kv = _draft_kv(llm, ids, 1), _draft_kv(cold_llm, ids, 1)
        for role in (DataRole.KEY, DataRole.VALUE):
            w, c = warm_kv[str(role)], cold_kv[str(role)]
            assert ((w - c).abs() <= torch.maximum(w.abs(), c.abs()) / 8 + 1e-6).all(), role
            same = (warm_kv[f"{role} bytes"] == cold_kv[f"{role} bytes"]).float().mean()
            assert same >= 0.9, (role, same)
    finally:
        llm.shutdown()
        cold_llm.shutdown()


@pytest.mark.gpu
def test_on_cuda_with_graphs_and_overlap_fp8_speculation_is_lossless_and_reuse_is_cold():
    """TRITON kernels, CUDA graphs, the overlap scheduler: 32 gsm8k-tiny prompts and a long prompt
    (MSA selects blocks) at FP8 KV; Eagle3 and MTP give the target-only tokens, accept as at bf16
    KV within 0.1 (over every step of every prompt: a few prompts of 24 tokens swing by more), and
    a second pass served from the prefix cache gives the same."""
    import random

    from tensorrt_llm.evaluate.tasks import gsm8k_tiny, long_prompt

    def run(spec, dtype, repeat=False):
        kv = KvCacheConfig(dtype=dtype, max_tokens=128 * 512)
        llm = LLM(str(BUNDLED_TARGET), device="cuda", kv_cache_config=kv, speculative_config=spec)
        try:
            rng = random.Random(7)
            chats = [gsm8k_tiny(rng)[0][:1] for _ in range(32)] + [long_prompt(rng)[0][:1]]
            texts = [llm.tokenizer.apply_chat_template(c) for c in chats]
            params = SamplingParams(max_tokens=64, temperature=0.0)
            outs = llm.generate(texts, params)
            assert llm.executor.cuda_graph_runner.num_replays > 0
            if repeat:  # served from the cache this time
                before = llm.get_stats()["num_reused_tokens"]
                again = llm.generate(texts, params)
                assert llm.get_stats()["num_reused_tokens"] > before
                assert tokens(again) == tokens(outs)
            made = [len(o.outputs[0].token_ids) for o in outs]
            steps = [n / o.outputs[0].avg_decoded_tokens_per_iter for n, o in zip(made, outs)]
            return tokens(outs), sum(made) / sum(steps)
        finally:
            llm.shutdown()

    target, _ = run(None, "fp8")
    for name, spec in SPECS.items():
        fp8, fp8_al = run(spec, "fp8", repeat=True)
        _, bf16_al = run(spec, "auto")
        assert fp8 == target, name
        assert fp8_al >= bf16_al - 0.1 and fp8_al > 2.5, (name, fp8_al, bf16_al)
