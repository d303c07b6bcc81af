"""The engine guard on the dual-stack address (its default) answers over IPv4 and IPv6:
the kubelet probes the pod's address, whichever family the cluster gives it."""

from __future__ import annotations

import asyncio

import pytest

from controller.guard.app import run
from controller.guard.settings import GuardSettings
from tests.listening import (
    NO_IPV6_LOOPBACK,
    free_port,
    has_ipv6_loopback,
    status_of,
    wait_listening,
)


def test_the_guard_listens_on_every_address_family_by_default() -> None:
    assert GuardSettings().host == "::"


@pytest.mark.parametrize("family", ["IPv4", "IPv6"])
async def test_on_the_dual_stack_address_the_guard_answers(monkeypatch: pytest.MonkeyPatch,
                                                           family: str) -> None:
    if family == "IPv6" and not has_ipv6_loopback():
        pytest.skip(NO_IPV6_LOOPBACK)
    monkeypatch.setenv("ROTA_CONTROL_TOKEN", "t0ken")
    port = free_port()
    settings = GuardSettings(host="::", port=port,
                             upstream=f"http://127.0.0.1:{free_port()}")
    stop = asyncio.Event()
    guard = asyncio.create_task(run(settings, stop=stop))
    client = "127.0.0.1" if family == "IPv4" else "::1"
    try:
        await wait_listening(port, host="::1" if has_ipv6_loopback() else "127.0.0.1")
        # Nothing serves upstream: any answer at all (the guard's 502) proves the listener.
        assert await status_of(client, port, "/health") is not None
    finally:
        stop.set()
        async with asyncio.timeout(30):
            await guard
