"""trtllm-bench against a live trtllm-serve (bundled model, Eagle3 unified, CPU): a concurrency
sweep prints the table and writes the JSON, figures are consistent with what was asked, and an
unreachable URL is a clear error (issue 12, acceptance 4)."""

import json
import socket

import pytest

from tensorrt_llm.bench.serving import RequestResult, summarize
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
