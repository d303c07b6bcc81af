"""GET /metrics: vLLM 0.26's in-flight and sleep gauges, so a drain can be watched as on a
real engine, with the real engine's blind spots."""

from __future__ import annotations

import asyncio
import re

from e2e.engine_simulator.metrics_api import render_metrics
from tests.simulator.conftest import MODEL, Sim, SimFactory, next_event, read_events

PROBE = {"model": MODEL, "messages": [{"role": "user", "content": "What is 3 + 4?"}],
         "stream": True}
_SAMPLE = re.compile(r'^(vllm:[a-z_]+)\{engine="0",model_name="([^"]*)"'
                     r'(?:,sleep_state="([a-z_]+)")?\} (\S+)$')
GAUGES = ("vllm:num_requests_running", "vllm:num_requests_waiting",
          "vllm:engine_sleep_state")
_GAUGE_SAMPLES = tuple(f"{name}{{" for name in GAUGES)


async def page(sim: Sim, path: str = "/metrics", **params: str | list[str]) -> str:
    query = [(k, v) for k, vs in params.items() for v in ([vs] if isinstance(vs, str) else vs)]
    async with sim.client.get(path, params=query) as resp:
        assert resp.status == 200
        assert resp.content_type == "text/plain"
        return await resp.text()


async def gauges(sim: Sim) -> dict[str, float]:
    text = await page(sim)
    found: dict[str, float] = {}
    for line in text.splitlines():
        if not line.startswith(_GAUGE_SAMPLES):
            continue  # comments, and the other families of the page
        match = _SAMPLE.match(line)
        assert match, line
        assert match.group(2) == MODEL
        name = match.group(1) + (f"/{match.group(3)}" if match.group(3) else "")
        found[name] = float(match.group(4))
    return found


def in_flight(found: dict[str, float]) -> tuple[float, float]:
    return found["vllm:num_requests_running"], found["vllm:num_requests_waiting"]


def sleep_state(found: dict[str, float]) -> str:
    [state] = [k.split("/")[1] for k, v in found.items()
               if k.startswith("vllm:engine_sleep_state/") and v == 1.0]
    return state


async def post_ok(sim: Sim, path: str, **params: str) -> None:
    async with sim.client.post(path, params=params) as resp:
        assert resp.status == 200, await resp.text()


async def test_idle_engine_reports_zero_and_awake(sim: Sim) -> None:
    found = await gauges(sim)
    assert in_flight(found) == (0.0, 0.0)
    assert sleep_state(found) == "awake"
    assert len([k for k in found if k.startswith("vllm:engine_sleep_state/")]) == 3


async def test_running_counts_a_stalled_generation_until_it_ends(sim: Sim) -> None:
    await sim.faults(stall_generation=True)
    async with sim.client.post("/v1/chat/completions", json=PROBE) as resp:
        await next_event(resp)
        assert in_flight(await gauges(sim)) == (1.0, 0.0)
        await sim.faults(stall_generation=False)
        await read_events(resp)
    await sim.until(lambda: sim.engine.running == 0)
    assert in_flight(await gauges(sim)) == (0.0, 0.0)


async def test_waiting_counts_requests_held_while_a_drain_still_steps(sim: Sim) -> None:
    await sim.faults(stall_generation=True)
    async with sim.client.post("/v1/chat/completions", json=PROBE) as resp:
        await next_event(resp)
        pausing = asyncio.create_task(post_ok(sim, "/pause", mode="wait"))
        await sim.until(lambda: sim.engine.paused)
        held = asyncio.create_task(sim.ask())
        await sim.until(lambda: sim.engine.waiting == 1)
        assert in_flight(await gauges(sim)) == (1.0, 1.0)
        await sim.faults(stall_generation=False)
        await read_events(resp)
        async with asyncio.timeout(10):
            await pausing
    await post_ok(sim, "/resume")
    async with asyncio.timeout(10):
        await held


async def test_requests_held_while_asleep_do_not_show(sim: Sim) -> None:
    """No engine step happens while asleep, so vLLM's gauges keep their last values: a
    drain watching them sees nothing of the requests held since."""
    await post_ok(sim, "/sleep", level="1")
    held = asyncio.create_task(sim.ask())
    await sim.until(lambda: sim.engine.waiting == 1)
    assert in_flight(await gauges(sim)) == (0.0, 0.0)
    await post_ok(sim, "/wake_up")
    async with asyncio.timeout(10):
        await held


async def test_sleep_state_follows_sleep_and_wake(sim: Sim) -> None:
    await post_ok(sim, "/sleep", level="1")
    assert sleep_state(await gauges(sim)) == "weights_offloaded"
    await post_ok(sim, "/wake_up")
    assert sleep_state(await gauges(sim)) == "awake"
    await post_ok(sim, "/sleep", level="2")
    assert sleep_state(await gauges(sim)) == "discard_all"
    await post_ok(sim, "/wake_up", tags="weights")  # vLLM records "awake" after any wake
    assert sleep_state(await gauges(sim)) == "awake"
    assert await sim.is_sleeping()


async def test_disable_log_stats_removes_every_gauge(make_sim: SimFactory) -> None:
    sim = await make_sim(disable_log_stats=True)
    assert await gauges(sim) == {}


def test_model_name_is_escaped() -> None:
    text = render_metrics('we"ird\\name', running=2, waiting=3)
    assert 'model_name="we\\"ird\\\\name"' in text
    assert 'vllm:num_requests_running{engine="0",model_name="we\\"ird\\\\name"} 2.0' in text


def _families(text: str) -> set[str]:
    return {line.split()[2] for line in text.splitlines() if line.startswith("# TYPE ")}


async def test_metrics_is_the_whole_page_whatever_the_filter(sim: Sim) -> None:
    """vLLM's /metrics is prometheus-fastapi-instrumentator's handler: it ignores
    prometheus_client's name[] filter and renders every family, histograms included."""
    whole = await page(sim)
    assert {"vllm:time_to_first_token_seconds", "vllm:e2e_request_latency_seconds",
            *GAUGES} <= _families(whole)
    assert len(whole) > 20_000
    assert await page(sim, **{"name[]": "vllm:engine_sleep_state"}) == whole


async def test_the_mount_behind_it_keeps_only_the_samples_named(sim: Sim) -> None:
    """/metrics/ reaches prometheus_client's own app (vLLM's Mount), which honours name[]
    by sample name: a histogram's base name matches none of its samples."""
    only = await page(sim, "/metrics/", **{"name[]": ["vllm:num_requests_running",
                                                      "vllm:num_requests_waiting"]})
    assert _families(only) == {"vllm:num_requests_running", "vllm:num_requests_waiting"}
    assert len(only) < 1_000
    assert await page(sim, "/metrics/", **{"name[]": "vllm:time_to_first_token_seconds"}
                      ) == ""
    assert _families(await page(sim, "/metrics/", **{
        "name[]": "vllm:time_to_first_token_seconds_count"})) == {
        "vllm:time_to_first_token_seconds"}
    assert await page(sim, "/metrics/") == await page(sim)


async def test_disable_log_stats_leaves_the_filtered_page_empty(make_sim: SimFactory
                                                                ) -> None:
    sim = await make_sim(disable_log_stats=True)
    assert await page(sim, "/metrics/", **{"name[]": "vllm:engine_sleep_state"}) == ""
