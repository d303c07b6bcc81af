"""What the lease controller needs from an engine, independent of which engine it is.

The switch protocol drains, sleeps, wakes and probes engines of several kinds (vLLM,
vLLM-Omni, anything with HTTP sleep controls). This module holds the one interface they
share, :class:`EngineAdapter`, the values its methods take and return, and the timeouts
that bound every call. Adapters live in their own modules and are chosen by
:func:`controller.lease.engines.registry.make_adapter`.

**Credentials.** Two, never mixed up, never logged:

- the engine's **API key** (vLLM's ``--api-key``, from the Secret a claim names in
  ``apiKeySecret``): sent as ``Authorization: Bearer <key>`` on ``/v1*`` calls (the probe,
  vLLM-Omni's ``/v1/omni/*``), the only paths vLLM checks it on;
- rota's **control token**, one per claim (the driver derives it and writes it into the
  claim's containers; the controller asks the driver for it,
  :mod:`controller.lease.control_tokens`): sent in :data:`CONTROL_TOKEN_HEADER` on the
  control calls to that claim's engine only, so what one engine learns opens no other.
  **vLLM never checks it**: its
  development routes (``/sleep``, ``/wake_up``, ``/collective_rpc``, ...) are open to
  anyone who reaches the engine's port, and only the network (the engines' NetworkPolicy)
  or rota's engine guard (``rota-engine-guard``, which does check it) protects them.

**Fences.** An adapter bound to the GPU Leases it acts under (:meth:`EngineAdapter.fenced`)
sends their fencing numbers in :data:`~rota.api.engine_guard.FENCE_HEADER` on every
control call; the engine guard refuses one whose fence is lower than one it already let
through (a stale instance's call). vLLM ignores the header: an engine without the guard
is not protected by it.
"""

from __future__ import annotations

import enum
from collections.abc import Awaitable, Callable, Mapping
from dataclasses import dataclass, field, replace
from typing import TYPE_CHECKING, Any, Protocol
from urllib.parse import urlsplit

from pydantic import BaseModel, ConfigDict, Field

from rota.api.engine_guard import CONTROL_TOKEN_HEADER

if TYPE_CHECKING:
    from controller.lease.engines.probe import ProbeResult

__all__ = [
    "CONTROL_TOKEN_HEADER",
    "KEEP_LEVELS",
    "SLEEP_LEVELS",
    "EngineAdapter",
    "EngineEndpoint",
    "SleepOutcome",
    "SleepState",
    "SleepStateKind",
    "StageAck",
    "StepTiming",
    "Timeouts",
    "UnfinishedWake",
    "WakeOutcome",
    "check_level",
]


