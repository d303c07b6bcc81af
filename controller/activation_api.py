"""The activation API's contract: what gateways send to a node's lease controller and what
it answers. The server (:mod:`controller.activation`) and the client
(:mod:`controller.gateway.activation`) both use these models; nothing else defines them.

``POST /v1/activate`` with :class:`ActivateRequest` (and the bearer token of the mounted
Secret, in ``Authorization: Bearer <token>`` or in :data:`TOKEN_HEADER`: the API server's
pod proxy, which ``kubectl rota`` goes through, authenticates its caller with
``Authorization`` and drops it before forwarding). Answers:

- 200 :class:`ActivateAnswer`: the claimant is the awake holder of its GPU under ``fence``.
  It carries no address: a gateway routes only to pod IPs it watches itself.
- 400 ``invalid_request``, 401 ``unauthorized``, 404 ``unknown_model``;
- 409 ``not_leader`` (this instance does not act for the node now) with ``Retry-After``;
- 503 with a switch failure reason (``gpu_oom``, ``memory_not_returned``, ...) and
  ``Retry-After``.

Every error body is :class:`ErrorBody`, the OpenAI error shape.
"""

from __future__ import annotations

from pydantic import BaseModel, ConfigDict, Field

from controller.engines.probe import ProbeReason

__all__ = ["OTHER_REASON", "PATH", "STATE_PATH", "SWITCH_FAILURE_REASONS", "TOKEN_HEADER",
           "ActivateAnswer", "ActivateRequest",
           "ErrorBody", "ErrorDetail"]

PATH = "/v1/activate"
STATE_PATH = "/v1/state"
TOKEN_HEADER = "X-Rota-Activation-Token"
"""The activation token itself (no scheme), for callers whose ``Authorization`` header
belongs to someone else (the API server's proxy)."""

OTHER_REASON = "other"
"""The failure label of an error no reason below names (its text stays in the Lease's
``last_error`` and the log)."""
SWITCH_FAILURE_REASONS = frozenset({
    # The engine errors (controller.engines.errors).
    "unreachable", "timeout", "rejected", "gpu_oom", "host_oom", "unauthorized", "ack_error",
    "engine_dead", "state_unknown", "lied", "bad_response", "engine_error",
    # The correctness probe (controller.engines.probe; a probe with no reason is "failed").
    *(f"probe_{reason.value}" for reason in ProbeReason), "probe_failed",
    # The NVML check before a wake (controller.device; inspect_failed: the read failed).
    "memory_not_returned", "unknown_process", "insufficient_memory", "inspect_failed",
    # Start-up admission (controller.admission) and a switch found unfinished (controller.gpu).
    "start_failed", "start_timeout", "start_not_taken", "controller_crash",
    OTHER_REASON,
})
"""Every reason a switch may fail with: the 503 error types of the activation API and the
values of ``rota_controller_switch_failures_total{reason}``."""


class ActivateRequest(BaseModel):
    model_config = ConfigDict(extra="forbid")

    model: str = Field(min_length=1, max_length=253)
    claim: str | None = Field(default=None, max_length=507)
    """``<namespace>/<claim name>`` of the claimant to wake; any serving one when unset."""


class ActivateAnswer(BaseModel):
    model_config = ConfigDict(extra="ignore")

    model: str
    claim: str
    switched: bool = False
    """True when this call's switch woke the claimant; False when it was already awake."""
    fence: int = 0
    """The GPU Lease's fencing number under which the claimant holds the GPU."""
    timings: dict[str, float] = Field(default_factory=dict)


class ErrorDetail(BaseModel):
    model_config = ConfigDict(extra="ignore")

    type: str
    message: str = ""


class ErrorBody(BaseModel):
    model_config = ConfigDict(extra="ignore")

    error: ErrorDetail
