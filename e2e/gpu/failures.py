"""The failure scenarios on real engines: a sleep whose client gives up, an engine core
that dies of it, an engine killed mid-switch, admission of an engine that does not fit
beside the awake one, a wake into too little memory, and a start without admission. Each
checks the one-awake invariant on NVML (the runner's sampler) and says what it took to give
the GPU back."""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import sys
import time
import uuid
from typing import Any

from controller.claimants import Claimant
from controller.lease.settings import StepTimeouts
from e2e.gpu import report
from e2e.gpu.context import (
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
from e2e.gpu.engines import EngineSpec, EngineStartError, SimulatorLauncher, bench_identity
from e2e.gpu.load import LongStream
from e2e.gpu.steps import (
    admit,
    ensure_holder,
    http,
    is_sleeping,
    overhead_bytes,
    require,
    say,
    wait_released,
)
from e2e.harness.waiting import WaitTimeout, eventually_async
from rota.api.engine_config import API_VERSION, KIND, parse_engine_config

__all__ = [
    "Ballast",
    "scenario_abandoned_sleep",
    "scenario_admission_counterexample",
    "scenario_admission_nofit",
    "scenario_dead_core",
    "scenario_killed_mid_switch",
    "scenario_wake_oom",
]


async def _small_engine(bench: Bench, order: tuple[str, ...]) -> str:
    """The first small engine of ``order`` still running; else a fresh V (model-small),
    started through start-up admission (a run taken up again after the others died)."""
    found = next((k for k in order if k in bench.live()), None)
    if found is not None:
        return found
    say("no small engine left: start-up admission of V (model-small)")
    await admit(bench, specs(bench.args, bench.args.state_dir)["v"], stay_awake=False)
    return "v"


async def scenario_abandoned_sleep(bench: Bench) -> dict[str, Any]:
    """A sleep whose client gives up while a long stream runs (vLLM 0.26 keeps it
    registered and fires it later, even after a wake): does rota leave a live engine?"""
    victim = await _small_engine(bench, ("b", "g", "v"))
    require(bench, "a", victim)
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
    say("  " + report.handoff_line(entry))
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
        sleeping = await is_sleeping(bench, victim)
        health = await http(bench, "GET", victim, "/health", timeout_s=3)
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
    say(f"  abandoned sleep: engine alive afterwards: {not crashed}; the pending sleep fired "
         f"after rota reported {victim} awake: {fired}")
    if crashed:
        pids = bench.engine(victim).kill()
        bench.sampler.unwatch(victim)
        result["release_after_kill_s"] = await wait_released(
            bench, victim, limit_bytes=0, timeout_s=bench.bound(20), pids=pids)
        if bench.state.holder == victim:
            bench.state.holder = None
    if bench.unsettled:  # rota left the victim unsettled: reconciliation would settle it
        result["still_unsettled_after_settling"] = await bench.settle()
    if bench.state.holder is None:
        result["holder_back"] = await bench.handoff("a", label="after the abandoned sleep: "
                                                               "A back")
    result["ok"] = not crashed
    return result


async def scenario_dead_core(bench: Bench) -> dict[str, Any]:
    """vLLM's own trap sprung on purpose: an abandoned sleep fires after a wake and the
    next request kills the engine core. What does the GPU show of the dead engine (is its
    memory freed, by when), and does its server stay up or exit (when, with what status)?
    rota's start-up admission depends on it: an engine that answers nothing but still holds
    memory keeps every other start on its GPU waiting."""
    victim = await _small_engine(bench, ("b", "g", "v"))
    require(bench, "a", victim)
    await ensure_holder(bench, victim)
    record, proc = bench.record(victim), bench.engine(victim)
    stream = LongStream(bench.session, record.base_url, record.spec.served_name,
                        max_tokens=bench.args.long_tokens, timeout_s=bench.bound(240))
    stream.start()
    with contextlib.suppress(TimeoutError):
        await asyncio.wait_for(stream.flowing.wait(), bench.bound(60))
    if stream.first_token is None:
        await stream.cancel()
        raise BenchError(f"the long stream on {victim} did not start: {stream.as_dict()}")
    result: dict[str, Any] = {"victim": victim, "pids": proc.group(),
                              "used_mib_awake": mib(await bench.used_by(victim))}
    result["abandoned_sleep"] = await http(bench, "POST", victim, "/sleep?level=1&mode=wait",
                                           timeout_s=bench.args.abandon_after_s)
    result["wake_up"] = await http(bench, "POST", victim, "/wake_up", timeout_s=30)
    await stream.wait(bench.bound(bench.args.long_tokens / 50 + 30))
    result["stream"] = stream.as_dict()
    async def asleep() -> bool:  # the pending sleep fires once the stream ended
        return await is_sleeping(bench, victim) is True

    with contextlib.suppress(WaitTimeout):
        await eventually_async(asleep, timeout=bench.bound(30), what="the pending sleep")
    result["asleep_with_the_scheduler_on"] = await is_sleeping(bench, victim)
    bench.sampler.unwatch(victim)  # from here on it is not an engine rota may wake
    killing = time.monotonic()
    result["request"] = await http(bench, "POST", victim, "/v1/completions", timeout_s=60,
                                   json_body={"model": record.spec.served_name,
                                              "prompt": "3 + 4 =", "max_tokens": 4})
    timeline: list[dict[str, Any]] = []
    last: tuple[Any, ...] | None = None
    exited_at: float | None = None
    watch_until = killing + bench.bound(30)
    pids = set(result["pids"])
    while time.monotonic() < watch_until:
        alive = proc.alive()
        health = (await http(bench, "GET", victim, "/health", timeout_s=2)).get("status") \
            if alive else None
        snapshot = await bench.snapshot()
        on_gpu = sorted(p.pid for p in snapshot.processes if p.pid in pids)
        point = (alive, health, tuple(on_gpu))
        if point != last:
            timeline.append({"t_s": round(time.monotonic() - killing, 3), "alive": alive,
                             "health": health, "pids_on_gpu": on_gpu,
                             "used_mib": mib(snapshot.used_by(record.claim_uid))})
            last = point
        if not alive and exited_at is None:
            exited_at = time.monotonic() - killing
        if exited_at is not None and not on_gpu:
            break
        await asyncio.sleep(0.1)
    result["timeline"] = timeline
    result["server_exit_s"] = None if exited_at is None else round(exited_at, 3)
    result["exit_status"] = proc.proc.poll() if proc.proc is not None else None
    released = next((p["t_s"] for p in timeline if not p["pids_on_gpu"]), None)
    result["gpu_released_s"] = released
    say(f"  dead core: request {result['request'].get('status')}; the GPU freed its memory "
        f"after {released} s; the server exited after {result['server_exit_s']} s "
        f"(status {result['exit_status']})")
    if proc.alive():  # VLLM_KEEP_ALIVE_ON_ENGINE_DEATH=1, or a server that hung
        result["killed_after_watch"] = proc.kill()
    record.dead = True
    if bench.state.holder == victim:
        bench.state.holder = None
    result["holder_back"] = await bench.handoff("a", label="after the dead core: A back")
    result["ok"] = (result["request"].get("status") == 500 and released is not None
                    and exited_at is not None and result["holder_back"]["ok"])
    return result


async def scenario_killed_mid_switch(bench: Bench) -> dict[str, Any]:
    """The target SIGKILLed while its wake is in flight: one owner, the old holder back."""
    target = await _small_engine(bench, ("g", "b", "v"))
    require(bench, "a", target)
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
    say("  " + report.handoff_line(entry))
    if "at" not in killed:  # the wake never started (the switch failed before it)
        kill()
    bench.record(target).dead = True
    release = await wait_released(bench, target, limit_bytes=0, timeout_s=bench.bound(20),
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
    require(bench, "a")
    await ensure_holder(bench, "a")
    snapshot = await bench.snapshot()
    record_a = bench.record("a")
    a_used = snapshot.used_by(record_a.claim_uid)
    free_if_a_asleep = snapshot.free_bytes + a_used - (record_a.resident_bytes or 0)
    overhead = overhead_bytes(bench)
    kv = _nofit_kv(bench, snapshot.free_bytes, free_if_a_asleep)
    if kv + overhead <= snapshot.free_bytes:
        return {"ok": False, "skipped": True,
                "reason": f"this GPU has room for X beside A ({mib(snapshot.free_bytes)} MiB "
                          "free); nothing to admit"}
    spec = EngineSpec(key="x", model_dir=bench.args.models / "model-small",
                      served_name="bench/model-small-big-kv", kv_cache_bytes=kv)
    say(f"start-up admission of X (model-small, {mib(spec.kv_cache_bytes)} MiB KV cache: does "
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
            found["health"] = await http(bench, "GET", key, "/health", timeout_s=5)
            found["alive"] = False
            return found
    elif bench.state.holder is None and await is_sleeping(bench, key) is not False:
        found["health"] = await http(bench, "GET", key, "/health", timeout_s=5)
        found["is_sleeping"] = await is_sleeping(bench, key)
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
    found["health"] = await http(bench, "GET", key, "/health", timeout_s=5)
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
        env |= bench_identity(self.claim_uid)
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
                        pod_name="ballast", pod_uid=self.claim_uid, pod_ip=None, pod_ready=True,
                        pod_deleting=False)


async def scenario_wake_oom(bench: Bench) -> dict[str, Any]:
    """X woken into less free memory than it needs: gpu_oom, then the old holder back."""
    require(bench, "a", "x")
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
        say(f"  ballast holds {mib(used)} MiB; X declares {mib(free_after - 2 * GIB)} MiB "
             f"awake, needs {mib(x.awake_bytes)} MiB")
        entry = await bench.handoff("x", label="wake that cannot fit")
        say("  " + report.handoff_line(entry))
        result["switch"] = entry
        result["reason"] = entry["reason"]
        result["x_mib_after"] = mib(await bench.used_by("x"))
        result["x_is_sleeping_after"] = await is_sleeping(bench, "x")
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
        finish["wake_post"] = await http(bench, "POST", "x", "/wake_up",
                                          timeout_s=bench.bound(120))
        finish["is_sleeping"] = await is_sleeping(bench, "x")
        probe = await bench.adapter("x").probe()
        finish["probe_ok"] = probe.ok
        finish["sleep_post"] = await http(bench, "POST", "x", "/sleep?level=1&mode=wait",
                                           timeout_s=bench.bound(120))
        finish["is_sleeping_after_sleep"] = await is_sleeping(bench, "x")
        finish["x_mib"] = mib(await bench.used_by("x"))
        steps["finish_wake_then_sleep"] = finish
    if await bench.used_by("x") > limit:
        pids = bench.engine("x").kill()
        bench.sampler.unwatch("x")
        steps["x_killed_as_a_pod_restart"] = True
        steps["x_release_s"] = await wait_released(bench, "x", limit_bytes=0,
                                                    timeout_s=bench.bound(20), pids=pids)
    bench.record("x").asleep_level = 1
    bench.state.holder = None
    back = await bench.handoff("a", label="after the failed wake: A back")
    steps["holder_back"] = back
    say("  " + report.handoff_line(back))
    return steps


def _nofit_kv(bench: Bench, free_now: int, free_if_a_asleep: int) -> int:
    """A KV cache that makes a small model not fit beside awake A, but fit alone."""
    overhead = overhead_bytes(bench)
    kv = min(free_now - overhead + 10 * GIB, free_if_a_asleep - overhead - 4 * GIB)
    return kv // MIB * MIB


async def scenario_admission_counterexample(bench: Bench) -> dict[str, Any]:
    """What admission saves: Y, which does not fit beside awake A, is started anyway. vLLM's
    start fails (CUDA out of memory) after its initialisation, while A keeps serving."""
    require(bench, "a")
    await ensure_holder(bench, "a")
    snapshot = await bench.snapshot()
    record_a = bench.record("a")
    a_used = snapshot.used_by(record_a.claim_uid)
    kv = _nofit_kv(bench, snapshot.free_bytes,
                   snapshot.free_bytes + a_used - (record_a.resident_bytes or 0))
    if kv + overhead_bytes(bench) <= snapshot.free_bytes:
        return {"ok": False, "skipped": True, "reason": "Y would fit beside A on this GPU"}
    spec = EngineSpec(key="y", model_dir=bench.args.models / "model-small",
                      served_name="bench/model-small-no-admission", kv_cache_bytes=kv)
    say(f"starting Y ({mib(kv)} MiB KV cache) beside awake A, without admission")
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
    result["release_s"] = await wait_released(bench, "y", limit_bytes=0,
                                               timeout_s=bench.bound(30), pids=pids)
    bench.sampler.phase("counterexample: after Y")
    probe = await asyncio.wait_for(bench.adapter("a").probe(),
                                   bench.bound(bench.args.probe_timeout_s))
    result["a_serves_after"] = probe.ok
    result["ok"] = not result["y_started"] and probe.ok
    say(f"  Y {'started' if result['y_started'] else 'failed to start'} after "
         f"{result['seconds_to_outcome']} s; A serves: {probe.ok}")
    return result


