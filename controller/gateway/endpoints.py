"""Activation URLs as controllers advertise them, made usable for IPv6. Pure.

An IPv6 address must be bracketed in a URL (``http://[fd00::5]:8090``); a controller that
advertises ``http://$(POD_IP):8090`` unbracketed (older ones did) would be unreachable.
Engine URLs are built from pod IPs with :func:`controller.urls.http_url`.
"""

from __future__ import annotations

import ipaddress
from urllib.parse import urlsplit

__all__ = ["normalize_base_url"]


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
