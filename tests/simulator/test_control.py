"""vLLM's control endpoints: sleep levels, wake tags, the level-2 sequence, their quirks."""

from __future__ import annotations

from tests.simulator.conftest import GIB, Sim, SimFactory


async def test_level1_round_trip(sim: Sim) -> None:
    assert not await sim.is_sleeping()
    assert (await sim.state())["memory_bytes"] == 10 * GIB

    await sim.post_empty("/sleep", level=1)
    assert await sim.is_sleeping()
    state = await sim.state()
    assert state["level"] == 1
    assert state["tags_asleep"] == ["weights", "kv_cache"]
    assert state["memory_bytes"] == 1 * GIB
    assert state["stages"][0]["weights"] == "offloaded"

    await sim.post_empty("/wake_up")
    assert not await sim.is_sleeping()
    state = await sim.state()
    assert state["memory_bytes"] == 10 * GIB
    assert state["level"] is None
    assert (state["sleep_count"], state["wake_count"]) == (1, 1)
    assert await sim.answer() == "7"


async def test_sleep_ignores_a_json_body(sim: Sim) -> None:
    async with sim.client.post("/sleep", json={"level": 2, "mode": "wait"}) as resp:
        assert resp.status == 200
        assert await resp.read() == b""
    state = await sim.state()
    assert state["level"] == 1
    assert state["sleeps"][0]["mode"] == "abort"
    assert state["weights_valid"]
    await sim.post_empty("/wake_up")
    assert await sim.answer() == "7"


async def test_misspelt_level_is_ignored_too(sim: Sim) -> None:
    await sim.post_empty("/sleep", sleep_level=2)
    assert (await sim.state())["level"] == 1


async def test_bad_sleep_parameters_are_refused(sim: Sim) -> None:
    for params in ({"level": "two"}, {"level": 3}, {"mode": "later"}):
        async with sim.client.post("/sleep", params=params) as resp:
            assert resp.status == 400, params
            body = await resp.json()
            assert body["error"]["code"] == 400
    assert not await sim.is_sleeping()


async def test_wake_by_tags_and_waking_an_awake_tag(sim: Sim) -> None:
    await sim.post_empty("/sleep", level=1)
    await sim.post_empty("/wake_up", tags="weights")
    assert await sim.is_sleeping()
    state = await sim.state()
    assert state["tags_asleep"] == ["kv_cache"]
    assert state["memory_bytes"] == 7 * GIB

    await sim.post_empty("/wake_up", tags="weights")  # already awake: a no-op
    assert (await sim.state())["wakes"][-1]["noop"]
    # vLLM 0.26 skips the whole call when any named tag is awake, kv_cache included.
    async with sim.client.post("/wake_up", params=[("tags", "weights"),
                                                   ("tags", "kv_cache")]) as resp:
        assert resp.status == 200
    assert (await sim.state())["tags_asleep"] == ["kv_cache"]
    await sim.post_empty("/wake_up", tags="kv_cache")
    assert not await sim.is_sleeping()
    await sim.post_empty("/wake_up")  # everything awake: still 200
    assert await sim.answer() == "7"


async def test_health_says_ok_while_asleep(sim: Sim) -> None:
    await sim.post_empty("/sleep", level=2)
    async with sim.client.get("/health") as resp:
        assert resp.status == 200


async def test_level2_full_sequence_answers_right(sim: Sim) -> None:
    await sim.post_empty("/sleep", level=2)
    assert (await sim.state())["memory_bytes"] == 1 * GIB
    await sim.post_empty("/wake_up", tags="weights")
    state = await sim.state()
    assert not state["weights_valid"]
    assert state["memory_bytes"] == 7 * GIB
    await sim.reload_weights()
    await sim.post_empty("/wake_up", tags="kv_cache")
    await sim.reset_prefix_cache()
    state = await sim.state()
    assert not state["sleeping"]
    assert state["weights_valid"]
    assert not state["prefix_cache_stale"]
    assert state["memory_bytes"] == 10 * GIB
    assert await sim.answer() == "7"


async def test_level2_without_reload_answers_garbage(sim: Sim) -> None:
    await sim.post_empty("/sleep", level=2)
    await sim.post_empty("/wake_up")
    await sim.reset_prefix_cache()
    answer = await sim.answer()
    assert answer != "7"
    assert set(answer) == {"!"}


