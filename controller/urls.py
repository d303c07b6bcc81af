"""URLs of pods and listeners, for IPv4 and IPv6 alike."""

from __future__ import annotations

import ipaddress

__all__ = ["http_url"]


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
