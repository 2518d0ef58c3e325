"""``examples/models/make_m3_tiny_vl.py``, as the README's Images section runs it: the bundled
model with a vision tower answers text as the bundled model does, and takes the README's image."""

import base64
import sys
from pathlib import Path

import pytest

from tensorrt_llm.bundled import bundled_prompt
from tensorrt_llm.inputs import IMAGE_TOKEN

ROOT = Path(__file__).parents[2]
sys.path.insert(0, str(ROOT / "examples" / "models"))
from make_m3_tiny_vl import make  # noqa: E402

QUESTION = "Ann has 58 cups. Ann gets 67 more cups. How many cups does Ann have now? "


def test_the_vl_example_answers_text_as_the_bundled_model(
    tmp_path, bundled_server, serve_in_thread
):
    import openai

    from tensorrt_llm.commands.serve import build_server

    target = make(tmp_path / "m3-tiny-vl")
    server = build_server(
        target,
        None,
        "cpu",
        allowed_local_media_path=ROOT / "examples",
        reasoning_parser="minimax_m3",
        tool_parser="minimax_m3",
    )
    url, stop = serve_in_thread(server.app)
    try:
        vl = openai.OpenAI(base_url=url + "/v1", api_key="unused")
        bundled = openai.OpenAI(base_url=bundled_server[1] + "/v1", api_key="unused")
        text_only = [{"role": "user", "content": QUESTION}]
        replies = [
            client.chat.completions.create(
                model=model, messages=text_only, temperature=0, max_tokens=80
            )
            for client, model in ((vl, "target"), (bundled, "target"))
        ]
        assert replies[0].choices[0].message.content == replies[1].choices[0].message.content
        assert replies[0].choices[0].message.content.endswith("The answer is 125.")
        raw = (ROOT / "examples/results/al_per_turn.png").read_bytes()
        png = base64.b64encode(raw).decode()
        with_image = [
            {
                "role": "user",
                "content": [
                    {"type": "text", "text": QUESTION},
                    {"type": "image_url", "image_url": {"url": f"data:image/png;base64,{png}"}},
                ],
            }
        ]
        reply = vl.chat.completions.create(
            model="target", messages=with_image, temperature=0, max_tokens=80
        )
        image = server.llm.multimodal.processor(raw)
        assert 0 < image.num_tokens <= 16  # within the example's max_pixels
        # the image's tokens and its two brackets
        assert reply.usage.prompt_tokens == replies[0].usage.prompt_tokens + image.num_tokens + 2
        assert reply.choices[0].message.content
        assert server.llm.get_stats()["images_encoded"] == 1
    finally:
        stop()
        server.close()


@pytest.mark.gpu
def test_the_vl_example_on_cuda_is_lossless_under_eagle3(tmp_path):
    """bf16 on CUDA, decode steps in CUDA graphs: Eagle3 (unified) gives the target-only tokens
    on prompts with images, and the text answer stays the bundled model's."""
    from PIL import Image

    from tensorrt_llm import LLM, SamplingParams

    target = make(tmp_path / "m3-tiny-vl")
    spec = {
        "decoding_type": "Eagle3",
        "max_draft_len": 3,
        "speculative_model": str(target.parent / "eagle3"),
    }
    picture = Image.open(ROOT / "examples/results/al_per_turn.png")
    question = bundled_prompt(QUESTION)
    prompts = [question] + [
        {
            "prompt": bundled_prompt(f"{QUESTION}{IMAGE_TOKEN}"),
            "multi_modal_data": {"image": [picture.resize(size)]},
        }
        for size in ((200, 100), (64, 64), (300, 300))
    ]
    params = SamplingParams(max_tokens=80, temperature=0)
    outputs = {}
    for name, options in (("target", {}), ("eagle3", {"speculative_config": spec})):
        llm = LLM(target, device="cuda", **options)
        try:
            outputs[name] = [o.outputs[0] for o in llm.generate(prompts, params)]
        finally:
            llm.shutdown()
    assert [o.token_ids for o in outputs["eagle3"]] == [o.token_ids for o in outputs["target"]]
    assert outputs["eagle3"][0].text.endswith("The answer is 125.")
    assert outputs["eagle3"][0].avg_decoded_tokens_per_iter > 2.0
