"""The policy comparison on real engines, through the lease controller's own code
(``python -m e2e.gpu.policy_run``): windows of a trace, 3 (or 5, 7) models on one GPU,
on-demand first-come switching, rota's drain-based policy and its preemptive one, beside
the bound of every engine awake at once.

``python -m e2e.bench.policy`` ranks the policies in a simulation. This runs the same
comparison where the engines are real vLLM 0.26 servers (``--launcher vllm``) on the GPU,
or the engine simulator standing in for them (``--launcher simulator --fake-nvml h200``),
and where the decisions, queueing and switches are the lease controller's: for each
policy a fresh :class:`~controller.lease.gpu.GpuWorker` with its ``--policy-mode``
(``first-come``; ``drain``, today's rules that never preempt; ``rota``, which preempts
engines that keep requests; :mod:`e2e.gpu.policy_replay`) on the engines as the GPU
benchmark runs them (:mod:`e2e.gpu.context`: the driver's inspection service on NVML, the
real Switcher and vLLM adapter, an in-memory Lease). ``all-awake`` is the bound: every
engine woken at once, no worker and no switch, where their awake footprints fit in the
GPU's memory together (else it is reported as "does not fit"). The engines start once (in
parallel, one after the other, or ``--start N`` at a time), each is probed and put through
its first sleep, then the policies run back to back on the same arrivals, every engine
asleep at each start. NVML is read every 10 ms throughout: each policy's phase may show
one engine above resident (the turns) or, for ``awake-set`` and ``all-awake``, the awake
budgets of those above resident within the GPU's memory and none over its own budget.

The windows, chosen by rule and not by result: ``--windows N`` windows of ``--window-s``
seconds, one every ``--window-every`` seconds from ``--window-from``, of the Azure LLM
inference trace 2023 compressed by ``--speed`` and mapped onto the engines as
``python -m e2e.bench.policy`` maps it (``--mapping``); or of ``--trace`` (a CSV of
``timestamp, model, context tokens, generated tokens``; ``--write-trace`` cuts one). The
default run (3 engines, 3 windows of 15 s at speed 0.4, 20-60 requests each, 4 policies)
is planned to fit one 570 s GPU call: the engines start once (about 1-2 minutes for three
vLLM engines), then 12 replays of at most about 30 s each. ``--budget-s`` is the whole
run's time: the windows shrink evenly to what is left after the engines started (never
below 10 s; windows are dropped from the end rather), and a replay that would not end in
time is not begun.

What each request's user felt (:mod:`e2e.gpu.policy_slo`): the first token, the longest
gap between two chunks, SLO met (first token within ``--first-token-s`` and no gap over
``--longest-freeze-s``), and, for every request whose engine was put to sleep while its
stream was open, its text against a never-slept reference of the same engine (greedy,
the same prompt and length): identical, altered or lost. The references are the
all-awake run's answers where it ran; else each engine is woken alone and asked for its
window's requests after the policies (``policy_replay.references``).

For the same arrivals it also prints what the simulation of ``e2e.bench.policy``
predicts for every policy, with its engines calibrated to these engines' weights, so the
rankings sit side by side (``simulated_ranking_agrees`` per window); ``python -m
e2e.gpu.report policy.json [other.json]`` prints the tables of a run, and whether the
simulator's run (``--launcher simulator``) and the real one rank the policies alike.

Results: ``--out``/policy.json (per window, policy and model: requests, served, goodput
at the first-token objective, SLO goodput, TTFT p50/p90/p99, the longest gaps, frozen
requests and their verdicts, wakes, wasted wakes, the rules that fired, every switch,
every request, the NVML watch of its phase), ``policy-nvml.json`` (the NVML timeline),
Markdown tables on stdout, the JSON headline as the last line.
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
from e2e.gpu.engine_args import add_engine_arguments
from e2e.gpu.engines import EngineSpec, Launcher, SimulatorLauncher, VllmLauncher, boot_id
from e2e.gpu.instrument import HttpTrace
from e2e.gpu.policy_replay import (
    Arrival,
    ClientSettings,
    PolicyRun,
    RecordingSwitcher,
    SwitchRecord,
    check,
    own_references,
    references,
    replay,
    replay_awake,
    rows,
)
from e2e.gpu.policy_slo import Bounds, Reference, RefKey, ranking, rankings_agree, share
from e2e.gpu.report import policy_summary, policy_totals
from e2e.gpu.sampler import NvmlSampler
from e2e.gpu.steps import admit, say
from e2e.harness.ports import MemoryLeasePort, ReaderDevice
from rota.api import naming
from rota.api.gpu_lease import GpuLease
from rota.kit.engine_connections import engine_connector
from rota.kit.logs import configure
from rota.kit.sockets import UnixServer

POLICIES = ("all-awake", "first-come", "drain", "rota")
"""The policies of a run by default, in the order they run (all-awake first: its answers
are the references the others' frozen streams are checked against)."""
AWAKE_SET = "awake-set"
"""The ``rota`` policy with the lease controller's ``--awake-set``: engines awake together
where their awake budgets fit the GPU (asked for with ``--policies``)."""
KNOWN_POLICIES = (*POLICIES, AWAKE_SET)
AWAKE = "all-awake"
SIM_NAMES = {"all-awake": "all-awake", "first-come": "on-demand", "drain": "drain",
             "rota": "rota"}
"""The policies by the names ``e2e.bench.policy`` simulates them under."""
TAIL_S = 15.0
"""Expected seconds after a window's last arrival until its clients are done."""
MIN_WINDOW_S = 10.0
REFERENCE_S = 15.0
"""Expected seconds to take one engine's references when all-awake does not run."""


def mode_of(policy: str) -> PolicyMode:
    """The lease controller's ``--policy-mode`` for a policy of the comparison. Where
    the controller has no ``drain`` mode yet, its ``rota`` mode is the drain-based one."""
    values = {m.value: m for m in PolicyMode}
    if policy == AWAKE_SET:
        return PolicyMode.ROTA
    if policy == "drain":
        return values.get("drain", PolicyMode.ROTA)
    return values[policy]


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m e2e.gpu.policy_run", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    add_engine_arguments(p, model_help="the folder under --models of every engine, or a "
                         "comma-separated list taken in turn (m0 the first, m1 the next, ...: "
                         "model-14b,model-small,model-small mixes the 26.5 GB model in)",
                         kv_help="each engine's fixed KV cache")
    add = p.add_argument
    add("--engines", type=int, default=3)
    add("--start", type=start_mode, default="parallel", metavar="parallel|sequential|N",
        help="start the engines at once (one after the other if that fails), in turn, or "
        "N at a time (as many as fit awake together: each group is put to sleep before "
        "the next starts)")
    add("--trace", type=Path, default=None, help="CSV of timestamp (s), model, context "
        "tokens, generated tokens, replayed as written")
    add("--write-trace", type=Path, default=None,
        help="write the windows of the Azure trace to this CSV (each at its offset from "
             "the first's start) and exit")
    add("--mapping", choices=("services", "modulo", "shift"), default="modulo")
    add("--speed", type=float, default=0.4,
        help="the trace's time is divided by this (0.4: 40 %% as dense)")
    add("--windows", type=int, default=None,
        help="how many windows (default 3 of the Azure trace, 1 of --trace)")
    add("--window-from", "--start-s", dest="window_from", type=float, default=None,
        help="the first window's start in the compressed trace (default 600 s of the "
             "Azure trace, 0 of --trace)")
    add("--window-every", type=float, default=1200.0,
        help="seconds of the compressed trace from one window's start to the next's")
    add("--window-s", type=float, default=15.0,
        help="seconds of the (compressed) trace each policy replays per window")
    add("--policies", default=",".join(POLICIES),
        help=f"of {', '.join(KNOWN_POLICIES)} ({AWAKE_SET}: rota with --awake-set)")
    add("--first-token-s", "--ttft-slo-s", dest="ttft_slo_s", type=float, default=2.0,
        help="the first-token objective of the SLO")
    add("--longest-freeze-s", type=float, default=3.0,
        help="the SLO's bound on the gap between two chunks of a stream")
    add("--frozen-gap-s", type=float, default=0.5,
        help="a gap longer than this counts a stream as frozen (checked against the "
             "reference) even without a recorded sleep of its engine")
    add("--client-timeout-s", type=float, default=30.0)
    add("--decode-bound-s", type=float, default=60.0,
        help="the most a client waits for a started stream's end")
    add("--max-context", type=int, default=2048)
    add("--max-generated", type=int, default=256)
    add("--sim-decode-step-s", type=float, default=None,
        help="the simulation's decode step (default: e2e.bench.policy's calibration, 10 ms "
             "for a model this small; the real engines' measured rate is in policy.json)")
    add("--simulate-only", action="store_true",
        help="print the simulation of the window and exit (no engines)")
    add("--sim-env", action="append", default=[], metavar="NAME=VALUE",
        help="an environment variable for every simulated engine (its settings' "
             "variables, e.g. a fault), repeatable")
    add("--out", type=Path, default=Path("."))
    add("--state-dir", type=Path, default=None)
    add("--budget-s", "--deadline-s", dest="budget_s", type=float, default=540.0,
        help="the whole run's seconds (one GPU call gives about 570)")
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

