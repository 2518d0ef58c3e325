"""The published MiniMax-M3, token for token against transformers' ``minimax_m3_vl`` (the definition).

Tiny random models built by transformers, with sparse layers that are not a prefix, an MoE whose
``e_score_correction_bias`` is nonzero, Gemma norm weights away from 0, and prompts long enough that
the indexer drops key blocks. Each is saved in the hub layout (``MiniMaxM3SparseForConditionalGeneration``)
and in transformers' own (``MiniMaxM3VLForCausalLM``). ``LLM``'s greedy tokens must equal
``generate``'s and its logprobs be within 1e-4 of transformers', target only and with Eagle3 (a random
drafter: speculation is lossless, so the tokens stay the same) in unified and separate mode. fp32, CPU.
"""

import math

import pytest
import torch

transformers = pytest.importorskip("transformers", minversion="5.24")

from tensorrt_llm import LLM, SamplingParams  # noqa: E402
from tensorrt_llm._torch.models.checkpoint import random_eagle3, save_pretrained  # noqa: E402
from tensorrt_llm._torch.models.modeling_speculative import Eagle3Config  # noqa: E402
from tensorrt_llm.llmapi.llm_args import Eagle3DecodingConfig, KvCacheConfig  # noqa: E402

NEW_TOKENS = 24
PROMPT_LENGTHS = (5, 41, 97)
FULL, SPARSE = "full_attention", "minimax_m3_sparse"
MODELS = {
    # GQA 2, RoPE on half of each head, one local block of 8 keys, top-2
    "gqa2-local1": dict(
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        index_head_dim=16,
        partial_rotary_factor=0.5,
        layer_types=[FULL, SPARSE, FULL, SPARSE],
        mlp_layer_types=["dense", "sparse", "sparse", "dense"],
        index_block_size=8,
        index_topk_blocks=2,
        index_local_blocks=1,
    ),
    # GQA 4 over 4 KV groups (each its own selection), full RoPE, two local blocks of 16, top-3
    "gqa4-local2": dict(
        num_attention_heads=16,
        num_key_value_heads=4,
        head_dim=8,
        index_head_dim=12,
        partial_rotary_factor=1.0,
        layer_types=[SPARSE, FULL, SPARSE, SPARSE],
        mlp_layer_types=["sparse", "dense", "sparse", "sparse"],
        index_block_size=16,
        index_topk_blocks=3,
        index_local_blocks=2,
    ),
}


def text_config(spec: dict) -> dict:
    spec = dict(spec)
    factor = spec.pop("partial_rotary_factor")
    return dict(
        vocab_size=97,
        hidden_size=64,
        num_hidden_layers=4,
        intermediate_size=32,
        dense_intermediate_size=48,
        shared_intermediate_size=24,
        num_local_experts=8,
        num_experts_per_tok=2,
        index_n_heads=spec["num_key_value_heads"],
        rope_parameters={
            "rope_type": "default",
            "rope_theta": 10000.0,
            "partial_rotary_factor": factor,
        },
        max_position_embeddings=512,
        bos_token_id=0,
        eos_token_id=1,
        **spec,
    )


def randomize(model: torch.nn.Module, seed: int) -> None:
    """Weights large enough that every part matters: norms away from 0 (Gemma's scale 1 + w), a
    score-correction bias that changes which experts are chosen."""
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, param in model.named_parameters():
            std = 0.3 if "norm" in name else 0.08
            param.copy_(torch.randn(param.shape, generator=generator) * std)
        for name, buffer in model.named_buffers():
            if name.endswith("e_score_correction_bias"):
                buffer.copy_(torch.randn(buffer.shape, generator=generator) * 0.3)


