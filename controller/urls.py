"""URLs of pods and listeners, for IPv4 and IPv6 alike."""

from __future__ import annotations

import ipaddress

__all__ = ["WILDCARDS", "advertised_url", "http_url"]

WILDCARDS = frozenset({"", "0.0.0.0", "::"})
"""Listen hosts that are every address, and so no address to advertise."""


def http_url(host: str, port: int, *, scheme: str = "http") -> str:
    """``scheme://host:port``, with an IPv6 address in brackets (``http://[fd00::5]:8000``).

    An address that already carries brackets, and a DNS name, are left as they are.
    """
    bare = host.strip("[]")
    try:
        if isinstance(ipaddress.ip_address(bare), ipaddress.IPv6Address):
            host = f"[{bare}]"
    except ValueError:
        pass  # a name
    return f"{scheme}://{host}:{port}"


def advertised_url(listen_host: str, port: int, *, host: str | None = None) -> str:
    """Where a listener on ``listen_host``/``port`` is reached: at ``host`` (the pod IP)
    when given, else at the listen host, else (a wildcard) at 127.0.0.1."""
    if not host:
        bare = listen_host.strip("[]")
        host = "127.0.0.1" if bare in WILDCARDS else bare
    return http_url(host, port)
