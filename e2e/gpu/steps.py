"""Steps the GPU benchmark's scenarios share: calls straight to an engine, giving the GPU to
an engine, waiting for a dead engine's memory, and start-up admission."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Sequence
from typing import Any

import aiohttp

from e2e.gpu.context import (
    GIB,
    Bench,
    BenchError,
    mib,
)
from e2e.gpu.engines import EngineSpec, SimulatorLauncher

__all__ = [
    "admit",
    "ensure_holder",
    "http",
    "is_sleeping",
    "overhead_bytes",
    "require",
    "say",
    "wait_released",
]


def say(text: str) -> None:
    print(text, flush=True)


# -- helpers --------------------------------------------------------------------------------


async def http(bench: Bench, method: str, key: str, path: str, *, timeout_s: float,
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


async def is_sleeping(bench: Bench, key: str) -> bool | None:
    answer = await http(bench, "GET", key, "/is_sleeping", timeout_s=5)
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


def require(bench: Bench, *keys: str) -> None:
    for key in keys:
        if key not in bench.state.engines or bench.record(key).dead:
            raise BenchError(f"engine {key} is not running (an earlier scenario did not start "
                             "it, or killed it)")
        if not bench.engine(key).alive():
            bench.record(key).dead = True
            raise BenchError(f"engine {key} has exited; its log: {bench.record(key).log}")


async def wait_released(bench: Bench, key: str, *, limit_bytes: int, timeout_s: float,
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


def overhead_bytes(bench: Bench) -> int:
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
    say(f"  {key}: cold start {record.ready_s:.1f} s to serving, first probe at "
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
    say(f"  {key}: first level-1 sleep {outcome.sleep_s:.3f} s, "
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
        say(f"  {key}: first wake {outcome_w.wake_s:.3f} s; {key} holds the GPU")
    elif slept_for_admission is not None:
        bench.sampler.phase(f"admission:{key}:holder back")
        entry["holder_back"] = await bench.handoff(slept_for_admission,
                                                   label=f"admission of {key}: holder back")
    entry["admission_s"] = round(time.monotonic() - began, 3)
    bench.save()
    return entry


