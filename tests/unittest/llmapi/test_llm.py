"""LLM.generate end to end on a random-init tiny model, on the CPU."""

import pytest
import torch

from tensorrt_llm import LLM, SamplingParams
from tensorrt_llm.llmapi.llm_args import KvCacheConfig

PROMPTS = [
    "ab",
    "the quick brown fox jumps over the lazy dog 0123456789 " * 2,
    "what is 12+30? ",
    "zz " * 17,
]
GREEDY = SamplingParams(max_tokens=12, ignore_eos=True, return_generation_logits=True)


def make_llm(ckpt, **kwargs):
    kv = kwargs.pop("kv_cache_config", KvCacheConfig(tokens_per_block=8, max_tokens=2048))
    return LLM(ckpt, kv_cache_config=kv, max_batch_size=4, device="cpu", **kwargs)


def test_a_batch_of_mixed_lengths_generates_what_each_prompt_generates_alone(tiny_checkpoint):
    llm = make_llm(tiny_checkpoint)
    batched = llm.generate(PROMPTS, GREEDY)
    for prompt, out in zip(PROMPTS, batched):
        alone = make_llm(tiny_checkpoint).generate(prompt, GREEDY)
        assert out.outputs[0].token_ids == alone.outputs[0].token_ids
        assert len(out.outputs[0].token_ids) == 12 and out.outputs[0].finish_reason == "length"
        torch.testing.assert_close(
            out.outputs[0].generation_logits,
            alone.outputs[0].generation_logits,
            rtol=1e-4,
            atol=1e-4,
        )
    stats = llm.kv_cache_manager.get_kv_cache_stats()
    assert stats.num_used_slots == 0
    llm.kv_cache_report()  # checks integrity


def test_chunked_prefill_equals_single_prefill(tiny_checkpoint):
    prompt = PROMPTS[1]
    whole = make_llm(tiny_checkpoint).generate(prompt, GREEDY)
    chunked_llm = make_llm(tiny_checkpoint, max_num_tokens=13)  # the 110-token prompt takes 9 steps
    chunked = chunked_llm.generate(prompt, GREEDY)
    assert chunked_llm.get_stats()["num_steps"] == 9 + 11
    assert chunked.outputs[0].token_ids == whole.outputs[0].token_ids
    torch.testing.assert_close(
        chunked.outputs[0].generation_logits,
        whole.outputs[0].generation_logits,
        rtol=1e-4,
        atol=1e-4,
    )


def test_a_prefix_reused_run_equals_a_cold_run_and_skips_the_reused_tokens(tiny_checkpoint):
    first, second = PROMPTS[1], PROMPTS[1] + "and then some"
    cold = make_llm(tiny_checkpoint).generate(second, GREEDY)
    llm = make_llm(tiny_checkpoint)
    llm.generate(first, GREEDY)
    before = llm.get_stats()["num_context_tokens_computed"]
    warm = llm.generate(second, GREEDY)
    computed = llm.get_stats()["num_context_tokens_computed"] - before
    # The second prompt shares the first one's 110 tokens: 13 full blocks of 8 (104 tokens) are
    # reused; block 13 also holds tokens the first turn generated, so it differs.
    assert len(llm.tokenizer.encode(first)) == 110
    assert llm.get_stats()["num_reused_tokens"] == 104
    assert computed == len(warm.prompt_token_ids) - 104
    assert warm.outputs[0].token_ids == cold.outputs[0].token_ids
    torch.testing.assert_close(
        warm.outputs[0].generation_logits, cold.outputs[0].generation_logits, rtol=1e-4, atol=1e-4
    )
    # get_stats (and so a metrics scrape) counts the slots without walking the pool, which on a
    # GPU's cache of hundreds of thousands of slots would stall the engine's loop for a second;
    # the KV report checks every invariant
    walks = []
    manager = llm.kv_cache_manager
    manager.check_integrity = lambda walk=manager.check_integrity: walks.append(walk())
    assert llm.get_stats()["kv_cached_slots"] > 0 and not walks
    assert llm.kv_cache_report()["KV_CACHE_MANAGER"]["used"] == 0 and len(walks) == 1


def test_stop_conditions(tiny_checkpoint):
    llm = make_llm(tiny_checkpoint)
    free = llm.generate(PROMPTS[2], SamplingParams(max_tokens=20, ignore_eos=True))
    ids = free.outputs[0].token_ids
    stop_id = ids[3]
    stopped = llm.generate(
        PROMPTS[2], SamplingParams(max_tokens=20, stop_token_ids=[stop_id], ignore_eos=True)
    )
    first = ids.index(stop_id)
    assert stopped.outputs[0].token_ids == ids[: first + 1]
    assert stopped.outputs[0].finish_reason == "stop" and stopped.outputs[0].stop_reason == stop_id
    text = free.outputs[0].text
    stop = text[5:7]
    by_string = llm.generate(PROMPTS[2], SamplingParams(max_tokens=20, stop=stop, ignore_eos=True))
    assert by_string.outputs[0].text == text[: text.index(stop)]
    assert by_string.outputs[0].finish_reason == "stop" and by_string.outputs[0].stop_reason == stop
    eos = llm.generate(PROMPTS[2], SamplingParams(max_tokens=20, end_id=stop_id))
    assert eos.outputs[0].token_ids == ids[: first + 1] and eos.outputs[
        0
    ].text == llm.tokenizer.decode(ids[:first])
    assert llm.generate([], SamplingParams(max_tokens=4)) == []  # (it once waited forever)


