"""Forged, replayed and stale transfer handles, forged pull notifications and malformed
generation-only fields, against real servers (a context server, two generation servers, a router):
each is refused with a clear error, none yields KV or a wrong 200, legitimate requests beside them
succeed, and no server keeps a slot afterwards (issue 11, items 1-4, 8 and acceptance 3)."""

import base64
import os
import secrets
import signal
import time
from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest
from conftest import disaggregated
from stress_helpers import assert_no_slot_in_use, kv_state

from tensorrt_llm._torch.disaggregation import trust
from tensorrt_llm._torch.disaggregation.params import DisaggregatedParams
from tensorrt_llm.evaluate.deployment import process_tree, running

pytest.importorskip("nixl")
pytestmark = pytest.mark.slow
QUESTION = "Ann has 58 cups. Ann gets 7 more cups. How many?"
HANDLES_HOLD_S = 10.0  # long enough for a test's steps between a prefill and its pull
PULL_S = 4.0  # how long the generation servers wait on a pull


@pytest.fixture(scope="module")
def servers(tmp_path_factory):
    with running(tmp_path_factory.mktemp("handles")) as deployment:
        yield disaggregated(
            deployment, generation=("gen", "gen2"), hold_s=HANDLES_HOLD_S, pull_s=PULL_S
        )


@pytest.fixture
def auth(servers):
    return {trust.DISAGG_AUTH_HEADER: servers.env["TRTLLM_DISAGG_SECRET"]}


@pytest.fixture(autouse=True)
def nothing_leaks(servers):
    yield
    names = ("ctx", "gen", "gen2")
    assert_no_slot_in_use(*(servers.urls[n] for n in names), within_s=HANDLES_HOLD_S + 20)


def body(params: dict | None = None, question: str = QUESTION) -> dict:
    request = {
        "messages": [{"role": "user", "content": question}],
        "max_tokens": 16,
        "temperature": 0,
    }
    return request if params is None else {**request, "disaggregated_params": params}


def prefill(servers, auth) -> dict:
    """A context server's signed reply (what the router would send on)."""
    reply = httpx.post(
        servers.urls["ctx"] + "/v1/chat/completions",
        json=body({"request_type": "context_only"}),
        headers=auth,
        timeout=60,
    )
    assert reply.status_code == 200, reply.text
    return {**reply.json()["disaggregated_params"], "request_type": "generation_only"}


def generate(servers, name: str, params: dict, headers: dict) -> httpx.Response:
    url = servers.urls[name] + "/v1/chat/completions"
    return httpx.post(url, json=body(params), headers=headers, timeout=60)


def refused(reply: httpx.Response, status: int, words: str) -> bool:
    error = reply.json()["error"]
    return reply.status_code == status and words in error["message"]


def resigned(servers, params: dict, **changes) -> dict:
    """``params`` changed and signed again with the deployment's secret: what only a server (or a
    holder of the secret) could make; the fields themselves must still be checked."""
    secret = servers.env["TRTLLM_DISAGG_SECRET"].encode()
    changed = DisaggregatedParams.model_validate({**params, **changes})
    return trust.sign(changed, secret).to_json()


def answer(servers) -> str:
    reply = httpx.post(servers.urls["router"] + "/v1/chat/completions", json=body(), timeout=60)
    assert reply.status_code == 200, reply.text
    return reply.json()["choices"][0]["message"]["content"]


def test_forged_handles_are_refused_and_the_real_one_serves(servers, auth):
    params = prefill(servers, auth)
    handle = params["transfer_handle"]
    elsewhere = {**params, "transfer_handle": {**handle, "slots": [0, 1, 2]}}
    assert refused(generate(servers, "gen", elsewhere, auth), 400, "do not match their signature")
    unsigned = {k: v for k, v in params.items() if k != "signature"}
    assert refused(generate(servers, "gen", unsigned, auth), 400, "carry no signature")
    assert generate(servers, "gen", params, {}).status_code == 403  # not from the router
    reply = generate(servers, "gen", params, auth)
    assert reply.status_code == 200
    assert reply.json()["choices"][0]["message"]["content"] == answer(servers)


def _until_released(servers, within_s: float = HANDLES_HOLD_S + 10) -> None:
    deadline = time.monotonic() + within_s
    while kv_state(servers.urls["ctx"])["held_for_transfer"] and time.monotonic() < deadline:
        time.sleep(0.1)
    assert kv_state(servers.urls["ctx"])["held_for_transfer"] == 0


