"""The policy comparison on real engines, through the lease controller's own code
(``python -m e2e.gpu.policy_run``): a short window of a trace, 3 models on one GPU, on-demand
first-come switching against rota's default policy.

``python -m e2e.bench.policy`` ranks the policies in a simulation. This runs the same
comparison where the engines are real vLLM 0.26 servers (``--launcher vllm``) on the GPU,
or the engine simulator standing in for them (``--launcher simulator --fake-nvml h200``),
and where the decisions, queueing and switches are the lease controller's: for each
policy a fresh :class:`~controller.lease.gpu.GpuWorker` with ``--policy-mode first-come``
or ``rota`` (:mod:`e2e.gpu.policy_replay`) on the engines as the GPU benchmark runs them
(:mod:`e2e.gpu.context`: the driver's inspection service on NVML, the real Switcher and
vLLM adapter, an in-memory Lease). The engines start once (in parallel, or one after the
other), each is probed and put through its first sleep, then the policies run back to back
on the same arrivals, every engine asleep at each start.

The window: ``--trace`` (a CSV of ``timestamp, model, context tokens, generated tokens``,
replayed as written; ``--write-trace`` cuts one), else the Azure LLM inference trace 2023
mapped as ``python -m e2e.bench.policy`` maps it (``--mapping``, ``--speed``,
``--start-s``, ``--window-s``). The window shrinks to what the deadline leaves. For the
same arrivals it also prints what the simulation of ``e2e.bench_policy`` predicts, with
its engines calibrated to these engines' weights, so the two rankings sit side by side.

Results: ``--out``/policy.json (per policy and model: requests, served, goodput at
``--ttft-slo-s``, TTFT p50/p90/p99, wakes, wasted wakes, the rules that fired, every
switch), a Markdown table on stdout, the JSON headline as the last line.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import csv
import dataclasses
import json
import math
import os
import sys
import time
import uuid
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import aiohttp

from controller.lease.device import DeviceReader
from controller.lease.policy import PolicyMode
from controller.lease.switch import Ports
from driver.devices import discover
from driver.inspection import InspectionService
from driver.nvml import open_backend
from e2e.bench import policy as bench_policy
from e2e.gpu.context import GIB, MIB, REPO_ROOT, Bench, BenchError, BenchState, byte_count
from e2e.gpu.engines import EngineSpec, Launcher, SimulatorLauncher, VllmLauncher, boot_id
from e2e.gpu.instrument import HttpTrace
from e2e.gpu.policy_replay import (
    Arrival,
    ClientSettings,
    PolicyRun,
    RecordingSwitcher,
    SwitchRecord,
    replay,
    rows,
)
from e2e.gpu.sampler import NvmlSampler
from e2e.gpu.steps import admit, say
from e2e.harness.ports import MemoryLeasePort, ReaderDevice
from rota.api import naming
from rota.api.gpu_lease import GpuLease
from rota.kit.logs import configure
from rota.kit.sockets import UnixServer

MODES = {"first-come": PolicyMode.FIRST_COME, "rota": PolicyMode.ROTA}
SIM_NAMES = {"first-come": "on-demand", "rota": "rota"}
TAIL_S = 15.0
"""Expected seconds after a window's last arrival until its clients are done."""


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m e2e.gpu.policy_run", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    add = p.add_argument
    add("--launcher", choices=("vllm", "simulator"), default="vllm")
    add("--fake-nvml", metavar="FIXTURE", default=None,
        help="the fake NVML with this fixture (with --launcher simulator)")
    add("--gpu-index", type=int, default=0)
    add("--models", type=Path, default=REPO_ROOT / ".vllm" / "models",
        help="folder holding model-small (config + tokenizer)")
    add("--model", default="model-small", help="the folder under --models of every engine")
    add("--engines", type=int, default=3)
    add("--kv", type=byte_count, default=2 * GIB, metavar="BYTES",
        help="each engine's fixed KV cache")
    add("--max-seqs", type=int, default=32)
    add("--max-model-len", type=int, default=4096)
    add("--gpu-memory-utilization", type=float, default=0.2)
    add("--start", choices=("parallel", "sequential"), default="parallel",
        help="start the engines at once (one after the other if that fails) or in turn")
    add("--trace", type=Path, default=None, help="CSV of timestamp (s), model, context "
        "tokens, generated tokens, replayed as written")
    add("--write-trace", type=Path, default=None,
        help="write the window of the Azure trace to this CSV and exit")
    add("--mapping", choices=("services", "modulo", "shift"), default="modulo")
    add("--speed", type=float, default=0.2)
    add("--start-s", type=float, default=0.0)
    add("--window-s", type=float, default=120.0,
        help="seconds of the (compressed) trace each policy replays")
    add("--policies", default="first-come,rota")
    add("--ttft-slo-s", type=float, default=2.0)
    add("--client-timeout-s", type=float, default=30.0)
    add("--max-context", type=int, default=2048)
    add("--max-generated", type=int, default=256)
    add("--sim-decode-step-s", type=float, default=None,
        help="the simulation's decode step (default: e2e.bench_policy's calibration, 10 ms "
             "for a model this small; the real engines' measured rate is in policy.json)")
    add("--simulate-only", action="store_true",
        help="print the simulation of the window and exit (no engines)")
    add("--tokens-per-second", type=float, default=100.0,
        help="the simulator's decode rate per request (with --launcher simulator)")
    add("--out", type=Path, default=Path("."))
    add("--state-dir", type=Path, default=None)
    add("--deadline-s", type=float, default=540.0)
    add("--vllm-python", default=sys.executable)
    add("--vllm-pythonpath", default=os.environ.get("ROTA_VLLM_PYTHONPATH", ""))
    add("--probe-mode", choices=("structure", "answer"), default="structure")
    add("--probe-max-tokens", type=int, default=4)
    add("--resident-budget", type=byte_count, default=GIB, metavar="BYTES")
    add("--resident-tolerance", type=byte_count, default=512 * MIB, metavar="BYTES")
    add("--unknown-limit", type=byte_count, default=512 * MIB, metavar="BYTES")
    add("--start-timeout-s", type=float, default=300.0)
    add("--sleep-timeout-s", type=float, default=120.0)
    add("--wake-timeout-s", type=float, default=60.0)
    add("--probe-timeout-s", type=float, default=30.0)
    add("--log-level", default="warning")
    return p