def test_seeded_sampling_is_reproducible_and_differs_from_greedy(tiny_checkpoint):
    llm = make_llm(tiny_checkpoint)
    params = SamplingParams(
        max_tokens=16, temperature=1.0, top_k=20, top_p=0.9, seed=7, ignore_eos=True
    )
    a = llm.generate(PROMPTS[0], params).outputs[0].token_ids
    b = llm.generate(PROMPTS[0], params).outputs[0].token_ids
    c = (
        llm.generate(
            PROMPTS[0], SamplingParams(max_tokens=16, temperature=1.0, seed=8, ignore_eos=True)
        )
        .outputs[0]
        .token_ids
    )
    greedy = (
        llm.generate(PROMPTS[0], SamplingParams(max_tokens=16, ignore_eos=True))
        .outputs[0]
        .token_ids
    )
    assert a == b and a != c and a != greedy


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"max_batch_sise": 4}, "max_batch_sise"),
        ({"max_num_tokens": "many"}, "max_num_tokens"),
        (
            {"kv_cache_config": {"tokens_per_block": 100}},
            "tokens_per_block=100 must be a power of two",
        ),
        ({"kv_cache_config": {"enable_block_reuse": True, "free_mem": 0.5}}, "free_mem"),
        ({"dtype": "float64"}, "dtype"),
    ],
)
def test_bad_configs_name_the_key_and_value(tiny_checkpoint, kwargs, message):
    with pytest.raises(ValueError, match=message):
        LLM(tiny_checkpoint, device="cpu", **kwargs)


def test_yaml_options_file(tiny_checkpoint, tmp_path):
    options = tmp_path / "opts.yaml"
    options.write_text(
        "max_batch_size: 2\nkv_cache_config:\n  tokens_per_block: 16\n  max_tokens: 512\n"
    )
    llm = LLM(tiny_checkpoint, device="cpu", extra_llm_api_options=options)
    assert llm.args.max_batch_size == 2 and llm.kv_cache_manager.tokens_per_block == 16
    assert llm.kv_cache_manager.blocks_in_primary_pool == 32
    options.write_text("max_batch_size: 2\nunknown_key: 1\n")
    with pytest.raises(ValueError, match="unknown_key"):
        LLM(tiny_checkpoint, device="cpu", extra_llm_api_options=options)
    with pytest.raises(ValueError, match="max_batch_size"):
        LLM(tiny_checkpoint, device="cpu", max_batch_size=3, extra_llm_api_options=options)


def test_a_prompt_longer_than_max_seq_len_is_rejected_and_nothing_leaks(tiny_checkpoint):
    llm = make_llm(tiny_checkpoint, max_seq_len=64)
    with pytest.raises(ValueError, match="prompt of 70 tokens exceeds max_seq_len=64"):
        llm.generate(["ok", "x" * 70], GREEDY)
    assert llm.get_stats()["active_requests"] == 0
    assert llm.generate("ok", GREEDY).outputs[0].finish_reason == "length"
    assert llm.kv_cache_report()["KV_CACHE_MANAGER"]["used"] == 0


def copy_checkpoint(src, dst, config_changes=None, generation_config=None):
    import json
    import shutil

    shutil.copytree(src, dst)
    if config_changes:
        data = json.loads((dst / "config.json").read_text())
        (dst / "config.json").write_text(json.dumps({**data, **config_changes}))
    if generation_config is not None:
        (dst / "generation_config.json").write_text(json.dumps(generation_config))
    return dst


def test_any_of_the_end_ids_ends_a_request(tiny_checkpoint, tmp_path):
    """``eos_token_id`` as a list (config.json or generation_config.json): any of them stops."""
    free = make_llm(tiny_checkpoint).generate(
        PROMPTS[2], SamplingParams(max_tokens=20, ignore_eos=True)
    )
    ids = free.outputs[0].token_ids
    first, second = ids[3], ids[6]
    firsts = min(ids.index(first), ids.index(second))
    for changes, generation in (
        ({"eos_token_id": [9999, second, first]}, None),
        (None, {"eos_token_id": [first, second]}),
    ):
        ckpt = copy_checkpoint(
            tiny_checkpoint, tmp_path / f"c{len(list(tmp_path.iterdir()))}", changes, generation
        )
        llm = make_llm(ckpt)
        assert set(llm.eos_token_ids) >= {first, second}
        out = llm.generate(PROMPTS[2], SamplingParams(max_tokens=20))
        assert out.outputs[0].token_ids == ids[: firsts + 1]
        assert out.outputs[0].finish_reason == "stop"


