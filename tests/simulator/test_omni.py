"""vLLM-Omni's stage-aware sleep and wakeup, as vLLM-Omni 0.26 behaves."""

from __future__ import annotations

import asyncio
from typing import Any

from e2e.engine_simulator.omni_api import LEVEL2_WAKE_NOT_IMPLEMENTED
from tests.simulator.conftest import GIB, MODEL, Sim, SimFactory, read_events

PROBE = {"model": MODEL, "messages": [{"role": "user", "content": "3 + 4"}]}


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
    # vLLM-Omni sends the GiB metadata as strings.
    assert ack["metadata"]["total_freed_gib"] == "4.50"
    assert ack["metadata"]["rank_residual_gib"] == "5.50"
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
    assert (status, body) == (200, {"status": "SKIPPED",
                                    "reason": "Target stages are not sleeping."})


async def test_gib_numbers_is_a_named_kinder_fault(make_sim: SimFactory) -> None:
    sim = await make_sim(omni=True, omni_stages=2, faults={"omni_gib_numbers": True})
    _, body = await omni(sim, "/v1/omni/sleep", {"stage_ids": [0], "level": 1})
    assert body["acks"][0]["metadata"]["total_freed_gib"] == 4.5


async def test_wake_after_level2_is_not_implemented_and_latches(make_sim: SimFactory) -> None:
    """vLLM-Omni 0.26 and 0.30: 501, and the engine cannot be woken until it restarts."""
    sim = await make_sim(omni=True, omni_stages=3)
    status, body = await omni(sim, "/v1/omni/sleep", {"stage_ids": [0, 1, 2]})  # level 2
    assert status == 200
    assert [a["stage_id"] for a in body["acks"]] == [0, 1, 2]
    assert sum(a["freed_bytes"] for a in body["acks"]) == 9 * GIB
    assert (await sim.state())["memory_bytes"] == 1 * GIB
    for _ in range(2):
        status, body = await omni(sim, "/v1/omni/wakeup", {"stage_ids": [0, 1, 2]})
        assert status == 501
        assert body["error"]["type"] == "NotImplementedError"
        assert body["error"]["message"] == LEVEL2_WAKE_NOT_IMPLEMENTED
    assert await sim.is_sleeping()


async def test_level2_wake_is_a_named_kinder_fault(make_sim: SimFactory) -> None:
    sim = await make_sim(omni=True, omni_stages=3, faults={"omni_level2_wake": True})
    await omni(sim, "/v1/omni/sleep", {"stage_ids": [0, 1, 2]})
    status, _ = await omni(sim, "/v1/omni/wakeup", {"stage_ids": [0, 1, 2]})
    assert status == 200
    assert (await sim.state())["weights_valid"]
    assert await sim.answer() == "42"  # vllm-omni#6442: prefix hashes survive the sleep
    await sim.reset_prefix_cache()
    assert await sim.answer() == "7"


async def test_sleep_does_not_drain_a_running_request(make_sim: SimFactory) -> None:
    """vLLM-Omni pauses nothing: a running request loses its memory and fails; new ones are
    rejected with 500 (never 503, never held)."""
    sim = await make_sim(omni=True, omni_stages=1)
    await sim.faults(stall_generation=True)
    payload = PROBE | {"stream": True, "max_tokens": 5, "ignore_eos": True}
    async with sim.client.post("/v1/chat/completions", json=payload) as resp:
        await sim.until(lambda: sim.engine.running == 1)
        status, _ = await omni(sim, "/v1/omni/sleep", {"stage_ids": [0], "level": 1})
        assert status == 200
        await sim.faults(stall_generation=False)
        events = await read_events(resp)
    errors = [e for e in events if isinstance(e, dict) and "error" in e]
    assert "partially or fully asleep" in errors[0]["error"]["message"]
    async with sim.client.post("/v1/chat/completions", json=PROBE) as rejected:
        assert rejected.status == 500
        assert "partially or fully asleep" in (await rejected.json())["error"]["message"]


async def test_sleep_aborts_is_a_named_kinder_fault(make_sim: SimFactory) -> None:
    sim = await make_sim(omni=True, omni_stages=1, faults={"omni_sleep_aborts": True})
    await sim.faults(stall_generation=True)
    payload = PROBE | {"stream": True, "max_tokens": 5, "ignore_eos": True}
    async with sim.client.post("/v1/chat/completions", json=payload) as resp:
        await sim.until(lambda: sim.engine.running == 1)
        sleeping = asyncio.create_task(omni(sim, "/v1/omni/sleep",
                                            {"stage_ids": [0], "level": 1}))
        events = await read_events(resp)
        assert (await sleeping)[0] == 200
    assert not [e for e in events if isinstance(e, dict) and "error" in e]


async def test_vllm_whole_engine_routes_fail_on_omni(make_sim: SimFactory) -> None:
    """vLLM's /sleep calls sleep(level, mode) positionally; AsyncOmni takes stage ids first."""
    sim = await make_sim(omni=True)
    for path in ("/sleep", "/wake_up"):
        async with sim.client.post(path) as resp:
            assert resp.status == 500
    assert not await sim.is_sleeping()


async def test_bad_bodies_and_unknown_stages(make_sim: SimFactory) -> None:
    sim = await make_sim(omni=True)
    for path, body in (("/v1/omni/sleep", {}), ("/v1/omni/wakeup", {"stage_ids": "x"})):
        status, answer = await omni(sim, path, body)
        assert status == 400, (path, body)
        assert answer["error"]["code"] == 400
    async with sim.client.post("/v1/omni/sleep", data=b"[") as resp:
        assert resp.status == 400
    status, answer = await omni(sim, "/v1/omni/sleep", {"stage_ids": [7]})
    assert status == 500  # IndexError before any RPC
    assert not await sim.is_sleeping()


async def test_not_served_without_omni(sim: Sim) -> None:
    async with sim.client.post("/v1/omni/sleep", json={"stage_ids": [0]}) as resp:
        assert resp.status == 404
