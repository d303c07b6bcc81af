"""GET /metrics: vLLM's in-flight gauges, so a drain can be watched as on a real engine."""

from __future__ import annotations

import asyncio
import re

from e2e.engine_simulator.metrics_api import render_metrics
from tests.simulator.conftest import MODEL, Sim, next_event, read_events

PROBE = {"model": MODEL, "messages": [{"role": "user", "content": "What is 3 + 4?"}],
         "stream": True}
_SAMPLE = re.compile(r'^(vllm:num_requests_(?:running|waiting))\{engine="0",'
                     r'model_name="([^"]*)"\} (\S+)$')


async def gauges(sim: Sim) -> dict[str, float]:
    async with sim.client.get("/metrics") as resp:
        assert resp.status == 200
        assert resp.content_type == "text/plain"
        text = await resp.text()
    found: dict[str, float] = {}
    for line in text.splitlines():
        if line.startswith("#"):
            assert line.split()[1] in ("HELP", "TYPE")
            continue
        match = _SAMPLE.match(line)
        assert match, line
        assert match.group(2) == MODEL
        found[match.group(1)] = float(match.group(3))
    return found


async def test_idle_engine_reports_zero(sim: Sim) -> None:
    assert await gauges(sim) == {"vllm:num_requests_running": 0.0,
                                 "vllm:num_requests_waiting": 0.0}


async def test_running_counts_a_stalled_generation_until_it_ends(sim: Sim) -> None:
    await sim.faults(stall_generation=True)
    async with sim.client.post("/v1/chat/completions", json=PROBE) as resp:
        await next_event(resp)
        assert (await gauges(sim))["vllm:num_requests_running"] == 1.0
        await sim.faults(stall_generation=False)
        await read_events(resp)
    await sim.until(lambda: sim.engine.running == 0)
    assert (await gauges(sim))["vllm:num_requests_running"] == 0.0


async def post_ok(sim: Sim, path: str) -> None:
    async with sim.client.post(path) as resp:
        assert resp.status == 200, await resp.text()


async def test_waiting_counts_requests_held_while_paused(sim: Sim) -> None:
    await post_ok(sim, "/pause")
    held = asyncio.create_task(sim.ask())
    await sim.until(lambda: sim.engine.waiting == 1)
    assert await gauges(sim) == {"vllm:num_requests_running": 0.0,
                                 "vllm:num_requests_waiting": 1.0}
    await post_ok(sim, "/resume")
    async with asyncio.timeout(10):
        await held
    assert (await gauges(sim))["vllm:num_requests_waiting"] == 0.0


def test_model_name_is_escaped() -> None:
    text = render_metrics('we"ird\\name', running=2, waiting=3)
    assert 'model_name="we\\"ird\\\\name"' in text
    assert 'vllm:num_requests_running{engine="0",model_name="we\\"ird\\\\name"} 2.0' in text
