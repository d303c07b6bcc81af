"""The scenarios of the reference experiment and its measurements: start-up admission of
A and B, the handoffs, the wake taken apart, level 2, CUDA graphs, the short smoke check."""

from __future__ import annotations

import asyncio
import json
import time
from typing import Any

from e2e.bench.stats import summary_s
from e2e.gpu import report
from e2e.gpu.context import (
    Bench,
    BenchError,
    mib,
    specs,
)
from e2e.gpu.load import output_throughput
from e2e.gpu.steps import (
    admit,
    ensure_holder,
    http,
    require,
    say,
)

__all__ = [
    "scenario_cuda_graphs",
    "scenario_level2",
    "scenario_main",
    "scenario_smoke",
    "scenario_startup",
    "scenario_wake_detail",
]


# -- scenarios --------------------------------------------------------------------------------


async def scenario_startup(bench: Bench) -> dict[str, Any]:
    """Start-up admission of A, then B; A ends as the holder."""
    all_specs = specs(bench.args, bench.args.state_dir)
    result: dict[str, Any] = {}
    for key, stay in (("a", True), ("b", False)):
        say(f"start-up admission of {key.upper()} ({all_specs[key].model_dir.name}, "
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
    require(bench, "a", "b")
    setup = await ensure_holder(bench, "a")
    throughput: dict[str, Any] = {"model": bench.record("a").spec.served_name}
    throughput["before"] = await _throughput(bench, "a")
    say(f"  throughput of A before a recovery: {throughput['before']['tokens_per_s']} tok/s")
    entries: list[dict[str, Any]] = []
    result: dict[str, Any] = {"setup": setup, "handoffs": entries, "throughput": throughput}
    bench.results["main"] = result
    for index in range(1, bench.args.handoffs + 1):
        target = "b" if index % 2 else "a"
        entry = await bench.handoff(target, label=f"handoff {index}")
        entry["index"] = index
        entries.append(entry)
        say("  " + report.handoff_line(entry))
        bench.save()
        if not entry["ok"]:
            break
        if target == "a" and "after" not in throughput:
            throughput["after"] = await _throughput(bench, "a") | {"after_handoff": index}
            say(f"  throughput of A after its recovery in handoff {index}: "
                 f"{throughput['after']['tokens_per_s']} tok/s")
    result["summary"] = report.handoff_summary(entries)
    result["ok"] = len(entries) == bench.args.handoffs and all(e["ok"] for e in entries)
    bench.results.pop("main", None)
    return result


async def scenario_wake_detail(bench: Bench) -> dict[str, Any]:
    """A's level-1 wake taken apart, call by call, in three ways of confirming it."""
    require(bench, "a")
    await ensure_holder(bench, "a")
    adapter = bench.adapter("a")
    cycles: list[dict[str, Any]] = []
    modes = ("sequential", "overlapped", "split")
    for i in range(bench.args.wake_cycles):
        mode = modes[i % len(modes)]
        cycle: dict[str, Any] = {"mode": mode}
        bench.cursor("a").read_new()
        cycle["sleep_post"] = await http(bench, "POST", "a", "/sleep?level=1&mode=wait",
                                          timeout_s=bench.bound(bench.args.sleep_timeout_s))
        cycle["sleep_confirm"] = await http(bench, "GET", "a", "/is_sleeping", timeout_s=5)
        bench.state.holder = None
        bench.record("a").asleep_level = 1
        cycle["asleep_mib"] = mib(await bench.used_by("a"))
        woke = time.monotonic()
        if mode == "split":
            first = await http(bench, "POST", "a", "/wake_up?tags=weights",
                                timeout_s=bench.bound(bench.args.wake_timeout_s))
            second = await http(bench, "POST", "a", "/wake_up?tags=kv_cache",
                                 timeout_s=bench.bound(bench.args.wake_timeout_s))
            cycle |= {"wake_weights": first, "wake_kv_cache": second}
            cycle["wake_post_ms"] = round(first["ms"] + second["ms"], 3)
        else:
            post = await http(bench, "POST", "a", "/wake_up",
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
        say("  " + report.wake_cycle_line(cycle))
    spec = bench.record("a").spec
    return {"cycles": cycles,
            "decomposition": report.wake_decomposition(
                cycles, bench.state.h2d or {}, model=spec.model_dir.name,
                weights_bytes=spec.weights_bytes())}


async def _generates(bench: Bench, key: str) -> dict[str, Any]:
    """A plain completion of 32 forced tokens: the engine generates (any text)."""
    record = bench.record(key)
    answer = await http(bench, "POST", key, "/v1/completions", timeout_s=bench.bound(60),
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
    require(bench, "a", "b")
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
        say("  " + report.handoff_line(to_b))
        if not to_b["ok"]:
            break
        generation.append(await _generates(bench, "b"))
        level = 2 if i < cycles else 1
        to_a = await bench.handoff("a", holder_level=level,
                                   label=f"level 2, cycle {i}: to A, B sleeps at level {level}")
        entries.append(to_a)
        say("  " + report.handoff_line(to_a))
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
    require(bench, "a")
    await ensure_holder(bench, "a")
    say("start-up admission of G (model-small, CUDA graphs on)")
    admission = await admit(bench, specs(bench.args, bench.args.state_dir)["g"],
                            stay_awake=False)
    entries: list[dict[str, Any]] = []
    for i in range(bench.args.graph_handoffs):
        entry = await bench.handoff("g" if i % 2 == 0 else "a", label=f"graphs {i}")
        entries.append(entry)
        say("  " + report.handoff_line(entry))
        if not entry["ok"]:
            break
    await ensure_holder(bench, "a")
    record = bench.record("g")
    return {"admission": admission, "handoffs": entries,
            "cold_start_s": record.ready_s, "start_phases": record.start_phases,
            "first_sleep_s": record.first_sleep_s,
            "summary": report.handoff_summary(entries),
            "ok": bool(entries) and all(e["ok"] for e in entries)}


async def scenario_smoke(bench: Bench) -> dict[str, Any]:
    """A short check on the engines that run (the real-GPU test): two handoffs between A
    and another live engine and back."""
    if "a" not in bench.live() or len(bench.live()) < 2:
        raise BenchError(f"the smoke check needs A and one more engine; running: "
                         f"{bench.live()} (run the startup scenario first)")
    require(bench, "a")
    other = next(k for k in bench.live() if k != "a")
    await ensure_holder(bench, "a")
    entries = [await bench.handoff(other, label="smoke 1"), await bench.handoff(
        "a", label="smoke 2")]
    for entry in entries:
        say("  " + report.handoff_line(entry))
    return {"other": other, "handoffs": entries, "summary": report.handoff_summary(entries),
            "ok": all(e["ok"] for e in entries)}


