"""Requests kept across a sleep (``mode=keep``), as unkind as vLLM 0.26 measured on an H100:
the kept stream is preempted and recomputed at the wake, its tokens come back merged into
fewer chunks (never lost), the gauges stand still while nothing steps, preemptions are
counted, greedy output matches a never-slept reference; and the test knobs that break it
(``keep_fault``, ``leak_per_cycle_mib``) are caught by rota's own checks."""

from __future__ import annotations

import asyncio
import json
import re
from pathlib import Path
from typing import Any

import aiohttp
import pytest

from e2e.engine_simulator.generation import count_prompt_tokens
from e2e.engine_simulator.settings import settings_from_args
from e2e.gpu.keep_probe import Progress, StreamRecord, stream
from tests.simulator.conftest import DEADLINE, GIB, MODEL, PID, Sim, SimFactory, read_events

PROMPT = "Tell me a story about a lighthouse keeper"
TOKENS = 12
MIB = 2**20


def _body(**extra: Any) -> dict[str, Any]:
    return {"model": MODEL, "prompt": PROMPT, "max_tokens": TOKENS, "ignore_eos": True,
            "temperature": 0, "stream": True, "logprobs": 1, "return_token_ids": True,
            "stream_options": {"include_usage": True}} | extra


async def _record(sim: Sim, session: aiohttp.ClientSession) -> StreamRecord:
    """One greedy completion read by the keep probe's own client (rota's check)."""
    rec = StreamRecord(prompt=PROMPT, max_tokens=TOKENS)
    base = str(sim.client.make_url("")).rstrip("/")
    return await stream(session, base, MODEL, rec, Progress(), DEADLINE)


async def _frozen(sim: Sim, session: aiohttp.ClientSession, *, pause_first: bool = False
                  ) -> StreamRecord:
    """A stream running when the engine is put to sleep with its requests kept (B2 with
    ``pause_first``, else A), then woken."""
    await sim.faults(stall_generation=True)
    reading = asyncio.create_task(_record(sim, session))
    await sim.until(lambda: sim.engine.running == 1)
    if pause_first:
        await sim.post_json("/pause", mode="keep")
    await sim.post_empty("/sleep", level=1, mode="keep")
    await sim.faults(stall_generation=False)
    assert not reading.done()  # frozen: nothing moves while asleep
    await sim.post_empty("/wake_up")
    if pause_first:
        await sim.post_json("/resume")
    async with asyncio.timeout(DEADLINE):
        return await reading


def _intact(rec: StreamRecord, reference: StreamRecord) -> bool:
    """What rota's measurement demands of a kept stream: the reference's text and ids, and
    every token the engine generated delivered exactly once."""
    return (rec.same_as(reference) and rec.finish == "length"
            and rec.tokens == rec.usage_tokens == reference.tokens == TOKENS)


async def _metric(sim: Sim, name: str) -> float:
    async with sim.client.get("/metrics") as resp:
        text = await resp.text()
    found = re.search(rf"^{re.escape(name)}\{{[^}}]*\}} (\S+)$", text, re.MULTILINE)
    assert found, name
    return float(found.group(1))


async def test_a_kept_stream_comes_back_merged_whole_and_identical(sim: Sim) -> None:
    async with aiohttp.ClientSession() as session:
        reference = await _record(sim, session)
        frozen = await _frozen(sim, session)
    assert reference.counted_by == frozen.counted_by == "token_ids"
    assert reference.chunk_tokens == [1] * TOKENS  # never slept: one token per chunk
    assert _intact(frozen, reference)
    assert len(frozen.chunk_tokens) < frozen.tokens  # merged, as on the H100
    assert frozen.chunk_tokens[0] == sim.settings.resume_merge_tokens
    assert frozen.token_ids == reference.token_ids
    assert await _metric(sim, "vllm:num_preemptions_total") == 1.0


async def test_pause_keep_then_sleep_keep_preempts_once(sim: Sim) -> None:
    """Sequence B2: the second keep finds the request already preempted."""
    async with aiohttp.ClientSession() as session:
        reference = await _record(sim, session)
        frozen = await _frozen(sim, session, pause_first=True)
    assert _intact(frozen, reference)
    assert (await sim.state())["preemptions"] == 1


async def test_each_chunk_counts_its_tokens_in_ids_and_logprobs(sim: Sim) -> None:
    """The fields a client counts tokens by agree chunk by chunk, chat included."""
    await sim.faults(stall_generation=True)
    async with sim.client.post("/v1/completions", json=_body()) as resp:
        await sim.until(lambda: sim.engine.running == 1)
        await sim.post_empty("/sleep", level=1, mode="keep")
        await sim.faults(stall_generation=False)
        await sim.post_empty("/wake_up")
        events = await read_events(resp)
    chunks = [e for e in events if isinstance(e, dict) and e["choices"]]
    assert chunks[0]["choices"][0]["prompt_token_ids"]
    offset = 0
    for chunk in chunks:
        choice = chunk["choices"][0]
        logprobs = choice["logprobs"]
        assert len(choice["token_ids"]) == len(logprobs["tokens"]) == len(
            logprobs["token_logprobs"]) == len(logprobs["top_logprobs"])
        assert "".join(logprobs["tokens"]) == choice["text"]
        assert logprobs["text_offset"][:1] in ([offset], [])
        offset += len(choice["text"])
    usage = events[-2]
    assert isinstance(usage, dict)
    assert usage["usage"]["completion_tokens"] == TOKENS
    chat = {"model": MODEL, "messages": [{"role": "user", "content": PROMPT}], "stream": True,
            "max_tokens": 3, "logprobs": True, "top_logprobs": 2, "return_token_ids": True,
            "stream_options": {"include_usage": True, "continuous_usage_stats": True}}
    async with sim.client.post("/v1/chat/completions", json=chat) as resp:
        events = await read_events(resp)
    role, *content = [e for e in events if isinstance(e, dict) and e["choices"]]
    assert role["prompt_token_ids"]
    for n, chunk in enumerate(content, start=1):
        entries = chunk["choices"][0]["logprobs"]["content"]
        assert len(entries) == len(chunk["choices"][0]["token_ids"]) == 1
        assert len(entries[0]["top_logprobs"]) == 2
        assert chunk["usage"]["completion_tokens"] == n


