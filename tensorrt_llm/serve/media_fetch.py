"""Fetching an image URL a client named, without letting the client reach what the server can.

The policy (``FetchPolicy``):
- only ``http`` and ``https``, no credentials in the URL, no control characters or spaces;
- the host's addresses are resolved here (on resolver threads of their own), and the connection
  goes to an address that was checked
  (so a name cannot resolve to one address for the check and another for the connection); every
  address must be global (no loopback, private, link-local, shared, reserved or multicast one,
  also when written inside an IPv6 address), unless the host is one the operator named in
  ``--allowed-media-domains``: that is the operator's choice, and it may resolve anywhere;
- with ``--allowed-media-domains`` set, no other host is fetched at all;
- redirects are followed here (at most ``MAX_REDIRECTS``), each hop checked again;
- one deadline for the whole fetch, redirects and body included, and the size cap enforced while
  reading;
- no proxy (``HTTP(S)_PROXY`` is not read): a proxy would resolve and connect itself, past the
  checks above.

Every failure raises ``FetchRefused`` with the reason for the log; what a client is told is the
same for all of them (``media.py``), so the answers cannot map a network.
"""

from __future__ import annotations

import asyncio
import functools
import ipaddress
import re
import socket
import ssl
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from urllib.parse import urljoin, urlsplit

import httpcore

MAX_REDIRECTS = 5
# Names are resolved on threads of their own: a resolver that never answers fills these, not the
# threads that tokenize (the fetch's deadline still ends the request).
_RESOLVER = ThreadPoolExecutor(4, thread_name_prefix="trtllm-resolve")
_REDIRECTS = {301, 302, 303, 307, 308}
_UNSAFE = re.compile(r"[\x00-\x20\x7f]")  # control characters and spaces (CR/LF: header splitting)
_NAT64 = (ipaddress.ip_network("64:ff9b::/96"), ipaddress.ip_network("64:ff9b:1::/48"))
_GLOBAL_UNICAST_V6 = ipaddress.ip_network("2000::/3")


class FetchRefused(Exception):
    """A fetch that failed or was not allowed; the message is for the server's log only."""


@dataclass(frozen=True)
class FetchPolicy:
    """``allowed_domains``: hosts the operator allows (exact names, case-insensitive); when given,
    the only ones fetched, and they may resolve to any address."""

    allowed_domains: frozenset[str] = field(default_factory=frozenset)
    timeout_s: float = 10.0
    max_bytes: int = 20 * 1024 * 1024

    def check_url(self, url: str) -> tuple[str, str, int]:
        """``(scheme, host, port)`` of a URL the policy lets through to name resolution."""
        if _UNSAFE.search(url):
            raise FetchRefused("control characters or spaces in the URL")
        try:
            parts = urlsplit(url)
            port = parts.port or (443 if parts.scheme == "https" else 80)
        except ValueError as exc:
            raise FetchRefused(f"not a URL ({exc})") from None
        if parts.scheme not in ("http", "https") or not parts.hostname:
            raise FetchRefused(f"scheme {parts.scheme!r} or no host")
        if parts.username is not None or parts.password is not None:
            raise FetchRefused("credentials in the URL")
        host = parts.hostname.lower().rstrip(".")
        if self.allowed_domains and host not in self.allowed_domains:
            raise FetchRefused(f"host {host!r} is not in --allowed-media-domains")
        return parts.scheme, host, port

    def check_address(self, host: str, address: str) -> None:
        if host.lower().rstrip(".") in self.allowed_domains:
            return
        if not is_public(ipaddress.ip_address(address.split("%", 1)[0])):
            raise FetchRefused(f"{host!r} resolves to {address}, which is not a global address")


def is_public(ip: ipaddress.IPv4Address | ipaddress.IPv6Address) -> bool:
    """A global unicast address. An IPv6 address must be in 2000::/3 (which leaves out the
    IPv4-compatible, -mapped and -translated forms and site-local ones), or a NAT64 one; where
    it carries an IPv4 address (6to4, Teredo, NAT64), that one must be global too."""
    if ip.version == 6:
        nat64 = any(ip in prefix for prefix in _NAT64)
        if not nat64 and ip not in _GLOBAL_UNICAST_V6:
            return False
        embedded = ip.sixtofour or (ip.teredo[1] if ip.teredo else None)
        if nat64:
            embedded = ipaddress.IPv4Address(int(ip) & 0xFFFFFFFF)
        if embedded is not None:
            return is_public(embedded)
    return ip.is_global and not ip.is_multicast


