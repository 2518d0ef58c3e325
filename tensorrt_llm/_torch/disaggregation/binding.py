"""Which network devices a server's NIXL agent (UCX) may use: those that serve ``--host``.

UCX's TCP transport listens on every interface it is allowed to use, so a server started with
``--host 127.0.0.1`` would still accept KV reads on its public address. ``bind_ucx_to(host)`` sets
``UCX_NET_DEVICES`` (read when the agent is created) to the interface that carries ``host`` plus
every RDMA device (those do not listen on TCP ports, and a deployment on InfiniBand or RoCE needs
them to move KV at full speed). A host of ``0.0.0.0`` or ``::`` means every interface, and a
``UCX_NET_DEVICES`` already set is the operator's choice: both are left alone.
"""

from __future__ import annotations

import fcntl
import ipaddress
import os
import socket
import struct
from pathlib import Path

_SIOCGIFADDR = 0x8915  # Linux: an interface's IPv4 address
_RDMA_DEVICES = Path("/sys/class/infiniband")


def _ipv4_of(interface: str) -> str | None:
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        try:
            raw = fcntl.ioctl(
                s.fileno(), _SIOCGIFADDR, struct.pack("256s", interface.encode()[:15])
            )
        except OSError:  # no IPv4 address
            return None
    return socket.inet_ntoa(raw[20:24])


def interface_of(host: str) -> str:
    """The network interface whose IPv4 address ``host`` (a name or an address) resolves to; a
    ``ValueError`` naming ``host`` when none does."""
    try:
        address = socket.gethostbyname(host)
    except OSError as exc:
        raise ValueError(f"--host {host!r} does not resolve: {exc}") from None
    if ipaddress.ip_address(address).is_loopback:
        address = "127.0.0.1"  # all of 127/8 is on the loopback interface
    for _, name in socket.if_nameindex():
        if _ipv4_of(name) == address:
            return name
    raise ValueError(f"--host {host!r} ({address}) is not an address of any interface here")


def rdma_devices() -> list[str]:
    """UCX's names (``device:port``) of this machine's RDMA ports."""
    if not _RDMA_DEVICES.is_dir():
        return []
    return sorted(
        f"{device.name}:{port.name}"
        for device in _RDMA_DEVICES.iterdir()
        for port in (device / "ports").iterdir()
    )


def bind_ucx_to(host: str) -> str | None:
    """Restrict UCX to ``host``'s interface and the RDMA devices; returns the ``UCX_NET_DEVICES``
    it set, or None when it left the setting alone (every interface, or already set)."""
    if os.environ.get("UCX_NET_DEVICES") or host in ("0.0.0.0", "::", ""):
        return None
    devices = ",".join([interface_of(host), *rdma_devices()])
    os.environ["UCX_NET_DEVICES"] = devices
    return devices
