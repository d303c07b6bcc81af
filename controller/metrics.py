"""The lease controller's Prometheus metrics (prefix ``rota_``), with the reference
experiment's timing boundaries:

- wake call time: from the wake call to its completion (a level-2 wake includes the
  weight reload and the prefix-cache reset);
- recovery to first token: wake call time plus the correctness request's time to first
  token;
- handoff to first token: from starting to put the holder to sleep until the target's
  first token (memory hand-back and every check included).
"""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

REGISTRY = CollectorRegistry(auto_describe=True)

_SECONDS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2, 4, 8, 16, 32, 64, 128, 256)

WAKE_CALL = Histogram("rota_wake_call_seconds", "Wake call time.", ["model", "level"],
                      buckets=_SECONDS, registry=REGISTRY)
RECOVERY_TO_FIRST_TOKEN = Histogram(
    "rota_recovery_to_first_token_seconds",
    "Wake call time plus the correctness request's time to first token.", ["model"],
    buckets=_SECONDS, registry=REGISTRY)
HANDOFF_TO_FIRST_TOKEN = Histogram(
    "rota_handoff_to_first_token_seconds",
    "From starting to sleep the holder to the target's first token.", ["model"],
    buckets=_SECONDS, registry=REGISTRY)
DRAIN = Histogram("rota_drain_seconds", "Time the holder took to finish in-flight work.",
                  ["model"], buckets=_SECONDS, registry=REGISTRY)
SLEEP_CALL = Histogram("rota_sleep_call_seconds", "Sleep call time (first sleeps are slow).",
                       ["model", "level", "first"], buckets=_SECONDS, registry=REGISTRY)
STEP = Histogram("rota_switch_step_seconds", "Each step of the switch protocol.", ["step"],
                 buckets=_SECONDS, registry=REGISTRY)
SWITCHES = Counter("rota_switches_total", "Switches by outcome.", ["outcome"],
                   registry=REGISTRY)
FAILURES = Counter("rota_switch_failures_total", "Failed switches by reason.", ["reason"],
                   registry=REGISTRY)
FENCED = Counter("rota_switch_fenced_total",
                 "Engine calls refused because the GPU Lease's fencing number moved.",
                 registry=REGISTRY)
STARTS = Counter("rota_starts_total", "Start-up admissions by outcome (ok: started, slept "
                 "once and the GPU went on; refused: no slot could be made; failed: the "
                 "engine did not come up).", ["outcome"], registry=REGISTRY)
START_SECONDS = Histogram("rota_start_seconds", "From a start slot's grant until the engine "
                          "answered /health.", ["model"], buckets=_SECONDS, registry=REGISTRY)
RECONCILES = Counter("rota_reconcile_actions_total",
                     "Engines put to sleep by start-up or expiry reconciliation.", ["reason"],
                     registry=REGISTRY)
GPU_MEMORY = Gauge("rota_controller_gpu_memory_bytes",
                   "GPU memory held by each claim's processes, as NVML reports it (claim "
                   "\"unknown\": processes of no claim); summed per claim, no pid. Series of "
                   "claims that left the GPU are removed.",
                   ["gpu", "gpu_uuid", "claim"], registry=REGISTRY)
HOLDER = Gauge("rota_controller_lease_holder", "1 for the claimant that holds each GPU, 0 for "
               "the others on it; series of claimants that left the GPU are removed.",
               ["gpu", "gpu_uuid", "claim", "model_name"], registry=REGISTRY)
WATCH_RESTARTS = Counter("rota_controller_watch_restarts_total",
                         "Lists made again after a failed list or watch, by resource.",
                         ["resource"], registry=REGISTRY)
LEADER = Gauge("rota_controller_leader", "1 while this instance acts for the node.",
               registry=REGISTRY)


class SeriesSet:
    """The label sets of one gauge that are current; :meth:`keep` removes the others, so
    a gauge keyed by claims does not keep series of claims that are gone."""

    def __init__(self, gauge: Gauge) -> None:
        self.gauge = gauge
        self._live: dict[str, set[tuple[str, ...]]] = {}

    def set(self, scope: str, values: dict[tuple[str, ...], float]) -> None:
        """Set every series of ``scope`` (a GPU) at once; series of the scope that are
        not in ``values`` any more are removed."""
        for labels, value in values.items():
            self.gauge.labels(*labels).set(value)
        for labels in self._live.get(scope, set()) - set(values):
            try:
                self.gauge.remove(*labels)
            except KeyError:
                pass
        self._live[scope] = set(values)
