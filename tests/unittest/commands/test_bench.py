"""trtllm-bench against a live trtllm-serve (bundled model, Eagle3 unified, CPU): a concurrency
sweep prints the table and writes the JSON, figures are consistent with what was asked, and an
unreachable URL is a clear error (issue 12, acceptance 4)."""

import json
import socket
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest

from tensorrt_llm.bench.serving import RequestResult, run_spread, summarize
from tensorrt_llm.commands.bench import main


@pytest.fixture(scope="module")
def url(bundled_server):
    return bundled_server[1]


def test_a_concurrency_sweep_prints_the_table_and_writes_the_figures(url, tmp_path, capsys):
    out = tmp_path / "bench.json"
    args = ["--url", url, "--concurrency", "1,4,16", "--num-requests", "16", "--output-len", "8"]
    assert main([*args, "--warmup", "2", "--out", str(out)]) == 0
    rows = [line for line in capsys.readouterr().out.splitlines() if line.startswith("| conc")]
    assert [row.split(" | ")[0] for row in rows] == [f"| concurrency={c}" for c in (1, 4, 16)]
    report = json.loads(out.read_text())
    assert report["model"] == "target" and len(report["levels"]) == 3
    for level in report["levels"]:
        assert level["failed"] == 0 and level["requests"] == 16
        assert level["mean_output_tokens"] == 8  # ignore_eos: every request runs to max_tokens
        assert 0 < level["ttft_s"]["p50"] <= level["ttft_s"]["p99"]
        assert level["itl_s"]["p50"] > 0 and level["output_tokens_per_s"] > 0
        assert level["mean_al"] >= 1.0  # the bundled drafter's acceptance, reported per request


def test_an_unreachable_server_is_a_clear_error(capsys):
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]  # nothing listens there
    assert main(["--url", f"http://127.0.0.1:{port}", "--num-requests", "2"]) == 2
    assert "/v1/models" in capsys.readouterr().err


def test_a_chunk_of_several_tokens_spreads_its_gap_and_percentiles_order():
    results = [
        RequestResult(ok=True, ttft=0.1 * i, latency=1.0, output_tokens=11, itls=[0.05] * 10)
        for i in range(1, 11)
    ]
    summary = summarize([*results, RequestResult(ok=False, error="HTTP 500")], wall_s=2.0)
    assert summary["failed"] == 1 and summary["errors"] == ["HTTP 500"]
    assert summary["ttft_s"]["p50"] <= summary["ttft_s"]["p90"] <= summary["ttft_s"]["p99"]
    assert summary["tpot_s"]["p50"] == pytest.approx((1.0 - 0.5) / 10)  # nearest-rank
    assert summary["output_tokens_per_s"] == pytest.approx(110 / 2.0)


class _Streams(BaseHTTPRequestHandler):
    """A stand-in server: each POST streams one chunk after the delay its body names, and is
    recorded by its body's index."""

    seen: list[int] = []

    def do_POST(self):
        body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
        type(self).seen.append(body["i"])
        time.sleep(body["delay"])
        chunk = {"choices": [{"index": 0, "delta": {"content": "x"}}]}
        payload = f"data: {json.dumps(chunk)}\n\ndata: [DONE]\n\n".encode()
        self.send_response(200)
        self.send_header("Content-Type", "text/event-stream")
        self.send_header("Content-Length", str(len(payload)))
        self.end_headers()
        self.wfile.write(payload)

    def log_message(self, *args):
        pass


def test_client_processes_take_the_next_request_from_one_queue():
    # two processes of one slot each; requests 0 and 2 take 0.6 s. A split fixed in advance
    # (every second request to each process) would give both to the first process, 1.2 s in
    # all; from one queue the other process's slot takes one of them as soon as it is free
    server = ThreadingHTTPServer(("127.0.0.1", 0), _Streams)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    url = f"http://127.0.0.1:{server.server_address[1]}/v1/chat/completions"
    bodies = [{"i": i, "delay": 0.6 if i in (0, 2) else 0.01} for i in range(12)]
    try:
        results, wall = run_spread(url, bodies, concurrency=2, processes=2)
    finally:
        server.shutdown()
    assert sorted(_Streams.seen) == list(range(12))  # each request sent exactly once
    assert len(results) == 12 and all(r.ok and r.output_tokens == 1 for r in results)
    assert 0.6 < wall < 1.1
