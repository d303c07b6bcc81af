"""Generation traffic of the simulated engine: admission, pacing, abort, drain, faults.

Every change a waiter may care about (engine state, the in-flight set, faults) notifies
one condition; waits are on predicates over it, never on the clock. A wait made for an
HTTP request also ends when the client goes away (aiohttp does not cancel handlers on
disconnect, so the transport is checked every :data:`DISCONNECT_POLL_SECONDS`).

Admission follows vLLM: a paused engine holds new requests until resumed; a sleeping one
(or one going to sleep) refuses them with 503, or holds them until woken when the
``refuse_while_asleep`` fault is off (a real vLLM may crash instead).
"""

from __future__ import annotations

import asyncio
import logging
import uuid
from abc import ABC, abstractmethod
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field
from typing import Literal

from aiohttp import web

from e2e.engine_simulator.errors import SimError
from e2e.engine_simulator.generation import TokenPlan
from e2e.engine_simulator.settings import Faults, FaultsPatch
from e2e.engine_simulator.state import Quality

__all__ = [
    "DISCONNECT_POLL_SECONDS",
    "Generation",
    "GenerationFailed",
    "PauseMode",
    "Traffic",
]

log = logging.getLogger(__name__)

DISCONNECT_POLL_SECONDS = 0.25

PauseMode = Literal["abort", "wait", "keep"]


class GenerationFailed(Exception):
    """A generation failed after it started (the ``fail_mid_stream`` fault)."""


@dataclass
class Generation:
    """One running generation request."""

    id: str
    quality: Quality
    aborted: asyncio.Event = field(default_factory=asyncio.Event)


def _client_gone(request: web.Request | None) -> bool:
    if request is None:
        return False
    transport = request.transport
    return transport is None or transport.is_closing()


