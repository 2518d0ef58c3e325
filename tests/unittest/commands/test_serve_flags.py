"""trtllm-serve's flags for the common LLM options (upstream's names), beside --config."""

from pathlib import Path

import pytest

from tensorrt_llm.commands.serve import FLAG_OPTIONS, _parser, apply_flags
from tensorrt_llm.llmapi.llm_args import TorchLlmArgs


def test_the_flags_set_the_llm_options_they_name():
    args = _parser().parse_args(
        [
            "--max_batch_size",
            "16",
            "--max_num_tokens",
            "4096",
            "--max_seq_len",
            "2048",
            "--ep_size",
            "2",
            "--tp_size",
            "2",
            "--kv_cache_free_gpu_memory_fraction",
            "0.5",
            "--chat_template",
            "own.jinja",
        ]
    )
    options = {"kv_cache_config": {"tokens_per_block": 64}}
    apply_flags(options, {flag: getattr(args, flag) for flag in FLAG_OPTIONS}, None)
    llm_args = TorchLlmArgs.from_kwargs(**options)
    assert (llm_args.max_batch_size, llm_args.max_num_tokens, llm_args.max_seq_len) == (
        16,
        4096,
        2048,
    )
    assert (llm_args.tensor_parallel_size, llm_args.moe_expert_parallel_size) == (2, 2)
    kv = llm_args.kv_cache_config
    assert (kv.free_gpu_memory_fraction, kv.tokens_per_block) == (0.5, 64)
    assert llm_args.chat_template == "own.jinja"


def test_a_flag_and_the_config_setting_one_option_is_refused():
    options = {"kv_cache_config": {"free_gpu_memory_fraction": 0.8}}
    with pytest.raises(ValueError, match="kv_cache_config.free_gpu_memory_fraction in opts.yaml"):
        apply_flags(options, {"kv_cache_free_gpu_memory_fraction": 0.5}, Path("opts.yaml"))
    untouched = {"max_batch_size": 8}
    apply_flags(untouched, {"max_batch_size": None, "max_seq_len": None}, None)
    assert untouched == {"max_batch_size": 8}
