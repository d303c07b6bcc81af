"""--control-token: control endpoints need the bearer token; the rest stays open."""

from __future__ import annotations

from typing import Any

import pytest

from e2e.engine_simulator.auth import CONTROL_PATHS
from tests.simulator.conftest import MODEL, Sim, SimFactory

TOKEN = "s3cret-token"
GOOD = {"Authorization": f"Bearer {TOKEN}"}

CONTROL_CALLS: list[tuple[str, str, Any]] = [
    ("POST", "/sleep", None),
    ("POST", "/wake_up", None),
    ("GET", "/is_sleeping", None),
    ("POST", "/collective_rpc", {"method": "reload_weights"}),
    ("POST", "/reset_prefix_cache", None),
    ("POST", "/pause", None),
    ("POST", "/resume", None),
    ("GET", "/is_paused", None),
    ("POST", "/v1/omni/sleep", {"stage_ids": [0], "level": 1}),
    ("POST", "/v1/omni/wakeup", {"stage_ids": [0]}),
]


@pytest.fixture
async def guarded(make_sim: SimFactory) -> Sim:
    return await make_sim(control_token=TOKEN, omni=True)


def test_every_control_path_is_listed() -> None:
    listed = {path for _, path, _ in CONTROL_CALLS if not path.startswith("/v1/omni/")}
    assert listed == CONTROL_PATHS


@pytest.mark.parametrize(("method", "path", "body"), CONTROL_CALLS)
@pytest.mark.parametrize("header", [None, "Bearer wrong", f"Basic {TOKEN}", TOKEN])
async def test_control_calls_without_the_token_get_401(
    guarded: Sim, method: str, path: str, body: Any, header: str | None
) -> None:
    headers = {"Authorization": header} if header is not None else {}
    async with guarded.client.request(method, path, json=body, headers=headers) as resp:
        assert resp.status == 401
        assert resp.headers["WWW-Authenticate"] == "Bearer"
        assert await resp.json() == {"error": "Unauthorized"}
    state = await guarded.state()
    assert state["sleep_count"] == state["wake_count"] == 0
    assert not state["paused"]


async def test_control_calls_with_the_token_work(guarded: Sim) -> None:
    async with guarded.client.post("/sleep", params={"level": "1"}, headers=GOOD) as resp:
        assert resp.status == 200
    async with guarded.client.get("/is_sleeping", headers=GOOD) as resp:
        assert await resp.json() == {"is_sleeping": True}
    async with guarded.client.post("/wake_up", headers=GOOD) as resp:
        assert resp.status == 200
    async with guarded.client.post("/v1/omni/sleep", json={"stage_ids": [1], "level": 1},
                                   headers=GOOD) as resp:
        assert resp.status == 200
        assert (await resp.json())["status"] == "SUCCESS"


async def test_open_endpoints_need_no_token(guarded: Sim) -> None:
    for path in ("/health", "/metrics", "/v1/models", "/sim/state", "/sim/faults"):
        async with guarded.client.get(path) as resp:
            assert resp.status == 200, path
    assert await guarded.answer() == "7"
    assert (await guarded.faults(stall_generation=False))["stall_generation"] is False


async def test_without_a_token_nothing_is_guarded(sim: Sim) -> None:
    await sim.post_empty("/sleep", level=1)
    assert await sim.is_sleeping()
    await sim.post_empty("/wake_up")
    async with sim.client.post("/v1/chat/completions", json={
            "model": MODEL, "messages": [{"role": "user", "content": "3 + 4"}]}) as resp:
        assert resp.status == 200