ORIGIN = "# origin"
"""A CSV's row that says where its time 0 is (``--write-trace`` writes ``# origin 0``)."""


def read_trace(path: Path) -> list[Arrival]:
    """A CSV of ``timestamp, model, context, generated`` (seconds; any header row is
    skipped); models named ``m0``, ``m1``... are those engines, other names are numbered
    in their sorted order. Time 0 is the first arrival, or where a ``# origin T`` row
    says."""
    with path.open(newline="") as f:
        rows = [r for r in csv.reader(f) if r]
    raw = [r for r in rows if not r[0].strip().lower().startswith(("timestamp", "#"))]
    origin = next((float(r[0].strip()[len(ORIGIN):]) for r in rows
                   if r[0].strip().startswith(ORIGIN)), None)
    found = sorted({r[1].strip() for r in raw})
    numbered = all(n[:1] == "m" and n[1:].isdigit() for n in found)  # as --write-trace names
    names = {n: int(n[1:]) if numbered else k for k, n in enumerate(found)}
    t0 = origin if origin is not None else min((float(r[0]) for r in raw), default=0.0)
    return sorted((Arrival(float(r[0]) - t0, names[r[1].strip()], int(r[2]), max(1, int(r[3])))
                   for r in raw), key=lambda a: a.at)


