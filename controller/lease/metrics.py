"""The lease controller's Prometheus metrics (prefix ``rota_controller_``; docs/metrics.md
lists them), with the reference experiment's timing boundaries:

- wake duration: from the wake call to its completion (a level-2 wake includes the
  weight reload and the prefix-cache reset);
- recovery duration: wake duration plus the correctness request's time to first token;
- handoff duration: from starting to put the holder to sleep until the target's first
  token (memory hand-back and every check included).

``model_name`` is the served model name (the engine config's ``model``, vLLM's
``model_name`` label), so these series join ``vllm:*{model_name=...}``. Label sets that are
known in advance (switch failure reasons, outcomes) are created at 0, so a rate or an
increase over them exists before the first event.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from prometheus_client import Counter, Gauge, Histogram

from controller.lease.policy import RULES as POLICY_RULES
from rota.api.activation import OTHER_REASON as OTHER_REASON
from rota.api.activation import SWITCH_FAILURE_REASONS as SWITCH_FAILURE_REASONS
from rota.kit.metrics_registry import new_registry, package_version

if TYPE_CHECKING:
    from controller.lease.switch import Frozen

REGISTRY = new_registry()

_SECONDS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2, 4, 8, 16, 32, 64, 128, 256)

SWITCH_OUTCOMES = ("ok", "failed")
START_OUTCOMES = ("ok", "refused", "failed")
RECONCILE_REASONS = ("two_awake", "unknown", "asleep", "woken_back")
"""What reconciliation saw of an engine it put to sleep: awake beside the holder; holding
memory without saying whether it sleeps; a suspect of an unfinished switch that says it
sleeps (its sleep may still be in flight). And ``woken_back``: a holder it woke again, which
said it slept while it still held its awake memory."""


def failure_reason(reason: str) -> str:
    """``reason`` as a failure label: one of :data:`SWITCH_FAILURE_REASONS`."""
    return reason if reason in SWITCH_FAILURE_REASONS else OTHER_REASON


WAKE = Histogram("rota_controller_wake_duration_seconds", "Wake call time.",
                 ["model_name", "level"], buckets=_SECONDS, registry=REGISTRY)
RECOVERY = Histogram(
    "rota_controller_recovery_duration_seconds",
    "Wake call time plus the correctness request's time to first token.", ["model_name"],
    buckets=_SECONDS, registry=REGISTRY)
HANDOFF = Histogram(
    "rota_controller_handoff_duration_seconds",
    "From starting to sleep the holder to the target's first token.", ["model_name"],
    buckets=_SECONDS, registry=REGISTRY)
DRAIN = Histogram("rota_controller_drain_duration_seconds",
                  "Time the holder took to finish in-flight work.", ["model_name"],
                  buckets=_SECONDS, registry=REGISTRY)
SLEEP = Histogram("rota_controller_sleep_duration_seconds",
                  "Sleep call time (first sleeps are slow: first=\"true\").",
                  ["model_name", "level", "first"], buckets=_SECONDS, registry=REGISTRY)
STEP = Histogram("rota_controller_switch_step_duration_seconds",
                 "Each step of the switch protocol.", ["step"], buckets=_SECONDS,
                 registry=REGISTRY)
SWITCHES = Counter("rota_controller_switches_total", "Switches by outcome (ok, failed).",
                   ["outcome"], registry=REGISTRY)
FAILURES = Counter("rota_controller_switch_failures_total",
                   "Failed switches by reason (docs/metrics.md lists them; anything else is "
                   "other).", ["reason"], registry=REGISTRY)
FENCED = Counter("rota_controller_fenced_total",
                 "Engine calls refused because the GPU Lease's fencing number moved.",
                 registry=REGISTRY)
STARTS = Counter("rota_controller_starts_total", "Start-up admissions by outcome (ok: "
                 "started, slept once and the GPU went on; refused: no slot could be made; "
                 "failed: the engine did not come up).", ["outcome"], registry=REGISTRY)
START = Histogram("rota_controller_start_duration_seconds", "From a start slot's grant until "
                  "the engine answered /health.", ["model_name"], buckets=_SECONDS,
                  registry=REGISTRY)
RECONCILES = Counter("rota_controller_reconcile_actions_total",
                     "Engines put to sleep by start-up or expiry reconciliation, by what was "
                     "seen of them (two_awake: awake beside the holder), and holders woken "
                     "back (woken_back: asleep by their own word but holding their memory).",
                     ["reason"],
                     registry=REGISTRY)
GPU_MEMORY = Gauge("rota_controller_gpu_memory_bytes",
                   "GPU memory held by each claim's processes, as NVML reports it (claim "
                   "\"unknown\": processes of no claim); summed per claim, no pid. Series of "
                   "claims that left the GPU are removed.",
                   ["gpu", "gpu_uuid", "claim"], registry=REGISTRY)
HOLDER = Gauge("rota_controller_lease_holder", "1 for the claimant that holds each GPU (and, "
               "in an awake set, for every engine awake beside it), 0 for the others on it; "
               "series of claimants that left the GPU are removed.",
               ["gpu", "gpu_uuid", "claim", "model_name"], registry=REGISTRY)
WATCH_RESTARTS = Counter("rota_controller_watch_restarts_total",
                         "Lists made again after a failed list or watch, by resource.",
                         ["resource"], registry=REGISTRY)
UNDECODABLE_OBJECTS = Counter(
    "rota_controller_undecodable_objects_total",
    "Objects a list or watch skipped because they could not be decoded or read (nested "
    "too deep, malformed), each time one came, by resource.", ["resource"], registry=REGISTRY)
LEADER = Gauge("rota_controller_leader", "1 while this instance acts for the node.",
               registry=REGISTRY)
VISIBLE_STATE_ERRORS = Counter(
    "rota_controller_visible_state_errors_total",
    "Events, pod labels or claim conditions that could not be written, by kind.", ["kind"],
    registry=REGISTRY)
VISIBLE_STATE_KINDS = ("event", "pod_label", "claim_conditions")
POLICY_DECISIONS = Counter(
    "rota_controller_policy_decisions_total",
    "Decisions of the switch policy that acted (a switch, an idle sleep, a cancelled "
    "switch), by the rule that fired (controller.lease.policy.RULES).", ["rule"],
    registry=REGISTRY)
KEPT = Gauge("rota_controller_kept_requests",
             "Requests an engine keeps while it sleeps (a preemptive switch froze them; they "
             "continue at its next wake), by its own gauges before the sleep. The series "
             "goes when the engine wakes or its claim leaves.",
             ["gpu", "claim", "model_name"], registry=REGISTRY)
FREEZES = Counter("rota_controller_freezes_total",
                  "Engines put to sleep with their requests kept (preemptive switches).",
                  ["model_name"], registry=REGISTRY)
FREEZE = Histogram("rota_controller_freeze_duration_seconds",
                   "From a sleep that kept an engine's requests to its next wake.",
                   ["model_name"], buckets=_SECONDS, registry=REGISTRY)
INFO = Gauge("rota_controller_info", "1, labelled with the lease controller's version.",
             ["version"], registry=REGISTRY)


class SwitchMetrics:
    """The switch's measurements as Prometheus series: the lease controller's
    :class:`~controller.lease.switch.SwitchObserver` (tests inject one that records)."""

    def step(self, name: str, seconds: float) -> None:
        STEP.labels(name).observe(seconds)

    def fenced(self) -> None:
        FENCED.inc()

    def drained(self, model: str, seconds: float) -> None:
        DRAIN.labels(model).observe(seconds)

    def slept(self, model: str, level: int, first: bool, seconds: float) -> None:
        SLEEP.labels(model, str(level), str(first).lower()).observe(seconds)

    def woke(self, model: str, level: int, seconds: float) -> None:
        WAKE.labels(model, str(level)).observe(seconds)

    def recovered(self, model: str, seconds: float) -> None:
        RECOVERY.labels(model).observe(seconds)

    def handed_off(self, model: str, seconds: float) -> None:
        HANDOFF.labels(model).observe(seconds)

    def switched(self, reason: str | None) -> None:
        """A switch ended: ``reason`` None when it succeeded, else why it failed."""
        if reason is None:
            SWITCHES.labels("ok").inc()
            return
        SWITCHES.labels("failed").inc()
        FAILURES.labels(failure_reason(reason)).inc()

    def started(self, outcome: str) -> None:
        """A start-up admission ended: ``ok``, ``refused`` or ``failed``."""
        STARTS.labels(outcome).inc()

    def start_took(self, model: str, seconds: float) -> None:
        START.labels(model).observe(seconds)

    def froze(self, frozen: Frozen) -> None:
        """An engine went to sleep with ``frozen.kept`` requests kept."""
        FREEZES.labels(frozen.model).inc()
        KEPT.labels(frozen.gpu, frozen.claim, frozen.model).set(frozen.kept)

    def thawed(self, frozen: Frozen, seconds: float) -> None:
        """An engine frozen for ``seconds`` woke: its series goes."""
        FREEZE.labels(frozen.model).observe(seconds)
        self.forgot(frozen)

    def forgot(self, frozen: Frozen) -> None:
        """A frozen engine's claim left the GPU (or it woke): its series goes."""
        try:
            KEPT.remove(frozen.gpu, frozen.claim, frozen.model)
        except KeyError:
            pass

for _reason in SWITCH_FAILURE_REASONS:
    FAILURES.labels(_reason)
for _outcome in SWITCH_OUTCOMES:
    SWITCHES.labels(_outcome)
for _outcome in START_OUTCOMES:
    STARTS.labels(_outcome)
for _reason in RECONCILE_REASONS:
    RECONCILES.labels(_reason)
for _kind in VISIBLE_STATE_KINDS:
    VISIBLE_STATE_ERRORS.labels(_kind)
for _rule in POLICY_RULES:
    POLICY_DECISIONS.labels(_rule)
INFO.labels(package_version()).set(1)


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


FOOTPRINT_RATIO = Gauge(
    "rota_controller_footprint_ratio",
    "An engine's measured memory on a GPU over its budget, read by the check before each "
    "wake: asleep against its resident budget, the engine about to wake against its awake "
    "budget. A sleeping engine is refused wakes past 1 + tolerance/budget; a notice comes "
    "before (--footprint-warn-fraction). The series goes when the claim leaves.",
    ["claim", "model_name", "device", "state"], registry=REGISTRY)
