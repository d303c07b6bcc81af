"""GPU switch benchmark: the controller's switch protocol on one GPU, WITHOUT a cluster.

    python -m e2e.bench_gpu                          # on a GPU node: real NVML, real memory
    python -m e2e.bench_gpu --fake-nvml h200         # anywhere: fake NVML, counted memory

No Kubernetes is involved: no apiserver, no DRA allocation, no Lease object. What runs
for real is the rest of the path a switch takes:

- the driver's NVML backend (pynvml; ``--fake-nvml FIXTURE`` swaps in the fake) behind the
  driver's node inspection service, served on a temporary unix socket;
- two engine simulators as separate processes (``python -m e2e.engine_simulator``) that
  hold real device memory (``--memory-backend cuda``; with the fake NVML they count it and
  register it), each started with ``ROTA_CLAIM_UID`` so the inspection service attributes
  its process to a claim;
- the lease controller's :class:`~controller.switch.Switcher` with the real engine
  adapters, the real :class:`~controller.device.DeviceReader` on the inspection socket,
  claimants built by hand (as the claims' opaque config would give them) and an
  in-memory lease port (a compare-and-swap on a counter instead of a Lease object).

The protocol is the reference experiment's (DESIGN.md): both engines start awake, the
non-holder B is put to sleep first as start-up reconciliation would (its first sleep is
reported separately, as is A's, which happens in the first handoff), then N handoffs
A<->B through ``Switcher.switch``, each ending with the streamed correctness request.
Around one recovery of A the script measures output tokens/s (8 concurrent requests x 2
rounds, 128 forced tokens with ``ignore_eos``; the simulator's ``--tokens-per-second``
sets the pace). Each level-1 wake is compared with its floor, weight bytes divided by the
host-to-device bandwidth, measured with PyTorch in a short-lived child process (pinned
host tensor to device) when torch and CUDA are present, else taken as 54e9 B/s.

Human-readable lines while it runs; one JSON object on the last line of stdout. Every wait
has a deadline; the simulators are stopped (SIGTERM, then SIGKILL) on every exit path and
die with this process (parent-death signal) if it is killed.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import importlib
import importlib.util
import json
import logging
import os
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time
import uuid
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import aiohttp

from controller import naming, reconcile
from controller.claimants import Claimant
from controller.device import DeviceReader, GpuSnapshot
from controller.engines.base import EngineAdapter, EngineEndpoint, Timeouts
from controller.engines.registry import make_adapter
from controller.leases import GpuLease
from controller.settings import StepTimeouts
from controller.switch import Fenced, Limits, Ports, Switcher, SwitchResult
from driver.devices import GpuDevice, discover
from driver.errors import ConfigError
from driver.inspection import InspectionService
from driver.logs import configure
from driver.nvml import open_backend
from driver.nvml.api import NvmlBackend
from driver.opaque import API_VERSION, KIND, parse_engine_config
from driver.quantity import parse_quantity
from driver.rpc.sockets import UnixServer
from e2e.ports import MemoryLeasePort, ReaderDevice
from e2e.stats import summary_s

log = logging.getLogger("e2e.bench_gpu")

MIB = 2**20
GIB = 2**30
ASSUMED_H2D_BYTES_PER_S = 54e9
"""Pinned host-to-device copy rate measured on the H200 (DESIGN.md), used when this run
cannot measure its own."""
NODE = "bench-node"
NAMESPACE = "bench"
REPO_ROOT = Path(__file__).resolve().parent.parent


def _note(fake: bool) -> str:
    nvml = "FAKE NVML backend (fixture)" if fake else "real NVML backend (pynvml)"
    return (f"switch protocol run WITHOUT a Kubernetes cluster: {nvml} behind the driver's "
            "inspection service on a unix socket, real Switcher and engine adapters, "
            "claimants built by hand, in-memory lease port")


class BenchError(RuntimeError):
    """The benchmark could not run to the end; the message says why."""


# -- small helpers -----------------------------------------------------------------------


def _mib(n: int) -> float:
    return round(n / MIB, 1)


def _stats(values: Sequence[float]) -> dict[str, Any]:
    """Count, p50, p90, min and max of ``values`` in seconds; nulls when empty."""
    return summary_s(values)


def _remaining(deadline: float, what: str) -> float:
    left = deadline - time.monotonic()
    if left <= 0:
        raise BenchError(f"the run's deadline passed before {what}")
    return left


def _tail(path: Path, lines: int = 15) -> str:
    try:
        text = path.read_text(encoding="utf-8", errors="replace")
    except OSError:
        return "(no log)"
    return "\n".join(text.splitlines()[-lines:])


def _say(text: str) -> None:
    print(text, flush=True)


# -- host-to-device bandwidth -------------------------------------------------------------


def _measure_h2d_child(nbytes: int, repeats: int) -> int:
    """Child-process mode: time pinned host -> device copies with torch; print JSON."""
    try:
        torch: Any = importlib.import_module("torch")
    except ModuleNotFoundError:
        print(json.dumps({"error": "torch is not installed"}))
        return 0
    if not torch.cuda.is_available():
        print(json.dumps({"error": "torch sees no CUDA device"}))
        return 0
    host = torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)
    device = torch.empty(nbytes, dtype=torch.uint8, device="cuda")
    device.copy_(host, non_blocking=True)  # warm-up: first touch, lazy mappings
    torch.cuda.synchronize()
    samples = []
    for _ in range(repeats):
        began = time.perf_counter()
        device.copy_(host, non_blocking=True)
        torch.cuda.synchronize()
        samples.append(nbytes / (time.perf_counter() - began))
    print(json.dumps({"bytes": nbytes, "samples": samples, "best": max(samples),
                      "median": statistics.median(samples),
                      "device": str(torch.cuda.get_device_name(0))}))
    return 0


def _h2d_bandwidth(args: argparse.Namespace, env: dict[str, str]) -> dict[str, Any]:
    """The bandwidth the wake floor uses, and where it came from."""
    if args.h2d_bandwidth is not None:
        return {"bytes_per_s": float(args.h2d_bandwidth), "measured": False,
                "source": "given with --h2d-bandwidth"}
    assumed = {"bytes_per_s": ASSUMED_H2D_BYTES_PER_S, "measured": False}
    if args.skip_h2d:
        return assumed | {"source": "assumed 54e9 B/s (--skip-h2d)"}
    if importlib.util.find_spec("torch") is None:
        return assumed | {"source": "assumed 54e9 B/s: torch is not installed"}
    command = [sys.executable, "-m", "e2e.bench_gpu", "--measure-h2d-only",
               "--h2d-bytes", str(args.h2d_bytes), "--h2d-repeats", str(args.h2d_repeats)]
    try:
        done = subprocess.run(command, cwd=REPO_ROOT, env=env, capture_output=True, text=True,
                              timeout=args.h2d_timeout_s, check=False)
    except subprocess.TimeoutExpired:
        return assumed | {"source": f"assumed 54e9 B/s: the measurement took over "
                                    f"{args.h2d_timeout_s} s"}
    lines = done.stdout.strip().splitlines()
    try:
        answer: dict[str, Any] = json.loads(lines[-1]) if lines else {}
    except json.JSONDecodeError:
        answer = {}
    if done.returncode != 0 or "best" not in answer:
        why = answer.get("error") or (done.stderr.strip().splitlines() or ["no answer"])[-1]
        return assumed | {"source": f"assumed 54e9 B/s: {why}"}
    return {"bytes_per_s": float(answer["best"]), "measured": True,
            "median_bytes_per_s": float(answer["median"]), "copy_bytes": int(answer["bytes"]),
            "repeats": len(answer["samples"]),
            "source": "measured: pinned host tensor -> device, torch, best of the repeats"}


# -- engine simulators --------------------------------------------------------------------


@dataclass
class Sim:
    """One engine simulator process and the claim it stands for."""

    key: str
    model: str
    awake: int
    resident: int
    weights: int
    claim_uid: str
    port_file: Path
    log_file: Path
    proc: subprocess.Popen[bytes] | None = None
    port: int = 0

    @property
    def label(self) -> str:
        return self.key.upper()


def _spawn(sim: Sim, args: argparse.Namespace, env: dict[str, str], gpu: GpuDevice,
           fake_dir: Path | None) -> None:
    command = [sys.executable, "-m", "e2e.engine_simulator", "--model", sim.model,
               "--host", "127.0.0.1", "--port", "0", "--port-file", str(sim.port_file),
               "--awake-memory-bytes", str(sim.awake),
               "--resident-memory-bytes", str(sim.resident),
               "--weights-bytes", str(sim.weights), "--memory-backend", args.memory_backend,
               "--tokens-per-second", str(args.tokens_per_second),
               "--gpu-uuid", gpu.uuid, "--shutdown-grace-seconds", "0",
               "--dev-mode", "--log-level", "warning"]
    if fake_dir is not None:
        command += ["--fake-nvml-dir", str(fake_dir)]
    child_env = dict(env, ROTA_CLAIM_UID=sim.claim_uid, ROTA_POD_UID=sim.claim_uid)
    setpriv = shutil.which("setpriv")
    if setpriv:  # the simulator gets SIGKILL if this process dies: no GPU memory left held
        command = [setpriv, "--pdeathsig", "KILL", "--", *command]
    with sim.log_file.open("wb") as out:
        sim.proc = subprocess.Popen(
            command, cwd=REPO_ROOT, env=child_env, stdin=subprocess.DEVNULL, stdout=out,
            stderr=subprocess.STDOUT)


def _stop(sims: Sequence[Sim], grace_s: float) -> None:
    """SIGTERM every simulator still running, wait (bounded), then SIGKILL."""
    running = [s.proc for s in sims if s.proc is not None and s.proc.poll() is None]
    for proc in running:
        with contextlib.suppress(ProcessLookupError):
            proc.send_signal(signal.SIGTERM)
    deadline = time.monotonic() + grace_s
    for proc in running:
        try:
            proc.wait(timeout=max(0.1, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            with contextlib.suppress(ProcessLookupError):
                proc.kill()
            with contextlib.suppress(subprocess.TimeoutExpired):
                proc.wait(timeout=10)


async def _wait_listening(sim: Sim, session: aiohttp.ClientSession, deadline: float) -> None:
    """Until the simulator wrote its port file (memory is allocated by then) and answers."""
    assert sim.proc is not None
    while True:
        code = sim.proc.poll()
        if code is not None:
            raise BenchError(f"simulator {sim.label} exited with status {code} while "
                             f"starting:\n{_tail(sim.log_file)}")
        text = ""
        with contextlib.suppress(OSError):
            text = sim.port_file.read_text(encoding="ascii").strip()
        if text.isdigit():
            sim.port = int(text)
            break
        if time.monotonic() >= deadline:
            raise BenchError(f"simulator {sim.label} did not listen within the start "
                             f"deadline:\n{_tail(sim.log_file)}")
        await asyncio.sleep(0.1)
    timeout = aiohttp.ClientTimeout(total=max(1.0, deadline - time.monotonic()))
    async with session.get(f"http://127.0.0.1:{sim.port}/health", timeout=timeout) as resp:
        if resp.status != 200:
            raise BenchError(f"simulator {sim.label} /health answered {resp.status}")


async def _sim_state(sim: Sim, session: aiohttp.ClientSession) -> dict[str, Any]:
    timeout = aiohttp.ClientTimeout(total=10)
    async with session.get(f"http://127.0.0.1:{sim.port}/sim/state", timeout=timeout) as resp:
        resp.raise_for_status()
        state: dict[str, Any] = await resp.json()
        return state


# -- controller pieces ------------------------------------------------------------------


def _claimant(sim: Sim, gpu: GpuDevice, allowance: int) -> Claimant:
    """What ``claimants_from`` would build from the claim, its opaque config and its pod."""
    config = parse_engine_config({
        "apiVersion": API_VERSION, "kind": KIND, "model": sim.model,
        "awakeMemory": sim.awake + allowance, "sleepLevel": 1, "enginePort": sim.port,
        "adapter": "vllm"})
    return Claimant(
        claim_uid=sim.claim_uid, namespace=NAMESPACE, claim_name=f"claim-{sim.key}",
        node=NODE, device=gpu.name, share_id=None, config=config, model=sim.model,
        port=sim.port, sleep_level=1, resident_bytes=sim.resident + allowance,
        pod_name=f"engine-{sim.key}", pod_uid=sim.claim_uid, pod_ip="127.0.0.1", pod_ready=True,
        pod_deleting=False)


def _engines(session: aiohttp.ClientSession, timeouts: Timeouts
             ) -> Callable[[Claimant], EngineAdapter]:
    def engine(claimant: Claimant) -> EngineAdapter:
        if claimant.endpoint is None:
            raise BenchError(f"{claimant.ref} has no endpoint")
        endpoint = EngineEndpoint(base_url=claimant.endpoint, model=claimant.model,
                                  claim=claimant.ref,
                                  pod=f"{claimant.namespace}/{claimant.pod_name}")
        return make_adapter(claimant.config, endpoint, session, timeouts)

    return engine


def _view(snapshot: GpuSnapshot, sims: Sequence[Sim]) -> dict[str, Any]:
    """The NVML view of one moment, in MiB: each engine, the rest, the card."""
    ours = {s.claim_uid for s in sims}
    view: dict[str, Any] = {f"{s.key}_mib": _mib(snapshot.used_by(s.claim_uid)) for s in sims}
    view |= {
        "other_processes_mib": _mib(sum(p.used_bytes for p in snapshot.processes
                                        if p.claim_uid not in ours)),
        "used_mib": _mib(snapshot.used_bytes), "free_mib": _mib(snapshot.free_bytes),
        "total_mib": _mib(snapshot.total_bytes),
        "processes": [{"pid": p.pid, "mib": _mib(p.used_bytes),
                       "engine": next((s.key for s in sims if s.claim_uid == p.claim_uid),
                                      None)} for p in snapshot.processes],
    }
    return view


def _view_line(view: dict[str, Any]) -> str:
    return (f"NVML: A {view['a_mib']:.0f} MiB, B {view['b_mib']:.0f} MiB, others "
            f"{view['other_processes_mib']:.0f} MiB; card used {view['used_mib']:.0f} MiB, "
            f"free {view['free_mib']:.0f} MiB")


async def _wait_attributed(device: ReaderDevice, gpu: GpuDevice, sims: Sequence[Sim],
                           deadline: float) -> GpuSnapshot:
    """Until NVML shows every simulator, attributed to its claim, holding its awake bytes."""
    while True:
        snapshot = await device.snapshot(gpu.name)
        if all(snapshot.used_by(s.claim_uid) >= s.awake for s in sims):
            return snapshot
        if time.monotonic() >= deadline:
            seen = ", ".join(f"pid {p.pid} {_mib(p.used_bytes)} MiB claim "
                             f"{p.claim_uid or '(none)'}" for p in snapshot.processes)
            ours = ", ".join(f"{s.label} pid {s.proc.pid if s.proc else '?'} claim "
                             f"{s.claim_uid}" for s in sims)
            raise BenchError(
                "NVML does not show both simulators with their awake memory, attributed to "
                f"their claims. NVML processes: {seen or 'none'}; simulators: {ours}. If the "
                "pids differ, NVML reports pids of another pid namespace and the inspection "
                "service cannot read their ROTA_CLAIM_UID from /proc.")
        await asyncio.sleep(0.2)


async def _throughput(sim: Sim, session: aiohttp.ClientSession, *, concurrency: int,
                      rounds: int, max_tokens: int, deadline: float) -> dict[str, Any]:
    """Output tokens/s of ``rounds`` rounds of ``concurrency`` forced-length completions."""
    url = f"http://127.0.0.1:{sim.port}/v1/completions"
    body = {"model": sim.model, "prompt": "Tell a long story about a GPU that takes turns.",
            "max_tokens": max_tokens, "ignore_eos": True, "stream": False}
    timeout = aiohttp.ClientTimeout(total=_remaining(deadline, "the throughput run"))

    async def one() -> int:
        async with session.post(url, json=body, timeout=timeout) as resp:
            if resp.status != 200:
                raise BenchError(f"throughput request to {sim.label} answered {resp.status}: "
                                 f"{(await resp.text())[:200]}")
            answer = await resp.json()
            return int(answer["usage"]["completion_tokens"])

    tokens = 0
    began = time.perf_counter()
    for _ in range(rounds):
        tokens += sum(await asyncio.gather(*(one() for _ in range(concurrency))))
    elapsed = time.perf_counter() - began
    return {"tokens": tokens, "seconds": round(elapsed, 4),
            "tokens_per_s": round(tokens / elapsed, 2) if elapsed > 0 else None}


@dataclass
class Run:
    """Everything the run records; becomes the JSON line."""

    sims: list[Sim]
    gpu: GpuDevice | None = None
    h2d: dict[str, Any] = field(default_factory=dict)
    phases: dict[str, Any] = field(default_factory=dict)
    first_sleep_s: dict[str, float] = field(default_factory=dict)
    handoffs: list[dict[str, Any]] = field(default_factory=list)
    failures: list[dict[str, Any]] = field(default_factory=list)
    throughput: dict[str, Any] = field(default_factory=dict)
    lease_writes: int = 0
    stage: str = "starting"
    """What the run is doing now, for the error message of a deadline."""


async def _protocol(run: Run, args: argparse.Namespace, backend: NvmlBackend,
                    socket: Path, deadline: float) -> None:
    gpu = run.gpu
    assert gpu is not None
    a, b = run.sims
    # The simulators run in no pod: each names a simulated one (its claim uid).
    service = InspectionService(backend=backend, gpus=[gpu], proc_root=Path("/proc"),
                                pods_from_environment=True)
    server = UnixServer(socket, [service.handler()])
    await server.start()
    reader = DeviceReader(socket, timeout_s=10.0)
    device = ReaderDevice(reader)
    try:
        async with aiohttp.ClientSession() as session:
            run.stage = "waiting for the simulators to allocate memory and listen"
            start_deadline = min(deadline, time.monotonic() + args.start_timeout_s)
            await asyncio.gather(*(_wait_listening(s, session, start_deadline)
                                   for s in run.sims))
            _say(f"simulators listening: A on port {a.port}, B on port {b.port}")
            snapshot = await _wait_attributed(device, gpu, run.sims,
                                              min(deadline, time.monotonic() + 30.0))
            run.phases["both_initialised"] = _view(snapshot, run.sims)
            _say(f"phase both initialised (nothing asleep): "
                 f"{_view_line(run.phases['both_initialised'])}")

            timeouts = Timeouts(sleep_s=args.sleep_timeout_s,
                                wake_level1_s=args.wake_timeout_s,
                                probe_total_s=args.probe_timeout_s,
                                probe_first_token_s=args.probe_timeout_s)
            engine = _engines(session, timeouts)
            claimants = [_claimant(s, gpu, args.context_allowance) for s in run.sims]
            ca, cb = claimants
            port = MemoryLeasePort(GpuLease(name=naming.gpu_lease_name(NODE, gpu.name),
                                            node=NODE, device=gpu.name, gpu_uuid=gpu.uuid))
            switcher = Switcher(
                ports=Ports(lease=port, device=device, engine=engine, guard=lambda: None),
                limits=Limits(tolerance_bytes=args.resident_tolerance,
                              unknown_limit_bytes=args.unknown_limit,
                              timeouts=StepTimeouts(sleep_s=args.sleep_timeout_s + 15,
                                                    wake_s=args.wake_timeout_s + 15,
                                                    probe_s=args.probe_timeout_s + 5)),
                identity="bench-gpu")

            # Start-up reconciliation: A is the Lease holder, B must sleep first.
            run.stage = "reconciliation (putting B to sleep)"
            seen = {c.claim_uid: reconcile.Seen.ASLEEP if await engine(c).is_sleeping()
                    else reconcile.Seen.AWAKE for c in claimants}
            plan = reconcile.plan(claimants, seen, ca.ref)
            if plan.keep is not ca or plan.put_to_sleep != (cb,):
                raise BenchError(f"unexpected reconciliation plan: keep "
                                 f"{plan.keep.ref if plan.keep else None}, sleep "
                                 f"{[c.ref for c in plan.put_to_sleep]}")
            await port.write(port.current.with_(
                holder=ca.ref, holder_model=ca.model, holder_claim_uid=ca.claim_uid,
                state=naming.STATE_AWAKE,
                controller="bench-gpu"))
            outcome = await asyncio.wait_for(engine(cb).sleep(1), args.sleep_timeout_s + 15)
            run.first_sleep_s["b"] = round(outcome.sleep_s, 4)
            _say(f"B put to sleep by reconciliation (its first level-1 sleep): "
                 f"{outcome.sleep_s:.3f} s")
            snapshot = await device.snapshot(gpu.name)
            run.phases["a_awake_b_asleep"] = _view(snapshot, run.sims)
            _say(f"phase A awake / B asleep: {_view_line(run.phases['a_awake_b_asleep'])}")

            throughput_args = {"concurrency": args.concurrency, "rounds": args.rounds,
                               "max_tokens": args.max_tokens}
            run.stage = "the throughput run before a recovery"
            before = await _throughput(a, session, deadline=deadline, **throughput_args)
            run.throughput = {"model": a.model, **throughput_args,
                              "tokens_per_second_knob": args.tokens_per_second,
                              "before": before, "after": None}
            _say(f"throughput of A before a recovery: {before['tokens_per_s']} output tok/s "
                 f"({args.concurrency} concurrent x {args.rounds} rounds)")

            slept = {"b"}
            for index in range(1, args.handoffs + 1):
                target, holder = (cb, ca) if index % 2 else (ca, cb)
                tsim, hsim = (b, a) if index % 2 else (a, b)
                run.stage = f"handoff {index} ({hsim.label}->{tsim.label})"
                result: SwitchResult = await asyncio.wait_for(
                    switcher.switch(port.current, holder=holder, target=target,
                                    claimants=claimants),
                    _remaining(deadline, f"handoff {index}"))
                await _record(run, index, result, hsim, tsim, slept, device, session)
                if not result.ok:
                    break
                if tsim is a and run.throughput["after"] is None:
                    run.stage = "the throughput run after a recovery"
                    after = await _throughput(a, session, deadline=deadline,
                                              **throughput_args)
                    run.throughput["after"] = after | {"after_handoff": index}
                    _say(f"throughput of A after its recovery in handoff {index}: "
                         f"{after['tokens_per_s']} output tok/s")
            run.lease_writes = port.writes
    finally:
        await reader.close()
        await server.stop(1.0)


async def _record(run: Run, index: int, result: SwitchResult, hsim: Sim, tsim: Sim,
                  slept: set[str], device: ReaderDevice, session: aiohttp.ClientSession
                  ) -> None:
    assert run.gpu is not None
    t = result.timings
    sleep_s = t.get("first_sleep", t.get("later_sleep"))
    first = hsim.key not in slept
    slept.add(hsim.key)
    if first and sleep_s is not None:
        run.first_sleep_s[hsim.key] = round(sleep_s, 4)
    floor = tsim.weights / run.h2d["bytes_per_s"]
    wake = t.get("wake_call")
    copy_s = None
    with contextlib.suppress(aiohttp.ClientError, TimeoutError, KeyError, IndexError):
        copy_s = (await _sim_state(tsim, session))["wakes"][-1]["copy_seconds"]
    view = _view(await device.snapshot(run.gpu.name), run.sims)

    def rounded(value: float | None) -> float | None:
        return None if value is None else round(value, 5)

    entry: dict[str, Any] = {
        "index": index, "from": hsim.key, "to": tsim.key, "ok": result.ok,
        "handoff_to_first_token_s": rounded(t.get("handoff_to_first_token")),
        "wake_call_s": rounded(wake),
        "recovery_to_first_token_s": rounded(t.get("recovery_to_first_token")),
        "probe_ttft_s": rounded(t.get("probe_ttft")), "sleep_s": rounded(sleep_s),
        "first_sleep": first, "drain_s": rounded(t.get("drain")),
        "inspect_s": rounded(t.get("inspect")), "total_s": rounded(t.get("total")),
        "simulator_copy_s": rounded(copy_s), "wake_floor_s": round(floor, 4),
        "wake_over_floor": round(wake / floor, 3) if wake is not None and floor > 0 else None,
        "nvml": {k: v for k, v in view.items() if k != "processes"},
    }
    run.handoffs.append(entry)
    phase = f"{tsim.key}_awake_{hsim.key}_asleep"
    if result.ok and phase not in run.phases:
        run.phases[phase] = view
    if not result.ok:
        run.failures.append({"index": index, "reason": result.reason,
                             "message": result.message, "holder_after": result.holder})
        _say(f"handoff {index:2d} {hsim.label}->{tsim.label} FAILED: {result.reason}: "
             f"{result.message}")
        return

    def sec(value: float | None) -> str:
        return "-" if value is None else f"{value:.3f} s"

    _say(f"handoff {index:2d} {hsim.label}->{tsim.label}: handoff to first token "
         f"{sec(entry['handoff_to_first_token_s'])}, wake {sec(wake)} (floor {floor:.3f} s, "
         f"x{entry['wake_over_floor']}), recovery {sec(entry['recovery_to_first_token_s'])}, "
         f"sleep {sec(sleep_s)}{' (first)' if first else ''}; {_view_line(view)}")


# -- summary ------------------------------------------------------------------------------


def _values(key: str, rows: Sequence[dict[str, Any]]) -> list[float]:
    return [float(e[key]) for e in rows if e.get(key) is not None]


def _timing_block(entries: Sequence[dict[str, Any]], *, with_sleep: bool) -> dict[str, Any]:
    """Stats of successful handoffs; handoff-to-first-token and sleep leave out the handoffs
    that held a first sleep (reported on their own, as the reference experiment does)."""
    ok = [e for e in entries if e["ok"]]
    steady = [e for e in ok if not e["first_sleep"]]
    block = {
        "handoff_to_first_token": _stats(_values("handoff_to_first_token_s", steady)),
        "wake_call": _stats(_values("wake_call_s", ok)),
        "recovery_to_first_token": _stats(_values("recovery_to_first_token_s", ok)),
        "probe_ttft": _stats(_values("probe_ttft_s", ok)),
        "wake_over_floor": _stats(_values("wake_over_floor", ok)),
    }
    if with_sleep:
        block["sleep"] = _stats(_values("sleep_s", steady))
    return block


def _summary(run: Run, args: argparse.Namespace, started: float, error: str | None
             ) -> dict[str, Any]:
    ok_handoffs = [h for h in run.handoffs if h["ok"]]
    first_handoffs = [h for h in ok_handoffs if h["first_sleep"]]
    bandwidth = run.h2d.get("bytes_per_s") or ASSUMED_H2D_BYTES_PER_S
    floors: dict[str, Any] = {}
    for sim in run.sims:
        wakes = [h["wake_call_s"] for h in ok_handoffs
                 if h["to"] == sim.key and h["wake_call_s"] is not None]
        copies = [h["simulator_copy_s"] for h in ok_handoffs
                  if h["to"] == sim.key and h["simulator_copy_s"] is not None]
        floor = sim.weights / bandwidth
        p50 = _stats(wakes)["p50"]
        floors[sim.key] = {
            "weights_bytes": sim.weights, "floor_s": round(floor, 4),
            "wake_call_p50_s": p50, "simulator_copy_p50_s": _stats(copies)["p50"],
            "ratio_p50": round(p50 / floor, 3) if p50 is not None and floor > 0 else None,
            "ratio_max": (round(max(wakes) / floor, 3) if wakes and floor > 0 else None)}
    device = run.gpu.product_name if run.gpu else None
    return {
        "benchmark": "gpu_switch",
        "cluster": False,
        "note": _note(bool(args.fake_nvml)),
        "ok": error is None and not run.failures and len(ok_handoffs) == args.handoffs,
        "error": error,
        "device": device,
        "gpu_uuid": run.gpu.uuid if run.gpu else None,
        "nvml": "fake" if args.fake_nvml else "real",
        "memory_backend": args.memory_backend,
        "engines": {s.key: {"model": s.model, "awake_bytes": s.awake,
                            "resident_bytes": s.resident, "weights_bytes": s.weights,
                            "kv_cache_bytes": s.awake - s.resident - s.weights}
                    for s in run.sims},
        "handoffs_requested": args.handoffs,
        "handoffs_ok": len(ok_handoffs),
        "failures": run.failures,
        "first_sleep_s": run.first_sleep_s,
        "first_sleep_handoff_to_first_token_s": [h["handoff_to_first_token_s"]
                                                 for h in first_handoffs],
        "timings_s": _timing_block(run.handoffs, with_sleep=True),
        "timings_by_target_s": {s.key: _timing_block([h for h in run.handoffs
                                                      if h["to"] == s.key], with_sleep=False)
                                for s in run.sims},
        "later_sleep_by_model_s": {
            s.key: _stats(_values("sleep_s", [h for h in run.handoffs if h["ok"]
                                              and h["from"] == s.key and not h["first_sleep"]]))
            for s in run.sims},
        "memory_mib": run.phases,
        "throughput": run.throughput,
        "h2d": run.h2d,
        "wake_floor": floors,
        "limits": {"resident_tolerance_bytes": args.resident_tolerance,
                   "unknown_limit_bytes": args.unknown_limit,
                   "context_allowance_bytes": args.context_allowance},
        "lease_writes": run.lease_writes,
        "handoffs": run.handoffs,
        "wall_s": round(time.monotonic() - started, 2),
    }


# -- command line -------------------------------------------------------------------------


def _bytes(text: str) -> int:
    try:
        return parse_quantity(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


def _engine_of(argv: Sequence[str]) -> str:
    """The value of ``--engine`` (simulator when absent)."""
    for i, arg in enumerate(argv):
        if arg == "--engine" and i + 1 < len(argv):
            return argv[i + 1]
        if arg.startswith("--engine="):
            return arg.split("=", 1)[1]
    return "simulator"


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python -m e2e.bench_gpu", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--engine", choices=("simulator", "vllm"), default="simulator",
                        help="simulator (default): engine simulators holding device memory; "
                             "vllm: real vLLM servers and the failure scenarios (python -m "
                             "e2e.bench_gpu --engine vllm --help)")
    parser.add_argument("--fake-nvml", metavar="FIXTURE", default=None,
                        help="use the fake NVML with this fixture (a path, or a shipped name "
                             "such as h200) instead of pynvml; implies --memory-backend fake")
    parser.add_argument("--memory-backend", choices=("cuda", "fake"), default=None,
                        help="the simulators' memory (default: cuda, fake with --fake-nvml)")
    parser.add_argument("--gpu-index", type=int, default=0, help="NVML index of the GPU")
    parser.add_argument("--handoffs", type=int, default=19)
    parser.add_argument("--a-awake", type=_bytes, default=60 * GIB, metavar="BYTES")
    parser.add_argument("--a-resident", type=_bytes, default=1 * GIB, metavar="BYTES")
    parser.add_argument("--a-weights", type=_bytes, default=48 * GIB, metavar="BYTES",
                        help="part of A's awake-minus-resident that is weights (rest: KV)")
    parser.add_argument("--b-awake", type=_bytes, default=10 * GIB, metavar="BYTES")
    parser.add_argument("--b-resident", type=_bytes, default=1 * GIB, metavar="BYTES")
    parser.add_argument("--b-weights", type=_bytes, default=8 * GIB, metavar="BYTES")
    parser.add_argument("--context-allowance", type=_bytes, default=None, metavar="BYTES",
                        help="added to each claimant's resident and awake budgets for the "
                             "CUDA context the simulator's knobs do not count (default 1Gi "
                             "with cuda memory, 0 with fake)")
    parser.add_argument("--resident-tolerance", type=_bytes, default=512 * MIB,
                        metavar="BYTES", help="the controller's resident tolerance")
    parser.add_argument("--unknown-limit", type=_bytes, default=512 * MIB, metavar="BYTES",
                        help="memory unknown processes may hold before wakes are refused")
    parser.add_argument("--tokens-per-second", type=float, default=500.0,
                        help="the simulators' decode speed per request")
    parser.add_argument("--concurrency", type=int, default=8)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--max-tokens", type=int, default=128)
    parser.add_argument("--h2d-bandwidth", type=float, default=None, metavar="BYTES_PER_S",
                        help="use this host-to-device bandwidth instead of measuring it")
    parser.add_argument("--skip-h2d", action="store_true",
                        help="do not measure the bandwidth; assume 54e9 B/s")
    parser.add_argument("--h2d-bytes", type=_bytes, default=4 * GIB, metavar="BYTES")
    parser.add_argument("--h2d-repeats", type=int, default=5)
    parser.add_argument("--h2d-timeout-s", type=float, default=120.0)
    parser.add_argument("--start-timeout-s", type=float, default=180.0,
                        help="bound on both simulators allocating and listening")
    parser.add_argument("--sleep-timeout-s", type=float, default=180.0,
                        help="bound on one sleep call (the first allocates pinned memory)")
    parser.add_argument("--wake-timeout-s", type=float, default=120.0)
    parser.add_argument("--probe-timeout-s", type=float, default=30.0)
    parser.add_argument("--deadline-s", type=float, default=480.0,
                        help="bound on the whole run, before the simulators are stopped")
    parser.add_argument("--stop-grace-s", type=float, default=20.0,
                        help="how long stopped simulators get before SIGKILL")
    parser.add_argument("--log-level", default="warning",
                        help="log level of the controller and driver code (stderr, JSON)")
    parser.add_argument("--measure-h2d-only", action="store_true", help=argparse.SUPPRESS)
    return parser


def _check(args: argparse.Namespace, parser: argparse.ArgumentParser) -> None:
    if args.memory_backend is None:
        args.memory_backend = "fake" if args.fake_nvml else "cuda"
    if args.context_allowance is None:
        args.context_allowance = GIB if args.memory_backend == "cuda" else 0
    if args.handoffs < 1 or args.concurrency < 1 or args.rounds < 1 or args.max_tokens < 1:
        parser.error("--handoffs, --concurrency, --rounds and --max-tokens must be >= 1")
    for key in ("a", "b"):
        awake, resident, weights = (getattr(args, f"{key}_{part}")
                                    for part in ("awake", "resident", "weights"))
        if weights <= 0 or resident + weights > awake:
            parser.error(f"engine {key.upper()}: need 0 < weights and resident + weights "
                         f"<= awake")


def main(argv: Sequence[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if _engine_of(argv) == "vllm":
        from e2e.gpu.bench import main as vllm_main

        return vllm_main(argv)
    parser = _parser()
    args = parser.parse_args(argv)
    if args.measure_h2d_only:
        return _measure_h2d_child(args.h2d_bytes, args.h2d_repeats)
    _check(args, parser)
    configure(args.log_level)
    started = time.monotonic()
    deadline = started + args.deadline_s
    workdir = Path(tempfile.mkdtemp(prefix="rota-bench-gpu-"))
    fake_dir = workdir / "nvml" if args.fake_nvml else None
    suffix = uuid.uuid4().hex[:8]
    run = Run(sims=[
        Sim(key=key, model=f"bench/model-{key}-{suffix}", awake=getattr(args, f"{key}_awake"),
            resident=getattr(args, f"{key}_resident"), weights=getattr(args, f"{key}_weights"),
            claim_uid=str(uuid.uuid4()), port_file=workdir / f"{key}.port",
            log_file=workdir / f"{key}.log") for key in ("a", "b")])
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(REPO_ROOT), env.get("PYTHONPATH"))
                                        if p)
    env.pop("ROTA_CLAIM_UID", None)
    env.pop("ROTA_POD_UID", None)
    _say(f"rota GPU switch benchmark -- {_note(bool(args.fake_nvml))}")
    error: str | None = None
    backend: NvmlBackend | None = None
    previous = signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    try:
        backend = open_backend(args.fake_nvml, fake_dir)
        backend.init()
        gpus = discover(backend)
        gpu = next((g for g in gpus if g.index == args.gpu_index), None)
        if gpu is None:
            raise BenchError(f"no usable GPU with NVML index {args.gpu_index}: "
                             f"{[g.index for g in gpus]}")
        run.gpu = gpu
        _say(f"GPU {gpu.index}: {gpu.product_name} {gpu.uuid}, "
             f"{gpu.memory_bytes // MIB} MiB (NVML {'fake' if args.fake_nvml else 'real'}, "
             f"memory backend {args.memory_backend})")
        if args.memory_backend == "cuda":
            env["CUDA_DEVICE_ORDER"] = "PCI_BUS_ID"
            env["CUDA_VISIBLE_DEVICES"] = gpu.uuid
        run.h2d = _h2d_bandwidth(args, env)
        _say(f"host-to-device bandwidth {run.h2d['bytes_per_s'] / 1e9:.1f} GB/s "
             f"({run.h2d['source']})")
        for sim in run.sims:
            _spawn(sim, args, env, gpu, fake_dir)
            _say(f"started simulator {sim.label}: {_mib(sim.awake):.0f} MiB awake "
                 f"({_mib(sim.weights):.0f} MiB weights), {_mib(sim.resident):.0f} MiB "
                 f"resident, pid {sim.proc.pid if sim.proc else '?'}")

        async def bounded() -> None:
            try:
                async with asyncio.timeout(_remaining(deadline, "the switch protocol")):
                    await _protocol(run, args, backend, workdir / "inspect.sock", deadline)
            except TimeoutError as exc:
                raise BenchError(f"timed out during {run.stage} (run deadline "
                                 f"--deadline-s {args.deadline_s:g}; a step bound may have "
                                 f"run out first)") from exc

        asyncio.run(bounded())
    except (BenchError, ConfigError, TimeoutError, OSError, aiohttp.ClientError,
            Fenced) as exc:
        error = f"{type(exc).__name__}: {exc}" if str(exc) else type(exc).__name__
    except (KeyboardInterrupt, SystemExit):
        error = "interrupted (signal); simulators stopped"
    except Exception as exc:
        error = f"{type(exc).__name__}: {exc}"
        log.exception("benchmark failed")
    finally:
        _stop(run.sims, args.stop_grace_s)
        if backend is not None:
            with contextlib.suppress(Exception):
                backend.shutdown()
        signal.signal(signal.SIGTERM, previous)
        if error is not None:
            _say(f"ERROR: {error}")
            for sim in run.sims:
                if sim.proc is not None:
                    print(f"--- simulator {sim.label} log (tail) ---\n{_tail(sim.log_file)}",
                          file=sys.stderr, flush=True)
        shutil.rmtree(workdir, ignore_errors=True)
    summary = _summary(run, args, started, error)
    print(json.dumps(summary), flush=True)
    return 0 if summary["ok"] else 1


if __name__ == "__main__":
    raise SystemExit(main())
