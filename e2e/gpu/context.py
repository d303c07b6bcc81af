"""What the GPU benchmark's scenarios work with: the state kept between commands, the
in-memory Lease and the device port, and :class:`Bench`, through which a scenario starts
engines, builds claimants, hands the GPU over with the real Switcher and records what it
saw (NVML views, the HTTP calls, vLLM's own log lines)."""

from __future__ import annotations

import argparse
import asyncio
import json
import logging
import os
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import aiohttp
from pydantic import BaseModel, ConfigDict, Field

from controller.claimants import Claimant
from controller.lease.device import GpuSnapshot
from controller.lease.engines.base import EngineAdapter, EngineEndpoint, Timeouts
from controller.lease.engines.registry import make_adapter
from controller.lease.settings import StepTimeouts
from controller.lease.switch import Limits, Ports, Switcher, SwitchResult
from driver.devices import GpuDevice
from driver.nvml.api import NvmlBackend
from e2e.gpu.engines import (
    EngineProcess,
    EngineRecord,
    EngineSpec,
    Launcher,
    SimulatorLauncher,
)
from e2e.gpu.instrument import AdapterCall, BenchAdapter, HttpTrace
from e2e.gpu.sampler import NvmlSampler
from e2e.gpu.vllm_log import LogCursor, LogEvent, summarise_start
from e2e.harness.ports import MemoryLeasePort, ReaderDevice
from rota.api import naming
from rota.api.engine_config import API_VERSION, KIND, parse_engine_config
from rota.api.gpu_lease import GpuLease
from rota.api.quantity import parse_quantity

log = logging.getLogger("e2e.gpu.context")

MIB = 2**20
GIB = 2**30
NODE = "bench-node"
NAMESPACE = "bench"
REPO_ROOT = Path(__file__).resolve().parents[2]
ASSUMED_H2D_BYTES_PER_S = 54e9


class BenchError(RuntimeError):
    """A scenario cannot go on; the message says why."""


class BenchState(BaseModel):
    """What a run leaves for the next command on the same machine."""

    model_config = ConfigDict(extra="forbid")

    boot_id: str
    gpu_uuid: str
    engines: dict[str, EngineRecord] = Field(default_factory=dict)
    holder: str | None = None
    """The engine the Lease gives the GPU to (None: nobody awake)."""
    done: list[str] = Field(default_factory=list)
    """Scenarios already run (passed or not); ``--scenarios next`` skips them."""
    h2d: dict[str, Any] | None = None
    stages: list[str] = Field(default_factory=list)

    @classmethod
    def load(cls, path: Path) -> BenchState | None:
        try:
            return cls.model_validate_json(path.read_text(encoding="utf-8"))
        except (OSError, ValueError):
            return None

    def save(self, path: Path) -> None:
        write_atomic(path, self.model_dump_json(indent=1))


def write_atomic(path: Path, text: str) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    tmp.write_text(text, encoding="utf-8")
    tmp.replace(path)


def mib(n: float | None) -> float | None:
    return None if n is None else round(n / MIB, 1)


