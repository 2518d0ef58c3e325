"""Picking a TCP port for a server (or a rendezvous) that starts a little later."""

from __future__ import annotations

import random
import socket
from pathlib import Path


def free_port() -> int:
    """A port free now, below the kernel's ephemeral range where one is known: a server starts
    some time after its port is picked, and meanwhile any process's outgoing connection or
    listener on port 0 (NIXL's UCX agents open some) may be given a port of that range."""
    low = _ephemeral_low()
    for port in random.sample(range(10000, low), k=min(64, max(low - 10000, 0))):
        with socket.socket() as s:
            try:
                s.bind(("127.0.0.1", port))
            except OSError:
                continue
            return port
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _ephemeral_low() -> int:
    try:
        return int(Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()[0])
    except (OSError, ValueError, IndexError):
        return 10000  # unknown: the kernel picks