def test_a_replayed_handle_is_refused_on_the_same_and_on_another_server(servers, auth):
    params = prefill(servers, auth)
    assert generate(servers, "gen", params, auth).status_code == 200
    assert refused(generate(servers, "gen", params, auth), 400, "already pulled")
    _until_released(servers)  # the first pull's notification freed the hold
    answer(servers)  # another request may own those slots now
    # (another server cannot tell a replay from a hold that ended: a failed transfer, a 502)
    assert refused(generate(servers, "gen2", params, auth), 502, "ended the hold")


def test_a_stale_handle_is_refused(servers, auth):
    params = prefill(servers, auth)
    _until_released(servers)  # nobody pulled it: the context server's hold timed out
    assert refused(generate(servers, "gen", params, auth), 502, "before the pull")


def test_forged_pull_notifications_free_nothing(servers, auth):
    from nixl._api import nixl_agent, nixl_agent_config

    params = prefill(servers, auth)
    handle = params["transfer_handle"]
    attacker = nixl_agent("attacker", nixl_agent_config(backends=["UCX"]))
    victim = attacker.add_remote_agent(base64.b64decode(handle["agent_metadata"]))
    guesses = [f"pulled:{handle['request_id']}", "pulled:" + secrets.token_urlsafe(24), "pulled:"]
    for message in [*guesses, "hello", "pulled:\xff"]:
        attacker.send_notif(victim, message.encode(errors="surrogateescape"))
    time.sleep(1.0)
    assert kv_state(servers.urls["ctx"])["held_for_transfer"] == 1  # still held for its pull
    assert generate(servers, "gen", params, auth).status_code == 200


MALFORMED = {
    "first_token": ({"first_token": 10**6}, "first_token and draft_tokens must be in"),
    "draft_tokens": ({"draft_tokens": [1] * 10}, "verifies at most max_draft_len"),
    "a negative draft": ({"draft_tokens": [-3]}, "first_token and draft_tokens must be in"),
    "prompt_token_ids": ({"prompt_token_ids": [5, 6, 7]}, "is not the one the context server"),
}


def test_malformed_generation_only_fields_fail_only_their_request(servers, auth):
    bad = {
        name: resigned(servers, prefill(servers, auth), **c) for name, (c, _) in MALFORMED.items()
    }
    with ThreadPoolExecutor(8) as pool:
        legit = [pool.submit(answer, servers) for _ in range(6)]
        replies = {n: pool.submit(generate, servers, "gen", p, auth) for n, p in bad.items()}
        expected = answer(servers)
        assert all(f.result() == expected for f in legit)
        for name, (_, words) in MALFORMED.items():
            assert refused(replies[name].result(), 400, words), (name, replies[name].text)


def test_a_frozen_context_server_holds_up_only_the_requests_pulling_from_it(servers, auth):
    """Issue 37, finding 6: the pull of a frozen context server's KV is waited for between the
    generation server's steps, never inside one; it fails as a 502 naming the context server's
    agent once the generation server's transfer timeout passes, and the requests beside it run
    on meanwhile."""
    params = prefill(servers, auth)
    agent = params["transfer_handle"]["agent_name"]
    arrivals = []

    def stream():
        body = {"prompt": "hi", "max_tokens": 400, "ignore_eos": True, "stream": True}
        with httpx.stream("POST", servers.urls["gen"] + "/v1/completions", json=body) as reply:
            for line in reply.iter_lines():
                if line.startswith("data: {"):
                    arrivals.append(time.monotonic())

    ctx = servers.procs["ctx"]
    with ThreadPoolExecutor(1) as pool:
        beside = pool.submit(stream)
        while not arrivals:
            time.sleep(0.05)
        frozen = process_tree(ctx.pid)  # the server and its engine core's process
        for pid in frozen:
            os.kill(pid, signal.SIGSTOP)
        try:
            start = time.monotonic()
            reply = generate(servers, "gen", params, auth)
            took = time.monotonic() - start
        finally:
            for pid in frozen:
                os.kill(pid, signal.SIGCONT)
        beside.result(timeout=120)
    assert refused(reply, 502, "could not be pulled from the context server") and agent in str(
        reply.json()
    )
    assert PULL_S - 1 < took < PULL_S + 5
    gaps = [b - a for a, b in zip(arrivals, arrivals[1:]) if start < b < start + took]
    assert len(gaps) > 10 and max(gaps) < 2.0, (len(gaps), max(gaps, default=None))