@pytest.fixture(scope="module", params=sorted(MODELS))
def published(request, tmp_path_factory):
    """``(model_dirs, reference)``: the same random model saved in both layouts, with a drafter, and
    transformers' greedy tokens and logprobs for every prompt."""
    from transformers import (
        GenerationConfig,
        MiniMaxM3SparseForConditionalGeneration,
        MiniMaxM3VLConfig,
        MiniMaxM3VLForCausalLM,
        MiniMaxM3VLTextConfig,
    )

    spec = MODELS[request.param]
    root = tmp_path_factory.mktemp(request.param)
    text = MiniMaxM3VLForCausalLM(MiniMaxM3VLTextConfig(**text_config(spec))).eval()
    randomize(text, seed=len(request.param))
    assert any(b.abs().sum() > 0 for n, b in text.named_buffers() if "correction_bias" in n)
    text.save_pretrained(root / "transformers")
    vision = dict(hidden_size=16, intermediate_size=32, num_hidden_layers=1, num_attention_heads=2)
    vl_config = MiniMaxM3VLConfig(
        text_config=text_config(spec), vision_config=vision, projector_hidden_size=32
    )
    vl = MiniMaxM3SparseForConditionalGeneration(vl_config).eval()
    vl.model.language_model.load_state_dict(text.model.state_dict())
    vl.lm_head.load_state_dict(text.lm_head.state_dict())
    vl.save_pretrained(root / "hub")

    generator = torch.Generator().manual_seed(7)
    prompts = [torch.randint(2, 97, (n,), generator=generator).tolist() for n in PROMPT_LENGTHS]
    keys_kept = spec["index_block_size"] * spec["index_topk_blocks"]
    assert max(PROMPT_LENGTHS) > 2 * keys_kept  # the indexer drops blocks
    greedy = GenerationConfig(
        max_new_tokens=NEW_TOKENS, do_sample=False, eos_token_id=None, pad_token_id=0
    )
    reference = []
    with torch.no_grad():
        for prompt in prompts:
            ids = torch.tensor([prompt])
            out = text.generate(
                ids, generation_config=greedy, output_logits=True, return_dict_in_generate=True
            )
            tokens = out.sequences[0, len(prompt) :].tolist()
            logprobs = [
                torch.log_softmax(step[0].float(), -1)[t].item()
                for step, t in zip(out.logits, tokens, strict=True)
            ]
            reference.append((prompt, tokens, logprobs))
            # the hub layout's model is the same model
            torch.testing.assert_close(vl(ids).logits, text(ids).logits, rtol=0, atol=0)

    draft_config = Eagle3Config.from_dict(
        {
            "hidden_size": 64,
            "intermediate_size": 96,
            "num_attention_heads": 4,
            "num_key_value_heads": 4,
            "head_dim": 16,
            "vocab_size": 97,
            "draft_vocab_size": 97,
            "target_hidden_size": 64,
        }
    )
    drafter = random_eagle3(draft_config, layer_idx=4, seed=3, std=0.1)
    save_pretrained(drafter, draft_config, root / "eagle3")
    return root, reference


@pytest.mark.parametrize("layout", ["hub", "transformers"])
@pytest.mark.parametrize("mode", [None, "unified", "separate"])
def test_llm_decodes_as_transformers(published, layout, mode):
    root, reference = published
    spec = None
    if mode is not None:
        spec = Eagle3DecodingConfig(
            max_draft_len=3, speculative_model=str(root / "eagle3"), draft_kv_cache=mode
        )
    llm = LLM(
        root / layout,
        skip_tokenizer_init=True,
        device="cpu",
        dtype="float32",
        kv_cache_config=KvCacheConfig(tokens_per_block=32, max_tokens=2048),
        speculative_config=spec,
    )
    try:
        params = SamplingParams(max_tokens=NEW_TOKENS, temperature=0, logprobs=0, ignore_eos=True)
        outputs = llm.generate([prompt for prompt, _, _ in reference], params)
    finally:
        llm.shutdown()
    for output, (prompt, tokens, logprobs) in zip(outputs, reference, strict=True):
        completion = output.outputs[0]
        assert completion.token_ids == tokens, f"prompt of {len(prompt)} tokens"
        got = [lp for lp, _ in completion.logprobs]
        worst = max(abs(a - b) for a, b in zip(got, logprobs, strict=True))
        assert worst <= 1e-4, f"prompt of {len(prompt)} tokens: logprobs off by {worst:.2e}"
        assert all(math.isfinite(lp) for lp in got)
