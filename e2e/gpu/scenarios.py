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

Run only when named:

``smoke``            one handoff each way (the real-GPU pytest's own check)
``dead_core``        the abandoned-sleep trap sprung on purpose: the next request kills
                     the engine core; when the GPU frees its memory, when its server
                     exits and with what status (the engine is gone afterwards)
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Any

import aiohttp

from controller.lease.engines.errors import EngineError
from controller.lease.switch import Fenced
from e2e.gpu import report
from e2e.gpu.context import Bench, BenchError
from e2e.gpu.engines import EngineStartError
from e2e.gpu.failures import (
    scenario_abandoned_sleep,
    scenario_admission_counterexample,
    scenario_admission_nofit,
    scenario_dead_core,
    scenario_killed_mid_switch,
    scenario_wake_oom,
)
from e2e.gpu.protocol import (
    scenario_cuda_graphs,
    scenario_level2,
    scenario_main,
    scenario_smoke,
    scenario_startup,
    scenario_wake_detail,
)
from e2e.gpu.steps import say

__all__ = ["EXTRA", "SCENARIOS", "Scenario", "run_scenarios", "select"]


RESERVE_S = 20.0
"""Kept free at the end of a run for stopping, writing results and copying logs."""


@dataclass(frozen=True)
class Scenario:
    name: str
    run: Callable[[Bench], Awaitable[dict[str, Any]]]
    estimate_s: float
    """Expected seconds with real vLLM on the H200 (cold starts dominate)."""



EXTRA: dict[str, Scenario] = {s.name: s for s in (
    Scenario("smoke", scenario_smoke, 30),
    Scenario("dead_core", scenario_dead_core, 60),
)}
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
            say(f"== {name}: not started ({results[name]['reason']})")
            bench.save()
            break
        say(f"== {name} (expected ~{need:.0f} s, {left:.0f} s left)")
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
                OSError, LookupError) as exc:
            result = {"ok": False, "error": f"{type(exc).__name__}: {exc}"}
        result["wall_s"] = round(time.monotonic() - began, 2)
        result["nvml_phases"] = [p for p in bench.sampler.phases()
                                 if p["start_s"] >= began - origin - 1e-3]
        result["invariant_violations"] = sum(p["violations"] for p in result["nvml_phases"])
        results[name] = result
        if "error" not in result:  # one that broke off is taken up again by the next stage
            bench.state.done.append(name)
        bench.save()
        say(f"== {name}: {report.scenario_verdict(name, result)}")

