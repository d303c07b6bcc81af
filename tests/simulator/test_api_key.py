"""--api-key as vLLM 0.26 applies it: only /v1*, /v2*, /inference* need the key; the
development routes, /health and /metrics are never authenticated."""

from __future__ import annotations

from typing import Any

import pytest

from tests.simulator.conftest import MODEL, Sim, SimFactory

KEY = "s3cret-key"
GOOD = {"Authorization": f"Bearer {KEY}"}

GUARDED: list[tuple[str, str, Any]] = [
    ("GET", "/v1/models", None),
    ("POST", "/v1/chat/completions",
     {"model": MODEL, "messages": [{"role": "user", "content": "3 + 4"}]}),
    ("POST", "/v1/completions", {"model": MODEL, "prompt": "3 + 4"}),
    ("POST", "/v1/omni/sleep", {"stage_ids": [0], "level": 1}),
    ("POST", "/v1/omni/wakeup", {"stage_ids": [0]}),
]
OPEN: list[tuple[str, str, Any]] = [
    ("POST", "/sleep", None),
    ("POST", "/wake_up", None),
    ("GET", "/is_sleeping", None),
    ("POST", "/reset_prefix_cache", None),
    ("POST", "/pause", None),
    ("POST", "/resume", None),
    ("GET", "/is_paused", None),
    ("GET", "/health", None),
    ("GET", "/metrics", None),
]


@pytest.fixture
async def keyed(make_sim: SimFactory) -> Sim:
    return await make_sim(api_key=KEY)


@pytest.fixture
async def keyed_omni(make_sim: SimFactory) -> Sim:
    return await make_sim(api_key=KEY, omni=True)


@pytest.mark.parametrize(("method", "path", "body"), GUARDED)
@pytest.mark.parametrize("header", [None, "Bearer wrong", f"Basic {KEY}", KEY])
async def test_v1_without_the_key_gets_401(
    keyed_omni: Sim, method: str, path: str, body: Any, header: str | None
) -> None:
    headers = {"Authorization": header} if header is not None else {}
    async with keyed_omni.client.request(method, path, json=body, headers=headers) as resp:
        assert resp.status == 401
        assert await resp.json() == {"error": "Unauthorized"}
    assert not await keyed_omni.is_sleeping()


@pytest.mark.parametrize(("method", "path", "body"), GUARDED)
async def test_v1_with_the_key_works(keyed_omni: Sim, method: str, path: str, body: Any
                                     ) -> None:
    async with keyed_omni.client.request(method, path, json=body, headers=GOOD) as resp:
        assert resp.status == 200, await resp.text()


@pytest.mark.parametrize(("method", "path", "body"), OPEN)
async def test_control_routes_are_never_authenticated(
    keyed: Sim, method: str, path: str, body: Any
) -> None:
    async with keyed.client.request(method, path, json=body) as resp:
        assert resp.status == 200, (path, await resp.text())


async def test_an_unauthenticated_client_can_put_the_engine_to_sleep(keyed: Sim) -> None:
    """What the real vLLM does with --api-key (verified on the H200): /sleep without a key
    answers 200 and the engine sleeps. Only the network (or rota's engine guard) stops it."""
    async with keyed.client.post("/sleep", params={"level": "1"}) as resp:
        assert resp.status == 200
    assert await keyed.is_sleeping()
    assert (await keyed.state())["memory_bytes"] == 1 * 2**30


async def test_without_a_key_nothing_is_guarded(sim: Sim) -> None:
    async with sim.client.get("/v1/models") as resp:
        assert resp.status == 200
