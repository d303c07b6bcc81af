"""URLs of pods, listeners and advertised activation endpoints, for IPv4 and IPv6 alike.
Pure; the one URL module of every process under ``controller/``."""

from __future__ import annotations

import ipaddress
from urllib.parse import urlsplit

__all__ = ["WILDCARDS", "advertised_url", "http_url", "normalize_base_url"]

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


def normalize_base_url(url: str) -> str | None:
    """A base URL as advertised (a controller Lease's activation URL), made usable: a
    controller that advertises ``http://$(POD_IP):8090`` unbracketed (older ones did) would
    be unreachable over IPv6.

    ``http://10.0.0.9:8090/`` stays as it is (without the trailing slash); an IPv6 address
    written without brackets (``http://fd00::9:8090``, what ``http://$(POD_IP):8090``
    expands to) gets them, the last ``:<digits>`` read as the port. None when the value is
    not an ``http``/``https`` URL with a host.
    """
    url = url.strip().rstrip("/")
    scheme, sep, rest = url.partition("://")
    if not sep or scheme not in ("http", "https") or not rest:
        return None
    authority, slash, path = rest.partition("/")
    if authority.count(":") > 1 and not authority.startswith("["):
        address, _, port = authority.rpartition(":")
        try:
            ipaddress.IPv6Address(address)
        except ValueError:
            return None
        if not port.isdigit():
            return None
        authority = f"[{address}]:{port}"
    candidate = f"{scheme}://{authority}{slash}{path}"
    try:
        parts = urlsplit(candidate)
        _ = parts.port  # raises on a bad port
    except ValueError:
        return None
    if not parts.hostname:
        return None
    return candidate
