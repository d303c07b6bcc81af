"""The lease controller's settings: parsed once, passed explicitly; flags and env vars.

Every timeout of the switch protocol is here, with the policy against thrash. The flag of
field ``x_y`` is ``--x-y``; its environment variable is ``ROTA_X_Y`` (``NODE_NAME`` and
``POD_NAMESPACE`` work too, as the downward API usually sets them).
"""

from __future__ import annotations

import fnmatch
import math
import os
import socket
from collections.abc import Mapping, Sequence
from pathlib import Path

from pydantic import BaseModel, ConfigDict, Field, RootModel, field_validator

from controller.lease.engines.base import Timeouts
from controller.lease.policy import ModelPolicy, PolicyMode
from controller.lease.tenants import Priority, TenantLimits
from rota.api import naming
from rota.api.engine_config import DEFAULT_FIRST_TOKEN_SECONDS, DEFAULT_LONGEST_FREEZE_SECONDS
from rota.kit.settings import LogLevel, parse_settings

GIB = 1024**3
MIB = 1024**2


class StepTimeouts(BaseModel):
    """Bounds of each step of a switch, in seconds."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    drain_s: float = Field(default=30.0, gt=0)
    sleep_s: float = Field(default=120.0, gt=0)
    confirm_s: float = Field(default=10.0, gt=0)
    inspect_s: float = Field(default=5.0, gt=0)
    wake_s: float = Field(default=300.0, gt=0)
    probe_s: float = Field(default=60.0, gt=0)
    lease_s: float = Field(default=10.0, gt=0)
    start_s: float = Field(default=900.0, gt=0)
    """From a start slot's grant until the engine answers /health (a cold start)."""

    def engine_calls(self) -> Timeouts:
        """The engine adapter's bounds for the same steps (a sleep, a wake, the probe)."""
        return Timeouts(sleep_s=self.sleep_s, wake_level1_s=self.wake_s,
                        wake_level2_s=self.wake_s, probe_total_s=self.probe_s)


class PriorityCeilings(RootModel[dict[str, Priority | TenantLimits]]):
    """The admin's binding: namespace name or shell pattern → what its claims may take,
    a priority ceiling or a :class:`controller.lease.tenants.TenantLimits` object."""