class Traffic(ABC):
    """The in-flight side of an engine; :class:`~.engine.Engine` adds the control calls."""

    def __init__(self, *, faults: Faults, ttft_seconds: float, tokens_per_second: float) -> None:
        self.faults = faults
        self._ttft_seconds = ttft_seconds
        self._tokens_per_second = tokens_per_second
        self._changed = asyncio.Condition()
        self._running: dict[str, Generation] = {}
        self._waiting = 0
        self._draining: Literal["sleep", "pause"] | None = None
        """A sleep or pause is under way: new generations are not admitted."""
        self._frozen = False
        """A ``mode=keep`` sleep or pause is under way: running generations stand still."""
        self._paused = False
        self._closing = False
        self.generations_started = 0
        self.generations_aborted = 0

    @abstractmethod
    def _asleep(self) -> bool:
        """True while any memory tag is asleep (or scheduling is paused by a level-0 sleep)."""

    @abstractmethod
    def _quality(self) -> Quality:
        """What a generation started now would produce."""

    async def shutdown(self, grace: float) -> None:
        """Refuse new work; let running generations finish for ``grace`` s, then abort them."""
        async with self._changed:
            self._closing = True
            self._changed.notify_all()
        try:
            async with asyncio.timeout(grace):
                await self.wait_for(lambda: not self._running)
        except TimeoutError:
            await self._abort_running("shutdown")
        log.info("engine simulator drained", extra={"aborted": self.generations_aborted})

    # -- waiting -----------------------------------------------------------------------

    async def wait_for(
        self, predicate: Callable[[], bool], *, request: web.Request | None = None
    ) -> None:
        """Wait until ``predicate()`` holds. With a request, give up when its client leaves."""
        async with self._changed:
            while not predicate():
                if _client_gone(request):
                    raise SimError("client closed the connection", status=499,
                                   err_type="ClientClosedRequest")
                try:
                    async with asyncio.timeout(
                        DISCONNECT_POLL_SECONDS if request is not None else None
                    ):
                        await self._changed.wait()
                except TimeoutError:
                    pass

    # -- generations -------------------------------------------------------------------

    @property
    def running(self) -> int:
        return len(self._running)

    @property
    def waiting(self) -> int:
        return self._waiting

    @property
    def paused(self) -> bool:
        return self._paused

    def _admissible(self) -> bool:
        return not (self._asleep() or self._draining is not None or self._paused
                    or self._closing)

    def _refusing(self) -> bool:
        """Refuse rather than hold: shutting down, or asleep (or going to sleep) and told to."""
        asleep = self._asleep() or self._draining == "sleep"
        return self._closing or (asleep and self.faults.refuse_while_asleep)

    def _runnable(self) -> bool:
        return not (self._asleep() or self._frozen or self._paused
                    or self.faults.stall_generation)

    async def admit(self, request: web.Request | None = None) -> Generation:
        """Admit a generation, or refuse it (503) or hold it while asleep or paused."""
        async with self._changed:
            self._waiting += 1
            self._changed.notify_all()
        try:
            while not self._admissible():
                if self._closing:
                    raise SimError("The server is shutting down.", status=503,
                                   err_type="ServiceUnavailableError")
                if self._refusing():
                    raise SimError(
                        "The engine is sleeping and cannot serve requests (engine simulator; "
                        "a real vLLM may crash or hang here). Wake it up first.",
                        status=503, err_type="ServiceUnavailableError",
                    )
                await self.wait_for(lambda: self._admissible() or self._refusing(),
                                    request=request)
            gen = Generation(id=uuid.uuid4().hex, quality=self._quality())
            self._running[gen.id] = gen
            self.generations_started += 1
        finally:
            async with self._changed:
                self._waiting -= 1
                self._changed.notify_all()
        return gen

    async def finish(self, gen: Generation) -> None:
        async with self._changed:
            self._running.pop(gen.id, None)
            self._changed.notify_all()

    async def _abort_running(self, reason: str) -> None:
        async with self._changed:
            for gen in self._running.values():
                if not gen.aborted.is_set():
                    gen.aborted.set()
                    self.generations_aborted += 1
            self._changed.notify_all()
        if self._running:
            log.info("aborted running generations",
                     extra={"reason": reason, "count": len(self._running)})

    async def _interruptible_delay(self, seconds: float, gen: Generation) -> None:
        if seconds <= 0:
            return
        try:
            async with asyncio.timeout(seconds):
                await gen.aborted.wait()
        except TimeoutError:
            pass

    async def tokens(
        self, gen: Generation, plan: TokenPlan, request: web.Request | None = None
    ) -> AsyncIterator[str]:
        """Yield the plan's tokens at the configured pace; stop early when aborted."""
        await self._interruptible_delay(self._ttft_seconds, gen)
        tps = self._tokens_per_second
        for index, token in enumerate(plan.tokens):
            if index > 0 and tps > 0:
                await self._interruptible_delay(1.0 / tps, gen)
            await self.wait_for(lambda: gen.aborted.is_set() or self._runnable(), request=request)
            if gen.aborted.is_set():
                return
            if self.faults.fail_mid_stream and (index > 0 or len(plan.tokens) == 1):
                raise GenerationFailed(
                    "simulated fault fail_mid_stream: the engine failed mid-generation"
                )
            yield token

    # -- draining for sleep and pause --------------------------------------------------

    async def _drain(
        self, mode: PauseMode, request: web.Request | None, *, purpose: Literal["sleep", "pause"]
    ) -> None:
        async with self._changed:
            self._draining = purpose
            self._frozen = mode == "keep"
            self._changed.notify_all()
        if mode == "abort":
            await self._abort_running("sleep or pause with mode=abort")
        elif mode == "wait":
            await self.wait_for(lambda: not self._running, request=request)

    async def _end_drain(self) -> None:
        async with self._changed:
            self._draining = None
            self._frozen = False
            self._changed.notify_all()

    async def set_faults(self, patch: FaultsPatch) -> Faults:
        async with self._changed:
            self.faults = patch.apply(self.faults)
            self._changed.notify_all()
        log.warning("faults changed", extra={"faults": self.faults.model_dump()})
        return self.faults