# -- the window ------------------------------------------------------------------------------

def read_trace(path: Path) -> list[Arrival]:
    """A CSV of ``timestamp, model, context, generated`` (seconds; any header row is
    skipped); models named ``m0``, ``m1``... are those engines, other names are numbered
    in their sorted order."""
    with path.open(newline="") as f:
        raw = [r for r in csv.reader(f) if r and not r[0].strip().lower().startswith(
            ("timestamp", "#"))]
    found = sorted({r[1].strip() for r in raw})
    numbered = all(n[:1] == "m" and n[1:].isdigit() for n in found)  # as --write-trace names
    names = {n: int(n[1:]) if numbered else k for k, n in enumerate(found)}
    t0 = min((float(r[0]) for r in raw), default=0.0)
    return sorted((Arrival(float(r[0]) - t0, names[r[1].strip()], int(r[2]), max(1, int(r[3])))
                   for r in raw), key=lambda a: a.at)


def azure_window(args: argparse.Namespace) -> list[Arrival]:
    requests = bench_policy.load_arrivals(trace=None, mapping=args.mapping,
                                          models=args.engines, speed=args.speed,
                                          start_s=args.start_s, duration_s=args.window_s,
                                          limit=None)
    return [Arrival(r.arrival, r.model, r.context, r.generated) for r in requests]


def write_trace(arrivals: Sequence[Arrival], path: Path) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    with path.open("w", newline="") as f:
        out = csv.writer(f)
        out.writerow(["timestamp", "model", "context_tokens", "generated_tokens"])
        for a in arrivals:
            out.writerow([f"{a.at:.4f}", f"m{a.model}", a.context, a.generated])


