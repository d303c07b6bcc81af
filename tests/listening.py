"""Checks of rota's listeners from the outside: a free port on both address families, an
HTTP GET over IPv4 or IPv6 loopback, and whether this machine has IPv6 loopback at all."""

from __future__ import annotations

import asyncio
import socket

import aiohttp

from controller.urls import http_url
from e2e.harness.waiting import eventually_async

DEADLINE_S = 30.0


def has_ipv6_loopback() -> bool:
    """``::1`` can be bound here (``ip -6 addr show lo`` lists it)."""
    try:
        with socket.socket(socket.AF_INET6, socket.SOCK_STREAM) as sock:
            sock.bind(("::1", 0))
    except OSError:
        return False
    return True


NO_IPV6_LOOPBACK = "this machine has no IPv6 loopback address (::1): only IPv4 is checked"


def free_port() -> int:
    """A port free on IPv4 and IPv6 (the kernel's pick for a dual-stack socket)."""
    family = socket.AF_INET6 if has_ipv6_loopback() else socket.AF_INET
    with socket.socket(family, socket.SOCK_STREAM) as sock:
        if family == socket.AF_INET6:
            sock.setsockopt(socket.IPPROTO_IPV6, socket.IPV6_V6ONLY, 0)
        sock.bind(("::" if family == socket.AF_INET6 else "0.0.0.0", 0))
        return int(sock.getsockname()[1])


async def status_of(host: str, port: int, path: str) -> int | None:
    """The HTTP status ``GET path`` gets from ``host``, None when the connection is
    refused."""
    timeout = aiohttp.ClientTimeout(total=DEADLINE_S, connect=5)
    async with aiohttp.ClientSession(timeout=timeout) as session:
        try:
            async with session.get(http_url(host, port) + path) as resp:
                await resp.read()
                return resp.status
        except aiohttp.ClientConnectorError:
            return None


async def wait_listening(port: int, *, host: str = "127.0.0.1") -> None:
    """Until something accepts connections on ``host``/``port`` (bounded)."""
    async def accepts() -> bool:
        _, writer = await asyncio.open_connection(host, port)
        writer.close()
        await writer.wait_closed()
        return True

    await eventually_async(accepts, timeout=DEADLINE_S, what=f"a listener on {host}:{port}")
