"""What a run found, per phase, from the audit log, ``/metrics`` and ``/proc``.

Formulas (N nodes, T a phase's length in minutes, S the switches done in it):

- requests per minute per node, by component: its requests in the phase / T / N (the
  gateways' per replica: / T / R);
- rota per node: (rota-controller + rota-driver + rota-gateway requests) / T / N: the
  gateways' share spread over the fleet, the figure the issue's idle target bounds;
- requests per switch: (rota requests while switching - rota's idle rate * T) / S,
  by component alike: what the switches added over the idle load;
- watch events and bytes per second by resource: the deltas of the API server's
  counters / the phase's seconds;
- relists after an API server restart, per process and resource: (lists from scratch,
  without a resourceVersion or continue token, in the restart phase - those usual in as
  long, from the switching phase's rate) / processes of that component. A periodic list
  (the driver's ledger GC lists its node's pods every minute) is such a list too, hence
  the baseline.
"""

from __future__ import annotations

import datetime as dt
import os
from collections import Counter
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from e2e.scale import apimetrics, audit

if TYPE_CHECKING:
    from e2e.scale.run import Options
    from e2e.scale.world import Shape

IDLE_TARGET_PER_NODE_MIN = 15.0
SWITCH_TARGET = 20.0
UNATTRIBUTED = ("OpenAPI-Generator", "(none)")
"""Products of Kubernetes clients that did not name themselves (the Python client's
default). The harness's own readiness probes and scrapes go out as urllib's."""
_TICK = os.sysconf("SC_CLK_TCK")


@dataclass(frozen=True)
class ProcessSample:
    pid: int
    cpu_s: float
    rss_bytes: int
    at: float

    @classmethod
    def read(cls, pid: int) -> ProcessSample:
        import time

        try:
            fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
            cpu = (int(fields[11]) + int(fields[12])) / _TICK
            rss = 0
            for line in Path(f"/proc/{pid}/status").read_text().splitlines():
                if line.startswith("VmRSS:"):
                    rss = int(line.split()[1]) * 1024
        except (OSError, IndexError, ValueError):
            cpu, rss = 0.0, 0
        return cls(pid=pid, cpu_s=cpu, rss_bytes=rss, at=time.monotonic())


@dataclass
class Phase:
    name: str
    start: dt.datetime
    end: dt.datetime
    switches: int
    watch: dict[str, dict[str, Any]]
    latency: dict[str, apimetrics.Latency]
    gateways: list[tuple[ProcessSample, ProcessSample]]
    harness: tuple[ProcessSample, ProcessSample]
    """The harness's own process (every emulated driver and controller)."""
    loop_lag_s: float
    """The longest the harness's event loop was late in the phase."""

    @property
    def seconds(self) -> float:
        return (self.end - self.start).total_seconds()


def _round(value: float, digits: int = 2) -> float:
    return round(value, digits)


def _cores(before: ProcessSample, after: ProcessSample) -> float:
    return _round((after.cpu_s - before.cpu_s) / max(after.at - before.at, 1e-9), 3)


WATCH_SHOWN = frozenset({"pods", "resourceclaims.resource.k8s.io",
                         "resourceslices.resource.k8s.io", "leases.coordination.k8s.io",
                         "nodes", "events.events.k8s.io", "events"})
"""Shown by name; every other resource (bookmarks of quiet watches, mostly) is summed."""


def _watch_rates(phase: Phase) -> dict[str, dict[str, float]]:
    rates: dict[str, dict[str, float]] = {}
    other = {"events": 0.0, "bytes": 0.0}
    for resource, v in phase.watch.items():
        into = rates.setdefault(resource, {"events": 0.0, "bytes": 0.0}) \
            if resource in WATCH_SHOWN else other
        into["events"] += v["events"] / phase.seconds
        into["bytes"] += v["bytes"] / phase.seconds
    rates["(other)"] = other
    return {r: {"events": _round(v["events"]), "bytes": _round(v["bytes"], 0)}
            for r, v in rates.items()}


def _phase_figures(phase: Phase, tally: audit.Tally, *, nodes: int, gateways: int
                   ) -> dict[str, Any]:
    minutes = phase.seconds / 60.0
    per_node = {c: _round(n / minutes / max(nodes, 1)) for c, n in
                sorted(tally.by_component.items()) if c != "rota-gateway"}
    rota = tally.rota()
    kinds: Counter[str] = Counter()
    for (component, verb, resource), n in tally.by_kind.items():
        if component in audit.ROTA_COMPONENTS:
            kinds[f"{component} {verb} {resource}"] += n
    return {
        "seconds": _round(phase.seconds, 1),
        "switches": phase.switches,
        "requests": dict(sorted(tally.by_component.items())),
        "per_minute_per_node": per_node,
        "gateway_per_minute_per_replica": _round(
            tally.by_component["rota-gateway"] / minutes / max(gateways, 1)),
        "rota_per_minute_per_node": _round(rota / minutes / max(nodes, 1)),
        "rota_requests_by_kind": dict(kinds.most_common()),
        "relists": dict(sorted(tally.relists.items())),
        "watch_per_second": _watch_rates(phase),
        "latency_p99": {
            cls: {"requests": lat.requests, "p99_s": lat.p99_s, "slo_s": lat.slo_s,
                  "met": lat.met} for cls, lat in phase.latency.items()},
        "harness": {"cpu_cores": _cores(*phase.harness),
                    "loop_lag_max_s": _round(phase.loop_lag_s, 3)},
        "gateways": [{
            "rss_mib": _round(after.rss_bytes / 2**20, 1),
            "cpu_cores": _cores(before, after)} for before, after in phase.gateways],
    }


