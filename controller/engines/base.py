"""What the lease controller needs from an engine, independent of which engine it is.

The switch protocol drains, sleeps, wakes and probes engines of several kinds (vLLM,
vLLM-Omni, anything with HTTP sleep controls). This module holds the one interface they
share, :class:`EngineAdapter`, the values its methods take and return, and the timeouts
that bound every call. Adapters live in their own modules and are chosen by
:func:`controller.engines.registry.make_adapter`.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Protocol
from urllib.parse import urlsplit

from pydantic import BaseModel, ConfigDict, Field

if TYPE_CHECKING:
    from controller.engines.probe import ProbeResult

__all__ = [
    "SLEEP_LEVELS",
    "EngineAdapter",
    "EngineEndpoint",
    "SleepOutcome",
    "StageAck",
    "StepTiming",
    "Timeouts",
    "WakeOutcome",
    "check_level",
]

SLEEP_LEVELS = (1, 2)
"""Sleep levels the adapters accept: 1 offloads weights to host memory, 2 discards them."""


def check_level(level: int) -> int:
    """``level`` if it is a sleep level rota uses; ValueError otherwise."""
    if type(level) is not int or level not in SLEEP_LEVELS:
        raise ValueError(f"sleep level must be 1 or 2, not {level!r}")
    return level


@dataclass(frozen=True)
class EngineEndpoint:
    """Where one claimant's engine listens, and who it is in logs.

    Attributes:
        base_url: scheme, host and port, e.g. ``http://10.0.0.5:8000`` (no path).
        model: the served model name (the ``model`` of the probe request).
        claim: the claim reference (``namespace/name``) for logs.
        pod: the engine pod (``namespace/name``) for logs, when known.
        token: bearer token for the control endpoints; never logged or shown.
    """

    base_url: str
    model: str
    claim: str
    pod: str | None = None
    token: str | None = field(default=None, repr=False)

    def __post_init__(self) -> None:
        parts = urlsplit(self.base_url)
        if parts.scheme not in ("http", "https") or not parts.hostname:
            raise ValueError(f"engine base_url must be http(s)://host:port, not {self.base_url!r}")
        if parts.path not in ("", "/") or parts.query or parts.fragment:
            raise ValueError(f"engine base_url must not have a path or query: {self.base_url!r}")
        object.__setattr__(self, "base_url", self.base_url.rstrip("/"))
        if not self.model:
            raise ValueError("engine model name must not be empty")

    def url(self, path: str) -> str:
        """The absolute URL of ``path`` (which starts with ``/``) on this engine."""
        return self.base_url + path

    def log_fields(self) -> dict[str, Any]:
        """Context for ``extra=`` of every log line about this engine."""
        return {"claim": self.claim, "pod": self.pod, "model": self.model,
                "engine": self.base_url}


class Timeouts(BaseModel):
    """Time limits of engine calls, in seconds. Every HTTP call runs under one of them.

    Defaults follow what real engines take: a first level-1 sleep allocates pinned host
    memory for the weights and can take tens of seconds (18.5 s for a 27B model in the
    reference experiment), and a level-2 wake reloads weights from disk.
    """

    model_config = ConfigDict(extra="forbid", frozen=True, use_attribute_docstrings=True)

    connect_s: float = Field(default=5.0, gt=0)
    """TCP connect to the engine; a connect that times out counts as unreachable."""
    status_s: float = Field(default=5.0, gt=0)
    """Reads: ``/is_sleeping``, ``/metrics``, ``/health``."""
    sleep_s: float = Field(default=120.0, gt=0)
    """One sleep call (``mode=wait`` finishes running requests first)."""
    wake_level1_s: float = Field(default=300.0, gt=0)
    """The whole level-1 wake (copying the weights back from host memory)."""
    wake_level2_s: float = Field(default=600.0, gt=0)
    """The whole level-2 wake sequence, weight reload from disk included."""
    probe_total_s: float = Field(default=60.0, gt=0)
    """The whole correctness probe, from the request to ``[DONE]``."""
    probe_first_token_s: float = Field(default=30.0, gt=0)
    """From the probe request to its first content token (warm-up after a wake included)."""

    def wake_s(self, level: int) -> float:
        """The budget of a whole wake from sleep ``level``."""
        return self.wake_level1_s if check_level(level) == 1 else self.wake_level2_s


@dataclass(frozen=True)
class StepTiming:
    """One HTTP step of a sleep or wake and how long it took (seconds, monotonic clock)."""

    name: str
    seconds: float


@dataclass(frozen=True)
class StageAck:
    """One acknowledgement of a stage-aware engine (vLLM-Omni) for one stage and rank."""

    task_id: str
    status: str
    stage_id: int | None
    rank: int | None
    freed_bytes: int
    total_freed_gib: float | None
    rank_residual_gib: float | None
    error_msg: str | None


@dataclass(frozen=True)
class SleepOutcome:
    """A sleep the engine confirmed (``/is_sleeping`` answered true afterwards).

    Attributes:
        level: the sleep level asked for.
        sleep_s: from sending the sleep call to its answer (confirmation not included).
        freed_bytes: device bytes the engine says it handed back; None when the engine
            does not say (vLLM's ``/sleep`` answers an empty body: read the device).
        acks: per-stage acknowledgements (vLLM-Omni), else empty.
    """

    level: int
    sleep_s: float
    freed_bytes: int | None = None
    acks: tuple[StageAck, ...] = ()


@dataclass(frozen=True)
class WakeOutcome:
    """A wake the engine confirmed (``/is_sleeping`` answered false afterwards).

    Attributes:
        level: the level the engine was woken from.
        wake_s: the wake call time: from sending the first wake call to the completion of
            the last step (weight reload and prefix-cache reset included; the
            ``/is_sleeping`` confirmation not).
        steps: every step in order with its duration.
        acks: per-stage acknowledgements (vLLM-Omni), else empty.
    """

    level: int
    wake_s: float
    steps: tuple[StepTiming, ...]
    acks: tuple[StageAck, ...] = ()


class EngineAdapter(Protocol):
    """The controller's view of one engine. Every method is bounded by :class:`Timeouts`
    and raises only :class:`~controller.engines.errors.EngineError` subclasses (besides
    ``ValueError`` for a level other than 1 or 2, and cancellation).

    No method retries a sleep or a wake: after a failure or a timeout the engine's state
    is unknown, and the caller decides (read ``is_sleeping``, put it back to sleep).
    """

    @property
    def endpoint(self) -> EngineEndpoint:
        """The engine this adapter talks to."""
        ...

    async def sleep(self, level: int) -> SleepOutcome:
        """Put the engine to sleep at ``level``, letting running requests finish, and
        confirm with ``/is_sleeping``. Raises EngineLied when the engine says it is awake
        after answering the sleep with success."""
        ...

    async def wake(self, level: int) -> WakeOutcome:
        """Wake the engine from a sleep at ``level`` (all steps that level needs) and
        confirm with ``/is_sleeping``. Raises EngineLied when it still says it sleeps."""
        ...

    async def is_sleeping(self) -> bool:
        """The engine's own answer to ``/is_sleeping``."""
        ...

    async def in_flight(self) -> int | None:
        """Requests running plus waiting, from the engine's Prometheus metrics; None when
        the engine exposes no such metrics."""
        ...

    async def health(self) -> bool:
        """True when ``/health`` answers 2xx. Proves nothing about a wake: vLLM answers
        200 while asleep; use :meth:`probe` for that."""
        ...

    async def probe(self) -> ProbeResult:
        """Send the correctness request; never raises for a failed probe (see
        :meth:`ProbeResult.raise_for_failure <controller.engines.probe.ProbeResult>`)."""
        ...
