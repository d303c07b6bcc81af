"""Which of a claim's opaque configurations applies: the rule prepare and every reader share.

Opaque configs for rota's driver are read from ``status.allocation.devices.config``, or from
``spec.devices.config`` when the allocation carries none. An entry applies when its
``requests`` list is empty or names one of the driver's results' requests (``req`` covers
its subrequests ``req/sub``). Entries from the claim (``FromClaim``, and every spec entry)
override entries from the DeviceClass (``FromClass``); within the winning source, more than
one distinct applicable entry is ambiguous. The driver applies this at prepare; the lease
controller and the gateway apply it to find each claimant's engine. Pure.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from rota.api.engine_config import EngineConfig, parse_engine_config
from rota.api.errors import ClaimError

__all__ = ["engine_config_of", "select_engine_config"]


def _mapping(value: object) -> Mapping[str, Any]:
    return value if isinstance(value, Mapping) else {}


def _sequence(value: object) -> Sequence[Any]:
    if isinstance(value, Sequence) and not isinstance(value, str | bytes):
        return value
    return ()


def _applies(entry_requests: Sequence[Any], full_requests: Sequence[str]) -> bool:
    if not entry_requests:
        return True
    for wanted in entry_requests:
        for request in full_requests:
            if request == wanted or request.startswith(f"{wanted}/"):
                return True
    return False


def select_engine_config(
    claim: Mapping[str, Any],
    allocated: Mapping[str, Any],
    full_requests: Sequence[str],
    *,
    driver: str,
    ref: str,
) -> EngineConfig | None:
    """The one opaque config of ``driver`` that applies to the claim's ``full_requests``.

    ``allocated`` is the claim's ``status.allocation.devices``; ``ref`` names the claim in
    messages. None: no entry applies.

    Raises:
        ClaimError: more than one distinct entry applies, or the entry is invalid.
    """
    entries = _sequence(allocated.get("config"))
    from_status = bool(entries)
    if not from_status:
        entries = _sequence(_mapping(_mapping(claim.get("spec")).get("devices")).get("config"))
    from_claim: list[object] = []
    from_class: list[object] = []
    for raw_entry in entries:
        entry = _mapping(raw_entry)
        opaque = _mapping(entry.get("opaque"))
        if opaque.get("driver") != driver:
            continue
        if not _applies(_sequence(entry.get("requests")), full_requests):
            continue
        parameters = opaque.get("parameters")
        target = from_class if from_status and entry.get("source") == "FromClass" else from_claim
        if parameters not in target:
            target.append(parameters)
    chosen = from_claim or from_class
    if not chosen:
        return None
    if len(chosen) > 1:
        raise ClaimError(
            f"claim {ref} has {len(chosen)} different opaque configs for driver "
            f"{driver} that apply to its requests; give exactly one",
            reason="invalid_config",
        )
    return parse_engine_config(chosen[0])


def engine_config_of(claim: Mapping[str, Any], *, driver: str) -> EngineConfig | None:
    """The claim's EngineConfig for ``driver``, chosen by the rule this module states.

    For readers other than prepare (the lease controller, the gateway): None when the
    claim has no config for the driver or no allocation result of it.

    Raises:
        ClaimError: the configs are ambiguous or invalid.
    """
    metadata = _mapping(claim.get("metadata"))
    ref = f"{metadata.get('namespace', '')}/{metadata.get('name', '')}"
    allocated = _mapping(_mapping(_mapping(claim.get("status")).get("allocation")).get("devices"))
    results = map(_mapping, _sequence(allocated.get("results")))
    requests = [str(r.get("request", "")) for r in results if r.get("driver") == driver]
    if not requests:
        return None
    return select_engine_config(claim, allocated, requests, driver=driver, ref=ref)
