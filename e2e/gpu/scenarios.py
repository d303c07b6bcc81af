"""The scenarios of the GPU benchmark, in the order a run takes them.

Each takes the :class:`~e2e.gpu.bench.Bench` and returns its result (a JSON object). The
runner gives each one only if the time it is expected to take is left, names a sampler
phase after it (the one-awake invariant is checked on NVML throughout), and records it as
done, so that the next command goes on with the next one on the same engines.

``startup``          start-up admission of A (model-14b) and B (model-small): cold start,
                     probe, first sleep (and A's first wake) before any traffic
``main``             the reference experiment: N level-1 handoffs A<->B, throughput of A
                     before and after a recovery
``wake_detail``      A's level-1 wake taken apart: each HTTP call timed, vLLM's own times,
                     the confirmation overlapped with the probe, weights and KV woken apart
``level2``           B at level 2 with real weight files: the four-call wake, and that it
                     generates afterwards
``cuda_graphs``      G = model-small without ``--enforce-eager``: start-up cost, wakes
``abandoned_sleep``  a sleep whose client gives up while a long stream runs
``killed_mid_switch``the target SIGKILLed during its wake
``admission_nofit``  X = model-small with a KV cache that does not fit beside awake A
``wake_oom``         X's wake into less free memory than its KV cache (ballast held by
                     another claimant; X's claim understates its budget) -> gpu_oom
``admission_counterexample``  Y, which does not fit beside awake A, started without
                     admission: its start fails while A keeps serving
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import sys
import time
import uuid
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass
from typing import Any

import aiohttp

from controller.claimants import Claimant
from controller.engines.errors import EngineError
from controller.settings import StepTimeouts
from controller.switch import Fenced
from driver.opaque import API_VERSION, KIND, parse_engine_config
from e2e.gpu import report
from e2e.gpu.bench import (
    GIB,
    MIB,
    NAMESPACE,
    NODE,
    REPO_ROOT,
    Bench,
    BenchError,
    mib,
    specs,
)
from e2e.gpu.engines import EngineSpec, EngineStartError, SimulatorLauncher
from e2e.gpu.load import LongStream, output_throughput
from e2e.stats import summary_s

__all__ = ["SCENARIOS", "Scenario", "admit", "run_scenarios"]

RESERVE_S = 20.0
"""Kept free at the end of a run for stopping, writing results and copying logs."""


@dataclass(frozen=True)
class Scenario:
    name: str
    run: Callable[[Bench], Awaitable[dict[str, Any]]]
    estimate_s: float
    """Expected seconds with real vLLM on the H200 (cold starts dominate)."""


def _say(text: str) -> None:
    print(text, flush=True)


# -- helpers --------------------------------------------------------------------------------


async def _http(bench: Bench, method: str, key: str, path: str, *, timeout_s: float,
                json_body: dict[str, Any] | None = None, keep: int = 300) -> dict[str, Any]:
    """One call straight to an engine (no adapter): status, milliseconds, body (cut)."""
    url = bench.record(key).base_url + path
    began = time.monotonic()
    try:
        async with bench.session.request(method, url, json=json_body,
                                         timeout=aiohttp.ClientTimeout(total=timeout_s)
                                         ) as resp:
            body = (await resp.text())[:keep]
            return {"status": resp.status, "ms": round((time.monotonic() - began) * 1e3, 3),
                    "body": body}
    except (aiohttp.ClientError, TimeoutError, OSError) as exc:
        return {"status": None, "ms": round((time.monotonic() - began) * 1e3, 3),
                "error": f"{type(exc).__name__}: {exc}"[:300]}


async def _is_sleeping(bench: Bench, key: str) -> bool | None:
    answer = await _http(bench, "GET", key, "/is_sleeping", timeout_s=5)
    if answer.get("status") != 200:
        return None
    return '"is_sleeping":true' in answer["body"].replace(" ", "")


async def ensure_holder(bench: Bench, key: str) -> dict[str, Any] | None:
    """Make ``key`` the holder (a measured handoff) unless it is already."""
    if bench.state.holder == key:
        return None
    entry = await bench.handoff(key, label=f"set-up: {key} to hold the GPU")
    if not entry["ok"]:
        raise BenchError(f"could not give the GPU to {key}: {entry['reason']}: "
                         f"{entry['message']}")
    return entry


def _require(bench: Bench, *keys: str) -> None:
    for key in keys:
        if key not in bench.state.engines or bench.record(key).dead:
            raise BenchError(f"engine {key} is not running (an earlier scenario did not start "
                             "it, or killed it)")
        if not bench.engine(key).alive():
            bench.record(key).dead = True
            raise BenchError(f"engine {key} has exited; its log: {bench.record(key).log}")


async def _wait_released(bench: Bench, key: str, *, limit_bytes: int, timeout_s: float,
                         pids: Sequence[int] = ()) -> float | None:
    """Seconds until NVML shows ``key`` at or below ``limit_bytes`` and none of ``pids``
    (a killed engine's processes: while one exits, its environment can no longer be read,
    so its memory is nobody's); None if that never happened."""
    began = time.monotonic()
    while time.monotonic() - began < timeout_s:
        snapshot = await bench.snapshot()
        listed = {p.pid for p in snapshot.processes} & set(pids)
        if not listed and snapshot.used_by(bench.record(key).claim_uid) <= limit_bytes:
            return round(time.monotonic() - began, 4)
        await asyncio.sleep(0.02)
    return None


def _overhead_bytes(bench: Bench) -> int:
    launcher = bench.launcher
    if isinstance(launcher, SimulatorLauncher):
        return launcher.overhead_bytes + launcher.resident_bytes
    return 3 * GIB


# -- start-up admission -----------------------------------------------------------------------


async def admit(bench: Bench, spec: EngineSpec, *, stay_awake: bool) -> dict[str, Any]:
    """Start-up admission, as DESIGN.md decides it ("start-up is a switch"): the newcomer
    starts only when its awake budget fits beside what is awake, else the holder is put to
    sleep first (and woken back afterwards); the newcomer is proved with the probe and put
    through its first sleep (and, when it is to hold the GPU, one wake) before any
    request-driven handoff, so that no user pays a first sleep. The controller's own
    start gate replaces this bench-local sequence where it exists."""
    key = spec.key
    if key in bench.state.engines and not bench.record(key).dead:
        if bench.record(key).first_sleep_s is not None:
            return {"engine": key, "reused": True}
        # Started by an earlier command that ran out of time: finish its admission.
        proc = bench.engine(key)
        await proc.wait_ready(bench.session,
                              deadline=time.monotonic() + bench.bound(bench.args.start_timeout_s))
        entry: dict[str, Any] = {"engine": key, "resumed": True}
        slept_for_admission: str | None = None
        beside = bench.state.holder is not None
        began = time.monotonic()
    else:
        snapshot = await bench.snapshot()
        need = bench.estimated_awake(spec)
        holder = bench.state.holder
        fits = need + GIB <= snapshot.free_bytes
        entry = {"engine": key, "estimated_awake_mib": mib(need),
                 "free_mib_before": mib(snapshot.free_bytes), "holder_before": holder,
                 "fits_beside_awake": fits}
        slept_for_admission = None
        if holder is not None and not fits:
            bench.sampler.phase(f"admission:{key}:holder to sleep")
            entry["holder_to_sleep"] = await bench.sleep_holder(reason="start-up admission")
            slept_for_admission = holder
            entry["view_holder_asleep"] = bench.view(await bench.snapshot())
        beside = bench.state.holder is not None
        bench.sampler.phase(f"admission:{key}:start", allowed_above=2 if beside else 1)
        began = time.monotonic()
        proc = await bench.start_engine(spec)
    record = proc.record
    adapter = bench.adapter(key)
    probe = await asyncio.wait_for(adapter.probe(), bench.bound(bench.args.probe_timeout_s + 5))
    if not probe.ok:
        raise BenchError(f"{key} started but its first probe failed: {probe.reason}: "
                         f"{probe.detail}")
    record.first_probe_s = round(time.time() - record.started_at, 3)
    record.awake_bytes = await bench.used_by(key)
    entry["view_started"] = await bench.phase_view(f"{key}_started")
    _say(f"  {key}: cold start {record.ready_s:.1f} s to serving, first probe at "
         f"{record.first_probe_s:.1f} s, {mib(record.awake_bytes)} MiB awake")
    bench.sampler.phase(f"admission:{key}:first sleep", allowed_above=2 if beside else 1)
    bench.cursor(key).read_new()
    outcome = await asyncio.wait_for(adapter.sleep(1), bench.bound(bench.args.sleep_timeout_s))
    record.first_sleep_s = round(outcome.sleep_s, 4)
    record.asleep_level = 1
    bench.switcher.record_sleep(bench.claimant(key), outcome.sleep_s)
    record.resident_bytes = await bench.used_by(key)
    bench.watch(key)
    entry["vllm_first_sleep"] = [{"kind": e.kind, **e.values} for e in bench.log_events(key)
                                 if e.kind in ("sleep", "sleep_freed", "cumem_sleep")]
    entry["view_first_sleep"] = await bench.phase_view(f"{key}_asleep_after_first_sleep")
    _say(f"  {key}: first level-1 sleep {outcome.sleep_s:.3f} s, "
         f"{mib(record.resident_bytes)} MiB asleep")
    bench.sampler.phase(f"admission:{key}:done")
    if stay_awake and bench.state.holder is None:
        outcome_w = await asyncio.wait_for(adapter.wake(1), bench.bound(bench.args.wake_timeout_s))
        record.first_wake_s = round(outcome_w.wake_s, 4)
        probe = await asyncio.wait_for(adapter.probe(),
                                       bench.bound(bench.args.probe_timeout_s + 5))
        if not probe.ok:
            raise BenchError(f"{key} woke after its first sleep but the probe failed: "
                             f"{probe.detail}")
        record.asleep_level = None
        bench.state.holder = key
        claimant = bench.claimant(key)
        bench.lease_port.current = bench.lease_port.current.with_(
            holder=claimant.ref, holder_model=claimant.model,
            holder_claim_uid=claimant.claim_uid, state="awake")
        entry["first_wake_s"] = record.first_wake_s
        entry["first_wake_probe_ttft_s"] = probe.ttft_s
        _say(f"  {key}: first wake {outcome_w.wake_s:.3f} s; {key} holds the GPU")
    elif slept_for_admission is not None:
        bench.sampler.phase(f"admission:{key}:holder back")
        entry["holder_back"] = await bench.handoff(slept_for_admission,
                                                   label=f"admission of {key}: holder back")
    entry["admission_s"] = round(time.monotonic() - began, 3)
    bench.save()
    return entry


# -- scenarios --------------------------------------------------------------------------------


async def scenario_startup(bench: Bench) -> dict[str, Any]:
    """Start-up admission of A, then B; A ends as the holder."""
    all_specs = specs(bench.args, bench.args.state_dir)
    result: dict[str, Any] = {}
    for key, stay in (("a", True), ("b", False)):
        _say(f"start-up admission of {key.upper()} ({all_specs[key].model_dir.name}, "
             f"{all_specs[key].load_format} weights)")
        result[key] = await admit(bench, all_specs[key], stay_awake=stay)
    await ensure_holder(bench, "a")
    result["first_sleeps_s"] = {k: bench.record(k).first_sleep_s for k in ("a", "b")}
    result["b_load_format"] = bench.record("b").spec.load_format
    return result


async def _throughput(bench: Bench, key: str) -> dict[str, Any]:
    record = bench.record(key)
    a = bench.args
    return await output_throughput(bench.session, record.base_url, record.spec.served_name,
                                   concurrency=a.concurrency, rounds=a.rounds,
                                   max_tokens=a.max_tokens, timeout_s=bench.bound(300))


async def scenario_main(bench: Bench) -> dict[str, Any]:
    """The reference experiment's protocol on the real switch path."""
    _require(bench, "a", "b")
    setup = await ensure_holder(bench, "a")
    throughput: dict[str, Any] = {"model": bench.record("a").spec.served_name}
    throughput["before"] = await _throughput(bench, "a")
    _say(f"  throughput of A before a recovery: {throughput['before']['tokens_per_s']} tok/s")
    entries: list[dict[str, Any]] = []
    result: dict[str, Any] = {"setup": setup, "handoffs": entries, "throughput": throughput}
    bench.results["main"] = result
    for index in range(1, bench.args.handoffs + 1):
        target = "b" if index % 2 else "a"
        entry = await bench.handoff(target, label=f"handoff {index}")
        entry["index"] = index
        entries.append(entry)
        _say("  " + report.handoff_line(entry))
        bench.save()
        if not entry["ok"]:
            break
        if target == "a" and "after" not in throughput:
            throughput["after"] = await _throughput(bench, "a") | {"after_handoff": index}
            _say(f"  throughput of A after its recovery in handoff {index}: "
                 f"{throughput['after']['tokens_per_s']} tok/s")
    result["summary"] = report.handoff_summary(entries)
    result["ok"] = len(entries) == bench.args.handoffs and all(e["ok"] for e in entries)
    bench.results.pop("main", None)
    return result


async def scenario_wake_detail(bench: Bench) -> dict[str, Any]:
    """A's level-1 wake taken apart, call by call, in three ways of confirming it."""
    _require(bench, "a")
    await ensure_holder(bench, "a")
    adapter = bench.adapter("a")
    cycles: list[dict[str, Any]] = []
    modes = ("sequential", "overlapped", "split")
    for i in range(bench.args.wake_cycles):
        mode = modes[i % len(modes)]
        cycle: dict[str, Any] = {"mode": mode}
        bench.cursor("a").read_new()
        cycle["sleep_post"] = await _http(bench, "POST", "a", "/sleep?level=1&mode=wait",
                                          timeout_s=bench.bound(bench.args.sleep_timeout_s))
        cycle["sleep_confirm"] = await _http(bench, "GET", "a", "/is_sleeping", timeout_s=5)
        bench.state.holder = None
        bench.record("a").asleep_level = 1
        cycle["asleep_mib"] = mib(await bench.used_by("a"))
        woke = time.monotonic()
        if mode == "split":
            first = await _http(bench, "POST", "a", "/wake_up?tags=weights",
                                timeout_s=bench.bound(bench.args.wake_timeout_s))
            second = await _http(bench, "POST", "a", "/wake_up?tags=kv_cache",
                                 timeout_s=bench.bound(bench.args.wake_timeout_s))
            cycle |= {"wake_weights": first, "wake_kv_cache": second}
            cycle["wake_post_ms"] = round(first["ms"] + second["ms"], 3)
        else:
            post = await _http(bench, "POST", "a", "/wake_up",
                               timeout_s=bench.bound(bench.args.wake_timeout_s))
            cycle["wake_post"] = post
            cycle["wake_post_ms"] = post["ms"]
        probe_began = time.monotonic()
        if mode == "overlapped":
            sleeping, probe = await asyncio.gather(adapter.is_sleeping(), adapter.probe())
            cycle["confirm_ms"] = bench.calls[-2].as_dict(bench.calls[-2].started)["ms"]
        else:
            sleeping = await adapter.is_sleeping()
            cycle["confirm_ms"] = bench.calls[-1].as_dict(bench.calls[-1].started)["ms"]
            probe_began = time.monotonic()
            probe = await adapter.probe()
        cycle["is_sleeping_after"] = sleeping
        cycle["probe_ok"] = probe.ok
        cycle["probe_ttft_ms"] = None if probe.ttft_s is None else round(probe.ttft_s * 1e3, 3)
        warm = await adapter.probe()  # the same request again: what the wake adds to TTFT
        cycle["warm_probe_ttft_ms"] = None if warm.ttft_s is None else round(
            warm.ttft_s * 1e3, 3)
        if probe.ttft_s is not None:
            cycle["recovery_ms"] = round((probe_began + probe.ttft_s - woke) * 1e3, 3)
        events = bench.log_events("a")
        cycle["vllm_sleep_s"] = sum(e.values["seconds"] for e in events if e.kind == "sleep")
        wakes = [e.values["seconds"] for e in events if e.kind == "wake"]
        cycle["vllm_wake_s"] = round(sum(wakes), 6) if wakes else None
        cycle["vllm_wake_parts_s"] = wakes
        cycle["awake_mib"] = mib(await bench.used_by("a"))
        bench.record("a").asleep_level = None
        bench.state.holder = "a"
        if not probe.ok or sleeping:
            cycle["ok"] = False
            cycles.append(cycle)
            raise BenchError(f"wake_detail cycle {i} ({mode}): A did not come back "
                             f"(is_sleeping {sleeping}, probe {probe.reason}: {probe.detail})")
        cycles.append(cycle)
        _say("  " + report.wake_cycle_line(cycle))
    spec = bench.record("a").spec
    return {"cycles": cycles,
            "decomposition": report.wake_decomposition(
                cycles, bench.state.h2d or {}, model=spec.model_dir.name,
                weights_bytes=spec.weights_bytes())}


async def _generates(bench: Bench, key: str) -> dict[str, Any]:
    """A plain completion of 32 forced tokens: the engine generates (any text)."""
    record = bench.record(key)
    answer = await _http(bench, "POST", key, "/v1/completions", timeout_s=bench.bound(60),
                         json_body={"model": record.spec.served_name, "prompt": "Hello",
                                    "max_tokens": 32, "ignore_eos": True, "temperature": 0},
                         keep=4096)
    body = answer.pop("body", "")
    try:
        tokens = json.loads(body)["usage"]["completion_tokens"]
    except (ValueError, KeyError, TypeError):
        tokens = None
    answer["completion_tokens"] = tokens
    answer["ok"] = answer.get("status") == 200 and tokens == 32
    return answer


async def scenario_level2(bench: Bench) -> dict[str, Any]:
    """B at level 2 on real weight files: sleep, the four-call wake, then generation."""
    _require(bench, "a", "b")
    if bench.record("b").spec.load_format != "auto":
        return {"ok": False, "skipped": True,
                "reason": "B runs on dummy weights (vLLM cannot reload those): write real "
                          "ones with python -m e2e.gpu.weights and start B from them"}
    await ensure_holder(bench, "a")
    cycles = bench.args.level2_cycles
    entries: list[dict[str, Any]] = []
    generation: list[dict[str, Any]] = []
    views: dict[str, Any] = {}
    for i in range(cycles + 1):
        to_b = await bench.handoff("b", label=f"level 2, cycle {i}: to B")
        entries.append(to_b)
        _say("  " + report.handoff_line(to_b))
        if not to_b["ok"]:
            break
        generation.append(await _generates(bench, "b"))
        level = 2 if i < cycles else 1
        to_a = await bench.handoff("a", holder_level=level,
                                   label=f"level 2, cycle {i}: to A, B sleeps at level {level}")
        entries.append(to_a)
        _say("  " + report.handoff_line(to_a))
        if not to_a["ok"]:
            break
        if level == 2 and "b_asleep_level2" not in views:
            views["b_asleep_level2"] = to_a["nvml_after"]
    wakes = [e for e in entries if e["to"] == "b" and e["ok"] and e is not entries[0]]
    sleeps = [e for e in entries if e["from"] == "b" and e["ok"] and e["holder_level"] == 2]
    return {"handoffs": entries, "generation_after_wake": generation, "memory_mib": views,
            "level2_wakes": report.level2_summary(wakes), "level2_sleeps": summary_s(
                [e["sleep_call_s"] for e in sleeps if e.get("sleep_call_s") is not None]),
            "ok": all(e["ok"] for e in entries) and len(entries) == 2 * (cycles + 1)
            and all(g["ok"] for g in generation)}


async def scenario_cuda_graphs(bench: Bench) -> dict[str, Any]:
    """G: the small model with CUDA graphs (no --enforce-eager): start-up cost, wakes."""
    _require(bench, "a")
    await ensure_holder(bench, "a")
    _say("start-up admission of G (model-small, CUDA graphs on)")
    admission = await admit(bench, specs(bench.args, bench.args.state_dir)["g"],
                            stay_awake=False)
    entries: list[dict[str, Any]] = []
    for i in range(bench.args.graph_handoffs):
        entry = await bench.handoff("g" if i % 2 == 0 else "a", label=f"graphs {i}")
        entries.append(entry)
        _say("  " + report.handoff_line(entry))
        if not entry["ok"]:
            break
    await ensure_holder(bench, "a")
    record = bench.record("g")
    return {"admission": admission, "handoffs": entries,
            "cold_start_s": record.ready_s, "start_phases": record.start_phases,
            "first_sleep_s": record.first_sleep_s,
            "summary": report.handoff_summary(entries),
            "ok": bool(entries) and all(e["ok"] for e in entries)}


async def scenario_abandoned_sleep(bench: Bench) -> dict[str, Any]:
    """A sleep whose client gives up while a long stream runs (vLLM 0.26 keeps it
    registered and fires it later, even after a wake): does rota leave a live engine?"""
    victim = next((k for k in ("b", "g", "v") if k in bench.live()), None)
    if victim is None:  # run again after the others died: a fresh small engine
        _say("no small engine left: start-up admission of V (model-small)")
        await admit(bench, specs(bench.args, bench.args.state_dir)["v"], stay_awake=False)
        victim = "v"
    _require(bench, "a", victim)
    await ensure_holder(bench, victim)
    record = bench.record(victim)
    stream = LongStream(bench.session, record.base_url, record.spec.served_name,
                        max_tokens=bench.args.long_tokens, timeout_s=bench.bound(240))
    stream.start()
    began = time.monotonic()
    with contextlib.suppress(TimeoutError):
        await asyncio.wait_for(stream.flowing.wait(), bench.bound(60))
    if stream.first_token is None:
        await stream.cancel()
        raise BenchError(f"the long stream on {victim} did not start: {stream.as_dict()}")
    abandon = bench.args.abandon_after_s
    base = bench.timeouts()
    bench.adapter_timeouts = base.model_copy(update={"sleep_s": abandon})
    short = bench.make_switcher(step=StepTimeouts(drain_s=0.5, sleep_s=abandon + 10,
                                                  wake_s=bench.args.wake_timeout_s + 15,
                                                  probe_s=bench.args.probe_timeout_s + 5))
    try:
        entry = await bench.handoff("a", label="abandoned sleep", switcher=short)
    finally:
        bench.adapter_timeouts = None
    _say("  " + report.handoff_line(entry))
    result: dict[str, Any] = {"victim": victim, "abandon_after_s": abandon, "switch": entry,
                              "holder_after_switch": bench.state.holder}
    timeline: list[dict[str, Any]] = []
    last: tuple[Any, ...] | None = None
    watch_until = time.monotonic() + bench.bound(
        bench.args.long_tokens / 50 + 30)  # bounded: the stream's length at >= 50 tok/s
    after_end: float | None = None
    while time.monotonic() < watch_until:
        if stream.ended is not None and after_end is None:
            after_end = time.monotonic() + 3.0
        if after_end is not None and time.monotonic() >= after_end:
            break
        sleeping = await _is_sleeping(bench, victim)
        health = await _http(bench, "GET", victim, "/health", timeout_s=3)
        used = await bench.used_by(victim)
        point = (sleeping, health.get("status"),
                 used > bench.resident_budget(victim) + bench.args.resident_tolerance)
        if point != last:
            timeline.append({"t_s": round(time.monotonic() - began, 3), "is_sleeping": sleeping,
                             "health": health.get("status"), "mib": mib(used),
                             "stream_chunks": stream.chunks})
            last = point
        await asyncio.sleep(0.25)
    await stream.cancel()
    result["stream"] = stream.as_dict()
    result["timeline"] = timeline
    result["after"] = after = await _prove_alive(bench, victim)
    crashed = not after["alive"]
    fired = result["holder_after_switch"] == victim and any(
        p["is_sleeping"] for p in timeline[1:])
    result["verdict"] = {"engine_alive_after": not crashed,
                         "sleep_fired_after_rota_reported_it_awake": fired}
    _say(f"  abandoned sleep: engine alive afterwards: {not crashed}; the pending sleep fired "
         f"after rota reported {victim} awake: {fired}")
    if crashed:
        pids = bench.engine(victim).kill()
        bench.sampler.unwatch(victim)
        result["release_after_kill_s"] = await _wait_released(
            bench, victim, limit_bytes=0, timeout_s=bench.bound(20), pids=pids)
        if bench.state.holder == victim:
            bench.state.holder = None
    if bench.state.holder is None:
        result["holder_back"] = await bench.handoff("a", label="after the abandoned sleep: "
                                                               "A back")
    result["ok"] = not crashed
    return result


async def scenario_killed_mid_switch(bench: Bench) -> dict[str, Any]:
    """The target SIGKILLed while its wake is in flight: one owner, the old holder back."""
    target = next((k for k in ("g", "b", "v") if k in bench.live()), None)
    if target is None:
        _say("no small engine left: start-up admission of V (model-small)")
        await admit(bench, specs(bench.args, bench.args.state_dir)["v"], stay_awake=False)
        target = "v"
    _require(bench, "a", target)
    await ensure_holder(bench, "a")
    proc = bench.engine(target)
    killed: dict[str, Any] = {}
    loop = asyncio.get_running_loop()
    delay = bench.args.kill_delay_s
    earlier = [float(c.detail["wake_call_ms"]) for c in bench.calls
               if c.engine == target and c.name == "wake_l1" and c.ok
               and c.detail.get("wake_call_ms") is not None]
    if delay < 0 and earlier:  # adaptive: 40 % into a wake as long as the last one
        delay = 0.4 * earlier[-1] / 1e3
    delay = max(0.0, delay if delay >= 0 else 0.02)

    def kill() -> None:
        killed["at"] = time.monotonic()
        killed["pids"] = proc.kill()

    def on_wake() -> None:
        killed["wake_started"] = time.monotonic()
        loop.call_later(delay, kill)

    bench.wake_hooks[target] = on_wake
    try:
        entry = await bench.handoff(target, label="killed mid-switch")
    finally:
        bench.wake_hooks.pop(target, None)
    _say("  " + report.handoff_line(entry))
    if "at" not in killed:  # the wake never started (the switch failed before it)
        kill()
    bench.record(target).dead = True
    release = await _wait_released(bench, target, limit_bytes=0, timeout_s=bench.bound(20),
                                   pids=killed.get("pids", []))
    bench.sampler.unwatch(target)
    switched = entry["ok"]
    result: dict[str, Any] = {
        "target": target, "kill_delay_s": round(delay, 4), "switch": entry,
        "killed": True, "pids_killed": killed.get("pids"),
        "kill_landed_mid_switch": not switched and "wake_started" in killed,
        "nvml_release_after_kill_s": release, "holder_after_switch": bench.state.holder}
    if switched:
        result["note"] = ("the wake and the probe finished before the kill: the holder "
                          "was killed instead (no switch to back out)")
    if bench.state.holder == "a":
        result["restored_by"] = "rota"
    else:
        bench.state.holder = None
        back = await bench.handoff("a", label="after the kill: A back")
        result["holder_back"] = back
        result["restored_by"] = "bench (after NVML released the dead engine)" if back["ok"] \
            else "nobody"
    result["ok"] = bench.state.holder == "a" and result["kill_landed_mid_switch"]
    return result


async def scenario_admission_nofit(bench: Bench) -> dict[str, Any]:
    """X's awake footprint does not fit beside awake A: A sleeps first, X starts, A back."""
    _require(bench, "a")
    await ensure_holder(bench, "a")
    snapshot = await bench.snapshot()
    record_a = bench.record("a")
    a_used = snapshot.used_by(record_a.claim_uid)
    free_if_a_asleep = snapshot.free_bytes + a_used - (record_a.resident_bytes or 0)
    overhead = _overhead_bytes(bench)
    kv = _nofit_kv(bench, snapshot.free_bytes, free_if_a_asleep)
    if kv + overhead <= snapshot.free_bytes:
        return {"ok": False, "skipped": True,
                "reason": f"this GPU has room for X beside A ({mib(snapshot.free_bytes)} MiB "
                          "free); nothing to admit"}
    spec = EngineSpec(key="x", model_dir=bench.args.models / "model-small",
                      served_name="bench/model-small-big-kv", kv_cache_bytes=kv)
    _say(f"start-up admission of X (model-small, {mib(spec.kv_cache_bytes)} MiB KV cache: does "
         f"not fit beside A)")
    entry = await admit(bench, spec, stay_awake=False)
    phases = [p for p in bench.sampler.phases() if p["label"].startswith("admission:x")]
    return {"x_kv_cache_mib": mib(spec.kv_cache_bytes), "admission": entry,
            "invariant": phases, "ok": bench.state.holder == "a"
            and not entry["fits_beside_awake"] and all(p["violations"] == 0 for p in phases)}


async def _prove_alive(bench: Bench, key: str) -> dict[str, Any]:
    """Is ``key`` a working engine? Probed where it holds the GPU, else handed the GPU by
    rota (wake and probe) when another engine holds it; never a request to a sleeper."""
    found: dict[str, Any] = {"holder": bench.state.holder}
    bound = bench.bound(bench.args.probe_timeout_s)
    if bench.state.holder != key and bench.state.holder is not None:
        entry = await bench.handoff(key, label=f"proof: {key} woken by rota")
        found["handoff"] = entry
        if not entry["ok"]:
            found["health"] = await _http(bench, "GET", key, "/health", timeout_s=5)
            found["alive"] = False
            return found
    elif bench.state.holder is None and await _is_sleeping(bench, key) is not False:
        found["health"] = await _http(bench, "GET", key, "/health", timeout_s=5)
        found["is_sleeping"] = await _is_sleeping(bench, key)
        found["alive"] = found["health"].get("status") == 200
        return found
    for name in ("probe_1", "probe_2"):
        try:
            probe = await asyncio.wait_for(bench.adapter(key).probe(), bound)
            found[name] = {"ok": probe.ok, "status": probe.status,
                           "reason": str(probe.reason or ""), "detail": probe.detail[:200]}
        except TimeoutError:
            found[name] = {"ok": False, "status": None, "reason": "timeout"}
        await asyncio.sleep(1.0)
    found["health"] = await _http(bench, "GET", key, "/health", timeout_s=5)
    found["alive"] = found["health"].get("status") == 200 and found["probe_1"]["ok"] and \
        found["probe_2"]["ok"]
    return found


class Ballast:
    """The failure scenarios' other claimant: a process holding GPU memory."""

    def __init__(self, bench: Bench, nbytes: int) -> None:
        self.bench = bench
        self.nbytes = nbytes
        self.claim_uid = str(uuid.uuid4())
        self.proc: asyncio.subprocess.Process | None = None
        self.ready: dict[str, Any] = {}

    async def start(self, timeout_s: float) -> None:
        launcher = self.bench.launcher
        env = dict(getattr(launcher, "base_env", {}) or os.environ)
        env["ROTA_CLAIM_UID"] = self.claim_uid
        env["PYTHONPATH"] = os.pathsep.join(p for p in (str(REPO_ROOT),
                                                        env.get("PYTHONPATH", "")) if p)
        command = [self.bench.args.vllm_python if not isinstance(launcher, SimulatorLauncher)
                   else sys.executable, "-m", "e2e.gpu.ballast", "--bytes", str(self.nbytes),
                   "--max-seconds", str(int(self.bench.bound(600)))]
        if isinstance(launcher, SimulatorLauncher):
            command += ["--fake-nvml-dir", str(launcher.fake_nvml_dir),
                        "--gpu-uuid", launcher.gpu_uuid]
        self.proc = await asyncio.create_subprocess_exec(
            *command, env=env, cwd=REPO_ROOT, stdin=asyncio.subprocess.DEVNULL,
            stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.STDOUT)
        assert self.proc.stdout is not None
        line = await asyncio.wait_for(self.proc.stdout.readline(), timeout_s)
        try:
            self.ready = json.loads(line.decode() or "{}")
        except ValueError:
            self.ready = {"ready": False, "error": line.decode()[:300]}
        if not self.ready.get("ready"):
            await self.stop()
            raise BenchError(f"the ballast could not hold {mib(self.nbytes)} MiB: "
                             f"{self.ready.get('error')}")

    async def stop(self) -> None:
        if self.proc is None or self.proc.returncode is not None:
            return
        self.proc.terminate()
        try:
            await asyncio.wait_for(self.proc.wait(), 20)
        except TimeoutError:
            self.proc.kill()
            await self.proc.wait()

    def claimant(self, used_bytes: int) -> Claimant:
        resident = used_bytes + 256 * MIB
        config = parse_engine_config({"apiVersion": API_VERSION, "kind": KIND,
                                      "model": "bench/ballast", "awakeMemory": resident + MIB,
                                      "enginePort": 1, "adapter": "vllm"})
        return Claimant(claim_uid=self.claim_uid, namespace=NAMESPACE, claim_name="ballast",
                        node=NODE, device=self.bench.gpu.name, share_id=None, config=config,
                        model="bench/ballast", port=1, sleep_level=1, resident_bytes=resident,
                        pod_name="ballast", pod_uid=None, pod_ip=None, pod_ready=True,
                        pod_deleting=False)


async def scenario_wake_oom(bench: Bench) -> dict[str, Any]:
    """X woken into less free memory than it needs: gpu_oom, then the old holder back."""
    _require(bench, "a", "x")
    await ensure_holder(bench, "a")
    a, x = bench.record("a"), bench.record("x")
    if not (a.awake_bytes and a.resident_bytes and x.awake_bytes and x.resident_bytes):
        raise BenchError("A's and X's awake and asleep footprints are not measured")
    snapshot = await bench.snapshot()
    a_used = snapshot.used_by(a.claim_uid)
    a_release = a_used - a.resident_bytes
    a_need, x_need = a.awake_bytes - a.resident_bytes, x.awake_bytes - x.resident_bytes
    target_free = (a_need + x_need) // 2
    context = 0 if isinstance(bench.launcher, SimulatorLauncher) else 600 * MIB
    ballast_bytes = (snapshot.free_bytes + a_release - target_free - context) // MIB * MIB
    plan = {"a_need_mib": mib(a_need), "x_need_mib": mib(x_need),
            "free_after_a_sleeps_target_mib": mib(target_free),
            "ballast_mib": mib(ballast_bytes), "free_now_mib": mib(snapshot.free_bytes)}
    if not a_need + 2 * GIB <= target_free <= x_need - 2 * GIB or \
            not 0 < ballast_bytes <= snapshot.free_bytes - 2 * GIB:
        return {"ok": False, "skipped": True, "plan": plan,
                "reason": "no ballast size leaves room for A but not for X"}
    ballast = Ballast(bench, ballast_bytes)
    result: dict[str, Any] = {"plan": plan}
    try:
        await ballast.start(bench.bound(120))
        used = (await bench.snapshot()).used_by(ballast.claim_uid)
        bench.extra_claimants["ballast"] = ballast.claimant(used)
        snapshot = await bench.snapshot()
        free_after = snapshot.free_bytes + snapshot.used_by(a.claim_uid) - a.resident_bytes
        bench.budget_override["x"] = free_after - 2 * GIB
        plan |= {"ballast_nvml_mib": mib(used), "free_after_a_sleeps_mib": mib(free_after),
                 "x_declared_awake_mib": mib(bench.budget_override["x"]),
                 "x_real_awake_mib": mib(x.awake_bytes)}
        _say(f"  ballast holds {mib(used)} MiB; X declares {mib(free_after - 2 * GIB)} MiB "
             f"awake, needs {mib(x.awake_bytes)} MiB")
        entry = await bench.handoff("x", label="wake that cannot fit")
        _say("  " + report.handoff_line(entry))
        result["switch"] = entry
        result["reason"] = entry["reason"]
        result["x_mib_after"] = mib(await bench.used_by("x"))
        result["x_is_sleeping_after"] = await _is_sleeping(bench, "x")
        result["holder_after_switch"] = bench.state.holder
        if entry["ok"]:
            result["note"] = "X woke: the device did not run out of memory"
            await ballast.stop()
            bench.extra_claimants.pop("ballast", None)
            result["holder_back"] = await bench.handoff("a", label="X woke after all: A back")
        elif bench.state.holder != "a":
            result["recovery"] = await _recover_from_oom(bench, ballast)
        else:
            result["restored_by"] = "rota"
    finally:
        await ballast.stop()
        bench.extra_claimants.pop("ballast", None)
        bench.budget_override.pop("x", None)
    if bench.state.holder == "a":
        probe = await bench.adapter("a").probe()
        result["holder_proved"] = {"ok": probe.ok, "ttft_s": probe.ttft_s}
    result["ok"] = result.get("reason") == "gpu_oom" and bench.state.holder == "a" and \
        result.get("holder_proved", {}).get("ok", False)
    return result


async def _recover_from_oom(bench: Bench, ballast: Ballast) -> dict[str, Any]:
    """What it takes to hand the GPU back after a wake that OOMed partway: the ballast goes,
    X's wake is finished and X put back to sleep (or X is restarted), then A is woken."""
    steps: dict[str, Any] = {}
    await ballast.stop()
    bench.extra_claimants.pop("ballast", None)
    steps["x_mib_before"] = mib(await bench.used_by("x"))
    limit = bench.resident_budget("x") + bench.args.resident_tolerance
    if await bench.used_by("x") > limit:
        finish: dict[str, Any] = {}
        finish["wake_post"] = await _http(bench, "POST", "x", "/wake_up",
                                          timeout_s=bench.bound(120))
        finish["is_sleeping"] = await _is_sleeping(bench, "x")
        probe = await bench.adapter("x").probe()
        finish["probe_ok"] = probe.ok
        finish["sleep_post"] = await _http(bench, "POST", "x", "/sleep?level=1&mode=wait",
                                           timeout_s=bench.bound(120))
        finish["is_sleeping_after_sleep"] = await _is_sleeping(bench, "x")
        finish["x_mib"] = mib(await bench.used_by("x"))
        steps["finish_wake_then_sleep"] = finish
    if await bench.used_by("x") > limit:
        pids = bench.engine("x").kill()
        bench.sampler.unwatch("x")
        steps["x_killed_as_a_pod_restart"] = True
        steps["x_release_s"] = await _wait_released(bench, "x", limit_bytes=0,
                                                    timeout_s=bench.bound(20), pids=pids)
    bench.record("x").asleep_level = 1
    bench.state.holder = None
    back = await bench.handoff("a", label="after the failed wake: A back")
    steps["holder_back"] = back
    _say("  " + report.handoff_line(back))
    return steps


def _nofit_kv(bench: Bench, free_now: int, free_if_a_asleep: int) -> int:
    """A KV cache that makes a small model not fit beside awake A, but fit alone."""
    overhead = _overhead_bytes(bench)
    kv = min(free_now - overhead + 10 * GIB, free_if_a_asleep - overhead - 4 * GIB)
    return kv // MIB * MIB


async def scenario_admission_counterexample(bench: Bench) -> dict[str, Any]:
    """What admission saves: Y, which does not fit beside awake A, is started anyway. vLLM's
    start fails (CUDA out of memory) after its initialisation, while A keeps serving."""
    _require(bench, "a")
    await ensure_holder(bench, "a")
    snapshot = await bench.snapshot()
    record_a = bench.record("a")
    a_used = snapshot.used_by(record_a.claim_uid)
    kv = _nofit_kv(bench, snapshot.free_bytes,
                   snapshot.free_bytes + a_used - (record_a.resident_bytes or 0))
    if kv + _overhead_bytes(bench) <= snapshot.free_bytes:
        return {"ok": False, "skipped": True, "reason": "Y would fit beside A on this GPU"}
    spec = EngineSpec(key="y", model_dir=bench.args.models / "model-small",
                      served_name="bench/model-small-no-admission", kv_cache_bytes=kv)
    _say(f"starting Y ({mib(kv)} MiB KV cache) beside awake A, without admission")
    bench.sampler.phase("counterexample: Y starts beside awake A", allowed_above=2)
    began = time.monotonic()
    result: dict[str, Any] = {"y_kv_cache_mib": mib(kv), "free_mib_before": mib(
        snapshot.free_bytes)}
    try:
        await bench.start_engine(spec)
        result["y_started"] = True
    except EngineStartError as exc:
        result["y_started"] = False
        lines = str(exc).splitlines()
        result["failure"] = [line for line in lines if "memory" in line.lower()][-3:] or \
            lines[-3:]
    result["seconds_to_outcome"] = round(time.monotonic() - began, 2)
    pids = bench.engine("y").kill()
    bench.sampler.unwatch("y")
    result["release_s"] = await _wait_released(bench, "y", limit_bytes=0,
                                               timeout_s=bench.bound(30), pids=pids)
    bench.sampler.phase("counterexample: after Y")
    probe = await asyncio.wait_for(bench.adapter("a").probe(),
                                   bench.bound(bench.args.probe_timeout_s))
    result["a_serves_after"] = probe.ok
    result["ok"] = not result["y_started"] and probe.ok
    _say(f"  Y {'started' if result['y_started'] else 'failed to start'} after "
         f"{result['seconds_to_outcome']} s; A serves: {probe.ok}")
    return result


async def scenario_smoke(bench: Bench) -> dict[str, Any]:
    """A short check on the engines that run (the real-GPU test): two handoffs between A
    and another live engine and back."""
    if "a" not in bench.live() or len(bench.live()) < 2:
        raise BenchError(f"the smoke check needs A and one more engine; running: "
                         f"{bench.live()} (run the startup scenario first)")
    _require(bench, "a")
    other = next(k for k in bench.live() if k != "a")
    await ensure_holder(bench, "a")
    entries = [await bench.handoff(other, label="smoke 1"), await bench.handoff(
        "a", label="smoke 2")]
    for entry in entries:
        _say("  " + report.handoff_line(entry))
    return {"other": other, "handoffs": entries, "summary": report.handoff_summary(entries),
            "ok": all(e["ok"] for e in entries)}


EXTRA: dict[str, Scenario] = {"smoke": Scenario("smoke", scenario_smoke, 30)}
"""Scenarios run only when named (never by ``all`` or ``next``)."""

SCENARIOS: dict[str, Scenario] = {s.name: s for s in (
    Scenario("startup", scenario_startup, 280),
    Scenario("main", scenario_main, 80),
    Scenario("wake_detail", scenario_wake_detail, 25),
    Scenario("level2", scenario_level2, 25),
    Scenario("cuda_graphs", scenario_cuda_graphs, 130),
    Scenario("abandoned_sleep", scenario_abandoned_sleep, 60),
    Scenario("killed_mid_switch", scenario_killed_mid_switch, 30),
    Scenario("admission_nofit", scenario_admission_nofit, 130),
    Scenario("wake_oom", scenario_wake_oom, 60),
    Scenario("admission_counterexample", scenario_admission_counterexample, 100),
)}


def select(spec: str, done: list[str]) -> list[str]:
    """The scenario names ``--scenarios`` asks for, in the fixed order."""
    if spec in ("all", ""):
        return list(SCENARIOS)
    if spec == "none":
        return []
    if spec == "next":
        return [name for name in SCENARIOS if name not in done]
    wanted = [s.strip() for s in spec.split(",") if s.strip()]
    known = SCENARIOS | EXTRA
    unknown = [s for s in wanted if s not in known]
    if unknown:
        raise BenchError(f"unknown scenarios {unknown}; known: {list(known)}")
    return [name for name in known if name in wanted]


async def run_scenarios(bench: Bench) -> None:
    results: dict[str, Any] = bench.results.setdefault("scenarios", {})
    for name in select(bench.args.scenarios, bench.state.done):
        scenario = (SCENARIOS | EXTRA)[name]
        need = scenario.estimate_s * bench.args.estimate_scale
        left = bench.remaining() - RESERVE_S
        if left < need:
            results[name] = {"ok": False, "skipped": True,
                             "reason": f"needs ~{need:.0f} s, {max(0.0, left):.0f} s left: "
                                       "the next stage runs it (--scenarios next)"}
            _say(f"== {name}: not started ({results[name]['reason']})")
            bench.save()
            break
        _say(f"== {name} (expected ~{need:.0f} s, {left:.0f} s left)")
        bench.sampler.phase(name)
        began = time.monotonic()
        origin = bench.sampler.origin
        try:
            async with asyncio.timeout(left):
                result = await scenario.run(bench)
            result.setdefault("ok", True)
        except TimeoutError:
            result = {"ok": False, "error": "the run's deadline passed inside this scenario"}
        except (BenchError, EngineStartError, EngineError, Fenced, aiohttp.ClientError,
                OSError) as exc:
            result = {"ok": False, "error": f"{type(exc).__name__}: {exc}"}
        result["wall_s"] = round(time.monotonic() - began, 2)
        result["nvml_phases"] = [p for p in bench.sampler.phases()
                                 if p["start_s"] >= began - origin - 1e-3]
        result["invariant_violations"] = sum(p["violations"] for p in result["nvml_phases"])
        results[name] = result
        if "error" not in result:  # one that broke off is taken up again by the next stage
            bench.state.done.append(name)
        bench.save()
        _say(f"== {name}: {report.scenario_verdict(name, result)}")