def azure_window(args: argparse.Namespace, start_s: float | None = None) -> list[Arrival]:
    """The Azure trace's arrivals in ``[start_s, start_s + --window-s)`` of its compressed
    time, from 0."""
    first = window_starts(args)[0] if start_s is None else start_s
    requests = bench_policy.load_arrivals(trace=None, mapping=args.mapping,
                                          models=args.engines, speed=args.speed,
                                          start_s=first, duration_s=args.window_s,
                                          limit=None)
    return [Arrival(r.arrival, r.model, r.context, r.generated) for r in requests]


def window_starts(args: argparse.Namespace) -> list[float]:
    """Where each window starts: every ``--window-every`` seconds from ``--window-from``
    (by rule, not by what the windows hold)."""
    windows = args.windows if args.windows is not None else (1 if args.trace else 3)
    first = args.window_from if args.window_from is not None else (0.0 if args.trace
                                                                   else 600.0)
    return [first + k * args.window_every for k in range(max(1, windows))]


def cut(arrivals: Sequence[Arrival], start_s: float, length_s: float) -> list[Arrival]:
    """The arrivals of ``[start_s, start_s + length_s)``, from 0."""
    return [Arrival(a.at - start_s, a.model, a.context, a.generated) for a in arrivals
            if start_s <= a.at < start_s + length_s]


def windows_of(args: argparse.Namespace) -> list[tuple[float, list[Arrival]]]:
    """Each window's start and arrivals (capped), at their full ``--window-s``."""
    if args.trace:
        whole = read_trace(args.trace)
        return [(start, capped(cut(whole, start, args.window_s), args))
                for start in window_starts(args)]
    return [(start, capped(azure_window(args, start), args)) for start in window_starts(args)]