def capped(arrivals: Sequence[Arrival], args: argparse.Namespace) -> list[Arrival]:
    return [Arrival(a.at, a.model, min(a.context, args.max_context),
                    min(a.generated, args.max_generated)) for a in arrivals]


# -- the simulation of the same arrivals -----------------------------------------------------

def simulated(arrivals: Sequence[Arrival], weights_bytes: int, args: argparse.Namespace
              ) -> dict[str, Any]:
    """What ``e2e.bench_policy`` predicts for these arrivals and engines of this size."""
    models = bench_policy.engine_models([weights_bytes / 1e9], args.engines, 400.0)
    if args.sim_decode_step_s:
        models = [dataclasses.replace(m, decode_step_s=args.sim_decode_step_s) for m in models]
    sim_args = argparse.Namespace(step_s=0.02, max_seqs=args.max_seqs,
                                  client_timeout_s=args.client_timeout_s,
                                  static_period_s=10.0, ttft_slo_s=args.ttft_slo_s)
    requests = [bench_policy.Request(a.at, a.model, a.context, a.generated) for a in arrivals]
    results = [bench_policy.simulate(SIM_NAMES[p], requests, models, sim_args)
               for p in args.policies.split(",")]
    return {"table": bench_policy.table(results, args.ttft_slo_s),
            "goodput": {r.policy: r.total_goodput for r in results},
            "rows": {r.policy: r.rows for r in results}}


# -- reporting -------------------------------------------------------------------------------

def _f(v: object) -> str:
    if isinstance(v, float):
        return "∞" if math.isinf(v) else "-" if math.isnan(v) else f"{v:.2f}"
    return "-" if v is None else str(v)


def table(runs: Sequence[PolicyRun], slo: float) -> str:
    lines = [f"| policy (lease controller) | model | requests | served | goodput (TTFT ≤ "
             f"{slo:g} s) | TTFT p50 s | p90 s | p99 s | wakes | wasted wakes "
             "| handoff to first token p50 s | holder's drain p50 s | sent back | decode "
             "tok/s per stream p50 |", "|" + "---|" * 14]
    for run in runs:
        per_model = rows(run)
        for row in per_model:
            cells = [_f(row[k]) for k in ("model", "requests", "served", "goodput", "p50",
                                          "p90", "p99", "wakes", "wasted",
                                          "handoff_to_first_token_s", "drain_s",
                                          "sent_back", "decode_tok_s")]
            lines.append(f"| {run.mode.value} | " + " | ".join(cells) + " |")
        good = sum(r["goodput"] for r in per_model)
        wakes = sum(r["wakes"] for r in per_model)
        lines.append(f"| **{run.mode.value}** | **all** | "
                     f"{sum(r['requests'] for r in per_model)} | "
                     f"{sum(r['served'] for r in per_model)} | **{good}** | | | | {wakes} | "
                     f"{sum(r['wasted'] for r in per_model)} | | | "
                     f"{sum(r['sent_back'] for r in per_model)} | |")
    return "\n".join(lines)


def _switch_json(s: SwitchRecord) -> dict[str, Any]:
    return {"at": round(s.at, 3), "from": s.holder, "to": s.target, "ok": s.ok,
            "fence": s.fence, "reason": s.reason or None,
            "timings": {k: round(v, 4) for k, v in s.timings.items()}}


def run_json(run: PolicyRun) -> dict[str, Any]:
    return {"mode": run.mode.value, "window_s": run.window_s, "wall_s": run.wall_s,
            "rules": run.rules, "rows": rows(run),
            "goodput": sum(r["goodput"] for r in rows(run)),
            "switches": [_switch_json(s) for s in run.switches],
            "ttft_s": [[o.arrival.at, o.arrival.model, None if math.isinf(o.ttft_s)
                        else round(o.ttft_s, 4), o.error or None] for o in run.outcomes]}


def write_json(path: Path, data: dict[str, Any]) -> None:
    tmp = path.with_name(f".{path.name}.tmp")
    tmp.write_text(json.dumps(data, default=str), encoding="utf-8")
    tmp.replace(path)