def byte_count(text: str) -> int:
    """A flag's byte count: ``4Gi``, ``512Mi``, ``500M`` or plain bytes."""
    try:
        return parse_quantity(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


@dataclass
class Bench:
    """Everything a scenario needs; scenarios change the world only through it."""

    args: argparse.Namespace
    state: BenchState
    state_file: Path
    out_file: Path
    backend: NvmlBackend
    gpu: GpuDevice
    launcher: Launcher
    session: aiohttp.ClientSession
    device: ReaderDevice
    sampler: NvmlSampler
    trace: HttpTrace
    deadline: float
    origin: float = field(default_factory=time.monotonic)
    engines: dict[str, EngineProcess] = field(default_factory=dict)
    cursors: dict[str, LogCursor] = field(default_factory=dict)
    calls: list[AdapterCall] = field(default_factory=list)
    results: dict[str, Any] = field(default_factory=dict)
    extra_claimants: dict[str, Claimant] = field(default_factory=dict)
    """Claimants that are no engine of the run (the failure scenarios' ballast)."""
    budget_override: dict[str, int] = field(default_factory=dict)
    """Declared awake budgets that differ from the measured ones (a misconfigured claim)."""
    wake_hooks: dict[str, Callable[[], None]] = field(default_factory=dict)
    adapter_timeouts: Timeouts | None = None
    lease_port: MemoryLeasePort = field(init=False)
    unsettled: list[Claimant] = field(init=False, default_factory=list)
    """Engines the last switch left unsettled (see :meth:`settle`)."""
    switcher: Switcher = field(init=False)

    def __post_init__(self) -> None:
        self.lease_port = MemoryLeasePort(GpuLease(
            name=naming.gpu_lease_name(NODE, self.gpu.name), node=NODE, device=self.gpu.name,
            gpu_uuid=self.gpu.uuid))
        self.switcher = self.make_switcher()

    # -- time ------------------------------------------------------------------------

    def remaining(self) -> float:
        return self.deadline - time.monotonic()

    def bound(self, seconds: float) -> float:
        """``seconds``, or what is left of the run if less (never below 1 s)."""
        return max(1.0, min(seconds, self.remaining()))

    # -- claimants and adapters ------------------------------------------------------

    def timeouts(self) -> Timeouts:
        if self.adapter_timeouts is not None:
            return self.adapter_timeouts
        a = self.args
        return Timeouts(sleep_s=a.sleep_timeout_s, wake_level1_s=a.wake_timeout_s,
                        wake_level2_s=a.wake_timeout_s, probe_total_s=a.probe_timeout_s,
                        probe_first_token_s=a.probe_timeout_s)

    def limits(self, *, step: StepTimeouts | None = None) -> Limits:
        a = self.args
        return Limits(tolerance_bytes=a.resident_tolerance, unknown_limit_bytes=a.unknown_limit,
                      timeouts=step or StepTimeouts(sleep_s=a.sleep_timeout_s + 15,
                                                    wake_s=a.wake_timeout_s + 15,
                                                    probe_s=a.probe_timeout_s + 5))

    def make_switcher(self, *, step: StepTimeouts | None = None) -> Switcher:
        switcher = Switcher(ports=Ports(lease=self.lease_port, device=self.device,
                                        engine=self.adapter_for, guard=lambda: None),
                            limits=self.limits(step=step), identity="bench-gpu")
        for key, record in self.state.engines.items():
            if record.first_sleep_s is not None:  # its first sleep is behind it
                switcher.record_sleep(self.claimant(key), record.first_sleep_s)
        return switcher

    def record(self, key: str) -> EngineRecord:
        try:
            return self.state.engines[key]
        except KeyError:
            raise BenchError(f"engine {key} was never started in this state") from None

    def resident_budget(self, key: str) -> int:
        measured = self.record(key).resident_bytes or 0
        floor: int = self.args.resident_budget
        return max(floor, measured + 128 * MIB)

    def awake_budget(self, key: str) -> int:
        if key in self.budget_override:
            return self.budget_override[key]
        record = self.record(key)
        if record.awake_bytes:
            return record.awake_bytes + 512 * MIB
        return self.estimated_awake(record.spec)

    def estimated_awake(self, spec: EngineSpec) -> int:
        if isinstance(self.launcher, SimulatorLauncher):
            return self.launcher.awake_bytes(spec)
        return spec.estimated_awake_bytes()

    def claimant(self, key: str, *, level: int | None = None) -> Claimant:
        """What ``claimants_from`` would build for this engine's claim and pod."""
        record = self.record(key)
        sleep_level = level or record.asleep_level or 1
        awake = max(self.awake_budget(key), self.resident_budget(key) + MIB)
        config = parse_engine_config({
            "apiVersion": API_VERSION, "kind": KIND, "model": record.spec.served_name,
            "awakeMemory": awake, "sleepLevel": sleep_level, "enginePort": record.port,
            "adapter": "vllm", "probe": {"mode": self.args.probe_mode,
                                         "maxTokens": self.args.probe_max_tokens}})
        return Claimant(
            claim_uid=record.claim_uid, namespace=NAMESPACE, claim_name=f"claim-{key}",
            node=NODE, device=self.gpu.name, share_id=None, config=config,
            model=record.spec.served_name, port=record.port, sleep_level=sleep_level,
            resident_bytes=self.resident_budget(key), pod_name=f"engine-{key}",
            pod_uid=record.claim_uid,
            pod_ip="127.0.0.1", pod_ready=True, pod_deleting=False)

    def key_of(self, claimant: Claimant) -> str:
        for key, record in self.state.engines.items():
            if record.claim_uid == claimant.claim_uid:
                return key
        raise BenchError(f"{claimant.ref} is no engine of this run")

    def key_of_ref(self, ref: str) -> str | None:
        return next((k for k in self.state.engines if ref == f"{NAMESPACE}/claim-{k}"), None)

    def live(self) -> list[str]:
        return [k for k, r in self.state.engines.items() if not r.dead]

    def claimants_on_gpu(self) -> list[Claimant]:
        return [self.claimant(k) for k in self.live()] + list(self.extra_claimants.values())

    def adapter_for(self, claimant: Claimant) -> EngineAdapter:
        key = self.key_of(claimant)
        if claimant.endpoint is None:
            raise BenchError(f"{claimant.ref} has no endpoint")
        endpoint = EngineEndpoint(base_url=claimant.endpoint, model=claimant.model,
                                  claim=claimant.ref, pod=f"{NAMESPACE}/engine-{key}")
        inner = make_adapter(claimant.config, endpoint, self.session, self.timeouts())
        return BenchAdapter(inner, engine=key, calls=self.calls,
                            on_wake=self.wake_hooks.get(key))

    def adapter(self, key: str, *, level: int | None = None) -> BenchAdapter:
        adapter = self.adapter_for(self.claimant(key, level=level))
        assert isinstance(adapter, BenchAdapter)
        return adapter

    # -- the device ------------------------------------------------------------------

    async def snapshot(self) -> GpuSnapshot:
        return await asyncio.wait_for(self.device.snapshot(self.gpu.name), 15)

    def view(self, snapshot: GpuSnapshot) -> dict[str, Any]:
        """The NVML view of one moment, in MiB: each engine, the rest, the card."""
        ours = {r.claim_uid: k for k, r in self.state.engines.items()}
        ours |= {c.claim_uid: k for k, c in self.extra_claimants.items()}
        view: dict[str, Any] = {f"{k}_mib": mib(snapshot.used_by(uid)) for uid, k in ours.items()
                                if k in self.live() or k in self.extra_claimants}
        view["other_processes_mib"] = mib(sum(p.used_bytes for p in snapshot.processes
                                              if p.claim_uid not in ours))
        view |= {"used_mib": mib(snapshot.used_bytes), "free_mib": mib(snapshot.free_bytes),
                 "total_mib": mib(snapshot.total_bytes)}
        return view

    async def phase_view(self, name: str) -> dict[str, Any]:
        view = self.view(await self.snapshot())
        self.results.setdefault("memory_mib", {})[name] = view
        return view

    def watch(self, key: str) -> None:
        """The sampler attributes the engine's processes: awake above its resident budget
        (plus the tolerance), over budget above its claim's awake memory."""
        record = self.record(key)
        self.sampler.watch(key, record.claim_uid,
                           self.resident_budget(key) + self.args.resident_tolerance,
                           awake_limit_bytes=self.claimant(key).config.awake_memory)

    # -- engine logs -------------------------------------------------------------------

    def cursor(self, key: str) -> LogCursor:
        if key not in self.cursors:
            self.cursors[key] = LogCursor(self.record(key).log)
            self.cursors[key].skip_to_end()
        return self.cursors[key]

    def log_events(self, key: str) -> list[LogEvent]:
        return self.cursor(key).events()

    # -- persistence ---------------------------------------------------------------------

    def save(self) -> None:
        self.state.save(self.state_file)
        write_atomic(self.out_file, json.dumps(self.summary(), default=str))

    def summary(self, error: str | None = None) -> dict[str, Any]:
        sampler = self.sampler.report()
        sampler.pop("timeline", None)
        scenarios = self.results.get("scenarios", {})
        return {
            "benchmark": "gpu_switch_vllm",
            "stage": self.args.stage,
            "ok": error is None and all(s.get("ok") for s in scenarios.values()),
            "error": error,
            "note": note(self.args),
            "launcher": self.launcher.name,
            "nvml": "fake" if self.args.fake_nvml else "real",
            "device": self.gpu.product_name,
            "gpu_uuid": self.gpu.uuid,
            "probe_mode": self.args.probe_mode,
            "h2d": self.state.h2d,
            "engines": {k: engine_summary(r) for k, r in self.state.engines.items()},
            "holder": self.state.holder,
            "scenarios_done": self.state.done,
            "wall_s": round(time.monotonic() - self.origin, 2),
            "sampler": sampler,
            **{k: v for k, v in self.results.items() if k != "scenarios"},
            "scenarios": scenarios,
        }

    # -- switches ------------------------------------------------------------------------

    async def settle(self) -> list[str]:
        """Settle what the last switch left unsettled, as the controller's reconciliation
        does (a sleep of ours that completes, or no process left); the refs still
        unsettled."""
        left = []
        for claimant in self.unsettled:
            if not await self.switcher.settle(claimant, self.lease_port.current.fence, {}):
                left.append(claimant.ref)
        self.unsettled = []
        return left

    async def handoff(self, target: str, *, label: str, holder_level: int = 1,
                      switcher: Switcher | None = None) -> dict[str, Any]:
        """One switch of the Lease to ``target`` through the real Switcher, measured."""
        holder = self.state.holder
        if holder == target:
            raise BenchError(f"{target} already holds the GPU")
        holder_claimant = self.claimant(holder, level=holder_level) if holder else None
        target_claimant = self.claimant(target)
        for key in (holder, target):
            if key:
                self.cursor(key).read_new()
        first_calls = len(self.calls)
        began = time.monotonic()
        result: SwitchResult = await asyncio.wait_for(
            (switcher or self.switcher).switch(
                self.lease_port.current, holder=holder_claimant, target=target_claimant,
                claimants=self.claimants_on_gpu()),
            self.bound(self.args.sleep_timeout_s + self.args.wake_timeout_s + 120))
        ended = time.monotonic()
        self.unsettled = list(result.unsettled)
        lease_holder = self.key_of_ref(result.lease.holder) if result.lease.holder else None
        self.state.holder = lease_holder
        if result.ok:
            self.record(target).asleep_level = None
            if holder:
                self.record(holder).asleep_level = holder_level
        entry = self._entry(label, holder, target, result, began, ended, first_calls)
        entry["nvml_after"] = self.view(await self.snapshot())
        if result.ok and holder:
            self.results.setdefault("memory_mib", {}).setdefault(
                f"{target}_awake_{holder}_asleep", entry["nvml_after"])
        return entry

    def _entry(self, label: str, holder: str | None, target: str, result: SwitchResult,
               began: float, ended: float, first_calls: int) -> dict[str, Any]:
        t = result.timings
        sleep_call = t.get("first_sleep", t.get("later_sleep"))
        wake_call = t.get("wake_call")
        ttft = t.get("probe_ttft")
        handoff = t.get("handoff_to_first_token")
        entry: dict[str, Any] = {
            "label": label, "from": holder, "to": target, "ok": result.ok,
            "holder_level": self.record(holder).asleep_level if holder and result.ok else None,
            "reason": result.reason or None, "message": result.message or None,
            "holder_after": self.state.holder,
            "handoff_to_first_token_s": handoff,
            "recovery_to_first_token_s": t.get("recovery_to_first_token"),
            "wake_call_s": wake_call, "probe_ttft_s": ttft, "sleep_call_s": sleep_call,
            "drain_s": t.get("drain"), "inspect_s": t.get("inspect"),
            "sleep_step_s": t.get("sleep"), "wake_step_s": t.get("wake"),
            "probe_step_s": t.get("probe"), "lease_s": t.get("lease"), "total_s": t.get("total"),
            "unsettled": [c.ref for c in result.unsettled],
        }
        if handoff is not None and sleep_call is not None and wake_call is not None and \
                ttft is not None:
            entry["controller_overhead_s"] = handoff - sleep_call - wake_call - ttft
        for step in ("sleep", "wake"):
            entry[f"{step}_confirm_s"] = t.get(f"{step}_confirm")
        weights = self.record(target).spec.weights_bytes()
        floor = weights / float((self.state.h2d or {}).get("bytes_per_s")
                                or ASSUMED_H2D_BYTES_PER_S)
        entry["wake_floor_s"] = floor
        entry["wake_over_floor"] = wake_call / floor if wake_call and floor > 0 else None
        entry["http"] = [c.as_dict(began) for c in self.trace.window(began, ended)]
        entry["calls"] = [c.as_dict(began) for c in self.calls[first_calls:]]
        engine_log: dict[str, Any] = {}
        for key in (holder, target):
            if key:
                engine_log[key] = [{"kind": e.kind, **e.values} for e in self.log_events(key)
                                   if e.kind in ("wake", "sleep", "sleep_freed", "cumem_sleep",
                                                 "oom", "engine_dead", "exception")]
        entry["engine_log"] = engine_log
        wake_internal = [e["seconds"] for e in engine_log.get(target, []) if e["kind"] == "wake"]
        entry["vllm_wake_s"] = wake_internal[-1] if wake_internal else None
        if holder:
            sleeps = [e["seconds"] for e in engine_log.get(holder, []) if e["kind"] == "sleep"]
            entry["vllm_sleep_s"] = sleeps[-1] if sleeps else None
        return {k: (round(v, 6) if isinstance(v, float) else v) for k, v in entry.items()}

    async def sleep_holder(self, *, reason: str) -> dict[str, Any]:
        """The holder to sleep, the GPU idle (start-up admission before a newcomer)."""
        holder = self.state.holder
        if holder is None:
            return {"slept": None}
        began = time.monotonic()
        first_calls = len(self.calls)
        lease = await asyncio.wait_for(self.switcher.sleep_holder(
            self.lease_port.current, self.claimant(holder, level=1), reason=reason),
            self.bound(self.args.sleep_timeout_s + 60))
        self.state.holder = self.key_of_ref(lease.holder) if lease.holder else None
        self.record(holder).asleep_level = 1
        calls = [c.as_dict(began) for c in self.calls[first_calls:]]
        return {"slept": holder, "seconds": round(time.monotonic() - began, 4), "calls": calls}

    # -- engines -------------------------------------------------------------------------

    async def start_engine(self, spec: EngineSpec) -> EngineProcess:
        """Start an engine (its cold start measured) and wait until it serves."""
        uid = str(uuid.uuid4())
        self.sampler.watch(spec.key, uid, self.args.resident_budget + self.args.resident_tolerance)
        proc = EngineProcess.start(spec, self.launcher, self.state_file.parent, claim_uid=uid)
        self.engines[spec.key] = proc
        self.state.engines[spec.key] = proc.record
        self.cursors[spec.key] = LogCursor(proc.record.log)
        self.save()
        proc.record.ready_s = round(await proc.wait_ready(
            self.session, deadline=time.monotonic() + self.bound(self.args.start_timeout_s)), 3)
        started = self.cursors[spec.key].events()
        proc.record.start_phases = summarise_start(started)
        return proc

    def engine(self, key: str) -> EngineProcess:
        if key not in self.engines:
            self.engines[key] = EngineProcess(self.record(key))
        return self.engines[key]

    async def used_by(self, key: str) -> int:
        return (await self.snapshot()).used_by(self.record(key).claim_uid)


def engine_summary(record: EngineRecord) -> dict[str, Any]:
    spec = record.spec
    return {"model": spec.model_dir.name, "served_name": spec.served_name,
            "kv_cache_mib": mib(spec.kv_cache_bytes), "load_format": spec.load_format,
            "enforce_eager": spec.enforce_eager, "weights_mib": mib(spec.weights_bytes()),
            "pid": record.pid, "port": record.port, "dead": record.dead,
            "cold_start_s": record.ready_s, "start_to_first_probe_s": record.first_probe_s,
            "start_phases": record.start_phases, "awake_mib": mib(record.awake_bytes),
            "asleep_mib": mib(record.resident_bytes), "first_sleep_s": record.first_sleep_s,
            "first_wake_s": record.first_wake_s, "asleep_level": record.asleep_level}


def note(args: argparse.Namespace) -> str:
    engines = ("real vLLM servers" if args.launcher == "vllm"
               else "the engine simulator standing in for vLLM")
    nvml = "fake NVML (fixture)" if args.fake_nvml else "real NVML (pynvml)"
    return (f"switch protocol WITHOUT a Kubernetes cluster: {engines}, the driver's inspection "
            f"service on {nvml}, the real Switcher and vLLM adapter, claimants built by hand, "
            f"an in-memory Lease; probe mode {args.probe_mode}")



def specs(args: argparse.Namespace, state_dir: Path) -> dict[str, EngineSpec]:
    """The engines the scenarios may start (``x`` is sized when admission_nofit runs; ``v``
    is started only when a failure scenario is run again with no small engine left)."""
    small_weights = args.small_weights or state_dir / "weights" / "model-small"
    has_weights = any(small_weights.glob("*.safetensors")) if small_weights.is_dir() else False
    big, small = args.models / args.a_model, args.models / "model-small"
    return {
        "a": EngineSpec(key="a", model_dir=big, served_name=f"bench/{args.a_model}",
                        kv_cache_bytes=args.a_kv),
        "b": EngineSpec(key="b", model_dir=small_weights if has_weights else small,
                        served_name="bench/model-small", kv_cache_bytes=args.b_kv,
                        load_format="auto" if has_weights else "dummy"),
        "g": EngineSpec(key="g", model_dir=small, served_name="bench/model-small-graphs",
                        kv_cache_bytes=args.g_kv, enforce_eager=False),
        "v": EngineSpec(key="v", model_dir=small, served_name="bench/model-small-victim",
                        kv_cache_bytes=args.b_kv),
    }