def test_generation_config_gives_the_sampling_defaults(tiny_checkpoint, tmp_path):
    """As transformers' generate: with do_sample the file's values (else 1.0, 1.0, 50) fill what a
    request leaves unset; without it requests stay greedy."""
    sampled = {"do_sample": True, "temperature": 0.7, "top_p": 0.9}
    llm = make_llm(copy_checkpoint(tiny_checkpoint, tmp_path / "s", generation_config=sampled))
    params = llm.generation_defaults.apply(SamplingParams(max_tokens=4, top_p=0.5))
    assert (params.temperature, params.top_p, params.top_k) == (0.7, 0.5, 50)  # the request wins
    defaults = llm.generation_defaults  # the server's unset temperature too
    assert (defaults.openai_temperature(None), defaults.openai_temperature(0.2)) == (0.7, 0.2)
    for name, greedy in (("g", {"do_sample": False, "temperature": 0.7}), ("n", {"top_k": 3})):
        llm = make_llm(copy_checkpoint(tiny_checkpoint, tmp_path / name, generation_config=greedy))
        params = llm.generation_defaults.apply(SamplingParams(max_tokens=4))
        assert params.temperature is None and params.top_k is None  # greedy by default
    bad = {"do_sample": True, "temperature": -1}
    with pytest.raises(ValueError, match=r"generation_config.json: SamplingParams.temperature=-1"):
        make_llm(copy_checkpoint(tiny_checkpoint, tmp_path / "b", generation_config=bad))


def test_without_a_tokenizer_prompts_are_token_ids(tiny_checkpoint):
    llm = make_llm(tiny_checkpoint, skip_tokenizer_init=True)
    assert llm.tokenizer is None
    out = llm.generate([3, 4, 5], SamplingParams(max_tokens=4, ignore_eos=True))
    assert len(out.outputs[0].token_ids) == 4 and out.outputs[0].text == ""
    with pytest.raises(
        ValueError, match="skip_tokenizer_init=True: prompts must be lists of token"
    ):
        llm.generate("ab")
    with pytest.raises(ValueError, match="stop strings and bad words need a tokenizer"):
        llm.generate([3, 4], SamplingParams(stop="x"))


def test_submit_streams_outputs_cancel_frees_the_slots_and_bad_input_takes_nothing(tiny_checkpoint):
    """The front door a server uses: ``submit`` with a callback (on the engine loop's thread),
    ``cancel``, ``kv_cache_report``; a request that cannot run raises at once."""
    import threading

    from tensorrt_llm.llmapi import GenerationRequest

    llm = make_llm(tiny_checkpoint)
    expected = llm.generate(PROMPTS[1], GREEDY).outputs[0].token_ids
    seen: dict[int, list] = {}
    done = threading.Event()
    ids: list[int] = []

    def on_update(output):
        seen.setdefault(output.request_id, []).append(output)
        if len(ids) == 2 and output.request_id == ids[1] and not output.finished:
            llm.cancel(ids[1])  # once it has its first token
        if len(ids) == 2 and all(seen.get(i) and seen[i][-1].finished for i in ids):
            done.set()

    endless = SamplingParams(max_tokens=500, ignore_eos=True)
    ids += [llm.submit(GenerationRequest(PROMPTS[1], GREEDY), on_update)]
    ids += [llm.submit(GenerationRequest(PROMPTS[2], endless), on_update)]
    assert done.wait(60)
    whole, cancelled = seen[ids[0]], seen[ids[1]]
    assert (
        whole[-1].outputs[0].token_ids == expected
        and whole[-1].outputs[0].finish_reason == "length"
    )
    lengths = [len(o.outputs[0].token_ids) for o in whole]
    assert lengths == sorted(lengths) and lengths[-1] == 12 and len(whole) > 2  # step by step
    assert cancelled[-1].outputs[0].finish_reason == "cancelled"
    assert len(cancelled[-1].outputs[0].token_ids) < 500
    with pytest.raises(ValueError, match="prompt token ids must be in"):
        llm.submit(GenerationRequest([10**6], GREEDY), on_update)
    with pytest.raises(TypeError, match="a prompt must be a str or a list of token ids"):
        llm.submit(GenerationRequest(3.5, GREEDY), on_update)
    report = llm.kv_cache_report()
    assert report["KV_CACHE_MANAGER"]["used"] == 0 and report["active_requests"] == 0
    # generate() goes through the running loop now, and gives the same tokens
    assert llm.generate(PROMPTS[1], GREEDY).outputs[0].token_ids == expected
    llm.shutdown()
    llm.shutdown()  # (a second call does nothing)
    llm.cancel(ids[0])  # (ignored)
    assert llm.model is None and llm.executor is None  # nothing holds the weights or the KV
    with pytest.raises(RuntimeError, match="shut down"):
        llm.generate(PROMPTS[1], GREEDY)
