"""MiniMax-M3 with images, token for token against transformers'
``MiniMaxM3SparseForConditionalGeneration`` (the definition). fp32, CPU.

A tiny random VL model (vision tower, projector and patch merge) saved in the hub layout. The
images go through this project's processor; transformers gets the same patches and grid. With one
image and with two, ``LLM``'s greedy tokens equal ``generate``'s and the logprobs are within 1e-4,
target only and with Eagle3 (lossless). The same text with another image gives the oracle's other
continuation, and none of the first image's blocks is reused for it.
"""

import json
import math

import numpy as np
import pytest
import torch

transformers = pytest.importorskip("transformers", minversion="5.24")

from tensorrt_llm import LLM, SamplingParams  # noqa: E402
from tensorrt_llm._torch.models.checkpoint import random_eagle3, save_pretrained  # noqa: E402
from tensorrt_llm._torch.models.modeling_speculative import Eagle3Config  # noqa: E402
from tensorrt_llm.llmapi.llm_args import Eagle3DecodingConfig, KvCacheConfig  # noqa: E402

NEW_TOKENS = 16
VOCAB, IMAGE_ID = 96, 95  # vocab even: two ranks split the LM head
BLOCK = 8  # tokens per KV block: the image tokens fill whole blocks
TEXT = dict(
    vocab_size=VOCAB,
    hidden_size=64,
    num_hidden_layers=4,
    intermediate_size=32,
    dense_intermediate_size=48,
    shared_intermediate_size=24,
    num_local_experts=8,
    num_experts_per_tok=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=16,
    index_n_heads=2,
    index_head_dim=16,
    layer_types=["full_attention", "minimax_m3_sparse", "full_attention", "minimax_m3_sparse"],
    mlp_layer_types=["dense", "sparse", "sparse", "dense"],
    index_block_size=8,
    index_topk_blocks=2,
    index_local_blocks=1,
    rope_parameters={"rope_type": "default", "rope_theta": 10000.0, "partial_rotary_factor": 0.5},
    max_position_embeddings=512,
    bos_token_id=0,
    eos_token_id=None,  # generate runs NEW_TOKENS whatever comes
)
# head_dim 24: 3D RoPE on 3 x 8 channels; patches of 4 pixels, merged 2 x 2
VISION = dict(
    hidden_size=48, intermediate_size=64, num_hidden_layers=2, num_attention_heads=2, patch_size=4
)
PREPROCESSOR = {"size": {"shortest_edge": 64, "longest_edge": 48 * 48}}


def picture(seed: int, height: int, width: int) -> np.ndarray:
    """A smooth random RGB picture (so resizing keeps it recognisable), ``[H, W, 3]`` uint8."""
    rng = np.random.RandomState(seed)
    coarse = torch.tensor(rng.rand(1, 3, 4, 4), dtype=torch.float32)
    fine = torch.nn.functional.interpolate(coarse, size=(height, width), mode="bilinear")
    noise = torch.tensor(rng.rand(1, 3, height, width), dtype=torch.float32) * 0.2
    return ((fine + noise).clamp(0, 1) * 255).to(torch.uint8)[0].permute(1, 2, 0).numpy()


IMAGES = [picture(1, 32, 48), picture(2, 24, 40), picture(3, 32, 48)]
# (prompt with one IMAGE_ID mark per image, the images' indices)
CASES = {
    "one image": ([5, 6, 7, 8, 9, 10, 11, 12, IMAGE_ID, 13, 14, 15, 16, 17], [0]),
    "two images": ([5, 6, IMAGE_ID, 20, 21, 22, IMAGE_ID, 30, 31, 32, 33], [0, 1]),
    "other image": ([5, 6, 7, 8, 9, 10, 11, 12, IMAGE_ID, 13, 14, 15, 16, 17], [2]),
}


def expand(prompt: list[int], num_tokens: list[int]) -> list[int]:
    """Each image mark grown to its image's token count."""
    sizes = iter(num_tokens)
    return [x for t in prompt for x in ([IMAGE_ID] * next(sizes) if t == IMAGE_ID else [t])]


