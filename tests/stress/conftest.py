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


def disaggregated(
    servers,
    generation: tuple[str, ...] = ("gen",),
    hold_s: float | None = None,
    pull_s: float | None = None,
):
    """A context server, the named generation servers and a router to the first of them.
    ``hold_s``: how long the context server holds KV for a pull; ``pull_s``: how long a
    generation server waits on one (both ``transfer_timeout_s``; ``pull_s`` defaults to
    ``hold_s``)."""
    pull_s = hold_s if pull_s is None else pull_s
    for name in ("ctx", *generation):
        servers.reserve(name)
    servers.reserve("router")
    for name in ("ctx", *generation):
        timeout = hold_s if name == "ctx" else pull_s
        options = {} if timeout is None else {"transfer_timeout_s": timeout}
        servers.server(name, disaggregation_options(POOL, **options))
    servers.router("router", ["ctx"], [generation[0]])
    servers.wait_healthy()
    return servers


@pytest.fixture(scope="module")
def disagg(tmp_path_factory):
    with running(tmp_path_factory.mktemp("disagg")) as servers:
        yield disaggregated(servers)
