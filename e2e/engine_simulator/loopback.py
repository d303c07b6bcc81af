"""The simulator's app served on loopback inside a test's own event loop.

aiohttp's ``TestServer`` cancels a handler when its client leaves; the simulator's own
process (:func:`e2e.engine_simulator.app.run`) does not, and neither does vLLM's server: a
wake whose caller gave up goes on and lands later. :class:`SimulatorServer` serves as the
real one does, so an in-memory kit meets the same engine as a real node.
"""

from __future__ import annotations

from typing import Any

from aiohttp.test_utils import TestServer
from aiohttp.web_runner import BaseRunner

__all__ = ["SimulatorServer"]


class SimulatorServer(TestServer):
    """A ``TestServer`` whose handlers run on when their client leaves."""

    async def _make_runner(self, handler_cancellation: bool = False,
                           **kwargs: Any) -> BaseRunner:
        return await super()._make_runner(handler_cancellation=False, **kwargs)
