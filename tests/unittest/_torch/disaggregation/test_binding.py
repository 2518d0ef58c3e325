"""UCX listens only where the server does (issue 11, item 6): ``--host 127.0.0.1`` keeps the KV
transfer port off the machine's other interfaces."""

import os
import shutil
import subprocess
import sys

import pytest

from tensorrt_llm._torch.disaggregation.binding import bind_ucx_to, interface_of

pytest.importorskip("nixl")

LISTENING_ADDRESSES = """
import os, re, subprocess
from tensorrt_llm._torch.disaggregation.binding import bind_ucx_to
from nixl._api import nixl_agent, nixl_agent_config
{bind}
agent = nixl_agent("listener", nixl_agent_config(backends=["UCX"]))
lines = subprocess.run(["ss", "-ltnpH"], capture_output=True, text=True).stdout.splitlines()
mine = [l.split()[3] for l in lines if f"pid={{os.getpid()}}," in l]
print(sorted({{re.sub(r":\\d+$", "", a) for a in mine}}))
"""


def listening_addresses(bind: str) -> list[str]:
    env = {k: v for k, v in os.environ.items() if k != "UCX_NET_DEVICES"}
    code = LISTENING_ADDRESSES.format(bind=bind)
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env)
    assert out.returncode == 0, out.stderr[-2000:]
    return eval(out.stdout.strip().splitlines()[-1])  # a list literal this test printed


@pytest.mark.skipif(shutil.which("ss") is None, reason="needs ss(8) to list listening sockets")
def test_a_loopback_server_accepts_kv_reads_on_loopback_only():
    assert listening_addresses('bind_ucx_to("127.0.0.1")') == ["127.0.0.1"]
    unbound = listening_addresses("")
    assert "127.0.0.1" in unbound  # and, on a machine with a network, its other addresses too


def test_the_interface_of_a_host():
    assert interface_of("127.0.0.1") == interface_of("localhost") == interface_of("127.0.0.2")
    with pytest.raises(ValueError, match="'203.0.113.9' .* not an address of any interface"):
        interface_of("203.0.113.9")
    with pytest.raises(ValueError, match="'no-such-host.invalid' does not resolve"):
        interface_of("no-such-host.invalid")


def test_every_interface_and_an_operators_choice_are_left_alone(monkeypatch):
    monkeypatch.delenv("UCX_NET_DEVICES", raising=False)
    assert bind_ucx_to("0.0.0.0") is None and "UCX_NET_DEVICES" not in os.environ
    monkeypatch.setenv("UCX_NET_DEVICES", "eth7")
    assert bind_ucx_to("127.0.0.1") is None
    monkeypatch.delenv("UCX_NET_DEVICES")
    assert bind_ucx_to("127.0.0.1") == interface_of("127.0.0.1")  # plus RDMA ports, if any
