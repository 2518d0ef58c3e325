"""trtllm-serve watches its engine core: a core that finishes no step for
``engine_core_deadline_s`` (here a stopped process) or whose process dies ends its requests with
503s, is killed with its ranks and replaced; ``/health`` and ``/kv_cache`` answer 503 at once
meanwhile, and the new core serves with no KV slot held. ``RestartPolicy`` bounds the starts."""

import json
import os
import signal
import threading
import time
from pathlib import Path

import httpx
import pytest

from tensorrt_llm import LLM
from tensorrt_llm.llmapi.core_handle import Heartbeat, RestartPolicy
from tensorrt_llm.llmapi.core_worker import _Outputs, decode
from tensorrt_llm.sampling_params import SamplingParams

DEADLINE_S = 3.0
STREAM = {"prompt": "Ann has 58 cups.", "max_tokens": 400, "ignore_eos": True, "temperature": 0}


@pytest.fixture(scope="module")
def watched(tmp_path_factory, serve_in_thread):
    """A server of the bundled model (CPU) whose engine core counts as hung after 3 s without a
    step, and whose restarts wait 0.2 s: (OpenAIServer, base URL)."""
    from tensorrt_llm.commands.serve import build_server

    options = tmp_path_factory.mktemp("watched") / "options.yaml"
    options.write_text(f"engine_core_deadline_s: {DEADLINE_S}\n")
    server = build_server(None, options, device="cpu")
    server.llm._core.restart_policy = RestartPolicy(backoff_s=0.2)
    url, stop = serve_in_thread(server.app)
    yield server, url
    stop()
    server.close()


def stream(url: str) -> tuple[list, threading.Event, threading.Thread]:
    """A streamed completion on a thread: (its events, set at the first, the thread)."""
    events, started = [], threading.Event()

    def read() -> None:
        body = {**STREAM, "stream": True}
        with httpx.stream("POST", url + "/v1/completions", json=body, timeout=60) as reply:
            for line in reply.iter_lines():
                if line.startswith("data: ") and line != "data: [DONE]":
                    events.append(json.loads(line[6:]))
                    started.set()

    reader = threading.Thread(target=read)
    reader.start()
    return events, started, reader


def replaced(server, url: str, restarts: int) -> None:
    """Wait for the new core; then it serves, and no KV slot is held."""
    deadline = time.monotonic() + 60
    while httpx.get(url + "/health").status_code != 200 and time.monotonic() < deadline:
        time.sleep(0.1)
    assert httpx.get(url + "/health").json() == {"status": "ok", "engine_core_restarts": restarts}
    reply = httpx.post(url + "/v1/completions", json={**STREAM, "max_tokens": 4}, timeout=30)
    assert reply.status_code == 200 and reply.json()["usage"]["completion_tokens"] == 4
    report = httpx.get(url + "/kv_cache", timeout=30).json()
    used = {name: kv["used"] for name, kv in report.items() if isinstance(kv, dict)}
    assert report["active_requests"] == 0 and used and set(used.values()) == {0}, report


def quick_503(url: str, path: str, text: str) -> None:
    began = time.monotonic()
    reply = httpx.get(url + path, timeout=10)
    assert time.monotonic() - began < 1.0
    message = reply.json()["error"]["message"] if path != "/health" else reply.json()["reason"]
    assert reply.status_code == 503 and text in message, (path, reply.text)


def test_a_stopped_core_fails_its_stream_health_and_kv_report_at_the_deadline(watched):
    server, url = watched
    restarts = server.llm.engine_core_restarts()
    events, started, reader = stream(url)
    core = server.llm._core._process
    try:
        assert started.wait(60)
        os.kill(core.pid, signal.SIGSTOP)  # what a stuck kernel or collective looks like
        stopped_at = time.monotonic()
        assert httpx.get(url + "/health").status_code == 200  # (a step may take this long)
        # a KV report asked of the stopped core waits for the deadline, no longer
        report = httpx.get(url + "/kv_cache", timeout=30)
        waited_s = time.monotonic() - stopped_at
        assert DEADLINE_S - 1 < waited_s < DEADLINE_S + 2, waited_s
        stall = "the engine core has not finished a step for"
        assert report.status_code == 503 and stall in report.json()["error"]["message"]
        assert "engine_core_deadline_s=3" in report.json()["error"]["message"]
        quick_503(url, "/health", stall)
        quick_503(url, "/kv_cache", stall)
        reader.join(30)
        assert not reader.is_alive()
        error = events[-1]["error"]
        assert error["code"] == 503 and stall in error["message"], error
    finally:
        if core.exitcode is None:  # (not killed by the front: the test failed)
            os.kill(core.pid, signal.SIGCONT)
    replaced(server, url, restarts + 1)
    assert core.exitcode == -signal.SIGKILL


