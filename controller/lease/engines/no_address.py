"""The engine of a claimant whose pod has no IP (not started yet, or restarting).

Such an engine cannot be reached, so every call fails as a connection that could not be
made fails (:class:`~controller.lease.engines.errors.EngineUnreachable`, nothing sent):
each caller then does what it does for an engine that does not answer (reconciliation
reads the GPU through the device, a switch to it fails with ``unreachable``, a sleep of it
is unknown). It is not a fence: nobody else moved the GPU Lease.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import NoReturn

from controller.lease.engines.base import (
    EngineEndpoint,
    SleepOutcome,
    SleepState,
    SleepStateKind,
    UnfinishedWake,
    WakeOutcome,
)
from controller.lease.engines.errors import EngineUnreachable
from controller.lease.engines.probe import ProbeMode, ProbeReason, ProbeResult

__all__ = ["NoAddressEngine"]


class NoAddressEngine:
    """An :class:`~controller.lease.engines.base.EngineAdapter` for a pod without an IP."""

    def __init__(self, endpoint: EngineEndpoint) -> None:
        self._endpoint = endpoint

    @property
    def endpoint(self) -> EngineEndpoint:
        return self._endpoint

    def fenced(self, fences: Mapping[str, int]) -> NoAddressEngine:
        """The same (nothing is ever sent), its endpoint bound to ``fences``."""
        return NoAddressEngine(self._endpoint.fenced(fences))

    def _why(self) -> str:
        return f"{self._endpoint.claim}: pod {self._endpoint.pod or '?'} has no IP"

    def _unreachable(self, step: str) -> NoReturn:
        raise EngineUnreachable(self._why(), step=step)

    async def sleep(self, level: int, *, confirm: bool = True, keep: bool = False
                    ) -> SleepOutcome:
        self._unreachable("sleep")

    async def can_keep(self, level: int) -> bool:
        return False

    async def wake(self, level: int, *, confirm: bool = True) -> WakeOutcome:
        self._unreachable("wake_up")

    async def confirm_asleep(self, level: int) -> None:
        self._unreachable("is_sleeping")

    async def confirm_awake(self) -> None:
        self._unreachable("is_sleeping")

    async def finish_wake(self, unfinished: UnfinishedWake) -> WakeOutcome:
        self._unreachable(unfinished.next_step)

    async def is_sleeping(self) -> bool:
        self._unreachable("is_sleeping")

    async def sleep_state(self, unfinished: UnfinishedWake | None = None) -> SleepState:
        return SleepState(SleepStateKind.UNKNOWN, detail=self._why())

    async def in_flight(self) -> int | None:
        self._unreachable("metrics")

    async def health(self) -> bool:
        return False

    async def probe(self) -> ProbeResult:
        return ProbeResult(ok=False, mode=ProbeMode.ANSWER, reason=ProbeReason.UNREACHABLE,
                           content="", ttft_s=None, total_s=0.0, usage=None,
                           detail=self._why())
