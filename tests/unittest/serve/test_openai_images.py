"""Chat requests with images (OpenAI ``image_url`` content parts) on a live trtllm-serve of a tiny
random MiniMax-M3 with a vision tower, driven by the openai client; bad images get 400s that name
the content part, and leave the server serving with no KV slot held."""

import base64
import io

import httpx
import numpy as np
import openai
import pytest
from PIL import Image

from tensorrt_llm import SamplingParams
from tensorrt_llm.inputs import IMAGE_TOKEN


def png(seed: int, height: int = 30, width: int = 40) -> bytes:
    pixels = np.random.RandomState(seed).randint(0, 255, (height, width, 3), dtype=np.uint8)
    buffer = io.BytesIO()
    Image.fromarray(pixels).save(buffer, format="PNG")
    return buffer.getvalue()


def data_url(data: bytes, kind: str = "png") -> str:
    return f"data:image/{kind};base64," + base64.b64encode(data).decode()


def ask(url: str, text: str = "what is this?") -> list[dict]:
    return [
        {
            "role": "user",
            "content": [
                {"type": "text", "text": text},
                {"type": "image_url", "image_url": {"url": url}},
            ],
        }
    ]


@pytest.fixture(scope="module")
def client(vl_server):
    return openai.OpenAI(base_url=vl_server[1] + "/v1", api_key="unused")


def test_a_data_url_image_is_answered_as_llm_generate_answers_it(vl_server, client):
    server = vl_server[0]
    reply = client.chat.completions.create(
        model="m3-vl", messages=ask(data_url(png(1))), temperature=0, max_tokens=12
    )
    image = Image.open(io.BytesIO(png(1)))
    prompt = f"<|user|>what is this?{IMAGE_TOKEN}<|end|><|assistant|>"
    direct = server.llm.generate(
        {"prompt": prompt, "multi_modal_data": {"image": [image]}},
        SamplingParams(max_tokens=12, temperature=0),
    )
    assert reply.choices[0].message.content == direct.outputs[0].text
    assert reply.usage.prompt_tokens == len(direct.prompt_token_ids)
    num_image_tokens = direct.prompt_token_ids.count(server.llm.model_config.vision.image_token_id)
    # 30x40 pixels are over max_pixels (32 * 32): resized to 24x32, 6x8 patches, 12 tokens
    assert num_image_tokens == 12
    assert server.llm.get_stats()["images_encoded"] >= 1
    metrics = httpx.get(vl_server[1] + "/metrics").text
    assert "trtllm_images_encoded_total" in metrics and "trtllm_image_cache_hits_total" in metrics


def test_a_local_file_under_the_allowed_path_is_taken(vl_server, client):
    media = vl_server[2]
    (media / "cat.png").write_bytes(png(2))
    reply = client.chat.completions.create(
        model="m3-vl", messages=ask(f"file://{media / 'cat.png'}"), temperature=0, max_tokens=4
    )
    assert reply.choices[0].finish_reason in ("stop", "length")


BAD = {
    "not an image": (data_url(b"definitely not a png"), "not a decodable image"),
    "not base64": ("data:image/png;base64,@@@@", "not valid base64"),
    "not a data URL of an image": ("data:text/plain;base64,aGk=", "data:image/<type>;base64"),
    "another scheme": ("ftp://example.com/cat.png", "scheme 'ftp' is not served"),
    "a file outside the allowed path": ("file:///etc/hostname", "outside the allowed media path"),
    "a missing file": ("file://{media}/missing.png", "no file"),
    "a loopback URL": ("http://127.0.0.1:9/cat.png", "could not get an image from this URL"),
    "too narrow": (data_url(png(3, 1, 300)), "image of 300x1 pixels: aspect ratio above 200"),
}


@pytest.mark.parametrize("case", sorted(BAD))
def test_a_bad_image_is_a_400_naming_the_content_part(vl_server, case):
    url, message = BAD[case]
    url = url.format(media=vl_server[2])
    response = httpx.post(
        vl_server[1] + "/v1/chat/completions",
        json={"messages": ask(url), "max_tokens": 4},
        timeout=60,
    )
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert error["param"] == "messages.0.content.1"
    assert message in error["message"]


def test_too_many_images_and_images_outside_user_messages_are_refused(vl_server):
    url = data_url(png(4))
    parts = [{"type": "image_url", "image_url": {"url": url}}] * 17
    too_many = [{"role": "user", "content": parts}]
    from_assistant = [
        {"role": "user", "content": "hi"},
        {"role": "assistant", "content": [{"type": "image_url", "image_url": {"url": url}}]},
    ]
    for messages, message, param in (
        (too_many, "17 images in one request; at most 16", "messages"),
        (from_assistant, "images are taken in user messages", "messages.1.content.0"),
    ):
        response = httpx.post(
            vl_server[1] + "/v1/chat/completions",
            json={"messages": messages, "max_tokens": 4},
            timeout=60,
        )
        assert response.status_code == 400, response.text
        assert message in response.json()["error"]["message"]
        assert response.json()["error"]["param"] == param


def test_after_the_refusals_the_server_serves_and_holds_no_slot(vl_server, client):
    server = vl_server[0]
    httpx.post(
        vl_server[1] + "/v1/chat/completions",
        json={"messages": ask(data_url(b"junk")), "max_tokens": 4},
        timeout=60,
    )
    reply = client.chat.completions.create(
        model="m3-vl", messages=ask(data_url(png(5))), temperature=0, max_tokens=4
    )
    assert reply.choices[0].message.content is not None
    assert httpx.get(vl_server[1] + "/health").json() == {"status": "ok"}
    stats = server.llm.get_stats()
    assert stats["active_requests"] == 0 and stats["kv_used_slots"] == 0


def test_a_model_without_a_vision_tower_refuses_images(bundled_server):
    response = httpx.post(
        bundled_server[1] + "/v1/chat/completions",
        json={"messages": ask(data_url(png(6))), "max_tokens": 4},
        timeout=60,
    )
    assert response.status_code == 400
    assert "this model takes no images" in response.json()["error"]["message"]
    assert response.json()["error"]["param"] == "messages.0.content.1"
