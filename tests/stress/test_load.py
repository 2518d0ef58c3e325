"""The load mix (mixed ``max_tokens``, greedy and sampled, half streamed, some clients leaving
early) on 16-slot pools, on one server and on a disaggregated deployment, and a generation server
killed in the middle of it: every request that stays ends well, every failure is a clear error,
and no server keeps a KV slot afterwards."""

import dataclasses
import threading
import time

import httpx
import pytest
from conftest import SHORT_HOLD_S, disaggregated
from stress_helpers import CI_MIX, MIX, assert_no_slot_in_use, run_mix

from tensorrt_llm.evaluate.deployment import metric, running

pytest.importorskip("nixl")
pytestmark = pytest.mark.slow
LEAVING = dataclasses.replace(MIX, disconnect_fraction=0.15)


def test_one_server_serves_the_mix_and_keeps_no_slot(single):
    report = run_mix(single.urls["one"], LEAVING)
    assert report.failures() == [] and report.counts["ok"] > 0.7 * LEAVING.requests
    assert report.counts["disconnected"] > 0
    assert_no_slot_in_use(single.urls["one"])


def test_the_disaggregated_deployment_serves_the_mix_and_keeps_no_slot(disagg):
    # issue 11, item 7 and acceptance 2 (at TRTLLM_STRESS=large: 500 requests at concurrency 64)
    report = run_mix(disagg.urls["router"], LEAVING)
    assert report.failures() == [] and report.counts["ok"] > 0.7 * LEAVING.requests
    # a client that leaves after its prefill cancels its generation-only request, which releases
    # the context server's hold (long before the 60 s hold would end)
    assert_no_slot_in_use(disagg.urls["ctx"], disagg.urls["gen"], within_s=20)


def test_a_generation_server_killed_mid_load_fails_its_requests_clearly(tmp_path):
    with running(tmp_path) as servers:
        disaggregated(servers, hold_s=SHORT_HOLD_S)  # the dead server's holds end soon
        router, gen = servers.urls["router"], servers.urls["gen"]
        mix = dataclasses.replace(CI_MIX, requests=32, seed=1)  # at any size: the kill is the test
        result = {}
        load = threading.Thread(target=lambda: result.update(report=run_mix(router, mix)))
        load.start()
        deadline = time.monotonic() + 120
        while (
            metric(gen, "trtllm_requests_total") < mix.requests // 4 and time.monotonic() < deadline
        ):
            time.sleep(0.1)
        servers.kill("gen")
        load.join(timeout=300)
        assert not load.is_alive(), "requests hung after the generation server died"
        report = result["report"]
        assert report.failures(), "the kill came after the load had ended"
        for failure in report.failures():  # each a 502, an SSE error event, or (once the
            # router's health checks find it down) a 503: with a reason, and retryable
            assert failure.status in (200, 502, 503), failure
            assert "generation server" in failure.detail, failure
        assert httpx.get(router + "/health", timeout=10).status_code == 503
        servers.restart("gen")
        assert httpx.get(router + "/health", timeout=10).status_code == 200
        after = run_mix(router, dataclasses.replace(mix, requests=16, seed=2))
        assert after.failures() == []
        assert_no_slot_in_use(servers.urls["ctx"], gen, within_s=SHORT_HOLD_S + 20)