SLEEP_LEVELS = (1, 2)
"""Sleep levels the adapters accept: 1 offloads weights to host memory, 2 discards them."""
KEEP_LEVELS = (1,)
"""Sleep levels across which requests in flight may be kept (recomputed after the wake):
level 1 only, the one shown on real engines; a level-2 wake reloads the weights."""


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
        token: rota's control token, sent in :data:`CONTROL_TOKEN_HEADER` on control
            calls; only the engine guard checks it (vLLM does not). Never logged or shown.
        token_source: where this claim's control token comes from when it is not known
            yet (asked of the driver on the first control call); wins over ``token``.
        api_key: the engine's own API key (vLLM's ``--api-key``), sent as
            ``Authorization: Bearer`` on ``/v1*`` calls only. Never logged or shown.
        fences: ``(GPU Lease name, fencing number)`` pairs sent on control calls in
            :data:`~rota.api.engine_guard.FENCE_HEADER` (empty: no header); set by
            :meth:`fenced`.
        run: which run of the engine this is (its pod's uid and container restarts), when
            known: what is learnt about an engine (its release) is kept per run, so a
            restarted or replaced engine at the same address is read again.
    """

    base_url: str
    model: str
    claim: str
    pod: str | None = None
    token: str | None = field(default=None, repr=False)
    token_source: Callable[[], Awaitable[str]] | None = field(default=None, repr=False,
                                                               compare=False)
    api_key: str | None = field(default=None, repr=False)
    fences: tuple[tuple[str, int], ...] = ()
    run: str | None = None

    def __post_init__(self) -> None:
        parts = urlsplit(self.base_url)
        if parts.scheme not in ("http", "https") or not parts.hostname:
            raise ValueError(f"engine base_url must be http(s)://host:port, not {self.base_url!r}")
        if parts.path not in ("", "/") or parts.query or parts.fragment:
            raise ValueError(f"engine base_url must not have a path or query: {self.base_url!r}")
        object.__setattr__(self, "base_url", self.base_url.rstrip("/"))
        if not self.model:
            raise ValueError("engine model name must not be empty")

    async def control_token(self) -> str | None:
        """The control token to send on a control call (raises what the source raises)."""
        if self.token_source is not None:
            return await self.token_source()
        return self.token

    def fenced(self, fences: Mapping[str, int]) -> EngineEndpoint:
        """This endpoint, its control calls sent under ``fences`` (Lease name to fence)."""
        return replace(self, fences=tuple(sorted(fences.items())))

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


class SleepStateKind(enum.StrEnum):
    """What an engine's sleep state is, as far as the engine lets anyone tell."""

    AWAKE = "awake"
    ASLEEP = "asleep"
    PARTLY_ASLEEP = "partly_asleep"
    """A wake stopped partway: some memory is mapped again, some tags still sleep. A new
    sleep does nothing (vLLM: "Executor is already sleeping"); finish the wake first."""
    DEAD = "dead"
    """The engine core is dead (``/health`` 503, 500 ``EngineDeadError``): restart it."""
    UNKNOWN = "unknown"
    """The engine cannot be read, or contradicts itself, or may still be about to fall
    asleep (a sleep whose outcome is unknown): confirm through the device."""


@dataclass(frozen=True)
class SleepState:
    """An engine's sleep state, from ``/health``, ``/is_sleeping`` and (where the engine
    exports it) ``vllm:engine_sleep_state``.

    Attributes:
        kind: the verdict.
        level: the sleep level ``vllm:engine_sleep_state`` reports (1, 2), or None.
        tags_asleep: for ``partly_asleep``: the tags the unfinished wake left asleep.
        is_sleeping: the engine's own ``/is_sleeping`` answer, None when not read.
        gauge: the ``sleep_state`` label of ``vllm:engine_sleep_state`` at 1
            (``awake``, ``weights_offloaded``, ``discard_all``); None when the engine has
            no such gauge (stats logging off, another engine).
        detail: a short explanation, for logs and the Lease.
    """

    kind: SleepStateKind
    level: int | None = None
    tags_asleep: tuple[str, ...] = ()
    is_sleeping: bool | None = None
    gauge: str | None = None
    detail: str = ""


@dataclass(frozen=True)
class UnfinishedWake:
    """A wake that stopped partway (a step failed or timed out), carried by the error the
    wake raised (``EngineError.unfinished``) and given back to
    :meth:`EngineAdapter.finish_wake`.

    vLLM cannot undo it: a ``/sleep`` on a half-woken executor does nothing and the memory
    mapped so far stays. Only finishing the wake (or restarting the engine) frees it.

    Attributes:
        level: the level the engine was being woken from.
        next_step: the name of the first step that did not complete.
        tags_asleep: the tags the engine's executor still lists asleep.
    """

    level: int
    next_step: str
    tags_asleep: tuple[str, ...]


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
    and raises only :class:`~controller.lease.engines.errors.EngineError` subclasses (besides
    ``ValueError`` for a level other than 1 or 2, and cancellation).

    No method retries a sleep or a wake (a control POST is re-sent once, only when the
    server closed a kept-alive connection before it answered). A sleep is never abandoned
    silently: one that does not answer in time raises
    :class:`~controller.lease.engines.errors.EngineStateUnknown` (vLLM keeps it registered and
    carries it out when the engine next goes idle, even after a later wake). A wake that
    stops partway raises with ``unfinished`` set; :meth:`finish_wake` continues it.
    """

    @property
    def endpoint(self) -> EngineEndpoint:
        """The engine this adapter talks to."""
        ...

    def fenced(self, fences: Mapping[str, int]) -> EngineAdapter:
        """This adapter with every control call sent under ``fences`` (GPU Lease name to
        the fencing number the caller checked): what a fenced caller uses, so that the
        engine guard can refuse the call if a newer fence reached the engine first."""
        ...

    async def sleep(self, level: int, *, confirm: bool = True, keep: bool = False
                    ) -> SleepOutcome:
        """Put the engine to sleep at ``level``, letting running requests finish, and
        confirm with ``/is_sleeping``. Raises EngineLied when the engine says it is awake
        after answering the sleep with success. ``confirm=False``: the caller confirms
        with :meth:`confirm_asleep` (alongside a read of its own), before anything else
        depends on this sleep.

        ``keep=True`` (only where :meth:`can_keep` says so): do not wait for running
        requests; freeze them with the engine (their output so far kept, recomputed and
        continued at its next wake, which resumes them) and hold new ones."""
        ...

    async def can_keep(self, level: int) -> bool:
        """Whether this engine serves :meth:`sleep` with ``keep=True`` at ``level``: its
        release has the calls, in its route table. Never raises; False when unsure."""
        ...

    async def wake(self, level: int, *, confirm: bool = True) -> WakeOutcome:
        """Wake the engine from a sleep at ``level`` (all steps that level needs) and
        confirm with ``/is_sleeping``. Raises EngineLied when it still says it sleeps.
        ``confirm=False``: the caller confirms with :meth:`confirm_awake`."""
        ...

    async def confirm_asleep(self, level: int) -> None:
        """Raise EngineLied unless the engine says it sleeps (at ``level``, where it
        exports the sleep gauge): the confirmation a sleep does after its call."""
        ...

    async def confirm_awake(self) -> None:
        """Raise EngineLied unless the engine says it is awake: the confirmation a wake
        does after its calls."""
        ...

    async def finish_wake(self, unfinished: UnfinishedWake) -> WakeOutcome:
        """Continue a wake that stopped partway, from ``unfinished.next_step``, and confirm
        it. The only way out of a half-woken engine short of a restart."""
        ...

    async def is_sleeping(self) -> bool:
        """The engine's own answer to ``/is_sleeping`` (true while it is paused, too)."""
        ...

    async def sleep_state(self, unfinished: UnfinishedWake | None = None) -> SleepState:
        """The engine's sleep state from ``/health``, ``/is_sleeping`` and
        ``vllm:engine_sleep_state``; never raises an :class:`EngineError` (an engine that
        cannot be read is ``unknown``, a dead one ``dead``). ``unfinished``: the wake this
        caller knows stopped partway (the engine cannot say which tags are still asleep)."""
        ...

    async def in_flight(self) -> int | None:
        """Requests running plus waiting, from the engine's Prometheus metrics; None when
        the engine exposes no such metrics (vLLM started with ``--disable-log-stats``:
        drain then has nothing to watch). As vLLM reports them at its last engine step:
        requests held while it sleeps or idles paused are not counted."""
        ...

    async def health(self) -> bool:
        """True when ``/health`` answers 2xx. Proves nothing about a wake: vLLM answers
        200 while asleep; use :meth:`probe` for that."""
        ...

    async def probe(self) -> ProbeResult:
        """Send the correctness request; never raises for a failed probe (see
        :meth:`ProbeResult.raise_for_failure <controller.lease.engines.probe.ProbeResult>`)."""
        ...