# -- the run ---------------------------------------------------------------------------------

def _specs(args: argparse.Namespace) -> list[EngineSpec]:
    return [EngineSpec(key=f"m{i}", model_dir=args.models / args.model,
                       served_name=f"policy/m{i}", kv_cache_bytes=args.kv,
                       max_num_seqs=args.max_seqs, max_model_len=args.max_model_len,
                       gpu_memory_utilization=args.gpu_memory_utilization)
            for i in range(args.engines)]


async def _start_engines(bench: Bench, specs: list[EngineSpec], mode: str) -> dict[str, Any]:
    began = time.monotonic()
    started: dict[str, Any] = {"mode": mode}
    if mode == "parallel":
        try:
            await asyncio.gather(*(bench.start_engine(s) for s in specs))
        except Exception as exc:  # one did not come up beside the others: in turn instead
            say(f"parallel start failed ({type(exc).__name__}: {str(exc)[:300]}); "
                "starting the engines one after the other")
            started["parallel_error"] = f"{type(exc).__name__}: {str(exc)[:2000]}"
            for spec in specs:
                if spec.key in bench.state.engines:
                    bench.engine(spec.key).stop(10.0)
                    del bench.state.engines[spec.key]
                    bench.engines.pop(spec.key, None)
            started["mode"] = "sequential after a failed parallel start"
    for spec in specs:
        say(f"engine {spec.key}: admission (probe, first sleep)")
        started[spec.key] = await admit(bench, spec, stay_awake=False)
    started["seconds"] = round(time.monotonic() - began, 2)
    started["cold_start_s"] = {s.key: bench.record(s.key).ready_s for s in specs}
    started["first_sleep_s"] = {s.key: bench.record(s.key).first_sleep_s for s in specs}
    return started


async def _one_policy(bench: Bench, name: str, arrivals: list[Arrival], window_s: float,
                      client: ClientSettings) -> PolicyRun:
    keys = bench.live()
    claimants = [bench.claimant(k) for k in keys]
    port = MemoryLeasePort(GpuLease(name=naming.gpu_lease_name("bench-node", bench.gpu.name),
                                    node="bench-node", device=bench.gpu.name,
                                    gpu_uuid=bench.gpu.uuid))
    bench.lease_port = port
    records: list[SwitchRecord] = []
    switcher = RecordingSwitcher(
        records=records, clock=asyncio.get_running_loop().time,
        ports=Ports(lease=port, device=bench.device, engine=bench.adapter_for,
                    guard=lambda: None),
        limits=bench.limits(), identity=f"policy-run-{name}")
    for key in keys:
        first = bench.record(key).first_sleep_s
        if first is not None:
            switcher.record_sleep(bench.claimant(key), first)
    run = await replay(mode=MODES[name], arrivals=arrivals, claimants=claimants,
                       gpu=bench.gpu.name, port=port, switcher=switcher,
                       engine=bench.adapter_for, session=bench.session, client=client,
                       window_s=window_s)
    lease = port.current
    holder = next((c for c in claimants if c.ref == lease.holder), None)
    if holder is not None and lease.state == naming.STATE_AWAKE:  # every engine asleep again
        slept = await switcher.sleep_holder(lease, holder, reason="the policy's window is over")
        run.extra["slept_after"] = {"holder": holder.ref, "ok": slept.ok}
    return run