def randomize(model: torch.nn.Module, seed: int) -> None:
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if "norm" in name and "vision" not in name:
                std = 0.3
            elif "layer_norm" in name or "pre_layrnorm" in name:
                param.copy_(1 + torch.randn(param.shape, generator=generator) * 0.1)
                continue
            else:
                std = 0.15
            param.copy_(torch.randn(param.shape, generator=generator) * std)
        for name, buffer in model.named_buffers():
            if name.endswith("e_score_correction_bias"):
                buffer.copy_(torch.randn(buffer.shape, generator=generator) * 0.3)


@pytest.fixture(scope="module")
def published(tmp_path_factory):
    """``(root, processor, reference)``: the model saved with its preprocessor config and a
    drafter, and transformers' tokens and logprobs for every case."""
    from transformers import (
        GenerationConfig,
        MiniMaxM3SparseForConditionalGeneration,
        MiniMaxM3VLConfig,
    )

    from tensorrt_llm._torch.models.modeling_minimaxm3_vision import MiniMaxM3VisionConfig
    from tensorrt_llm.inputs.image_processing import ImageProcessorConfig, MiniMaxM3ImageProcessor

    root = tmp_path_factory.mktemp("m3-vl")
    config = MiniMaxM3VLConfig(
        text_config=TEXT,
        vision_config=VISION,
        projector_hidden_size=32,
        image_token_index=IMAGE_ID,
    )
    model = MiniMaxM3SparseForConditionalGeneration(config).eval()
    randomize(model, seed=11)
    model.save_pretrained(root / "hub")
    (root / "hub" / "preprocessor_config.json").write_text(json.dumps(PREPROCESSOR))
    vision = MiniMaxM3VisionConfig(**VISION, image_token_id=IMAGE_ID)
    processor = MiniMaxM3ImageProcessor(ImageProcessorConfig.from_pretrained(root / "hub", vision))

    greedy = GenerationConfig(
        max_new_tokens=NEW_TOKENS, do_sample=False, eos_token_id=None, pad_token_id=0
    )
    reference = {}
    with torch.no_grad():
        for name, (prompt, which) in CASES.items():
            items = [processor(IMAGES[i]) for i in which]
            ids = expand(prompt, [it.num_tokens for it in items])
            out = model.generate(
                torch.tensor([ids]),
                pixel_values=torch.cat([it.patches for it in items]),
                image_grid_thw=torch.tensor([it.grid_thw for it in items]),
                generation_config=greedy,
                output_logits=True,
                return_dict_in_generate=True,
            )
            tokens = out.sequences[0, len(ids) :].tolist()
            logprobs = [
                torch.log_softmax(step[0].float(), -1)[t].item()
                for step, t in zip(out.logits, tokens, strict=True)
            ]
            reference[name] = (tokens, logprobs, len(ids))
    draft_config = Eagle3Config.from_dict(
        {
            "hidden_size": 64,
            "intermediate_size": 96,
            "num_attention_heads": 4,
            "num_key_value_heads": 4,
            "head_dim": 16,
            "vocab_size": VOCAB,
            "draft_vocab_size": VOCAB,
            "target_hidden_size": 64,
        }
    )
    drafter = random_eagle3(draft_config, layer_idx=4, seed=3, std=0.1)
    save_pretrained(drafter, draft_config, root / "eagle3")
    return root, processor, reference


def request(name: str) -> dict:
    prompt, which = CASES[name]
    return {"prompt_token_ids": prompt, "multi_modal_data": {"image": [IMAGES[i] for i in which]}}


def make_llm(root, mode=None, device="cpu", **options) -> LLM:
    spec = None
    if mode is not None:
        spec = Eagle3DecodingConfig(
            max_draft_len=3, speculative_model=str(root / "eagle3"), draft_kv_cache=mode
        )
    return LLM(
        root / "hub",
        skip_tokenizer_init=True,
        device=device,
        dtype="float32",
        kv_cache_config=KvCacheConfig(tokens_per_block=BLOCK, max_tokens=1024),
        speculative_config=spec,
        **options,
    )


