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

__all__ = ["PATH", "STATE_PATH", "TOKEN_HEADER", "ActivateAnswer", "ActivateRequest",
           "ErrorBody", "ErrorDetail"]

PATH = "/v1/activate"
STATE_PATH = "/v1/state"
TOKEN_HEADER = "X-Rota-Activation-Token"
"""The activation token itself (no scheme), for callers whose ``Authorization`` header
belongs to someone else (the API server's proxy)."""


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
