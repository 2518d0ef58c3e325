"""A chat request with an image through a disaggregated deployment in one process (a router, a
context server and a generation server of M3-tiny-VL with its Eagle3 drafter, unified cache, NIXL
over UCX): the reply and its AL equal the aggregated server's, and the generation server never
reads the image (it is a ``file://`` only the context server may open)."""

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
sys.path.insert(0, str(Path(__file__).parents[3] / "examples" / "models"))
from make_m3_tiny_vl import make  # noqa: E402

QUESTION = "Ann has 58 cups. Ann gets 67 more cups. How many cups does Ann have now? "


@pytest.fixture(scope="module")
def deployment(tmp_path_factory, serve_in_thread):
    root = tmp_path_factory.mktemp("disagg-vl")
    model = make(root / "m3-tiny-vl")
    spec = {
        "decoding_type": "Eagle3",
        "max_draft_len": 3,
        "speculative_model": str(model.parent / "eagle3"),
    }
    media = root / "media"
    media.mkdir()
    pixels = np.random.RandomState(3).randint(0, 255, (32, 48, 3), dtype=np.uint8)
    Image.fromarray(pixels).save(media / "picture.png")
    servers, stops, urls = [], [], {}
    for name, disagg, allowed in (("agg", False, media), ("ctx", True, media), ("gen", True, None)):
        llm = LLM(
            model,
            device="cpu",
            speculative_config=spec,
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
                {"type": "text", "text": QUESTION},
                {"type": "image_url", "image_url": {"url": f"file://{picture}"}},
            ],
        }
    ]
    replies = {}
    for name in ("agg", "router"):
        client = openai.OpenAI(base_url=urls[name] + "/v1", api_key="unused")
        replies[name] = client.chat.completions.create(
            model="m3-vl", messages=messages, temperature=0, max_tokens=80
        )
    assert replies["router"].choices[0].message.content == replies["agg"].choices[0].message.content
    al = [replies[n].choices[0].model_extra["avg_decoded_tokens_per_iter"] for n in replies]
    assert al[0] > 1.5 and abs(al[0] - al[1]) <= 0.05  # the drafter's KV crossed too
    assert replies["router"].usage.prompt_tokens == replies["agg"].usage.prompt_tokens
    gen = servers["gen"].llm.get_stats()
    assert gen["num_context_tokens_computed"] == 0 and gen["images_encoded"] == 0
    assert gen["num_transferred_tokens"] == replies["agg"].usage.prompt_tokens
    assert servers["ctx"].llm.get_stats()["images_encoded"] == 1
    direct = openai.OpenAI(base_url=urls["gen"] + "/v1", api_key="unused")
    with pytest.raises(openai.BadRequestError, match="local files are served only under"):
        direct.chat.completions.create(model="m3-vl", messages=messages, max_tokens=4)
