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
RECONCILES = Counter("rota_reconcile_actions_total",
                     "Engines put to sleep by start-up or expiry reconciliation.", ["reason"],
                     registry=REGISTRY)
GPU_PROCESS_MEMORY = Gauge("rota_gpu_process_memory_bytes",
                           "GPU memory per process, as NVML reports it.",
                           ["gpu", "pid", "claim"], registry=REGISTRY)
HOLDER = Gauge("rota_lease_holder", "1 for the claimant that holds each GPU.",
               ["device", "claim"], registry=REGISTRY)
LEADER = Gauge("rota_controller_leader", "1 while this instance acts for the node.",
               registry=REGISTRY)