class _CheckedBackend(httpcore.AsyncNetworkBackend):
    """Connects only to addresses the policy allows, resolved here: the address checked is the
    address connected to."""

    def __init__(self, policy: FetchPolicy) -> None:
        self.policy = policy
        self.inner = httpcore.AnyIOBackend()

    async def connect_tcp(self, host, port, timeout=None, local_address=None, socket_options=None):
        loop = asyncio.get_running_loop()
        resolve = functools.partial(socket.getaddrinfo, host, port, type=socket.SOCK_STREAM)
        try:
            infos = await loop.run_in_executor(_RESOLVER, resolve)
        except OSError as exc:
            raise FetchRefused(f"{host!r} does not resolve ({exc})") from None
        addresses = list(dict.fromkeys(info[4][0] for info in infos))
        for address in addresses:  # one address the policy refuses refuses the host
            self.policy.check_address(host, address)
        last: Exception | None = None
        for address in addresses:
            try:
                return await self.inner.connect_tcp(address, port, timeout=timeout)
            except (httpcore.ConnectError, httpcore.ConnectTimeout, OSError) as exc:
                last = exc
        raise FetchRefused(f"could not connect to {host!r} ({last})")

    async def sleep(self, seconds: float) -> None:
        await self.inner.sleep(seconds)


async def fetch(url: str, policy: FetchPolicy) -> bytes:
    """The body at ``url`` under ``policy``; ``FetchRefused`` for anything else."""
    try:
        async with asyncio.timeout(policy.timeout_s):
            return await _fetch(url, policy)
    except TimeoutError:
        raise FetchRefused(f"no whole answer within {policy.timeout_s}s") from None
    except httpcore.TimeoutException:
        raise FetchRefused(f"no whole answer within {policy.timeout_s}s") from None
    except httpcore.NetworkError as exc:
        raise FetchRefused(f"network error ({type(exc).__name__}: {exc})") from None
    except (httpcore.ProtocolError, httpcore.UnsupportedProtocol, ssl.SSLError) as exc:
        raise FetchRefused(f"bad answer ({type(exc).__name__}: {exc})") from None


async def _fetch(url: str, policy: FetchPolicy) -> bytes:
    timeouts = {k: policy.timeout_s for k in ("connect", "read", "write", "pool")}
    async with httpcore.AsyncConnectionPool(
        ssl_context=ssl.create_default_context(),
        network_backend=_CheckedBackend(policy),
        max_connections=1,
        retries=0,
    ) as pool:
        for _ in range(MAX_REDIRECTS + 1):
            policy.check_url(url)
            async with pool.stream(
                "GET",
                url,
                headers={"Accept": "image/*", "User-Agent": "trtllm-serve"},
                extensions={"timeout": timeouts},
            ) as response:
                if response.status in _REDIRECTS:
                    location = _header(response, b"location")
                    if location is None:
                        raise FetchRefused(f"HTTP {response.status} without a Location")
                    url = urljoin(url, location)
                    continue
                if response.status != 200:
                    raise FetchRefused(f"HTTP {response.status}")
                return await _read_capped(response, policy.max_bytes)
    raise FetchRefused(f"more than {MAX_REDIRECTS} redirects")


async def _read_capped(response, max_bytes: int) -> bytes:
    declared = _header(response, b"content-length")
    if declared is not None and declared.isdigit() and int(declared) > max_bytes:
        raise FetchRefused(f"declares {declared} bytes; at most {max_bytes}")
    data = bytearray()
    async for chunk in response.aiter_stream():
        data += chunk
        if len(data) > max_bytes:
            raise FetchRefused(f"more than {max_bytes} bytes")
    return bytes(data)


def _header(response, name: bytes) -> str | None:
    for key, value in response.headers:
        if key.lower() == name:
            return value.decode("latin-1").strip()
    return None
