"""The contract of the engine guard with the lease controller's engine adapters and with
the gateway.

The guard (:mod:`controller.guard`) sits in front of an engine and lets control calls
(sleep, wake, reset) through only with rota's control token; the adapters
(:mod:`controller.lease.engines`) send it. Client requests pass on the paths the gateway
forwards (:mod:`rota.api.client_routes`), with the engine's own API key. Standard
library only: the guard imports nothing of the lease controller or the gateway.

Fences. Every control call the lease controller sends also carries the fencing number of
each GPU Lease it acts under (:data:`FENCE_HEADER`, written by :func:`format_fences`, read
by :func:`parse_fences`); the guard refuses a call whose number for a Lease is lower than
one it already let through, so that a controller instance that was paused after its own
fencing check cannot act after a newer instance has (see :mod:`controller.guard.proxy`).
"""

from __future__ import annotations

import re
from collections.abc import Mapping

from rota.api.errors import ContractError

__all__ = ["CONTROL_TOKEN_HEADER", "FENCE_HEADER", "MAX_FENCES", "FenceHeaderError",
           "format_fences", "parse_fences"]

CONTROL_TOKEN_HEADER = "X-Rota-Control-Token"
"""The header carrying rota's control token on control calls (checked by the engine
guard; vLLM ignores it). ``Authorization`` is left to the engine's own API key."""


FENCE_HEADER = "X-Rota-Fence"
"""The header carrying the fencing numbers a control call is sent under:
``<GPU Lease name>=<fence>``, comma-separated for a gang (one per GPU Lease), e.g.
``rota-gpu-node-a-gpu-0=12,rota-gpu-node-a-gpu-1=7``. Optional: a call without it is not
checked (the engine's own tooling, a controller older than the header)."""

MAX_FENCES = 64
"""Most Leases one header may name (a gang spans the GPUs of one node)."""
_MAX_FENCE = 2**63 - 1
"""A Lease's ``leaseTransitions`` is an int32 on the API server; anything above this is
not a fence."""
_LEASE_NAME = re.compile(r"[a-z0-9]([-a-z0-9.]{0,251}[a-z0-9])?")
"""A Lease's name: a DNS-1123 subdomain."""
_FENCE = re.compile(r"[0-9]{1,19}")


class FenceHeaderError(ContractError, ValueError):
    """A :data:`FENCE_HEADER` value that is not ``name=fence[,name=fence...]``."""


def format_fences(fences: Mapping[str, int]) -> str:
    """The :data:`FENCE_HEADER` value for ``fences`` (Lease name to fencing number),
    sorted by name so that one set of fences is always one string."""
    if not fences:
        raise ValueError("a fence header names at least one Lease")
    return ",".join(f"{name}={fences[name]}" for name in sorted(fences))


def parse_fences(value: str) -> dict[str, int]:
    """Lease name to fencing number, from a :data:`FENCE_HEADER` value.

    Raises:
        FenceHeaderError: empty, more than :data:`MAX_FENCES` items, an item that is not
            ``<Lease name>=<decimal>``, or one Lease named twice.
    """
    items = value.split(",")
    if len(items) > MAX_FENCES:
        raise FenceHeaderError(f"{FENCE_HEADER} names more than {MAX_FENCES} Leases")
    fences: dict[str, int] = {}
    for item in items:
        name, sep, number = item.strip().partition("=")
        if not sep or not _LEASE_NAME.fullmatch(name) or not _FENCE.fullmatch(number):
            raise FenceHeaderError(f"{FENCE_HEADER} item {item.strip()[:80]!r} is not "
                                   "<Lease name>=<fencing number>")
        if name in fences:
            raise FenceHeaderError(f"{FENCE_HEADER} names Lease {name} twice")
        fence = int(number)
        if fence > _MAX_FENCE:
            raise FenceHeaderError(f"{FENCE_HEADER}: fence {number} of {name} is too large")
        fences[name] = fence
    return fences
