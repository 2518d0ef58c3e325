"""Servers for the fault and load suite: real ``trtllm-serve`` processes on loopback, each on a
16-slot KV pool (so the mix forces prefix-cache eviction), torn down after their module."""

import pytest
from stress_helpers import POOL

from tensorrt_llm.evaluate.deployment import disaggregation_options, running

# How long a context server holds KV for a pull: the default (60 s) under load, where a pull may
# wait that long for room on its generation server; SHORT_HOLD_S where a test waits for holds that
# can never be pulled (their generation server died) or makes a handle stale on purpose.
SHORT_HOLD_S = 10.0


@pytest.fixture(scope="module")
def single(tmp_path_factory):
    with running(tmp_path_factory.mktemp("single")) as servers:
        servers.server("one", POOL)
        servers.wait_healthy()
        yield servers


def disaggregated(servers, generation: tuple[str, ...] = ("gen",), hold_s: float | None = None):
    """A context server, the named generation servers and a router to the first of them."""
    hold = {} if hold_s is None else {"transfer_timeout_s": hold_s}
    worker = disaggregation_options(POOL, **hold)
    servers.reserve("ctx", *generation, "router")
    for name in ("ctx", *generation):
        servers.server(name, worker)
    servers.router("router", ["ctx"], [generation[0]])
    servers.wait_healthy()
    return servers


@pytest.fixture(scope="module")
def disagg(tmp_path_factory):
    with running(tmp_path_factory.mktemp("disagg")) as servers:
        yield disaggregated(servers)