async def _compare(bench: Bench, args: argparse.Namespace, arrivals: list[Arrival],
                   result: dict[str, Any], out: Path) -> None:
    result["engines"] = await _start_engines(bench, _specs(args), args.start)
    write_json(out, result)
    client = ClientSettings(client_timeout_s=args.client_timeout_s, max_context=args.max_context,
                            max_generated=args.max_generated, ttft_slo_s=args.ttft_slo_s)
    policies = args.policies.split(",")
    runs: list[PolicyRun] = []
    window = args.window_s
    left_total = bench.remaining() - 20.0
    fit = left_total / len(policies) - args.client_timeout_s - TAIL_S
    if fit < window:
        window = max(10.0, fit)
        say(f"the window shrinks to {window:.0f} s to fit the deadline")
    todo = [a for a in arrivals if a.at < window]
    result["window_s"] = window
    result["arrivals"] = len(todo)
    result["simulated"] = simulated(todo, bench.record(bench.live()[0]).spec.weights_bytes(),
                                    args)
    for name in policies:
        say(f"== policy {name}: {len(todo)} arrivals over {window:.0f} s "
            f"({bench.remaining():.0f} s left)")
        run = await _one_policy(bench, name, todo, window, client)
        runs.append(run)
        result.setdefault("runs", []).append(run_json(run))
        write_json(out, result)
        say(f"   goodput {sum(r['goodput'] for r in rows(run))}, rules {run.rules}, "
            f"{len(run.switches)} switches, {run.wall_s:.0f} s")
    result["table"] = table(runs, args.ttft_slo_s)


async def _main(args: argparse.Namespace, launcher: Launcher, arrivals: list[Arrival],
                result: dict[str, Any], deadline: float) -> Bench | None:
    out = args.out / "policy.json"
    backend = open_backend(args.fake_nvml, args.state_dir / "nvml")
    backend.init()
    bench: Bench | None = None
    try:
        gpu = next((g for g in discover(backend) if g.index == args.gpu_index), None)
        if gpu is None:
            raise BenchError(f"no usable GPU with NVML index {args.gpu_index}")
        result["device"] = gpu.product_name
        say(f"GPU {gpu.index}: {gpu.product_name}, {gpu.memory_bytes // MIB} MiB")
        if isinstance(launcher, VllmLauncher):
            launcher.base_env["CUDA_DEVICE_ORDER"] = "PCI_BUS_ID"  # type: ignore[index]
            launcher.base_env["CUDA_VISIBLE_DEVICES"] = str(gpu.index)  # type: ignore[index]
        socket = args.state_dir / f"inspect-{os.getpid()}.sock"
        service = InspectionService(backend=backend, gpus=[gpu], proc_root=Path("/proc"),
                                    pods_from_environment=True)
        server = UnixServer(socket, [service.handler()])
        await server.start()
        reader = DeviceReader(socket, timeout_s=10.0)
        try:
            connector = aiohttp.TCPConnector(keepalive_timeout=3.0, limit=0)
            async with aiohttp.ClientSession(connector=connector) as session:
                bench = Bench(args=args, state=BenchState(boot_id=boot_id(), gpu_uuid=gpu.uuid),
                              state_file=args.state_dir / "state.json",
                              out_file=args.out / "policy-engines.json", backend=backend,
                              gpu=gpu, launcher=launcher, session=session,
                              device=ReaderDevice(reader),
                              sampler=NvmlSampler(backend, gpu.index), trace=HttpTrace(),
                              deadline=deadline)
                await _compare(bench, args, arrivals, result, out)
        finally:
            await reader.close()
            await server.stop(1.0)
    finally:
        if bench is not None:
            result["engine_records"] = {k: {"cold_start_s": r.ready_s, "awake_mib":
                                            (r.awake_bytes or 0) // MIB, "asleep_mib":
                                            (r.resident_bytes or 0) // MIB,
                                            "first_sleep_s": r.first_sleep_s}
                                        for k, r in bench.state.engines.items()}
            for key in list(bench.state.engines):
                bench.engine(key).stop(10.0)
        with contextlib.suppress(Exception):
            backend.shutdown()
    return bench


