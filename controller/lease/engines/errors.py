"""How talking to an engine fails, as one small hierarchy with stable metric labels.

The lease controller needs to tell apart an engine it cannot reach, one that is too slow,
one that said no (and whether the no was a GPU out-of-memory), one whose state contradicts
its own success answer, and a correctness probe that failed. Every class carries a
``reason``: a short label that never changes between releases, so the controller can use it
as a Prometheus label value as is. The reasons, all distinct:

===================  ====================================================================
``unreachable``      :class:`EngineUnreachable`: connection refused, reset or timed out
                     while connecting; DNS failure; the connection dropped mid-answer.
``timeout``          :class:`EngineTimeout`: the engine did not answer one step in time
                     (``step`` names it).
``rejected``         :class:`EngineRejected`: any other non-2xx answer.
``gpu_oom``          :class:`EngineRejected`: the answer says CUDA ran out of memory
                     (vLLM's 500 for a wake that found no room on the device).
``host_oom``         :class:`EngineRejected`: the answer says host memory ran out (a
                     level-1 sleep pins the weights in host memory).
``unauthorized``     :class:`EngineRejected`: 401 or 403; the engine's API key (on
                     ``/v1*``) or, behind rota's engine guard, the control token is wrong.
``ack_error``        :class:`EngineRejected`: a vLLM-Omni ACK with status ``ERROR`` (or an
                     unknown overall status) inside a 200 answer.
``engine_dead``      :class:`EngineDead`: the engine process is alive but its core is dead
                     (``/health`` 503, or a 500 ``EngineDeadError``); only a restart helps.
``state_unknown``    :class:`EngineStateUnknown`: a sleep or wake whose outcome is not known
                     and that may still take effect later (vLLM keeps an abandoned
                     ``/sleep?mode=wait`` registered and fires it when the engine idles).
``lied``             :class:`EngineLied`: a 200 answer, then ``/is_sleeping`` contradicts it.
``bad_response``     :class:`EngineProtocolError`: a 2xx answer that cannot be parsed.
``unsupported_engine`` :class:`EngineUnsupported`: the engine's release is outside the range
                     rota supports, or it does not serve a route the adapter needs (vLLM
                     without ``VLLM_SERVER_DEV_MODE=1``); found at the claim's first probe.
``probe_<reason>``   :class:`ProbeFailed`: the correctness probe failed; ``<reason>`` is one
                     of :class:`~controller.lease.engines.probe.ProbeReason` (``wrong_content``,
                     ``no_done``, ``no_usage``, ``stream_error``, ``timeout``,
                     ``http_error``, ``unreachable``, ``unsupported_engine``).
===================  ====================================================================

Bodies quoted in errors are cut to :data:`MAX_BODY_CHARS` characters so that a large or
secret-bearing answer never reaches logs whole.

A wake that stopped partway raises with :attr:`EngineError.unfinished` set (what is still
asleep, where to go on): the engine cannot be put back to sleep until that wake is
finished (``EngineAdapter.finish_wake``) or the engine restarted.
"""

from __future__ import annotations

import json
import re
from typing import TYPE_CHECKING, Any

from controller.lease.errors import LeaseControllerError

if TYPE_CHECKING:
    from controller.lease.engines.base import UnfinishedWake

__all__ = [
    "MAX_BODY_CHARS",
    "EngineDead",
    "EngineError",
    "EngineLied",
    "EngineProtocolError",
    "EngineRejected",
    "EngineStateUnknown",
    "EngineTimeout",
    "EngineUnreachable",
    "EngineUnsupported",
    "ProbeFailed",
    "error_message",
    "is_engine_dead",
    "is_gpu_oom",
    "parse_json",
    "truncate",
]

MAX_BODY_CHARS = 256
"""At most this many characters of an engine's answer are kept in an error."""

_OOM = re.compile(r"out of memory|CUDA_ERROR_OUT_OF_MEMORY|OutOfMemoryError", re.IGNORECASE)
_HOST_OOM = re.compile(r"DefaultCPUAllocator|cannot allocate memory|host memory|pinned memory"
                       r"|\bENOMEM\b", re.IGNORECASE)


def truncate(text: str, limit: int = MAX_BODY_CHARS) -> str:
    """``text`` cut to ``limit`` characters, marked with an ellipsis when cut."""
    return text if len(text) <= limit else text[: limit - 3] + "..."


def is_gpu_oom(message: str) -> bool:
    """True when an engine's error message reports a device out-of-memory."""
    return bool(_OOM.search(message))


def is_host_oom(message: str) -> bool:
    """True when an engine's error message reports host (CPU, pinned) memory exhausted."""
    return bool(_HOST_OOM.search(message))


ENGINE_DEAD_MESSAGE = "EngineCore encountered an issue."
"""The start of vLLM's ``EngineDeadError`` message. vLLM 0.26 answers a call that met the
dead core with ``{"error": {"message": <that message>, "type": "InternalServerError",
...}}``: the exception's name is not in the answer, its message is."""


def parse_json(body: str, *, step: str, status: int = 200) -> Any:
    """``body`` (an engine's answer) as JSON, or :class:`EngineProtocolError`.

    The one place an engine's JSON is parsed: an answer that is not JSON, and one nested so
    deep that the parser gives up (``RecursionError``, e.g. ``[[[[...`` 5000 deep), are the
    engine's fault, not the controller's; escaping as anything else would stop the
    controller serving every claim of the GPU that engine shares.
    """
    try:
        return json.loads(body)
    except (ValueError, RecursionError) as exc:
        raise EngineProtocolError(
            f"{step}: the engine answered {status} with a body that is not JSON "
            "(or nested too deep)", step=step, body=body) from exc