async def test_level2_without_prefix_reset_answers_wrong(sim: Sim) -> None:
    await sim.post_empty("/sleep", level=2)
    await sim.post_empty("/wake_up", tags="weights")
    await sim.reload_weights()
    await sim.post_empty("/wake_up", tags="kv_cache")
    assert (await sim.state())["prefix_cache_stale"]
    assert await sim.answer() == "42"
    await sim.reset_prefix_cache()
    assert await sim.answer() == "7"


async def test_reload_needs_the_weights_mapped(sim: Sim) -> None:
    await sim.post_empty("/sleep", level=2)
    async with sim.client.post("/collective_rpc", json={"method": "reload_weights"}) as resp:
        assert resp.status == 500
        body = await resp.json()
        assert body["error"]["type"] == "InternalServerError"
    assert not (await sim.state())["weights_valid"]


async def test_collective_rpc_errors(sim: Sim) -> None:
    async with sim.client.post("/collective_rpc", data=b"{not json") as resp:
        assert resp.status == 400
        body = await resp.json()
        assert body["error"]["type"] == "Bad Request"
        assert body["error"]["message"].startswith("JSON decode error")
    async with sim.client.post("/collective_rpc", json={"args": []}) as resp:
        assert resp.status == 400
        assert (await resp.json())["error"]["message"] == "Missing 'method' in request body"
    async with sim.client.post("/collective_rpc", json={"method": "no_such_method"}) as resp:
        assert resp.status == 500
    body_extra: dict[str, object] = {"method": "reload_weights", "args": [], "kwargs": {},
                                     "timeout": None, "unknown": 1}
    async with sim.client.post("/collective_rpc", json=body_extra) as resp:
        assert resp.status == 200


async def test_level1_survives_a_reload(sim: Sim) -> None:
    await sim.post_empty("/sleep", level=1)
    await sim.post_empty("/wake_up")
    await sim.reload_weights()
    assert (await sim.state())["reloads"] == 1
    assert await sim.answer() == "7"


async def test_level0_pauses_without_moving_memory(sim: Sim) -> None:
    await sim.post_empty("/sleep", level=0)
    assert await sim.is_sleeping()
    assert (await sim.state())["memory_bytes"] == 10 * GIB
    await sim.post_empty("/wake_up")
    assert not await sim.is_sleeping()


async def test_first_level1_sleep_is_reported_apart(sim: Sim) -> None:
    for _ in range(3):
        await sim.post_empty("/sleep", level=1)
        await sim.post_empty("/wake_up")
    sleeps = (await sim.state())["sleeps"]
    assert [s["first"] for s in sleeps] == [True, False, False]
    assert all(w["from_level"] == 1 for w in (await sim.state())["wakes"])


async def test_sleeping_twice_is_a_noop(sim: Sim) -> None:
    await sim.post_empty("/sleep", level=1)
    await sim.post_empty("/sleep", level=2)
    state = await sim.state()
    assert state["level"] == 1
    assert state["sleeps"][-1]["noop"]
    await sim.post_empty("/wake_up")
    assert await sim.answer() == "7"  # the level-1 host copy came back


async def test_pause_resume(sim: Sim) -> None:
    async with sim.client.post("/pause") as resp:
        assert await resp.json() == {"status": "paused"}
    async with sim.client.get("/is_paused") as resp:
        assert await resp.json() == {"is_paused": True}
    async with sim.client.post("/pause", params={"mode": "bogus"}) as resp:
        assert resp.status == 400
    async with sim.client.post("/resume") as resp:
        assert await resp.json() == {"status": "resumed"}
    async with sim.client.get("/is_paused") as resp:
        assert await resp.json() == {"is_paused": False}
    assert await sim.answer() == "7"


async def test_unknown_route_is_fastapi_shaped(sim: Sim) -> None:
    async with sim.client.get("/no/such/route") as resp:
        assert resp.status == 404
        assert await resp.json() == {"detail": "Not Found"}


async def test_sleep_has_no_tags_in_vllm_0_26(sim: Sim) -> None:
    await sim.post_empty("/sleep", level=1, tags="kv_cache")  # ignored, as 0.26 ignores it
    state = await sim.state()
    assert state["tags_asleep"] == ["weights", "kv_cache"]
    assert state["memory_bytes"] == 1 * GIB


async def test_wake_each_tag_is_a_named_kinder_fault(make_sim: SimFactory) -> None:
    sim = await make_sim(faults={"wake_each_tag": True})
    await sim.post_empty("/sleep", level=1)
    await sim.post_empty("/wake_up", tags="weights")
    async with sim.client.post("/wake_up", params=[("tags", "weights"),
                                                   ("tags", "kv_cache")]) as resp:
        assert resp.status == 200
    assert not await sim.is_sleeping()
