"""Base URLs the gateway sends to, built so that IPv6 addresses work.

A URL's host is an IP address the gateway watches (an engine pod's IP) or that a
controller advertises. An IPv6 address must be bracketed in a URL (``http://[fd00::5]:8000``);
``f"http://{ip}:{port}"`` is not a URL for one, and aiohttp refuses it. Pure.
"""

from __future__ import annotations

import ipaddress
from urllib.parse import urlsplit

__all__ = ["base_url", "normalize_base_url"]


def _host(ip: str) -> str:
    try:
        address = ipaddress.ip_address(ip.strip("[]"))
    except ValueError:
        return ip  # a name: used as it is
    return f"[{address.compressed}]" if address.version == 6 else address.compressed


def base_url(ip: str, port: int, *, scheme: str = "http") -> str:
    """``http://<ip>:<port>`` with an IPv6 address in brackets."""
    return f"{scheme}://{_host(ip)}:{port}"


def normalize_base_url(url: str) -> str | None:
    """A base URL as advertised (a controller Lease's activation URL), made usable.

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
