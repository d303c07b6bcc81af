"""The simulator records the credential headers it receives, as a hostile engine would:
even on requests its own API key refuses."""

from __future__ import annotations

from tests.simulator.conftest import SimFactory

KEY = "engine-key"


async def test_control_and_authorization_headers_are_recorded_refused_or_not(
        make_sim: SimFactory) -> None:
    sim = await make_sim(api_key=KEY)
    sent = {"X-Rota-Control-Token": "ctl-1", "Authorization": "Bearer wrong"}
    async with sim.client.get("/is_sleeping", headers=sent) as resp:
        assert resp.status == 200
    async with sim.client.get("/v1/models", headers={"Authorization": "Bearer wrong"}) as resp:
        assert resp.status == 401
    async with sim.client.get("/sim/headers") as resp:
        assert resp.status == 200
        assert await resp.json() == {"authorization": ["Bearer wrong"],
                                     "x-rota-control-token": ["ctl-1"]}