def main(argv: Sequence[str] | None = None) -> int:
    p = parser()
    args = p.parse_args(argv)
    if args.launcher == "simulator" and not args.fake_nvml:
        p.error("--launcher simulator needs --fake-nvml")
    if args.policies and any(x not in MODES for x in args.policies.split(",")):
        p.error(f"--policies: of {', '.join(MODES)}")
    arrivals = capped(read_trace(args.trace) if args.trace else azure_window(args), args)
    if args.simulate_only:
        config = args.models / args.model / "config.json"
        weights = EngineSpec(key="m0", model_dir=config.parent, served_name="m",
                             kv_cache_bytes=args.kv).weights_bytes()
        print(simulated(arrivals, weights, args)["table"])
        return 0
    if args.write_trace is not None:
        write_trace(arrivals, args.write_trace)
        print(f"{len(arrivals)} arrivals written to {args.write_trace}")
        return 0
    configure(args.log_level)
    began = time.monotonic()
    args.state_dir = args.state_dir or Path(os.environ.get("TMPDIR", "/tmp")) / \
        f"rota-policy-run-{uuid.uuid4().hex[:8]}"
    args.state_dir.mkdir(parents=True, exist_ok=True)
    args.out.mkdir(parents=True, exist_ok=True)
    args.stage, args.estimate_scale = "policy", 1.0  # what Bench's helpers read
    env = {k: v for k, v in os.environ.items() if k not in ("ROTA_CLAIM_UID", "ROTA_POD_UID")}
    launcher: Launcher
    if args.launcher == "vllm":
        launcher = VllmLauncher(python=args.vllm_python, pythonpath=args.vllm_pythonpath,
                                base_env=env)
    else:
        launcher = SimulatorLauncher(python=sys.executable, repo_root=REPO_ROOT,
                                     fake_nvml_dir=args.state_dir / "nvml", gpu_uuid="",
                                     base_env=env, tokens_per_second=args.tokens_per_second)
    result: dict[str, Any] = {
        "benchmark": "policy_on_engines", "launcher": args.launcher,
        "note": ("the lease controller's GpuWorker, policy and Switcher, the driver's "
                 f"inspection service on {'fake' if args.fake_nvml else 'real'} NVML, "
                 f"{args.engines} engines of {args.model}, an in-memory Lease"),
        "trace": str(args.trace) if args.trace else
        f"azure {args.mapping}, speed {args.speed:g}, from {args.start_s:g} s",
        "ttft_slo_s": args.ttft_slo_s, "client_timeout_s": args.client_timeout_s,
        "caps": {"context": args.max_context, "generated": args.max_generated}}
    error: str | None = None
    try:
        if isinstance(launcher, SimulatorLauncher):
            launcher = _simulator_for_gpu(launcher, args)
        asyncio.run(_main(args, launcher, arrivals, result, began + args.deadline_s))
    except Exception as exc:
        error = f"{type(exc).__name__}: {exc}"
    result["error"] = error
    result["wall_s"] = round(time.monotonic() - began, 2)
    write_json(args.out / "policy.json", result)
    print()
    if "simulated" in result:
        print("Simulated (e2e.bench_policy's engines, these arrivals):")
        print(result["simulated"]["table"])
        print()
    if "table" in result:
        print(f"On {result.get('device')} through the lease controller ({result['launcher']}):")
        print(result["table"])
        print()
    print(bench_policy.ATTRIBUTION)
    if error:
        print(f"ERROR: {error}")
    print(json.dumps({"ok": error is None and "table" in result, "error": error,
                      "device": result.get("device"), "window_s": result.get("window_s"),
                      "arrivals": result.get("arrivals"),
                      "goodput": {r["mode"]: r["goodput"] for r in result.get("runs", [])},
                      "simulated_goodput": (result.get("simulated") or {}).get("goodput"),
                      "wall_s": result["wall_s"]}))
    return 0 if error is None and "table" in result else 1


def _simulator_for_gpu(launcher: SimulatorLauncher, args: argparse.Namespace
                       ) -> SimulatorLauncher:
    """The simulator registers its memory with the fake NVML under the GPU's uuid."""
    backend = open_backend(args.fake_nvml, args.state_dir / "nvml")
    backend.init()
    try:
        gpu = next(g for g in discover(backend) if g.index == args.gpu_index)
    finally:
        backend.shutdown()
    return SimulatorLauncher(python=launcher.python, repo_root=launcher.repo_root,
                             fake_nvml_dir=launcher.fake_nvml_dir, gpu_uuid=gpu.uuid,
                             base_env=launcher.base_env,
                             tokens_per_second=launcher.tokens_per_second)


if __name__ == "__main__":
    raise SystemExit(main())
