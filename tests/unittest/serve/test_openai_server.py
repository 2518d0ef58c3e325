"""A live trtllm-serve (bundled model, Eagle3 unified, CPU) driven by the openai client."""

import time

import httpx
import openai
import pytest

from tensorrt_llm.bundled import bundled_prompt


@pytest.fixture(scope="module")
def server(bundled_server):
    return bundled_server


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=server[1] + "/v1", api_key="unused")


QUESTION = "Ann has 58 cups. Ann gets 67 more cups. How many cups does Ann have now?"


def test_models_and_health(server, client):
    assert [m.id for m in client.models.list().data] == ["target"]
    assert httpx.get(server[1] + "/health").json() == {"status": "ok"}


def test_chat_completion_streamed_equals_non_streamed(client):
    messages = [{"role": "user", "content": QUESTION}]
    whole = client.chat.completions.create(
        model="target", messages=messages, temperature=0, max_tokens=80
    )
    text = whole.choices[0].message.content
    assert text.endswith("The answer is 125.") and whole.choices[0].finish_reason == "stop"
    assert whole.choices[0].model_extra["avg_decoded_tokens_per_iter"] > 2.0
    chunks = client.chat.completions.create(
        model="target", messages=messages, temperature=0, max_tokens=80, stream=True
    )
    pieces = [c.choices[0].delta.content or "" for c in chunks]
    assert "".join(pieces) == text and len(pieces) > 2


def test_completion_streamed_equals_non_streamed_with_a_stop_string(client):
    prompt = bundled_prompt(QUESTION, thinking_mode="disabled")
    whole = client.completions.create(
        model="target", prompt=prompt, temperature=0, max_tokens=80, stop=[", so"]
    )
    assert whole.choices[0].text == "58 + 67: 8 + 7 = 15, 5 + 6 + 1 = 12"
    chunks = client.completions.create(
        model="target", prompt=prompt, temperature=0, max_tokens=80, stop=[", so"], stream=True
    )
    assert "".join(c.choices[0].text for c in chunks) == whole.choices[0].text


def test_errors_are_openai_error_objects(server, client):
    with pytest.raises(openai.NotFoundError) as info:
        client.completions.create(model="nope", prompt="hi", max_tokens=4)
    assert "does not exist" in info.value.body["message"]
    with pytest.raises(openai.BadRequestError) as info:
        client.completions.create(model="target", prompt="hi", max_tokens=0)
    assert info.value.body["param"] == "max_tokens"
    with pytest.raises(openai.BadRequestError) as info:
        client.completions.create(model="target", prompt="x" * 5000, max_tokens=4)
    assert "max_seq_len" in info.value.body["message"]
    reply = httpx.post(server[1] + "/v1/chat/completions", json={"messages": [], "max_tokens": 4})
    assert reply.status_code == 400 and reply.json()["error"]["type"] == "invalid_request_error"


def test_a_disconnected_stream_frees_its_slots_and_metrics_report(server):
    srv, url = server
    with httpx.stream(
        "POST",
        url + "/v1/completions",
        json={
            "prompt": "Repeat the list. " * 3,
            "max_tokens": 500,
            "stream": True,
            "ignore_eos": True,
        },
    ) as response:
        for _ in response.iter_lines():
            break  # leave after the first event
    deadline = time.time() + 20
    while time.time() < deadline and srv.llm.kv_cache_report()["KV_CACHE_MANAGER"]["used"]:
        time.sleep(0.1)
    assert srv.llm.kv_cache_report()["KV_CACHE_MANAGER"]["used"] == 0
    text = httpx.get(url + "/metrics").text
    assert 'trtllm_draft_kv_mode{mode="target manager\'s draft sub-page view"} 1' in text
    assert "trtllm_acceptance_length" in text and 'trtllm_kv_cache_slots{state="used"} 0' in text


def test_a_disconnected_non_streamed_request_is_cancelled(server):
    # issue 11, item 10: an abandoned non-streamed request used to run to its end, holding slots
    srv, url = server
    body = {"prompt": "Count on. " * 3, "max_tokens": 900, "ignore_eos": True}
    with pytest.raises(httpx.ReadTimeout):
        httpx.post(url + "/v1/completions", json=body, timeout=httpx.Timeout(5.0, read=1.0))
    deadline = time.time() + 5  # the 900 tokens alone take far longer on the CPU
    while time.time() < deadline and srv.llm.kv_cache_report()["KV_CACHE_MANAGER"]["used"]:
        time.sleep(0.1)
    assert srv.llm.kv_cache_report()["KV_CACHE_MANAGER"]["used"] == 0