def is_engine_dead(body: str) -> bool:
    """True when an error answer says the engine core is dead (vLLM's ``EngineDeadError``)."""
    try:
        parsed: Any = parse_json(body, step="error")
    except EngineProtocolError:
        parsed = None
    if isinstance(parsed, dict) and isinstance(parsed.get("error"), dict):
        error = parsed["error"]
        message = str(error.get("message", ""))
        return (error.get("type") == "EngineDeadError" or "EngineDeadError" in message
                or message.startswith(ENGINE_DEAD_MESSAGE))
    return "EngineDeadError" in body or ENGINE_DEAD_MESSAGE in body


def error_message(body: str) -> str:
    """The human part of an error answer: vLLM's ``{"error": {"message": ...}}``, the
    ``{"error": "..."}`` and ``{"detail": ...}`` shapes, or the raw text."""
    try:
        parsed: Any = parse_json(body, step="error")
    except EngineProtocolError:
        return body
    if isinstance(parsed, dict):
        error = parsed.get("error")
        if isinstance(error, dict) and isinstance(error.get("message"), str):
            return str(error["message"])
        if isinstance(error, str):
            return error
        if "detail" in parsed:
            detail = parsed["detail"]
            return detail if isinstance(detail, str) else json.dumps(detail)
    return body


class EngineError(LeaseControllerError):
    """Base of every error an engine adapter raises on purpose.

    Attributes:
        reason: the stable metric label (see the module docstring).
        step: the call that failed (``sleep``, ``wake_up``, ``reload_weights``,
            ``is_sleeping``, ``probe``, ...).
    """

    reason: str = "engine_error"
    unfinished: UnfinishedWake | None = None
    """Set on the error of a wake that stopped partway: what is still asleep, and the step
    :meth:`~controller.lease.engines.base.EngineAdapter.finish_wake` continues from."""

    def __init__(self, message: str, *, step: str) -> None:
        super().__init__(message)
        self.step = step


class EngineUnreachable(EngineError):
    """No usable connection: refused, reset, DNS failure, connect timeout, dropped answer.

    Attributes:
        request_sent: the request may have reached the engine (the connection broke
            after it was made); False when no connection could be made at all.
    """

    reason = "unreachable"

    def __init__(self, message: str, *, step: str, request_sent: bool = False) -> None:
        super().__init__(message, step=step)
        self.request_sent = request_sent


class EngineTimeout(EngineError):
    """The engine did not answer ``step`` within ``timeout_s`` seconds.

    After a timed-out sleep or wake the engine's state is unknown: the caller must read
    ``/is_sleeping`` (and the device) before deciding anything.
    """

    reason = "timeout"

    def __init__(self, message: str, *, step: str, timeout_s: float) -> None:
        super().__init__(message, step=step)
        self.timeout_s = timeout_s


class EngineRejected(EngineError):
    """The engine answered with an error.

    Attributes:
        status: the HTTP status (200 for an error inside a 200 answer, e.g. an Omni ACK).
        body: at most :data:`MAX_BODY_CHARS` characters of the answer.
    """

    def __init__(
        self, message: str, *, step: str, status: int, body: str, reason: str | None = None
    ) -> None:
        super().__init__(message, step=step)
        self.status = status
        self.body = truncate(body)
        self.reason = reason or self._classify(status, body)

    @staticmethod
    def _classify(status: int, body: str) -> str:
        message = error_message(body)
        if is_host_oom(message):  # checked first: host messages may say "out of memory" too
            return "host_oom"
        if is_gpu_oom(message):
            return "gpu_oom"
        if status in (401, 403):
            return "unauthorized"
        return "rejected"


class EngineDead(EngineError):
    """The engine's core is dead (vLLM: ``/health`` 503, or 500 ``EngineDeadError``).

    Nothing but a restart of its pod brings it back; it must never be woken or probed again.
    """

    reason = "engine_dead"


class EngineStateUnknown(EngineError):
    """A sleep or wake whose outcome is unknown and may still take effect later.

    The engine must be treated as possibly awake *and* possibly about to fall asleep until
    ``/is_sleeping`` and the device agree; it must not be woken while such a call may fire.
    """

    reason = "state_unknown"


class EngineLied(EngineError):
    """A control call answered success, but the engine's state says it did not happen."""

    reason = "lied"


class EngineProtocolError(EngineError):
    """A 2xx answer that is not what the endpoint documents (bad JSON, wrong shape)."""

    reason = "bad_response"

    def __init__(self, message: str, *, step: str, body: str) -> None:
        super().__init__(message, step=step)
        self.body = truncate(body)


class ProbeFailed(EngineError):
    """The correctness probe did not pass; ``probe_reason`` is the probe's own label."""

    def __init__(self, message: str, *, probe_reason: str) -> None:
        super().__init__(message, step="probe")
        self.probe_reason = probe_reason
        self.reason = f"probe_{probe_reason}"


class EngineUnsupported(EngineError):
    """The engine is a release (or a configuration) rota cannot drive: its version is
    outside the supported range, or it lacks a route the adapter calls. Nothing was sent
    that changes the engine; only a change of the engine's image or flags helps."""

    reason = "unsupported_engine"