class LeaseSettings(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)

    node_name: str = Field(min_length=1, description="The node whose GPUs this instance "
                                                     "manages. Env NODE_NAME works too.")
    namespace: str = Field(default=naming.DEFAULT_NAMESPACE,
                           description="Namespace of the Leases. Env POD_NAMESPACE works too.")
    identity: str = Field(default_factory=lambda: f"{socket.gethostname()}-{os.getpid()}",
                          description="This instance's name in the controller Lease.")
    kubeconfig: str | None = Field(default=None, description="kubeconfig; in-cluster when "
                                                             "unset.")
    api_qps: float = Field(default=20.0, ge=0, description="Client-side limit on Kubernetes "
                           "API requests per second (a token bucket; 0: none).")
    api_burst: int = Field(default=40, ge=1, description="Kubernetes API requests that may "
                           "go out at once, above --api-qps, after a quiet spell.")
    inspect_socket: Path = Field(default=Path("/var/lib/kubelet/plugins/gpu.rota.dev/"
                                              "inspect.sock"),
                                 description="The driver's node inspection socket.")
    listen: str = Field(default="[::]:8090", description="host:port of the activation "
                        "API, /healthz and /metrics; port 0 picks one; '[::]' is every IPv6 "
                        "and IPv4 address (one dual-stack socket), '0.0.0.0' IPv4 only.")
    advertise_host: str | None = Field(default=None, description="Address gateways reach "
                                       "this instance at (the pod IP; an IPv6 one is put "
                                       "in brackets). Default: the listen host, or "
                                       "127.0.0.1 when that is a wildcard.")
    advertise_url: str | None = Field(default=None, description="URL gateways use to reach "
                                      "the activation API, whole (overrides "
                                      "--advertise-host).")
    token_file: Path | None = Field(default=None, description="File holding the bearer "
                                    "token the activation API requires (a mounted Secret).")
    token_reload_s: float = Field(default=30.0, gt=0, description="Re-read the token file "
                                  "this often (a rotated Secret reaches the volume, not the "
                                  "process); every line of the file is a valid token.")
    election_lease_s: float = Field(default=15.0, gt=1, description="Duration of the "
                                    "controller Lease; renewed every third of it.")
    min_residency_s: float = Field(default=0.0, ge=0, description="An awake engine keeps "
                                   "the GPU at least this long before a switch away.")
    coalesce_window_s: float = Field(default=0.0, ge=0, description="Before switching away, "
                                     "let the holder finish its work for up to this long "
                                     "(its admission stays open meanwhile).")
    idle_sleep_s: float = Field(default=0.0, ge=0, description="Put the holder to sleep "
                                "after this long without work (0: never).")
    policy_mode: PolicyMode = Field(default=PolicyMode.ROTA, description="Switch policy: "
                                    "rota (quantum, bounds, priorities, cost, fair share, "
                                    "service objectives; a holder that keeps its requests "
                                    "may be preempted), drain (the same rules, every switch "
                                    "drains the holder: the baseline before preemption) or "
                                    "first-come (on-demand in arrival order, llama-swap's "
                                    "behaviour: a request for a sleeping model drains and "
                                    "sleeps the holder at once; the baseline to compare).")
    policy_quantum_factor: float = Field(default=4.0, ge=0, description="Switch policy: "
                                         "a busy holder keeps the GPU at least this many "
                                         "times the measured cost of the switch away.")
    policy_min_quantum_s: float = Field(default=1.0, ge=0, description="Switch policy: "
                                        "the quantum's floor.")
    policy_max_wait_s: float = Field(default=30.0, gt=0, description="Switch policy: "
                                     "default bound on a request's wait for a switch while "
                                     "the GPU serves others (EngineConfig maxWaitSeconds).")
    policy_keep_alive_s: float = Field(default=0.0, ge=0, description="Switch policy: "
                                       "default keep-alive after the last request with "
                                       "nobody waiting (EngineConfig keepAliveSeconds); 0: "
                                       "--idle-sleep-s, and when that is 0 too, forever.")
    policy_priority: int = Field(default=0, description="Switch policy: default priority.")
    policy_priority_ceilings: PriorityCeilings = Field(
        default_factory=lambda: PriorityCeilings({}),
        description="Switch policy: JSON object of what the claims of a namespace may "
                    "take, by name or shell pattern: a priority ceiling ({\"prod\": 100}) "
                    "or an object of priority, maxWaitSeconds (the shortest bound), "
                    "shareWeight, keepAliveSeconds, home, firstTokenSeconds and "
                    "longestFreezeSeconds (the tightest objectives) ({\"team-*\": "
                    "{\"priority\": 10, \"maxWaitSeconds\": 60}}); a claim asking more is "
                    "held to it, and what an entry leaves out, or a namespace not named, is "
                    "held to the node's defaults (no home). Empty: no bound but a "
                    "maxWaitSeconds of at least 5 s and objectives of at least 1 s.")
    policy_share_weight: float = Field(default=1.0, gt=0, description="Switch policy: "
                                       "default fair-share weight.")
    policy_switch_share: float = Field(default=0.25, gt=0, lt=1, description="Switch "
                                       "policy: the largest share of GPU time a turn of a "
                                       "preemptible holder spends switching (its quantum is "
                                       "at least (1 - share) / share x the switch's cost, "
                                       "the kept requests' recompute included).")
    first_token_objective_s: float = Field(
        default=DEFAULT_FIRST_TOKEN_SECONDS, gt=0, le=3600, description="Switch "
                                           "policy: default objective for a request's first "
                                           "token (EngineConfig firstTokenSeconds); a waiter "
                                           "due at it preempts a holder that keeps its "
                                           "requests.")
    longest_freeze_s: float = Field(
        default=DEFAULT_LONGEST_FREEZE_SECONDS, gt=0, le=3600, description="Switch policy: "
                                    "default longest gap a started stream may suffer while "
                                    "its engine sleeps with the stream kept (EngineConfig "
                                    "longestFreezeSeconds); a holder is preempted only when "
                                    "every frozen stream stays within its bound.")
    home_model: str = Field(default="", description="Switch policy: the served model name "
                            "woken on a GPU idle for --home-idle-s (empty: the claim with "
                            "home: true, if any).")
    home_idle_s: float = Field(default=60.0, gt=0, description="Switch policy: how long a "
                               "GPU is without work before its home model is woken.")
    awake_set: bool = Field(default=False, description="Allow an awake set: more than "
                            "one engine awake on a GPU at once where their awake budgets "
                            "fit it together (checked through NVML before every wake, like "
                            "one awake; the GPU's Lease names the whole set). A switch then "
                            "puts to sleep only as many engines as the newcomer needs room "
                            "for. Off: one engine awake per GPU. Engines that span GPUs "
                            "always take their GPUs alone.")
    awake_set_gpus: str = Field(default="", description="Where --awake-set applies: "
                                "comma-separated shell patterns of node names or "
                                "<node>/<gpu> (e.g. 'big-*,node-a/gpu-1'); empty: every GPU "
                                "of the node.")
    resync_s: float = Field(default=10.0, gt=0, description="Reconcile each GPU (ask its "
                            "engines, read the device) at least this often, also under load.")
    shutdown_grace_s: float = Field(default=25.0, gt=0, description="On SIGTERM, let the "
                                    "switch in flight finish for up to this long before "
                                    "releasing the controller Lease (keep it below the pod's "
                                    "terminationGracePeriodSeconds).")
    resident_tolerance_bytes: int = Field(default=512 * MIB, ge=0, description="How far above "
                                          "its resident budget a sleeping engine may read.")
    unknown_process_bytes: int = Field(default=512 * MIB, ge=0, description="An unknown "
                                       "process holding more than this blocks wakes.")
    footprint_warn_fraction: float = Field(default=0.9, gt=0, le=1, description="Warn (a "
                                           "Warning Event, a log line) once an engine holds "
                                           "more than this share of its budget + "
                                           "--resident-tolerance-bytes, before its creep "
                                           "gets a wake refused.")
    timeouts: StepTimeouts = Field(default_factory=StepTimeouts,
                                   description="JSON object of per-step timeouts.")
    start_socket: Path | None = Field(default=Path("/var/run/rota/start/start.sock"),
                                      description="Unix socket where engines' start gates "
                                      "ask for a start slot (the driver mounts its directory "
                                      "into claim containers). Empty: no start-up admission.")
    start_hold_s: float = Field(default=20.0, gt=0, description="A start gate's question is "
                                "held this long before it is told to ask again.")
    visible_state: bool = Field(default=True, description="Show switches where kubectl "
                                "sees them: Events on engine pods, their gpu.rota.dev/state "
                                "label and the Awake/Ready conditions of their claims.")
    log_level: LogLevel = Field(default="info", description="debug | info | warning | error")

    def awake_set_on(self, gpu: str) -> bool:
        """Whether ``gpu`` of this node may have an awake set (``--awake-set``, narrowed by
        ``--awake-set-gpus``)."""
        if not self.awake_set:
            return False
        patterns = [p.strip() for p in self.awake_set_gpus.split(",") if p.strip()]
        return not patterns or any(
            fnmatch.fnmatchcase(self.node_name, p) or
            fnmatch.fnmatchcase(f"{self.node_name}/{gpu}", p) for p in patterns)

    def model_policy(self) -> ModelPolicy:
        """The node's default switch policy per model (a claim's EngineConfig overrides
        it): keep-alive is ``policy_keep_alive_s``, else ``idle_sleep_s``, else forever."""
        keep = self.policy_keep_alive_s or self.idle_sleep_s
        return ModelPolicy(priority=self.policy_priority,
                           keep_alive_s=keep if keep > 0 else math.inf,
                           quantum_factor=self.policy_quantum_factor,
                           min_quantum_s=self.policy_min_quantum_s,
                           max_wait_s=self.policy_max_wait_s,
                           share_weight=self.policy_share_weight,
                           first_token_s=self.first_token_objective_s,
                           longest_freeze_s=self.longest_freeze_s,
                           switch_share=self.policy_switch_share, mode=self.policy_mode)

    @field_validator("start_socket", mode="before")
    @classmethod
    def _empty_is_off(cls, value: object) -> object:
        return None if value == "" else value


_ALIASES = {"NODE_NAME": "ROTA_NODE_NAME", "POD_NAMESPACE": "ROTA_NAMESPACE"}


def load(argv: Sequence[str] | None = None, environ: Mapping[str, str] | None = None
         ) -> LeaseSettings:
    env = dict(os.environ if environ is None else environ)
    for alias, name in _ALIASES.items():
        if alias in env and name not in env:
            env[name] = env[alias]
    settings: LeaseSettings = parse_settings(
        LeaseSettings, argv, env, prog="rota-controller lease",
        description="rota's lease controller: one awake engine per GPU on this node.")
    return settings
