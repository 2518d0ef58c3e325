"""``trtllm-serve --tp_size 2`` and attention DP behind the OpenAI API (real server processes on
the CPU, ranks over gloo): the replies equal one rank's, streamed or not, a client that hangs up
mid-stream costs nothing, and the server stops cleanly with its ranks."""

import os
import signal
import time
from pathlib import Path

import httpx
import pytest

from tensorrt_llm.evaluate.deployment import metric, running

pytestmark = pytest.mark.slow
QUESTION = [{"role": "user", "content": "Ann has 58 cups. Ann gets 67 more cups. How many now?"}]
BODY = {"messages": QUESTION, "temperature": 0, "max_tokens": 40}


def chat(url: str, **extra) -> str:
    reply = httpx.post(url + "/v1/chat/completions", json={**BODY, **extra}, timeout=120)
    reply.raise_for_status()
    return reply.json()["choices"][0]["message"]["content"]


def streamed(url: str) -> str:
    text = ""
    with httpx.stream(
        "POST", url + "/v1/chat/completions", json={**BODY, "stream": True}, timeout=120
    ) as reply:
        for line in reply.iter_lines():
            if line.startswith("data: {"):
                delta = httpx.Response(200, content=line[6:]).json()["choices"][0]["delta"]
                text += delta.get("content") or ""
    return text


def hang_up_mid_stream(url: str) -> None:
    body = {**BODY, "max_tokens": 200, "stream": True, "ignore_eos": True}
    with httpx.stream("POST", url + "/v1/chat/completions", json=body, timeout=120) as reply:
        for line in reply.iter_lines():
            if line.startswith("data: {"):
                return  # one event, then the client goes away


def test_tp2_and_adp2_servers_answer_as_one_rank(tmp_path):
    with running(tmp_path) as servers:
        servers.server("one", {})
        servers.start("tp2", ["--tp_size", "2", "--device", "cpu"])
        servers.server("adp2", {"tensor_parallel_size": 2, "enable_attention_dp": True})
        servers.wait_healthy()
        expected = chat(servers.urls["one"])
        for name in ("tp2", "adp2"):
            url = servers.urls[name]
            assert chat(url) == expected, name
            assert streamed(url) == expected, name
            for _ in range(3):
                hang_up_mid_stream(url)
            assert chat(url) == expected, name  # the ranks are still in step
            report = httpx.get(url + "/kv_cache", timeout=30).json()
            assert report["active_requests"] == 0, (name, report)
            assert metric(url, "trtllm_generation_tokens_total") > 0, name  # /metrics answers
        procs = dict(servers.procs)
    for name in ("tp2", "adp2"):
        assert procs[name].returncode == 0, servers.log(name)[-2000:]


def spawned(pid: int) -> list[int]:
    """The processes ``pid`` started with multiprocessing's spawn."""
    children = Path(f"/proc/{pid}/task/{pid}/children").read_text().split()
    return [int(c) for c in children if b"spawn_main" in Path(f"/proc/{c}/cmdline").read_bytes()]


def test_a_server_that_loses_a_rank_says_so_instead_of_hanging(tmp_path):
    with running(tmp_path) as servers:
        servers.start("tp2", ["--tp_size", "2", "--device", "cpu"])
        servers.wait_healthy()
        url, pid = servers.urls["tp2"], servers.procs["tp2"].pid
        (core,) = spawned(pid)  # the engine core's process, and rank 1 under it
        (rank1,) = spawned(core)
        os.kill(rank1, signal.SIGKILL)
        deadline = time.time() + 10
        while httpx.get(url + "/health").status_code == 200 and time.time() < deadline:
            time.sleep(0.1)
        health = httpx.get(url + "/health")
        assert health.status_code == 503 and "rank 1 exited" in health.json()["reason"]
        reply = httpx.post(url + "/v1/chat/completions", json=BODY, timeout=30)
        assert reply.status_code == 503 and "lost a rank" in reply.json()["error"]["message"]
        # and it stops when told to: its engine core's process (alive) is told to shut down too
        servers.procs["tp2"].terminate()
        assert servers.procs["tp2"].wait(timeout=20) is not None


def test_tp_size_and_the_option_file_cannot_both_set_it(tmp_path):
    from tensorrt_llm.commands.serve import build_server

    config = tmp_path / "options.yaml"
    config.write_text("tensor_parallel_size: 2\n")
    with pytest.raises(ValueError, match="--tp_size 2 and tensor_parallel_size in"):
        build_server(None, config, "cpu", tp_size=2)