async def test_recompute_costs_prompt_plus_generated_tokens(make_sim: SimFactory) -> None:
    rate = 1e6  # tokens per second: the cost is recorded, the test does not wait for it
    sim = await make_sim(prefill_tokens_per_second=rate)
    async with aiohttp.ClientSession() as session:
        await _frozen(sim, session)
    state = await sim.state()
    assert state["recompute_seconds"] == pytest.approx(count_prompt_tokens(PROMPT) / rate)


async def test_the_gauges_stand_still_while_nothing_steps(sim: Sim) -> None:
    """vLLM reports running/waiting with its steps only: asleep with a kept request, the
    gauges keep the last step's values (the kept request as running, nothing waiting),
    whatever arrives meanwhile; the preemption shows once the request ran again."""
    running, waiting = "vllm:num_requests_running", "vllm:num_requests_waiting"
    await sim.faults(stall_generation=True)
    async with sim.client.post("/v1/completions", json=_body()) as resp:
        await sim.until(lambda: sim.engine.running == 1)
        await sim.post_empty("/sleep", level=1, mode="keep")
        held = asyncio.create_task(sim.ask())
        await sim.until(lambda: sim.engine.waiting == 1)
        assert (await _metric(sim, running), await _metric(sim, waiting)) == (1.0, 0.0)
        assert await _metric(sim, "vllm:num_preemptions_total") == 0.0
        await sim.faults(stall_generation=False)
        await sim.post_empty("/wake_up")
        await read_events(resp)
    async with asyncio.timeout(DEADLINE):
        await held
    assert (await _metric(sim, running), await _metric(sim, waiting)) == (0.0, 0.0)
    assert await _metric(sim, "vllm:num_preemptions_total") == 1.0


@pytest.mark.parametrize("fault", ["lose-token", "duplicate-token", "abort"])
async def test_each_keep_fault_fails_the_identity_check(make_sim: SimFactory,
                                                        fault: str) -> None:
    sim = await make_sim(keep_fault=fault)
    async with aiohttp.ClientSession() as session:
        reference = await _record(sim, session)  # never kept: the fault does not touch it
        frozen = await _frozen(sim, session)
    assert reference.tokens == TOKENS
    assert not _intact(frozen, reference)
    assert not frozen.same_as(reference)  # the text alone already tells


def _registered(nvml_dir: Path) -> int:
    record = json.loads((nvml_dir / f"{PID}.json").read_text())
    return int(record["used_bytes"])


async def test_the_leak_knob_grows_the_footprint_each_cycle(make_sim: SimFactory,
                                                            nvml_dir: Path) -> None:
    sim = await make_sim(leak_per_cycle_mib=64)
    awake, asleep = [], []
    for _ in range(3):
        awake.append(_registered(nvml_dir))
        await sim.post_empty("/sleep", level=1)
        asleep.append(_registered(nvml_dir))
        await sim.post_empty("/wake_up")
    assert awake == [10 * GIB + k * 64 * MIB for k in range(3)]
    assert asleep == [1 * GIB + k * 64 * MIB for k in range(3)]
    assert (await sim.state())["memory"]["leaked_bytes"] == 3 * 64 * MIB


async def test_without_the_leak_knob_the_footprint_does_not_creep(sim: Sim,
                                                                  nvml_dir: Path) -> None:
    for _ in range(3):
        await sim.post_empty("/sleep", level=1)
        await sim.post_empty("/wake_up")
    assert _registered(nvml_dir) == 10 * GIB


async def test_greedy_output_depends_on_model_and_prompt(make_sim: SimFactory) -> None:
    one, other = await make_sim(), await make_sim(model="sim/other-model")
    texts = []
    for sim, prompt in ((one, PROMPT), (one, PROMPT), (one, "Another prompt"),
                        (other, PROMPT)):
        body = _body(prompt=prompt, stream=False, model=sim.settings.model) | {
            "stream_options": None}
        async with sim.client.post("/v1/completions", json=body) as resp:
            assert resp.status == 200, await resp.text()
            texts.append((await resp.json())["choices"][0]["text"])
    assert texts[0] == texts[1]
    assert len({texts[0], texts[2], texts[3]}) == 3


def test_the_knobs_come_from_flags_and_environment() -> None:
    flags = settings_from_args(["--keep-fault", "duplicate-token", "--leak-per-cycle-mib", "8",
                                "--prefill-tokens-per-second", "5000"], {})
    assert (flags.keep_fault, flags.leak_per_cycle_mib) == ("duplicate-token", 8)
    assert flags.prefill_tokens_per_second == 5000.0
    env = settings_from_args([], {"ROTA_SIM_KEEP_FAULT": "abort",
                                  "ROTA_SIM_RESUME_MERGE_TOKENS": "1"})
    assert (env.keep_fault, env.resume_merge_tokens) == ("abort", 1)
    plain = settings_from_args([], {})
    assert (plain.keep_fault, plain.leak_per_cycle_mib) == (None, 0)  # off by default
    with pytest.raises(SystemExit):
        settings_from_args(["--keep-fault", "lose-everything"], {})
