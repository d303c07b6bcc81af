"""Where rota's HTTP servers listen: ``host:port`` addresses, IPv4 and IPv6 alike.

``::`` (or ``[::]``) is dual-stack: one IPv6 socket with ``IPV6_V6ONLY`` off, which takes
IPv4 connections too (as IPv4-mapped addresses), so a pod answers on its address whatever
the cluster's family. asyncio's own binding of ``::`` sets ``IPV6_V6ONLY`` on every IPv6
socket, which on an IPv4 pod would refuse the kubelet's probes; so that socket is built
here. Where the kernel has no IPv6 at all, ``::`` falls back to ``0.0.0.0``. Any other host
(``0.0.0.0``, ``127.0.0.1``, ``fd00::5``) binds exactly that address.
"""

from __future__ import annotations

import errno
import logging
import socket

from aiohttp import web

__all__ = ["DUAL_STACK", "dual_stack_socket", "split_host_port", "start_site"]

log = logging.getLogger(__name__)

DUAL_STACK = "::"
"""The host that means every IPv6 and IPv4 address."""


def split_host_port(address: str) -> tuple[str, int]:
    """``host:port`` -> (host, port); the host without brackets, empty when none is given.

    ``[::]:8090`` and ``:::8090`` are both (``::``, 8090); ``:8090`` is ("", 8090).

    Raises:
        ValueError: the port is not a number in 0-65535, or the brackets do not close.
    """
    host, sep, port = address.rpartition(":")
    if not sep:
        raise ValueError(f"{address!r} is not host:port")
    if host.startswith("["):
        if not host.endswith("]"):
            raise ValueError(f"{address!r}: unclosed bracket")
        host = host[1:-1]
    try:
        number = int(port)
    except ValueError:
        raise ValueError(f"{address!r}: port {port!r} is not a number") from None
    if not 0 <= number <= 65535:
        raise ValueError(f"{address!r}: port {number} is out of range")
    return host, number


def dual_stack_socket(port: int) -> socket.socket:
    """A non-blocking TCP socket bound to ``port`` on every IPv6 and IPv4 address (not
    listening yet); bound to ``0.0.0.0`` where the kernel has no IPv6."""
    try:
        sock = socket.socket(socket.AF_INET6, socket.SOCK_STREAM)
    except OSError as exc:
        if exc.errno not in (errno.EAFNOSUPPORT, errno.EPROTONOSUPPORT):
            raise
        log.info("no IPv6 in this kernel: listening on IPv4 only", extra={"port": port})
        sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        host = "0.0.0.0"
    else:
        sock.setsockopt(socket.IPPROTO_IPV6, socket.IPV6_V6ONLY, 0)
        host = DUAL_STACK
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind((host, port))
        sock.setblocking(False)
    except OSError:
        sock.close()
        raise
    return sock


async def start_site(runner: web.BaseRunner, host: str, port: int) -> web.BaseSite:
    """Start ``runner`` listening on ``host``/``port`` (``::``: dual-stack, see the module);
    the runner's ``addresses`` then hold the bound port."""
    host = host.strip("[]")
    site: web.BaseSite
    if host == DUAL_STACK:
        site = web.SockSite(runner, dual_stack_socket(port))
    else:
        site = web.TCPSite(runner, host, port)
    await site.start()
    return site