def report(*, options: Options, shape: Shape, phases: list[Phase],
           requests: list[audit.Request], renewed: dict[str, bool],
           gpu_errors: int, lease_losses: int, lease_namespace: str) -> dict[str, Any]:
    """The figures of a run; agents and writers are over the whole audit log (start-up
    included), the rest per phase."""
    tallies = {p.name: audit.tally(requests, p.start, p.end) for p in phases}
    figures = {p.name: _phase_figures(p, tallies[p.name], nodes=shape.nodes,
                                      gateways=options.gateways) for p in phases}
    idle, switching = figures.get("idle"), figures.get("switching")
    per_switch: dict[str, float] = {}
    if idle and switching and switching["switches"]:
        idle_s, sw_s = idle["seconds"], switching["seconds"]
        for component in (*audit.ROTA_COMPONENTS, "rota"):
            def count(fig: dict[str, Any], c: str = component) -> int:
                return sum(fig["requests"].get(x, 0) for x in
                           (audit.ROTA_COMPONENTS if c == "rota" else (c,)))
            added = count(switching) - count(idle) / idle_s * sw_s
            per_switch[component] = _round(added / switching["switches"])
    restart: dict[str, Any] = {}
    if "restart" in figures and switching:
        processes = {"rota-controller": shape.nodes, "rota-driver": shape.nodes,
                     "rota-gateway": options.gateways}
        scale = figures["restart"]["seconds"] / switching["seconds"]
        kinds = {*figures["restart"]["relists"], *switching["relists"]}
        for kind in sorted(kinds):
            processes_of = processes.get(kind.split(" ", 1)[0])
            if processes_of is None:
                continue
            lists = figures["restart"]["relists"].get(kind, 0)
            usual = switching["relists"].get(kind, 0) * scale
            restart[kind] = {
                "lists_from_scratch": lists, "usual_in_as_long": _round(usual, 1),
                "per_process_over_usual": _round((lists - usual) / max(processes_of, 1))}
    agents: dict[str, set[str]] = {}
    rota_writes: Counter[str] = Counter()
    for request in requests:
        agents.setdefault(request.component, set()).add(request.user_agent)
        if audit.writes_rota_state(request, lease_namespace):
            rota_writes[request.component] += 1
    unattributed = sum(1 for r in requests if r.component in UNATTRIBUTED)
    targets = {}
    if idle:
        targets["idle_per_node_min"] = {
            "value": idle["rota_per_minute_per_node"], "target": IDLE_TARGET_PER_NODE_MIN,
            "met": idle["rota_per_minute_per_node"] <= IDLE_TARGET_PER_NODE_MIN}
    if "rota" in per_switch:
        targets["per_switch"] = {"value": per_switch["rota"], "target": SWITCH_TARGET,
                                 "met": per_switch["rota"] <= SWITCH_TARGET}
    return {
        "nodes": shape.nodes, "gpus_per_node": shape.gpus, "engines_per_gpu": shape.engines,
        "claims": shape.claims, "gateways": options.gateways,
        "switches_per_gpu_hour": options.switches_per_gpu_hour,
        "cpus": os.cpu_count(),
        "phases": figures,
        "requests_per_switch": per_switch,
        "relists_after_restart": restart,
        "targets": targets,
        "user_agents": {c: sorted(a) for c, a in sorted(agents.items())},
        "unattributed_requests": unattributed,
        "rota_state_writes_by_component": dict(sorted(rota_writes.items())),
        "controller_leases_renewed": sum(renewed.values()),
        "controller_leases_not_renewed": sorted(n for n, ok in renewed.items() if not ok),
        "gpu_step_errors": gpu_errors,
        "controller_lease_losses": lease_losses,
    }


def phase_line(name: str, fig: dict[str, Any]) -> str:
    per_node = fig["per_minute_per_node"]
    watch = fig["watch_per_second"]
    events = sum(v["events"] for v in watch.values())
    kbytes = sum(v["bytes"] for v in watch.values()) / 1024
    lat = " ".join(
        f"{cls} {v['p99_s'] if v['p99_s'] is not None else '-'}s/{v['slo_s']:g}s"
        for cls, v in fig["latency_p99"].items())
    gws = ", ".join(f"{g['rss_mib']} MiB {g['cpu_cores'] * 100:.1f}%" for g in fig["gateways"])
    return (f"{name}: {fig['seconds']:.0f} s, {fig['switches']} switches; rota "
            f"{fig['rota_per_minute_per_node']} req/min/node (controller "
            f"{per_node.get('rota-controller', 0)}, driver {per_node.get('rota-driver', 0)}, "
            f"gateway {fig['gateway_per_minute_per_replica']}/min/replica); kwok "
            f"{per_node.get('kwok', 0)}/min/node; watch {events:.0f} events/s "
            f"{kbytes:.0f} KiB/s; p99 {lat}; gateways {gws}; harness "
            f"{fig['harness']['cpu_cores'] * 100:.0f}% CPU, loop late by "
            f"{fig['harness']['loop_lag_max_s']} s at most")
