"""A chat request with an image through a disaggregated deployment in one process (a router, a
context server and a generation server of a tiny random M3 with a vision tower, NIXL over UCX):
the reply equals the aggregated server's, and the generation server never reads the image (it is
a ``file://`` only the context server may open)."""

import sys
from pathlib import Path

import numpy as np
import openai
import pytest
from PIL import Image

from tensorrt_llm import LLM
from tensorrt_llm.llmapi.llm_args import CacheTransceiverConfig
from tensorrt_llm.serve.media import MediaOptions
from tensorrt_llm.serve.openai_server import OpenAIServer
from tensorrt_llm.serve.router import DisaggRouter

pytest.importorskip("nixl")
sys.path.insert(0, str(Path(__file__).parents[1] / "llmapi"))
from llm_helpers import write_tiny_vl_checkpoint  # noqa: E402


@pytest.fixture(scope="module")
def deployment(tmp_path_factory, serve_in_thread):
    root = tmp_path_factory.mktemp("disagg-vl")
    model = write_tiny_vl_checkpoint(root / "m3-vl")
    media = root / "media"
    media.mkdir()
    pixels = np.random.RandomState(3).randint(0, 255, (32, 48, 3), dtype=np.uint8)
    Image.fromarray(pixels).save(media / "picture.png")
    servers, stops, urls = [], [], {}
    for name, disagg, allowed in (("agg", False, media), ("ctx", True, media), ("gen", True, None)):
        llm = LLM(
            model,
            device="cpu",
            cache_transceiver_config=CacheTransceiverConfig() if disagg else None,
        )
        server = OpenAIServer(llm, "m3-vl", media_options=MediaOptions(allowed))
        urls[name], stop = serve_in_thread(server.app)
        servers.append(server)
        stops.append(stop)
    urls["router"], stop = serve_in_thread(DisaggRouter([urls["ctx"]], [urls["gen"]]).app)
    stops.append(stop)
    yield urls, media / "picture.png", dict(zip(("agg", "ctx", "gen"), servers, strict=True))
    for stop in stops:
        stop()
    for server in servers:
        server.close()


def test_an_image_chat_through_the_router_equals_the_aggregated_reply(deployment):
    urls, picture, servers = deployment
    messages = [
        {
            "role": "user",
            "content": [
                {"type": "text", "text": "what is in "},
                {"type": "image_url", "image_url": {"url": f"file://{picture}"}},
            ],
        }
    ]
    replies = {}
    for name in ("agg", "router"):
        client = openai.OpenAI(base_url=urls[name] + "/v1", api_key="unused")
        replies[name] = client.chat.completions.create(
            model="m3-vl", messages=messages, temperature=0, max_tokens=16
        )
    assert replies["router"].choices[0].message.content == replies["agg"].choices[0].message.content
    assert replies["router"].usage.prompt_tokens == replies["agg"].usage.prompt_tokens
    gen = servers["gen"].llm.get_stats()
    assert gen["num_context_tokens_computed"] == 0 and gen["images_encoded"] == 0
    assert gen["num_transferred_tokens"] == replies["agg"].usage.prompt_tokens
    assert servers["ctx"].llm.get_stats()["images_encoded"] == 1
    direct = openai.OpenAI(base_url=urls["gen"] + "/v1", api_key="unused")
    with pytest.raises(openai.BadRequestError, match="local files are served only under"):
        direct.chat.completions.create(model="m3-vl", messages=messages, max_tokens=4)
