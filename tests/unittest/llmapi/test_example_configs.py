"""Every LLM option file under examples/configs loads as ``TorchLlmArgs`` (the router's config
and ``trtllm-kv-layout``'s layout file aside), and the disaggregated parallel arm's files describe the layouts they say."""

from pathlib import Path

import pytest

from tensorrt_llm.llmapi.llm_args import TorchLlmArgs, load_yaml_options

CONFIGS = sorted((Path(__file__).parents[3] / "examples" / "configs").glob("*.yaml"))
OTHER_TOOLS = {"context_servers", "layers"}  # keys of the router's and of a KV layout file
LLM_OPTIONS = [p for p in CONFIGS if not OTHER_TOOLS & set(load_yaml_options(p))]


@pytest.mark.parametrize("path", LLM_OPTIONS, ids=[p.stem for p in LLM_OPTIONS])
def test_an_example_option_file_loads(path):
    TorchLlmArgs.from_kwargs(extra_llm_api_options=path)


def test_the_parallel_disaggregated_arm_is_tp2_context_and_adp2_generation():
    folder = CONFIGS[0].parent
    context = TorchLlmArgs.from_kwargs(extra_llm_api_options=folder / "disagg_context_tp2.yaml")
    generation = TorchLlmArgs.from_kwargs(
        extra_llm_api_options=folder / "disagg_generation_adp2.yaml"
    )
    assert (
        context.mapping().describe() == "tp2-ep1-moetp2"
        and context.cache_transceiver_config is not None
    )
    assert generation.mapping().describe() == "adp2-ep1-moetp1"
    assert generation.cache_transceiver_config is not None