@pytest.mark.parametrize(
    "params, param, message",
    [
        (
            {"request_type": "prefill_only"},
            "disaggregated_params.request_type",
            "disaggregated_params.request_type: Input should be 'context_only'",
        ),
        (
            {"request_type": "generation_only"},
            "disaggregated_params",
            "missing ['first_token', 'prompt_token_ids', 'transfer_handle']",
        ),
        (  # well formed, but this server has no transceiver
            {"request_type": "context_only"},
            "disaggregated_params",
            "this server has no cache_transceiver_config",
        ),
    ],
)
def test_a_bad_disaggregated_request_is_a_400_naming_disaggregated_params(
    server, params, param, message
):
    reply = httpx.post(
        server[1] + "/v1/completions",
        json={"prompt": "hi", "max_tokens": 4, "disaggregated_params": params},
    )
    error = reply.json()["error"]
    assert reply.status_code == 400 and error["param"] == param and message in error["message"]


HISTOGRAMS = (
    "trtllm_time_to_first_token_seconds",
    "trtllm_inter_token_latency_seconds",
    "trtllm_e2e_request_latency_seconds",
    "trtllm_request_queue_time_seconds",
    "trtllm_request_handoff_time_seconds",
    "trtllm_request_acceptance_length",
)


def scrape(url: str) -> dict[str, dict[str, float]]:
    """``/metrics`` parsed by prometheus_client: family -> sample name (with labels) -> value."""
    from prometheus_client.parser import text_string_to_metric_families

    families = {}
    for family in text_string_to_metric_families(httpx.get(url + "/metrics").text):
        samples = {}
        for s in family.samples:
            labels = ",".join(f"{k}={v}" for k, v in sorted(s.labels.items()) if k != "le")
            key = s.name + (f"{{{labels}}}" if labels else "")
            if "le" not in s.labels:
                samples[key] = s.value
        families[family.name] = samples
    return families


def test_metrics_parse_and_the_latency_histograms_move(server, client):
    # issue 12, acceptance 3
    _, url = server
    before = scrape(url)
    assert all(before[h].get(h + "_count") is not None for h in HISTOGRAMS), sorted(before)
    for stream in (False, True):
        reply = client.completions.create(
            model="target",
            prompt=QUESTION,
            max_tokens=12,
            temperature=0,
            stream=stream,
            extra_body={"ignore_eos": True},
        )
        if stream:
            list(reply)
    after = scrape(url)
    for name in HISTOGRAMS:
        assert after[name][name + "_count"] >= before[name][name + "_count"] + 2, name
        assert after[name][name + "_sum"] > before[name][name + "_sum"], name
    # the handoff (arrival to the engine core receiving the request) is part of the queue time
    moved = {
        name: after[f"trtllm_request_{name}_time_seconds"][
            f"trtllm_request_{name}_time_seconds_sum"
        ]
        - before[f"trtllm_request_{name}_time_seconds"][f"trtllm_request_{name}_time_seconds_sum"]
        for name in ("queue", "handoff")
    }
    assert 0 < moved["handoff"] <= moved["queue"]
    itl = after["trtllm_inter_token_latency_seconds"]["trtllm_inter_token_latency_seconds_count"]
    assert (
        itl
        - before["trtllm_inter_token_latency_seconds"]["trtllm_inter_token_latency_seconds_count"]
        >= 2 * (12 - 1) - 2
    )  # about one interval per token after the first
    assert after["trtllm_requests"]["trtllm_requests_total"] >= 2
    assert after["trtllm_kv_cache_slots"]["trtllm_kv_cache_slots{state=used}"] == 0
    # the bundled target's MoE layers (8 experts, top-2, on one rank): every routed token counted
    routed = after["trtllm_moe_expert_tokens"]
    moved = sum(routed.values()) - sum(before["trtllm_moe_expert_tokens"].values())
    assert len(routed) == 8 and moved >= 2 * 3 * 2 * 12  # 2 requests x 3 layers x top-2 x tokens
    load = after["trtllm_moe_expert_load"]
    assert load["trtllm_moe_expert_load_count{rank=0}"] == 8
    assert load["trtllm_moe_expert_load_sum{rank=0}"] == pytest.approx(8.0)  # shares of the mean
    assert after["trtllm_moe_rank_imbalance"]["trtllm_moe_rank_imbalance"] == 1.0


def test_include_usage_ends_the_stream_with_the_usage(client):
    chunks = list(
        client.chat.completions.create(
            model="target",
            messages=[{"role": "user", "content": QUESTION}],
            max_tokens=9,
            temperature=0,
            stream=True,
            stream_options={"include_usage": True},
            extra_body={"ignore_eos": True},
        )
    )
    assert all(c.usage is None for c in chunks[:-1]) and chunks[-1].choices == []
    usage = chunks[-1].usage
    assert usage.completion_tokens == 9 and usage.total_tokens == usage.prompt_tokens + 9