def decode_every_case(llm: LLM) -> list:
    """Every case's greedy output with logprobs, then ``llm`` shut down."""
    try:
        params = SamplingParams(max_tokens=NEW_TOKENS, temperature=0, logprobs=0, ignore_eos=True)
        return llm.generate([request(name) for name in CASES], params)
    finally:
        llm.shutdown()


def check(output, reference, tolerance: float = 1e-4) -> None:
    tokens, logprobs, prompt_len = reference
    completion = output.outputs[0]
    assert len(output.prompt_token_ids) == prompt_len
    assert completion.token_ids == tokens
    got = [lp for lp, _ in completion.logprobs]
    worst = max(abs(a - b) for a, b in zip(got, logprobs, strict=True))
    assert worst <= tolerance, f"logprobs off by {worst:.2e}"
    assert all(math.isfinite(lp) for lp in got)


def test_the_cases_differ(published):
    _, processor, reference = published
    assert processor(IMAGES[0]).num_tokens >= 2 * BLOCK  # the image fills whole blocks
    assert reference["one image"][0] != reference["other image"][0]


@pytest.mark.parametrize("mode", [None, "unified"])
def test_images_decode_as_transformers(published, mode):
    root, _, reference = published
    llm = make_llm(root, mode)
    try:
        params = SamplingParams(max_tokens=NEW_TOKENS, temperature=0, logprobs=0, ignore_eos=True)
        outputs = llm.generate([request("one image"), request("two images")], params)
        stats = llm.get_stats()
    finally:
        llm.shutdown()
    check(outputs[0], reference["one image"])
    check(outputs[1], reference["two images"])
    assert stats["images_encoded"] == 2  # image 0 of both prompts once


def test_another_image_reuses_no_block_of_the_first(published):
    root, processor, reference = published
    prompt, _ = CASES["one image"]
    image_at = prompt.index(IMAGE_ID)
    llm = make_llm(root)
    try:
        params = SamplingParams(max_tokens=NEW_TOKENS, temperature=0, logprobs=0, ignore_eos=True)
        reused = []
        outputs = []
        for name in ("one image", "other image", "one image", "two images"):
            before = llm.get_stats()["num_reused_tokens"]
            outputs.append(llm.generate(request(name), params))
            reused.append(llm.get_stats()["num_reused_tokens"] - before)
        stats = llm.get_stats()
    finally:
        llm.shutdown()
    check(outputs[0], reference["one image"])
    check(outputs[1], reference["other image"])
    check(outputs[2], reference["one image"])
    check(outputs[3], reference["two images"])
    assert reused[1] <= image_at  # only the text blocks before the image
    num_tokens = processor(IMAGES[0]).num_tokens
    assert reused[2] >= (image_at + num_tokens) // BLOCK * BLOCK  # the same image: reused
    # the third request's image is inside its reused prefix: not encoded; the fourth's first
    # image comes from the encoder cache
    assert (stats["images_encoded"], stats["image_cache_hits"]) == (3, 1)


@pytest.mark.gpu
def test_images_decode_as_transformers_on_cuda(published):
    """The tower and the prefill on CUDA (fp32; Triton's dots may round through TF32, hence the
    wider logprob tolerance), with Eagle3 and the decode steps in CUDA graphs."""
    root, _, reference = published
    outputs = decode_every_case(make_llm(root, "unified", device="cuda"))
    for output, name in zip(outputs, CASES, strict=True):
        check(output, reference[name], tolerance=2e-3)


@pytest.mark.parametrize("layout", ["tp2", "adp2"])
def test_images_decode_as_transformers_on_two_ranks(published, layout):
    """Tensor parallelism, and attention data parallelism (each rank its own requests): each rank
    makes the patches again from the pixels rank 0 sends, and encodes its images itself."""
    root, _, reference = published
    outputs = decode_every_case(
        make_llm(root, tensor_parallel_size=2, enable_attention_dp=layout == "adp2")
    )
    for output, name in zip(outputs, CASES, strict=True):
        check(output, reference[name])
