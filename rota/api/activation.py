"""The activation API's contract: what gateways (and ``kubectl rota``) send to a node's
lease controller, what it answers, and what each error code means for the caller.

The server (:mod:`controller.lease.activation`), the gateway's client
(:mod:`controller.gateway.activation`), ``kubectl rota`` and the tests' fake controllers
all take the paths, the bodies and :data:`ERRORS` from here; nothing else defines them.

``POST /v1/activate`` with :class:`ActivateRequest` (at most :data:`MAX_BODY_BYTES`) and
the bearer token of the mounted Secret, in ``Authorization: Bearer <token>`` or in
:data:`TOKEN_HEADER` (the API server's pod proxy, which ``kubectl rota`` goes through,
authenticates its caller with ``Authorization`` and drops it before forwarding). Answers:

- 200 :class:`ActivateAnswer`: the claimant is the awake holder of its GPU under ``fence``.
  It carries no address: a gateway routes only to pod IPs it watches itself.
- an error: :class:`ErrorBody` (the OpenAI error shape), whose ``error.type`` is the error
  code. **The code alone decides the status** and whether the caller should ask again,
  by :data:`ERRORS`; a code the table does not list is a failed switch (:data:`SWITCH_FAILED`).

``GET /v1/state``: :class:`StateAnswer`, what this instance knows of its node, with each
claimant's expected switch (:class:`ClaimantState` ``expected_switch_s``,
``queue_position``, ``expected_wait_s``): what a gateway tells the clients it holds.

Every body is read with unknown keys ignored, so fields added later (as those three) never
break an earlier reader, and a reader gets None for a field an earlier writer did not send.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from types import MappingProxyType
from typing import Any

from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    SerializerFunctionWrapHandler,
    field_serializer,
    field_validator,
    model_serializer,
)

__all__ = ["ASK_AGAIN_RETRY_AFTER_S", "ENGINE_UNAUTHORIZED", "ERRORS", "MAX_BODY_BYTES",
           "OTHER_REASON", "PATH", "PROBE_REASONS", "STATE_PATH", "SWITCH_FAILED",
           "SWITCH_FAILURE_REASONS", "SWITCH_FAILURE_RETRY_AFTER_S", "TOKEN_HEADER",
           "ActivateAnswer", "ActivateRequest", "ClaimantState", "ErrorBody", "ErrorDetail",
           "LastSwitch", "LeaseState", "Refusal", "StateAnswer", "asks_again", "refusal_of",
           "wire_reason"]

PATH = "/v1/activate"
STATE_PATH = "/v1/state"
TOKEN_HEADER = "X-Rota-Activation-Token"
"""The activation token itself (no scheme), for callers whose ``Authorization`` header
belongs to someone else (the API server's proxy)."""
MAX_BODY_BYTES = 16 * 1024
"""A request body longer than this is answered 413 ``request_too_large``."""

OTHER_REASON = "other"
"""The failure label of an error no reason below names (its text stays in the Lease's
``last_error`` and the log)."""
PROBE_REASONS = frozenset({"wrong_content", "no_done", "no_usage", "stream_error", "timeout",
                           "http_error", "unreachable", "unsupported_engine"})
"""The values of :class:`controller.lease.engines.probe.ProbeReason` (a test keeps them equal;
this module imports no process)."""
SWITCH_FAILURE_REASONS = frozenset({
    # The engine errors (controller.lease.engines.errors).
    "unreachable", "timeout", "rejected", "gpu_oom", "host_oom", "unauthorized", "ack_error",
    "engine_dead", "state_unknown", "lied", "bad_response", "engine_error",
    "unsupported_engine",
    # The correctness probe (controller.lease.engines.probe; a probe with no reason is "failed").
    *(f"probe_{reason}" for reason in PROBE_REASONS), "probe_failed",
    # The NVML check before a wake (controller.lease.device; inspect_failed: the read failed).
    "memory_not_returned", "awake_over_budget", "unknown_process", "insufficient_memory",
    "inspect_failed",
    # Start-up admission (controller.lease.admission) and a switch found unfinished
    # (controller.lease.gpu).
    "start_failed", "start_timeout", "start_not_taken", "controller_crash",
    OTHER_REASON,
})
"""Every reason a switch may fail with: the values of
``rota_controller_switch_failures_total{reason}`` and, through :func:`wire_reason`, error
codes of the activation API."""

ENGINE_UNAUTHORIZED = "engine_unauthorized"
"""The error code of a switch that failed because the engine refused rota's control token
(the switch's reason ``unauthorized``): ``unauthorized`` is the API's own 401."""
_RENAMED_ON_THE_WIRE = MappingProxyType({"unauthorized": ENGINE_UNAUTHORIZED})

ASK_AGAIN_RETRY_AFTER_S = 1
SWITCH_FAILURE_RETRY_AFTER_S = 2


@dataclass(frozen=True)
class Refusal:
    """What an error code means: the HTTP status it is sent with, whether the caller should
    ask again (after ``Retry-After``; a gateway does while its request's deadline allows),
    and the ``Retry-After`` it carries (None: none)."""

    status: int
    ask_again: bool
    retry_after_s: int | None
    meaning: str

    def headers(self, retry_after_s: float | None = None) -> dict[str, str]:
        """The answer's ``Retry-After`` header (``retry_after_s`` overrides the row's)."""
        value = self.retry_after_s if retry_after_s is None else retry_after_s
        return {} if value is None else {"Retry-After": str(int(max(1, value)))}


SWITCH_FAILED = Refusal(503, False, SWITCH_FAILURE_RETRY_AFTER_S,
                        "the switch failed (the code says why); the GPU stays as it was or "
                        "idle, and a later activation starts a new switch")
"""The row of every switch failure reason, and of every code the table does not list."""

_ASK_AGAIN = Refusal(409, True, ASK_AGAIN_RETRY_AFTER_S, "")

ERRORS: Mapping[str, Refusal] = MappingProxyType({
    "invalid_request": Refusal(400, False, None, "the body is not an ActivateRequest"),
    "unauthorized": Refusal(401, False, None, "no valid activation token was given"),
    "unknown_model": Refusal(404, False, None,
                             "no serving claimant of this node has the model (or claim)"),
    "not_found": Refusal(404, False, None, "no such path or method of the activation API"),
    "method_not_allowed": Refusal(405, False, None, "the path takes another method"),
    "request_too_large": Refusal(413, False, None,
                                 f"the body is longer than {MAX_BODY_BYTES} bytes"),
    "not_leader": Refusal(409, True, ASK_AGAIN_RETRY_AFTER_S,
                          "this instance does not act for the node (a standby, or a worker "
                          "closed when it lost the node): the node's leader answers"),
    "stopping": Refusal(409, True, ASK_AGAIN_RETRY_AFTER_S,
                        "this instance is stopping (its waiters are answered now): the next "
                        "leader answers"),
    "interrupted": Refusal(409, True, ASK_AGAIN_RETRY_AFTER_S,
                           "the switch was cut short before it finished (fenced off: the Lease "
                           "moved or this instance lost the node; or a step failed); the "
                           "worker reconciles, and asking again starts from what it finds"),
    "min_residency": Refusal(409, True, ASK_AGAIN_RETRY_AFTER_S,
                             "declined for now by policy (this release's controller holds "
                             "the switch for the residency instead)"),
    "switch_failed": SWITCH_FAILED,
    "not_serving": Refusal(503, False, SWITCH_FAILURE_RETRY_AFTER_S,
                           "the claimant's pod is not running and ready on this node"),
    ENGINE_UNAUTHORIZED: Refusal(503, False, SWITCH_FAILURE_RETRY_AFTER_S,
                                 "the engine refused rota's control token (a failed switch)"),
    **{reason: SWITCH_FAILED for reason in sorted(SWITCH_FAILURE_REASONS)
       if reason not in _RENAMED_ON_THE_WIRE},
})
"""The one table from error code to answer: the server sends each code with its status and
``Retry-After``, the gateway asks again exactly where ``ask_again`` says so."""


def refusal_of(code: str) -> Refusal:
    """The row of ``code``; :data:`SWITCH_FAILED` for a code the table does not list (a
    reason of a newer release, an unexpected error's name)."""
    return ERRORS.get(code, SWITCH_FAILED)


def wire_reason(reason: str) -> str:
    """The error code of a switch (or activation) that failed with ``reason``."""
    if not reason:
        return "switch_failed"
    return _RENAMED_ON_THE_WIRE.get(reason, reason)


def asks_again(code: str | None, status: int) -> bool:
    """Whether an error answer means "ask again" to a caller: by the code where the table
    knows it (whatever the status: a controller of an earlier release sent ``stopping`` and
    ``not_leader`` as 503 at times), by a 409 otherwise (a code of a newer release)."""
    if code is not None and code in ERRORS:
        return ERRORS[code].ask_again
    return status == 409


# -- POST /v1/activate ------------------------------------------------------------------------


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
    """The error code: a key of :data:`ERRORS`, or a switch failure reason."""
    message: str = ""


class ErrorBody(BaseModel):
    model_config = ConfigDict(extra="ignore")

    error: ErrorDetail

    @classmethod
    def of(cls, code: str, message: str) -> ErrorBody:
        return cls(error=ErrorDetail(type=code, message=message))


# -- GET /v1/state ----------------------------------------------------------------------------


class LastSwitch(BaseModel):
    """The outcome of a GPU's latest switch."""

    model_config = ConfigDict(extra="ignore", populate_by_name=True)

    ok: bool
    from_: str | list[str] | None = Field(default=None, alias="from")
    """The holder before the switch (None: the GPU was idle); for a gang switch, every
    holder it put to sleep."""
    to: str
    reason: str = ""
    fence: int
    gang: list[str] | None = None
    """A gang switch's GPUs (absent from the JSON for a switch of one GPU)."""
    timings: dict[str, float] = Field(default_factory=dict)

    @model_serializer(mode="wrap")
    def _without_gang_of_one(self, dump: SerializerFunctionWrapHandler) -> dict[str, Any]:
        out: dict[str, Any] = dump(self)
        if out.get("gang") is None:
            out.pop("gang", None)
        return out


class LeaseState(BaseModel):
    """One GPU Lease as this instance knows it."""

    model_config = ConfigDict(extra="ignore")

    holder: str
    state: str
    fence: int
    awake_with: list[str] = Field(default_factory=list)
    """An awake set: the claims (``<namespace>/<name>``) awake beside the holder, in wake
    order (absent from the JSON with one awake, and from a controller of an earlier
    release)."""
    last_error: str = ""
    last_switch: LastSwitch | None = None
    """None (``{}`` in JSON): no switch of this GPU since this instance started."""

    @field_validator("last_switch", mode="before")
    @classmethod
    def _empty_is_none(cls, value: Any) -> Any:
        return None if value == {} else value

    @field_serializer("last_switch")
    def _none_is_empty(self, value: LastSwitch | None) -> dict[str, Any]:
        return {} if value is None else value.model_dump(by_alias=True)

    @model_serializer(mode="wrap")
    def _without_an_empty_set(self, dump: SerializerFunctionWrapHandler) -> dict[str, Any]:
        out: dict[str, Any] = dump(self)
        if not out.get("awake_with"):
            out.pop("awake_with", None)  # one awake: the answer reads as it always did
        return out


class ClaimantState(BaseModel):
    """A claimant of the node, as this instance's cache holds it."""

    model_config = ConfigDict(extra="ignore")

    claim: str
    """``<namespace>/<claim name>``."""
    model: str
    device: str
    gpu: str
    endpoint: str | None = None
    serving: bool
    expected_switch_s: float | None = None
    """Seconds a switch to this claimant is expected to take on its GPU now, from this
    controller's own measurements: the holder's sleep and drain, this claimant's wake and
    probe (the policy's defaults for what was not measured yet); 0 while it is the awake
    holder. None: a controller of an earlier release."""
    queue_position: int | None = None
    """Switches ahead of this claimant's on its GPU: one for a switch in flight to another
    claimant, plus every other claimant queued before it (0: its switch is next, or it is
    awake)."""
    expected_wait_s: float | None = None
    """:attr:`expected_switch_s` plus the expected cost of the switches ahead of it."""


class StateAnswer(BaseModel):
    """The answer of ``GET /v1/state``."""

    model_config = ConfigDict(extra="ignore")

    node: str
    identity: str
    leader: bool
    leases: dict[str, LeaseState] = Field(default_factory=dict)
    """By device (``gpu-<i>`` or a share's device), the GPUs whose Lease this instance read."""
    claimants: list[ClaimantState] = Field(default_factory=list)