def write_trace(arrivals: Sequence[Arrival], path: Path) -> None:
    """The arrivals as a CSV that :func:`read_trace` reads back as they are (its time 0
    written out)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    with path.open("w", newline="") as f:
        out = csv.writer(f)
        out.writerow([f"{ORIGIN} 0"])
        out.writerow(["timestamp", "model", "context_tokens", "generated_tokens"])
        for a in arrivals:
            out.writerow([f"{a.at:.4f}", f"m{a.model}", a.context, a.generated])


def capped(arrivals: Sequence[Arrival], args: argparse.Namespace) -> list[Arrival]:
    return [Arrival(a.at, a.model, min(a.context, args.max_context),
                    min(a.generated, args.max_generated)) for a in arrivals]


# -- the simulation of the same arrivals -----------------------------------------------------

def simulated(arrivals: Sequence[Arrival], weights_bytes: Sequence[int],
              args: argparse.Namespace) -> dict[str, Any]:
    """What ``e2e.bench.policy`` predicts for these arrivals and engines with these weights
    (m0's first, taken in turn)."""
    models = bench_policy.engine_models([b / 1e9 for b in weights_bytes], args.engines, 400.0)
    if args.sim_decode_step_s:
        models = [dataclasses.replace(m, decode_step_s=args.sim_decode_step_s) for m in models]
    sim_args = argparse.Namespace(step_s=0.02, max_seqs=args.max_seqs,
                                  client_timeout_s=args.client_timeout_s,
                                  static_period_s=10.0, ttft_slo_s=args.ttft_slo_s,
                                  longest_freeze_s=args.longest_freeze_s)
    requests = [bench_policy.Request(a.at, a.model, a.context, a.generated) for a in arrivals]
    names = {SIM_NAMES[p]: p for p in args.policies.split(",") if p in SIM_NAMES}
    results = [bench_policy.simulate(sim, requests, models, sim_args) for sim in names]
    return {"table": bench_policy.table(results, args.ttft_slo_s, args.longest_freeze_s),
            "goodput": {r.policy: r.total_goodput for r in results},
            "as_policies": {names[r.policy]: r.total_goodput for r in results},
            "slo_goodput": {names[r.policy]: r.total_slo_goodput for r in results},
            "rows": {r.policy: r.rows for r in results}}


# -- reporting -------------------------------------------------------------------------------

def _f(v: object) -> str:
    if isinstance(v, float):
        return "∞" if math.isinf(v) else "-" if math.isnan(v) else f"{v:.2f}"
    return "-" if v is None else str(v)


def table(runs: Sequence[PolicyRun], bounds: Bounds) -> str:
    """Per policy and model: today's columns, then what the users felt (SLO goodput, the
    longest gaps, frozen requests and their verdicts against the references)."""
    lines = [f"| policy (lease controller) | model | requests | served | goodput (TTFT ≤ "
             f"{bounds.first_token_s:g} s) | TTFT p50 s | p90 s | p99 s | wakes | wasted wakes "
             "| handoff to first token p50 s | holder's drain p50 s | sent back | decode "
             f"tok/s per stream p50 | SLO met (TTFT ≤ {bounds.first_token_s:g} s, gaps ≤ "
             f"{bounds.longest_freeze_s:g} s) | longest gap p50 / max s | frozen | "
             "identical / altered / lost |", "|" + "---|" * 18]
    for run in runs:
        per_model = rows(run)
        for row in per_model:
            cells = [_f(row[k]) for k in ("model", "requests", "served", "goodput", "p50",
                                          "p90", "p99", "wakes", "wasted",
                                          "handoff_to_first_token_s", "drain_s",
                                          "sent_back", "decode_tok_s", "slo_goodput")]
            gap = row["longest_gap_s"]
            cells += [f"{_f(gap['p50'])} / {_f(gap['max'])}", _f(row["frozen"]),
                      f"{row['identical']} / {row['altered']} / {row['lost']}"]
            lines.append(f"| {run.name} | " + " | ".join(cells) + " |")
        t = policy_totals(per_model)
        lines.append(f"| **{run.name}** | **all** | {t['requests']} | {t['served']} | "
                     f"**{t['goodput']}** | | | | {t['wakes']} | {t['wasted']} | | | "
                     f"{t['sent_back']} | | **{t['slo_goodput']}** | | {t['frozen']} | "
                     f"{t['identical']} / {t['altered']} / {t['lost']} |")
    return "\n".join(lines)


def _switch_json(s: SwitchRecord) -> dict[str, Any]:
    return {"at": round(s.at, 3), "from": s.holder, "to": s.target, "ok": s.ok,
            "fence": s.fence, "reason": s.reason or None, "preempt": s.preempt,
            "kept": s.kept,
            "timings": {k: round(v, 4) for k, v in s.timings.items()}}


def run_json(run: PolicyRun) -> dict[str, Any]:
    per_model = rows(run)
    t = policy_totals(per_model)
    return {"mode": run.name, "policy_mode": run.mode.value if run.mode else None,
            "window_s": run.window_s, "wall_s": run.wall_s,
            "rules": run.rules, "rows": per_model,
            "goodput": t["goodput"], "slo_goodput": t["slo_goodput"],
            "slo_share_pct": share(t["slo_goodput"], t["requests"]),
            "correctness": {k: t[k] for k in ("frozen", "identical", "altered", "lost",
                                              "unchecked")},
            "not_frozen": {v: sum(r["not_frozen"][v] for r in per_model)
                           for v in ("identical", "altered", "lost", "unchecked")},
            "switches": [_switch_json(s) for s in run.switches],
            "requests_columns": ["at", "model", "ttft_s", "longest_gap_s", "slo_met",
                                 "frozen", "verdict", "chunks", "tokens", "error"],
            "requests": [[round(o.arrival.at, 3), o.arrival.model,
                          None if math.isinf(o.ttft_s) else round(o.ttft_s, 4),
                          round(o.longest_gap_s, 4),
                          run.bounds.met(o.ttft_s, o.longest_gap_s) and not o.error,
                          o.frozen, o.verdict,
                          len(o.trace.chunk_at) if o.trace else 0,
                          o.trace.tokens if o.trace else None, o.error or None]
                         for o in run.outcomes]} | run.extra


def write_json(path: Path, data: dict[str, Any]) -> None:
    tmp = path.with_name(f".{path.name}.tmp")
    tmp.write_text(json.dumps(data, default=str), encoding="utf-8")
    tmp.replace(path)


# -- the run ---------------------------------------------------------------------------------

def model_names(args: argparse.Namespace) -> list[str]:
    """Each engine's model folder, m0 first: ``--model``'s list taken in turn."""
    names = [n.strip() for n in args.model.split(",") if n.strip()]
    return [names[i % len(names)] for i in range(args.engines)]


def _specs(args: argparse.Namespace) -> list[EngineSpec]:
    return [EngineSpec(key=f"m{i}", model_dir=args.models / name,
                       served_name=f"policy/m{i}", kv_cache_bytes=args.kv,
                       max_num_seqs=args.max_seqs, max_model_len=args.max_model_len,
                       gpu_memory_utilization=args.gpu_memory_utilization)
            for i, name in enumerate(model_names(args))]


def start_mode(text: str) -> str:
    """``--start``: ``parallel``, ``sequential`` or a count of engines started at once."""
    if text in ("parallel", "sequential") or (text.isdigit() and int(text) >= 1):
        return text
    raise argparse.ArgumentTypeError(f"{text!r}: parallel, sequential or a count >= 1")


async def _start_engines(bench: Bench, specs: list[EngineSpec], mode: str) -> dict[str, Any]:
    began = time.monotonic()
    started: dict[str, Any] = {"mode": mode}
    if mode.isdigit():  # N at a time, each group asleep before the next starts
        at_once = int(mode)
        for first in range(0, len(specs), at_once):
            group = specs[first:first + at_once]
            say(f"starting {', '.join(s.key for s in group)} at once")
            await asyncio.gather(*(bench.start_engine(s) for s in group))
            for spec in group:
                say(f"engine {spec.key}: admission (probe, first sleep)")
                started[spec.key] = await admit(bench, spec, stay_awake=False)
    elif mode == "parallel":
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
        if spec.key not in started:
            say(f"engine {spec.key}: admission (probe, first sleep)")
            started[spec.key] = await admit(bench, spec, stay_awake=False)
    started["seconds"] = round(time.monotonic() - began, 2)
    started["cold_start_s"] = {s.key: bench.record(s.key).ready_s for s in specs}
    started["first_sleep_s"] = {s.key: bench.record(s.key).first_sleep_s for s in specs}
    return started


def _switcher(bench: Bench, port: MemoryLeasePort, name: str) -> RecordingSwitcher:
    """The controller's Switcher on ``port``, with every engine's first sleep behind it."""
    switcher = RecordingSwitcher(
        records=[], clock=asyncio.get_running_loop().time,
        ports=Ports(lease=port, device=bench.device, engine=bench.adapter_for,
                    guard=lambda: None),
        limits=bench.limits(), identity=f"policy-run-{name}")
    for key in bench.live():
        first = bench.record(key).first_sleep_s
        if first is not None:
            switcher.record_sleep(bench.claimant(key), first)
    return switcher


def _fresh_port(bench: Bench) -> MemoryLeasePort:
    port = MemoryLeasePort(GpuLease(name=naming.gpu_lease_name("bench-node", bench.gpu.name),
                                    node="bench-node", device=bench.gpu.name,
                                    gpu_uuid=bench.gpu.uuid))
    bench.lease_port = port
    return port


async def _one_policy(bench: Bench, name: str, arrivals: list[Arrival], window_s: float,
                      client: ClientSettings) -> PolicyRun:
    keys = bench.live()
    claimants = [bench.claimant(k) for k in keys]
    port = _fresh_port(bench)
    switcher = _switcher(bench, port, name)
    run = await replay(mode=mode_of(name), arrivals=arrivals, claimants=claimants,
                       gpu=bench.gpu.name, port=port, switcher=switcher,
                       engine=bench.adapter_for, session=bench.session, client=client,
                       window_s=window_s, awake_set=name == AWAKE_SET)
    run.name = name
    slept_after = []
    for _ in claimants:  # every engine asleep again (an awake set: one member at a time)
        lease = port.current
        holder = next((c for c in claimants if c.ref == lease.holder), None)
        if holder is None or lease.state != naming.STATE_AWAKE:
            break
        slept = await switcher.sleep_holder(lease, holder, reason="the policy's window is over")
        slept_after.append({"holder": holder.ref, "ok": slept.ok})
        if not slept.ok:
            break
    if slept_after:
        run.extra["slept_after"] = slept_after
    return run


def awake_fit(bench: Bench) -> dict[str, Any]:
    """Whether every engine fits awake at once: their measured awake footprints (else
    the estimate) and 1 GiB to spare against the GPU's memory."""
    need = sum(bench.record(k).awake_bytes or bench.estimated_awake(bench.record(k).spec)
               for k in bench.live()) + GIB
    return {"fits": need <= bench.gpu.memory_bytes, "need_mib": need // MIB,
            "gpu_mib": bench.gpu.memory_bytes // MIB}


async def _all_awake(bench: Bench, arrivals: list[Arrival], window_s: float,
                     client: ClientSettings) -> PolicyRun:
    """Every engine woken (straight through its adapter, past the Lease: the bound has
    no turns), the window replayed to them, every engine put back to sleep."""
    claimants = [bench.claimant(k) for k in bench.live()]
    woken: list[Any] = []
    try:
        for claimant in claimants:
            adapter = bench.adapter_for(claimant)
            await adapter.wake(claimant.sleep_level)
            woken.append((adapter, claimant.sleep_level))
        return await replay_awake(arrivals=arrivals, claimants=claimants,
                                  session=bench.session, client=client, window_s=window_s)
    finally:
        for adapter, level in woken:
            with contextlib.suppress(Exception):
                await adapter.sleep(level)


async def _run_policy(bench: Bench, name: str, arrivals: list[Arrival], window_s: float,
                      client: ClientSettings, fit: dict[str, Any]) -> PolicyRun | dict[str, Any]:
    """One policy on one window, within what is left of the budget; a dict when it did
    not run (does not fit, no time)."""
    if name == AWAKE and not fit["fits"]:
        return {"mode": AWAKE, **fit}
    left = bench.remaining() - 15.0
    if left < window_s + TAIL_S:
        return {"mode": name, "skipped": f"the budget leaves {max(0.0, left):.0f} s"}
    try:
        async with asyncio.timeout(left):
            if name == AWAKE:
                return await _all_awake(bench, arrivals, window_s, client)
            return await _one_policy(bench, name, arrivals, window_s, client)
    except TimeoutError:
        return {"mode": name, "skipped": "cut by the budget mid-run"}


async def _references(bench: Bench, arrivals: list[Arrival], client: ClientSettings
                      ) -> tuple[dict[RefKey, Reference], dict[str, Any]]:
    """Each engine woken alone and asked for its model's requests of the window."""
    if bench.remaining() < REFERENCE_S * len(bench.live()) + 15.0:
        return {}, {"skipped": "no time left for the references"}
    port = _fresh_port(bench)
    return await references(arrivals=arrivals, claimants=[bench.claimant(k)
                                                          for k in bench.live()],
                            switcher=_switcher(bench, port, "references"), port=port,
                            session=bench.session, client=client,
                            concurrency=bench.args.max_seqs)


def plan(left_s: float, windows: int, policies: Sequence[str], engines: int, fits: bool,
         window_s: float) -> tuple[int, float]:
    """How many windows, and how long each, fit in ``left_s``: the windows shrink evenly
    (to ``MIN_WINDOW_S`` at least), then are dropped from the end."""
    refs = 0.0 if (AWAKE in policies and fits) else REFERENCE_S * engines
    for count in range(max(1, windows), 0, -1):
        fit = (left_s / count - refs) / max(1, len(policies)) - TAIL_S
        if fit >= min(MIN_WINDOW_S, window_s) or count == 1:
            return count, min(window_s, max(MIN_WINDOW_S, fit))
    return 1, min(window_s, MIN_WINDOW_S)


async def _window(bench: Bench, args: argparse.Namespace, start_s: float,
                  arrivals: list[Arrival], window_s: float, client: ClientSettings,
                  fit: dict[str, Any], result: dict[str, Any], out: Path
                  ) -> tuple[dict[str, Any], list[PolicyRun]]:
    """Every policy on one window, then the frozen streams checked against references."""
    todo = [a for a in arrivals if a.at < window_s]
    entry: dict[str, Any] = {"start_s": start_s, "window_s": window_s, "arrivals": len(todo),
                             "runs": []}
    result["windows"].append(entry)
    entry["simulated"] = simulated(todo, [s.weights_bytes() for s in _specs(args)], args)
    runs: list[PolicyRun] = []
    slots: list[PolicyRun | dict[str, Any]] = []
    for name in args.policies.split(","):
        say(f"== window {start_s:g} s, policy {name}: {len(todo)} arrivals over "
            f"{window_s:.0f} s ({bench.remaining():.0f} s left)")
        label = f"window {start_s:g} s, {name}"
        together = name in (AWAKE, AWAKE_SET)
        bench.sampler.phase(label, allowed_above=len(bench.live()) if together else 1,
                            set_budget_bytes=bench.gpu.memory_bytes if together else None)
        done = await _run_policy(bench, name, todo, window_s, client, fit)
        bench.sampler.phase(f"window {start_s:g} s, between policies")
        if isinstance(done, PolicyRun):
            done.extra["nvml"] = bench.sampler.phase_stats(label)
        slots.append(done)
        if isinstance(done, dict):
            entry["runs"].append(done)
            say(f"   {name}: {done.get('skipped') or 'does not fit'}")
            continue
        runs.append(done)
        check(done, {}, client)  # frozen marks now; verdicts once the references are in
        entry["runs"].append(run_json(done))
        write_json(out, result)
        t = policy_totals(rows(done))
        say(f"   TTFT goodput {t['goodput']}, SLO goodput {t['slo_goodput']} of "
            f"{t['requests']}, frozen {t['frozen']}, rules {done.rules}, "
            f"{len(done.switches)} switches, {done.wall_s:.0f} s; {nvml_line(done.extra['nvml'])}")
    awake = next((r for r in runs if r.name == AWAKE), None)
    refs: dict[RefKey, Reference]
    how: dict[str, Any]
    if awake is not None:
        refs, how = own_references(awake, client), {"from": AWAKE}
    elif any(o.frozen for r in runs for o in r.outcomes):
        refs, how = await _references(bench, todo, client)
        how["from"] = "each engine woken alone"
    else:
        refs, how = {}, {"from": None, "note": "no stream was frozen"}
    entry["references"] = how | {"count": len(refs)}
    for run in runs:
        check(run, refs, client)
    entry["runs"] = [run_json(r) if isinstance(r, PolicyRun) else r for r in slots]
    measured = {r.name: policy_totals(rows(r))["slo_goodput"] for r in runs}
    entry["ranking"] = ranking(measured)
    entry["simulated_ranking"] = ranking(entry["simulated"]["slo_goodput"])
    entry["simulated_ranking_agrees"] = rankings_agree(measured,
                                                       entry["simulated"]["slo_goodput"])
    write_json(out, result)
    return entry, runs


def nvml_line(stats: dict[str, Any] | None) -> str:
    """One phase of the NVML watch, in words."""
    if not stats:
        return "NVML: not sampled"
    return (f"NVML: {stats['samples']} samples, at most {stats['max_engines_above_resident']} "
            f"engines above resident, peak {stats['peak_used_mib']:.0f} MiB used, "
            f"{stats['violations']} violations")


async def _compare(bench: Bench, args: argparse.Namespace,
                   windows: list[tuple[float, list[Arrival]]], result: dict[str, Any],
                   out: Path) -> None:
    bench.sampler.phase("engines start", allowed_above=args.engines)
    bench.sampler.start()
    result["engines"] = await _start_engines(bench, _specs(args), args.start)
    for key in bench.live():  # their budgets are measured now
        bench.watch(key)
    write_json(out, result)
    bounds = Bounds(first_token_s=args.ttft_slo_s, longest_freeze_s=args.longest_freeze_s,
                    frozen_gap_s=args.frozen_gap_s)
    client = ClientSettings(client_timeout_s=args.client_timeout_s, max_context=args.max_context,
                            max_generated=args.max_generated, ttft_slo_s=args.ttft_slo_s,
                            decode_bound_s=args.decode_bound_s, bounds=bounds)
    policies = args.policies.split(",")
    fit = awake_fit(bench)
    result["all_awake"] = fit
    count, window = plan(bench.remaining() - 20.0, len(windows), policies, len(bench.live()),
                         fit["fits"], args.window_s)
    if count < len(windows) or window < args.window_s:
        say(f"the budget leaves {count} of {len(windows)} windows of {window:.0f} s")
    result["plan"] = {"windows": count, "of": len(windows), "window_s": window,
                      "dropped": [s for s, _ in windows[count:]]}
    result["window_s"] = window
    result["windows"] = []
    tables: list[str] = []
    for start_s, arrivals in windows[:count]:
        _, runs = await _window(bench, args, start_s, arrivals, window, client, fit, result,
                                out)
        tables.append(f"Window from {start_s:g} s ({window:.0f} s):\n\n"
                      + table(runs, bounds))
    result["arrivals"] = sum(w["arrivals"] for w in result["windows"])
    result["table"] = "\n\n".join(tables)
    result["summary"] = policy_summary(result["windows"], bounds)


async def _main(args: argparse.Namespace, launcher: Launcher,
                windows: list[tuple[float, list[Arrival]]], result: dict[str, Any],
                deadline: float) -> Bench | None:
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
            async with aiohttp.ClientSession(connector=engine_connector(limit=0)) as session:
                bench = Bench(args=args, state=BenchState(boot_id=boot_id(), gpu_uuid=gpu.uuid),
                              state_file=args.state_dir / "state.json",
                              out_file=args.out / "policy-engines.json", backend=backend,
                              gpu=gpu, launcher=launcher, session=session,
                              device=ReaderDevice(reader),
                              sampler=NvmlSampler(backend, gpu.index, interval_s=0.01),
                              trace=HttpTrace(),
                              deadline=deadline)
                await _compare(bench, args, windows, result, out)
        finally:
            await reader.close()
            await server.stop(1.0)
    finally:
        if bench is not None:
            bench.sampler.stop()
            watched = bench.sampler.report()
            write_json(args.out / "policy-nvml.json",
                       {k: watched.pop(k) for k in ("timeline_columns", "timeline")})
            # the engines' start is no turn of the controller's (started in parallel, all
            # are awake at once): what is judged are the windows' phases
            watched["violations_in_windows"] = sum(
                ph["violations"] for ph in watched["phases"] if ph["label"].startswith("window"))
            result["nvml"] = watched
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
    if not args.policies or any(x not in KNOWN_POLICIES for x in args.policies.split(",")):
        p.error(f"--policies: of {', '.join(KNOWN_POLICIES)}")
    windows = windows_of(args)
    missing = [] if args.write_trace is not None else [  # cutting a trace needs no model
        n for n in dict.fromkeys(model_names(args))
        if not (args.models / n / "config.json").is_file()]
    if missing:
        p.error(f"--model: {', '.join(missing)} under {args.models} holds no config.json")
    if args.simulate_only:
        weights = [s.weights_bytes() for s in _specs(args)]
        for start_s, arrivals in windows:
            print(f"Window from {start_s:g} s:")
            print(simulated(arrivals, weights, args)["table"])
        return 0
    if args.write_trace is not None:  # every window, each at its offset from the first's
        first = windows[0][0]
        cut_out = [Arrival(start - first + a.at, a.model, a.context, a.generated)
                   for start, arrivals in windows for a in arrivals]
        write_trace(cut_out, args.write_trace)
        print(f"{len(cut_out)} arrivals of {len(windows)} windows written to "
              f"{args.write_trace}; replay them with --trace {args.write_trace} --windows "
              f"{len(windows)} --window-every {args.window_every:g} --window-s "
              f"{args.window_s:g}")
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
        env |= dict(item.split("=", 1) for item in args.sim_env)
        launcher = SimulatorLauncher(python=sys.executable, repo_root=REPO_ROOT,
                                     fake_nvml_dir=args.state_dir / "nvml", gpu_uuid="",
                                     base_env=env, tokens_per_second=args.tokens_per_second)
    result: dict[str, Any] = {
        "benchmark": "policy_on_engines", "launcher": args.launcher,
        "note": ("the lease controller's GpuWorker, policy and Switcher, the driver's "
                 f"inspection service on {'fake' if args.fake_nvml else 'real'} NVML, "
                 f"{args.engines} engines of {', '.join(model_names(args))}, an "
                 "in-memory Lease"),
        "trace": str(args.trace) if args.trace else
        f"azure {args.mapping}, speed {args.speed:g}",
        "windows_rule": {"from_s": window_starts(args)[0], "every_s": args.window_every,
                         "count": len(windows), "window_s": args.window_s},
        "engines_count": args.engines, "kv_bytes": args.kv, "policies": args.policies,
        "ttft_slo_s": args.ttft_slo_s, "longest_freeze_s": args.longest_freeze_s,
        "frozen_gap_s": args.frozen_gap_s, "client_timeout_s": args.client_timeout_s,
        "budget_s": args.budget_s,
        "caps": {"context": args.max_context, "generated": args.max_generated}}
    error: str | None = None
    try:
        if isinstance(launcher, SimulatorLauncher):
            launcher = _simulator_for_gpu(launcher, args)
        asyncio.run(_main(args, launcher, windows, result, began + args.budget_s))
    except Exception as exc:
        error = f"{type(exc).__name__}: {exc}"
    result["error"] = error
    result["wall_s"] = round(time.monotonic() - began, 2)
    write_json(args.out / "policy.json", result)
    print(closing(result))
    return 0 if error is None and "table" in result else 1


def closing(result: dict[str, Any]) -> str:
    """What a run prints at its end: the simulation's tables, the runs' tables, the
    summary over the windows, the trace's attribution and the JSON headline."""
    lines = [""]
    for w in result.get("windows", []):
        lines += [f"Simulated (e2e.bench.policy's engines, the window from {w['start_s']:g} s):",
                  w["simulated"]["table"], ""]
    if "table" in result:
        lines += [f"On {result.get('device')} through the lease controller "
                  f"({result['launcher']}):", "", result["table"], "",
                  "Per window (SLO: both objectives met; frozen: its engine slept while its "
                  "stream was open; verdicts against a never-slept reference):", "",
                  result["summary"], ""]
    lines.append(bench_policy.ATTRIBUTION)
    if result.get("error"):
        lines.append(f"ERROR: {result['error']}")
    lines.append(json.dumps({
        "ok": result.get("error") is None and "table" in result, "error": result.get("error"),
        "device": result.get("device"), "window_s": result.get("window_s"),
        "arrivals": result.get("arrivals"), "all_awake_fits": (result.get("all_awake") or {})
        .get("fits"),
        "slo_goodput": [{r["mode"]: r.get("slo_goodput", r.get("skipped", "does not fit"))
                         for r in w["runs"]} for w in result.get("windows", [])],
        "lost": sum((r.get("correctness") or {}).get("lost", 0)
                    for w in result.get("windows", []) for r in w["runs"]),
        "altered": sum((r.get("correctness") or {}).get("altered", 0)
                       for w in result.get("windows", []) for r in w["runs"]),
        "nvml_violations": (result.get("nvml") or {}).get("violations_in_windows"),
        "ranking": [w.get("ranking") for w in result.get("windows", [])],
        "simulated_ranking_agrees": [w.get("simulated_ranking_agrees")
                                     for w in result.get("windows", [])],
        "wall_s": result.get("wall_s")}))
    return "\n".join(lines)


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