def test_logprobs_in_chat_and_completions_streamed_or_not(client):
    # issue 12, acceptance 2: a greedy token's logprob is the largest of its top_logprobs
    # (thinking disabled: every token is content; a reasoning block's tokens have theirs too)
    messages = [{"role": "user", "content": QUESTION}]
    common = {"model": "target", "max_tokens": 10, "temperature": 0}
    extra = {"ignore_eos": True, "chat_template_kwargs": {"thinking_mode": "disabled"}}
    chat = client.chat.completions.create(
        messages=messages, logprobs=True, top_logprobs=3, extra_body=extra, **common
    )
    content = chat.choices[0].logprobs.content
    assert len(content) == chat.usage.completion_tokens == 10
    assert "".join(t.token for t in content) == chat.choices[0].message.content
    for token in content:
        assert len(token.top_logprobs) == 3
        assert token.logprob == max(t.logprob for t in token.top_logprobs)
        assert token.top_logprobs[0].token == token.token
    chunks = client.chat.completions.create(
        messages=messages,
        logprobs=True,
        top_logprobs=3,
        stream=True,
        extra_body=extra,
        **common,
    )
    streamed = [
        t
        for c in chunks
        if c.choices and c.choices[0].logprobs
        for t in c.choices[0].logprobs.content
    ]
    assert [(t.token, t.logprob) for t in streamed] == [(t.token, t.logprob) for t in content]
    completion = client.completions.create(prompt=QUESTION, logprobs=2, **common)
    logprobs = completion.choices[0].logprobs
    assert "".join(logprobs.tokens) == completion.choices[0].text
    assert logprobs.text_offset[0] == 0 and len(logprobs.top_logprobs[0]) == 2
    for logprob, top in zip(logprobs.token_logprobs, logprobs.top_logprobs, strict=True):
        assert logprob == max(top.values())


def test_top_logprobs_without_logprobs_is_a_400(server):
    body = {"messages": [{"role": "user", "content": "hi"}], "top_logprobs": 2}
    reply = httpx.post(server[1] + "/v1/chat/completions", json=body)
    assert (
        reply.status_code == 400
        and "top_logprobs needs logprobs" in reply.json()["error"]["message"]
    )


def test_n_samples_and_prompt_lists(server, client):
    # issue 12, acceptance 2: greedy n=3 gives three identical answers; the samples after the
    # first reuse its prompt KV from the prefix cache
    srv, _ = server
    reused = srv.llm.get_stats()["num_reused_tokens"]
    long_question = " ".join([QUESTION] * 4)  # over two 128-token blocks (reuse is per block)
    chat = client.chat.completions.create(
        model="target",
        messages=[{"role": "user", "content": long_question}],
        max_tokens=12,
        temperature=0,
        n=3,
        extra_body={"chat_template_kwargs": {"thinking_mode": "disabled"}},  # all content
    )
    assert [c.index for c in chat.choices] == [0, 1, 2]
    assert len({c.message.content for c in chat.choices}) == 1
    assert chat.usage.completion_tokens == sum(
        len(srv.llm.tokenizer.encode(c.message.content)) + (c.finish_reason == "stop")
        for c in chat.choices
    )
    assert srv.llm.get_stats()["num_reused_tokens"] > reused
    sampled = client.completions.create(
        model="target", prompt=QUESTION, max_tokens=12, temperature=1.0, seed=5, n=3
    )
    assert len({c.text for c in sampled.choices}) > 1  # seed, seed + 1, seed + 2
    prompts = [
        QUESTION,
        "Ben has 93 pens. Ben gives away 45 pens. How many pens does Ben have left?",
    ]
    many = client.completions.create(model="target", prompt=prompts, max_tokens=8, temperature=0)
    one = [
        client.completions.create(model="target", prompt=p, max_tokens=8, temperature=0)
        for p in prompts
    ]
    assert [c.text for c in many.choices] == [o.choices[0].text for o in one]
    assert many.usage.prompt_tokens == sum(o.usage.prompt_tokens for o in one)
    chunks = list(
        client.completions.create(
            model="target",
            prompt=prompts,
            max_tokens=8,
            temperature=0,
            n=2,
            stream=True,
            stream_options={"include_usage": True},
        )
    )
    texts = ["", "", "", ""]
    for chunk in chunks:
        for c in chunk.choices:
            texts[c.index] += c.text
    assert texts == [one[0].choices[0].text] * 2 + [one[1].choices[0].text] * 2
    assert chunks[-1].usage.prompt_tokens == many.usage.prompt_tokens


def test_logit_bias_and_penalties(server, client):
    srv, _ = server
    seven = srv.llm.tokenizer.encode("7")[0]
    forced = client.completions.create(
        model="target", prompt=QUESTION, max_tokens=6, temperature=0, logit_bias={str(seven): 100}
    )
    assert forced.choices[0].text == "777777"
    messages = [{"role": "user", "content": "aaaa bbbb"}]  # an unsure prompt: penalties show

    def answer(**penalties):
        reply = client.chat.completions.create(
            model="target", messages=messages, max_tokens=24, temperature=0, **penalties
        )
        return reply.choices[0].message.content

    plain = answer()
    assert answer(presence_penalty=2.0) != plain and answer(frequency_penalty=2.0) != plain