def test_a_killed_core_ends_its_streams_with_503s_and_a_new_core_serves(watched):
    server, url = watched
    restarts = server.llm.engine_core_restarts()
    streams = [stream(url) for _ in range(3)]
    core, ipc_dir = server.llm._core._process, server.llm._core._core.dir.name
    for _, started, _ in streams:
        assert started.wait(60)
    os.kill(core.pid, signal.SIGKILL)
    for events, _, reader in streams:
        reader.join(30)
        assert not reader.is_alive()
        error = events[-1]["error"]
        assert error["code"] == 503, error
        assert "the engine core's process exited (code -9)" in error["message"]
    health = httpx.get(url + "/health")
    assert health.status_code == 503 and "code -9" in health.json()["reason"]
    replaced(server, url, restarts + 1)
    assert not os.path.exists(ipc_dir) and server.llm._core._process.pid != core.pid


def test_a_core_lost_with_no_restart_left_stays_a_503(watched):
    server, url = watched
    server.llm._core.restart_policy = RestartPolicy(max_attempts=0)
    os.kill(server.llm._core._process.pid, signal.SIGKILL)
    deadline = time.monotonic() + 10
    while "not restarted" not in (server.llm.lost_rank() or "") and time.monotonic() < deadline:
        time.sleep(0.05)
    for path in ("/health", "/kv_cache"):
        quick_503(url, path, "was not restarted")
    reply = httpx.post(url + "/v1/completions", json={**STREAM, "max_tokens": 4})
    assert reply.status_code == 503 and "code -9" in reply.json()["error"]["message"]


def test_restarts_come_in_rows_with_doubling_waits_and_a_core_that_lasted_starts_a_new_row():
    policy = RestartPolicy(max_attempts=3, backoff_s=0.5, stable_s=60)
    assert [policy.next_wait(served_s=5) for _ in range(4)] == [0.5, 1.0, 2.0, None]
    assert policy.next_wait(served_s=0) is None  # (a start that failed: still the same row)
    assert policy.next_wait(served_s=60) == 0.5  # the last core served a minute: a new row
    assert policy.attempts == 1


def test_a_beat_says_how_long_ago_the_loop_finished_an_iteration():
    sent = []
    outputs = _Outputs(type("Socket", (), {"send": lambda self, b: sent.append(decode(b))})(), None)
    outputs.flushed_at -= 7.0  # the loop's last iteration ended 7 s ago: it is in a long step
    outputs.beat()
    outputs.flush()  # (the end of an iteration, outputs or none)
    outputs.beat()
    assert [m["op"] for m in sent] == ["beat", "beat"]
    assert 7.0 <= sent[0]["since_s"] < 8.0 and 0 <= sent[1]["since_s"] < 1.0


def test_a_core_stuck_in_one_step_and_a_core_that_sends_nothing_are_told_apart():
    now = time.monotonic()
    for since_s, stall in ((2.0, None), (4.0, "not finished a step for 4 s")):
        busy = Heartbeat(heard_at=now - 5, stepped_at=now - 5)
        busy.heard(since_s=since_s)  # a beat: the loop is since_s into a step
        assert busy.stall(deadline_s=3.0) == (
            stall and f"the engine core has {stall} (engine_core_deadline_s=3)"
        )
    silent = Heartbeat(heard_at=now - 4.2, stepped_at=now - 4.4)  # nothing since
    assert silent.stall(deadline_s=3.0) == (
        "the engine core has not finished a step for 4 s (engine_core_deadline_s=3); its "
        "process sent nothing for 4 s"
    )
    idle = Heartbeat(heard_at=now - 9, stepped_at=now - 9)
    idle.heard(since_s=0.4)  # an idle loop ends an iteration every IDLE_WAIT_S
    assert idle.stall(deadline_s=3.0) is None


def children(pid: int) -> list[int]:
    return [
        int(c)
        for t in Path(f"/proc/{pid}/task").iterdir()
        for c in (t / "children").read_text().split()
    ]


def running(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except FileNotFoundError:
        return False
    return state != "Z"  # (killed, not yet reaped by init: gone)


@pytest.mark.slow
def test_a_core_that_loses_a_rank_is_replaced_with_all_its_ranks():
    """tp2 on the CPU: rank 1 is killed; the old core and its ranks end, a new core and a new
    rank 1 decode as before, and none is left after shutdown."""
    llm = LLM(device="cpu", engine_process=True, tensor_parallel_size=2)
    llm._core.restart_policy = RestartPolicy(backoff_s=0.2)
    params = SamplingParams(max_tokens=8, temperature=0, ignore_eos=True)
    try:
        first = llm.generate(STREAM["prompt"], params).outputs[0].token_ids
        core = llm._core._process.pid
        (rank1,) = children(core)
        os.kill(rank1, signal.SIGKILL)
        deadline = time.monotonic() + 60
        while llm.engine_core_restarts() == 0 and time.monotonic() < deadline:
            time.sleep(0.1)
        assert llm.lost_rank() is None
        assert llm.generate(STREAM["prompt"], params).outputs[0].token_ids == first
        assert not running(core) and not running(rank1)
        new_core = llm._core._process.pid
        (new_rank1,) = children(new_core)
    finally:
        llm.shutdown()
    assert not running(new_core) and not running(new_rank1)
