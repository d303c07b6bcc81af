"""vLLM-Omni's stage-aware sleep and wakeup."""

from __future__ import annotations

from typing import Any

from tests.simulator.conftest import GIB, Sim, SimFactory

GIB_F = float(GIB)


async def omni(sim: Sim, path: str, body: Any) -> tuple[int, Any]:
    async with sim.client.post(path, json=body) as resp:
        return resp.status, await resp.json()


async def test_sleep_and_wake_one_stage(make_sim: SimFactory) -> None:
    sim = await make_sim(omni=True, omni_stages=2)
    status, body = await omni(sim, "/v1/omni/sleep", {"stage_ids": [0], "level": 1})
    assert status == 200
    assert body["status"] == "SUCCESS"
    [ack] = body["acks"]
    assert set(ack) == {"task_id", "status", "stage_id", "rank", "freed_bytes", "metadata",
                        "error_msg"}
    assert (ack["status"], ack["stage_id"], ack["rank"], ack["error_msg"]) == ("SUCCESS", 0, 0,
                                                                              None)
    assert ack["freed_bytes"] == 9 * GIB // 2
    assert ack["metadata"]["total_freed_gib"] == 4.5
    assert ack["metadata"]["rank_residual_gib"] == (10 * GIB - 9 * GIB // 2) / GIB_F
    state = await sim.state()
    assert state["sleeping"]
    assert [s["asleep"] for s in state["stages"]] == [True, False]

    status, body = await omni(sim, "/v1/omni/wakeup", {"stage_ids": [0, 1]})
    assert status == 200
    assert body["status"] == "SUCCESS"
    assert [a["stage_id"] for a in body["acks"]] == [0]
    assert not await sim.is_sleeping()
    assert await sim.answer() == "7"

    status, body = await omni(sim, "/v1/omni/wakeup", {"stage_ids": [0]})
    assert (status, body) == (200, {"status": "SKIPPED", "acks": []})


async def test_level2_default_and_stale_prefix_cache(make_sim: SimFactory) -> None:
    sim = await make_sim(omni=True, omni_stages=3)
    status, body = await omni(sim, "/v1/omni/sleep", {"stage_ids": [0, 1, 2]})
    assert status == 200
    assert [a["stage_id"] for a in body["acks"]] == [0, 1, 2]
    assert sum(a["freed_bytes"] for a in body["acks"]) == 9 * GIB
    state = await sim.state()
    assert state["level"] == 2
    assert state["memory_bytes"] == 1 * GIB

    status, body = await omni(sim, "/v1/omni/wakeup", {"stage_ids": [0, 1, 2]})
    assert status == 200
    assert (await sim.state())["weights_valid"]
    assert await sim.answer() == "42"  # vllm-omni#6442: prefix hashes survive the sleep
    await sim.post_empty("/reset_prefix_cache")
    assert await sim.answer() == "7"


async def test_whole_engine_routes_still_work(make_sim: SimFactory) -> None:
    sim = await make_sim(omni=True)
    await sim.post_empty("/sleep", level=1)
    assert all(s["asleep"] for s in (await sim.state())["stages"])
    await sim.post_empty("/wake_up")
    assert await sim.answer() == "7"


async def test_invalid_bodies_are_422(make_sim: SimFactory) -> None:
    sim = await make_sim(omni=True)
    for path, body in (
        ("/v1/omni/sleep", {"stage_ids": []}),
        ("/v1/omni/sleep", {"stage_ids": [0], "level": -1}),
        ("/v1/omni/sleep", {}),
        ("/v1/omni/wakeup", {"stage_ids": []}),
    ):
        status, answer = await omni(sim, path, body)
        assert status == 422, (path, body)
        assert answer["detail"][0]["loc"][0] == "body"
    async with sim.client.post("/v1/omni/sleep", data=b"[") as resp:
        assert resp.status == 422
    status, answer = await omni(sim, "/v1/omni/sleep", {"stage_ids": [7]})
    assert status == 400
    assert not await sim.is_sleeping()


async def test_not_served_without_omni(sim: Sim) -> None:
    async with sim.client.post("/v1/omni/sleep", json={"stage_ids": [0]}) as resp:
        assert resp.status == 404
