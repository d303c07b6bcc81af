"""Per-model places: a concurrency limit, a bounded FIFO queue and bounded waits.

Each model has a :class:`ModelGate`. A request takes a place (``running``) while it is
being served by this replica — waiting for a switch or streaming from the engine — and at
most ``limit`` do at once: ``limit_per_engine`` for every engine that serves the model (at
least one), so a model served by four engines takes four times the requests of a model
served by one. The count of engines is read at every arrival and every release, so places
follow the fleet as engines come and go. Beyond the limit up to ``queue_size`` wait in
arrival order, and a
request finding the queue full is refused at once (429). A queued request that does not
get a place before its deadline is refused with 503. Either way the dispatcher gives the
answer its Retry-After, from the switch costs measured for the model
(:meth:`~controller.gateway.dispatch.Dispatcher.retry_after_s`). A place is given back on
every exit, a client's disconnect (task cancellation) included, and handed straight to the
next request in the queue.

``in_flight`` counts the requests sent to an engine and not yet finished; the metrics read
it at scrape time. These counts are per replica and only shape load: routing correctness
never depends on them.
"""

from __future__ import annotations

import asyncio
from collections import deque
from collections.abc import AsyncIterator, Callable, Collection, Iterator
from contextlib import asynccontextmanager, contextmanager
from dataclasses import dataclass

from controller.gateway.errors import Code, Overloaded, Unavailable

__all__ = ["GateCounts", "ModelGate", "ModelPlaces"]


@dataclass(frozen=True)
class GateCounts:
    running: int
    waiting: int
    in_flight: int


class ModelGate:
    """The places of one model on this replica."""

    def __init__(self, model: str, *, limit_per_engine: int, engines: Callable[[], int],
                 queue_size: int) -> None:
        self.model = model
        self.limit_per_engine = limit_per_engine
        self._engines = engines
        self.queue_size = queue_size
        self.running = 0
        self.in_flight = 0
        self._queue: deque[asyncio.Future[None]] = deque()

    @property
    def limit(self) -> int:
        """How many requests may hold a place at once now."""
        return self.limit_per_engine * max(1, self._engines())

    @property
    def waiting(self) -> int:
        return len(self._queue)

    def counts(self) -> GateCounts:
        return GateCounts(self.running, self.waiting, self.in_flight)

    async def acquire(self, deadline: float) -> None:
        """Take a place, waiting in the queue until ``deadline`` (event-loop time).

        Raises:
            Overloaded: the queue is full (429).
            Unavailable: no place came free before the deadline (503).
        """
        self._grant()  # places an added engine brought go to the queue first
        if self.running < self.limit and not self._queue:
            self.running += 1
            return
        if len(self._queue) >= self.queue_size:
            raise Overloaded(
                f"Too many requests for model '{self.model}'; {self.queue_size} are already "
                "waiting.", code=Code.QUEUE_FULL)
        place: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        self._queue.append(place)
        granted = False
        try:
            async with asyncio.timeout_at(deadline):
                await place
            granted = True
        except TimeoutError:
            raise Unavailable(
                f"Waited too long for a place to serve model '{self.model}'.",
                code=Code.QUEUE_TIMEOUT) from None
        finally:
            if not granted:
                try:
                    self._queue.remove(place)
                except ValueError:
                    # Already handed to us as we gave up: pass it on.
                    if place.done() and not place.cancelled():
                        self.release()

    def release(self) -> None:
        """Give a place back: to the oldest waiter still waiting, else to the pool."""
        self.running -= 1
        self._grant()

    def _grant(self) -> None:
        """Hand free places to the waiters, oldest first."""
        limit = self.limit
        while self._queue and self.running < limit:
            place = self._queue.popleft()
            if not place.done():
                self.running += 1
                place.set_result(None)

    @asynccontextmanager
    async def place(self, deadline: float) -> AsyncIterator[None]:
        """Hold a place for the block (see :meth:`acquire`)."""
        await self.acquire(deadline)
        try:
            yield
        finally:
            self.release()

    @contextmanager
    def upstream(self) -> Iterator[None]:
        """Count the block as a request in flight to an engine."""
        self.in_flight += 1
        try:
            yield
        finally:
            self.in_flight -= 1


class ModelPlaces:
    """The gates of every model, created on first use (only for models rota knows).

    ``engines(model)`` says how many engines serve ``model`` now."""

    def __init__(self, *, limit_per_engine: int, engines: Callable[[str], int],
                 queue_size: int) -> None:
        self._limit_per_engine = limit_per_engine
        self._engines = engines
        self._queue_size = queue_size
        self._gates: dict[str, ModelGate] = {}

    def gate(self, model: str) -> ModelGate:
        gate = self._gates.get(model)
        if gate is None:
            gate = self._gates[model] = ModelGate(
                model, limit_per_engine=self._limit_per_engine,
                engines=lambda: self._engines(model), queue_size=self._queue_size)
        return gate

    def counts(self) -> dict[str, GateCounts]:
        return {model: gate.counts() for model, gate in sorted(self._gates.items())}

    def prune(self, known: Collection[str]) -> None:
        """Forget the idle gates of models that no claim serves any more."""
        for model in [m for m, g in self._gates.items() if m not in known
                      and g.running == 0 and g.waiting == 0 and g.in_flight == 0]:
            del self._gates[model]
