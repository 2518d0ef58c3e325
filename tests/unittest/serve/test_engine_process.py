"""trtllm-serve's engine core runs in a process of its own; when that process dies, the requests
in flight end with a 5xx, ``/health`` fails naming the exit, and new requests are 503s."""

import json
import os
import signal
import threading

import httpx

STREAM = {"prompt": "Ann has 58 cups.", "max_tokens": 400, "ignore_eos": True, "temperature": 0}


def test_a_dead_engine_process_is_a_5xx_and_a_failing_health(serve_in_thread):
    from tensorrt_llm.commands.serve import build_server

    server = build_server(None, None, device="cpu")
    url, stop = serve_in_thread(server.app)
    try:
        assert server.llm.args.engine_process and server.llm.executor is None
        assert httpx.get(url + "/health").status_code == 200
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
        assert started.wait(60)
        os.kill(server.llm._core._process.pid, signal.SIGKILL)
        reader.join(30)
        assert not reader.is_alive()
        error = events[-1]["error"]
        assert error["code"] == 503 and "engine core's process exited (code -9)" in error["message"]
        health = httpx.get(url + "/health")
        assert health.status_code == 503 and "code -9" in health.json()["reason"]
        reply = httpx.post(url + "/v1/completions", json={**STREAM, "max_tokens": 4})
        assert reply.status_code == 503 and "code -9" in reply.json()["error"]["message"]
    finally:
        stop()
        server.close()
