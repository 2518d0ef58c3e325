"""The NIXL agent of a transceiver, with a progress thread that waits for work.

``nixl_agent`` starts its UCX progress thread with a poll delay of 0: the thread spins, one core
per agent for as long as the agent lives, idle or not. On a server that is a core taken from the
executor; on a small host running a context and a generation server it is every core. Given a
delay, the thread sleeps in ``poll`` on the worker's event descriptor and wakes for work, so an
idle agent costs nothing and a transfer is no slower (``benchmarks/bench_nixl_agent.py``).

The Python API sets the delay itself (no option reaches it), so the agent is built with a config
class whose ``pthrDelay`` cannot be set to 0. Where the API is not laid out as expected, the agent
is built as the API builds it, and a warning says that its thread spins.
"""

from __future__ import annotations

import sys
import threading
from collections.abc import Sequence

from tensorrt_llm.logger import logger

PROGRESS_POLL_US = 100  # the progress thread's longest wait for an event, in microseconds
_BUILDING = threading.Lock()  # the config class is swapped on the binding module while building


def make_agent(name: str, backends: Sequence[str], poll_us: int = PROGRESS_POLL_US):
    """A ``nixl_agent`` named ``name`` with ``backends`` whose progress thread waits up to
    ``poll_us`` for an event instead of spinning (``poll_us=0``: the API's own, spinning)."""
    from nixl._api import nixl_agent, nixl_agent_config

    config = nixl_agent_config(backends=list(backends))
    if poll_us == 0:
        return nixl_agent(name, config)
    bind = getattr(sys.modules.get(nixl_agent.__module__), "nixlBind", None)
    base = getattr(bind, "nixlAgentConfig", None)
    if base is None:
        logger.warning("NIXL's agent config is not reachable: its progress thread will spin")
        return nixl_agent(name, config)

    class _PollingConfig(base):
        def __setattr__(self, key, value):
            super().__setattr__(key, poll_us if key == "pthrDelay" and value == 0 else value)

    with _BUILDING:
        bind.nixlAgentConfig = _PollingConfig
        try:
            return nixl_agent(name, config)
        finally:
            bind.nixlAgentConfig = base
