"""A back-out whose sleep of the failed target loses its connection, on the in-memory node
(real simulators over HTTP, the controller's own workers and switch code).

vLLM's server (uvicorn) closes a kept-alive connection idle for 5 s; a call that reuses it
at that moment never reaches the engine, and the client sees the connection closed or, as
often, reset. The transport sends a control call again after a close, not after a reset:
the back-out's sleep of a target whose wake failed then ended "outcome unknown", the
target stayed unsettled and the old holder was not woken back (callers got
``state_unknown``). This made test_faults_in_memory's ``wake_ignored`` case fail about one
run in four: its probe timeout (5 s) equals the simulator's keep-alive, so the back-out's
sleep went out just as the simulator closed the idle connections. The back-out now sends
the sleep once more when its connection broke; one that completes proves the target
asleep. :class:`KeepAliveResetSimulator` plays the reset, on cue, so the test is
deterministic.
"""

from __future__ import annotations

import asyncio
import contextlib
import socket
import struct

import aiohttp
import pytest

from e2e.harness.gang_node import Engine, gang_node
from tests.controller.conftest import EngineSimFactory

pytestmark = pytest.mark.controller

DEADLINE_S = 30.0


class KeepAliveResetSimulator:
    """A TCP relay in front of one engine that plays uvicorn's keep-alive close in its
    reset form: once :meth:`arm` is called, the next request whose first line is
    ``POST <path>`` is not passed on, and its connection is reset (``SO_LINGER`` 0, as the
    kernel does when a server closes a socket with a request unread in it). Everything
    else is relayed as it comes."""

    def __init__(self, target_port: int) -> None:
        self.target_port = target_port
        self.port = 0
        self.resets = 0
        self._armed: bytes | None = None
        self._server: asyncio.Server | None = None
        self._handlers: set[asyncio.Task[None]] = set()
        self._writers: set[asyncio.StreamWriter] = set()

    @property
    def base_url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def arm(self, path: str) -> None:
        self._armed = f"POST {path}".encode()

    async def start(self) -> None:
        self._server = await asyncio.start_server(self._serve, "127.0.0.1", 0)
        self.port = self._server.sockets[0].getsockname()[1]

    async def close(self) -> None:
        if self._server is not None:
            self._server.close()
        for writer in list(self._writers):  # each handler ends with its connections
            writer.transport.abort()
        await asyncio.gather(*self._handlers, return_exceptions=True)
        if self._server is not None:
            await self._server.wait_closed()

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter
                     ) -> None:
        handler = asyncio.current_task()
        assert handler is not None
        self._handlers.add(handler)
        up_reader, up_writer = await asyncio.open_connection("127.0.0.1", self.target_port)
        self._writers |= {writer, up_writer}
        pumps = [asyncio.create_task(self._requests(reader, up_writer, writer)),
                 asyncio.create_task(self._pump(up_reader, writer))]
        try:
            await asyncio.wait(pumps, return_when=asyncio.FIRST_COMPLETED)
        finally:
            for pump in pumps:
                pump.cancel()
            await asyncio.gather(*pumps, return_exceptions=True)
            for w in (writer, up_writer):
                self._writers.discard(w)
                w.transport.abort()
            self._handlers.discard(handler)

    async def _requests(self, reader: asyncio.StreamReader, upstream: asyncio.StreamWriter,
                        client: asyncio.StreamWriter) -> None:
        with contextlib.suppress(OSError):
            while data := await reader.read(65536):
                if self._armed is not None and data.startswith(self._armed) and (
                        data[len(self._armed):][:1] in (b" ", b"?")):
                    self._armed = None
                    self.resets += 1
                    client.get_extra_info("socket").setsockopt(
                        socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
                    client.transport.abort()
                    return
                upstream.write(data)
                await upstream.drain()

    @staticmethod
    async def _pump(source: asyncio.StreamReader, sink: asyncio.StreamWriter) -> None:
        with contextlib.suppress(OSError):
            while data := await source.read(65536):
                sink.write(data)
                await sink.drain()


async def _behind_reset(engine: Engine) -> KeepAliveResetSimulator:
    """``engine``'s controller calls go through a :class:`KeepAliveResetSimulator`."""
    relay = KeepAliveResetSimulator(int(engine.sim.server.port or 0))
    await relay.start()
    engine.base_url = relay.base_url
    return relay


async def test_the_back_out_sleep_reset_on_its_connection_still_restores_the_holder(
        engine_sim_factory: EngineSimFactory, engine_session: aiohttp.ClientSession) -> None:
    """One GPU: b's wake fails, and the back-out's sleep of b is reset before b reads
    it. b is asleep (it never woke), so a is woken back and serves its callers."""
    node = await gang_node(engine_sim_factory, engine_session,
                           [("a", ("gpu-0",), 20), ("b", ("gpu-0",), 20)],
                           gpus=1, awake=("a",))
    a, b = node.engines
    relay = await _behind_reset(b)
    try:
        await b.sim.faults(wake_fails=True)
        relay.arm("/sleep")
        async with asyncio.timeout(DEADLINE_S):
            failed = await node.activate(b)
        assert (failed.ok, failed.reason) == (False, "gpu_oom"), failed.message
        assert relay.resets == 1, "the back-out's sleep was reset"
        assert node.workers["gpu-0"].unsettled == {}, "b is known asleep"
        assert node.holders() == {"gpu-0": a.claimant.ref}, node.lease("gpu-0").last_error
        assert not a.sim.engine.is_sleeping
        assert b.sim.engine.is_sleeping
        async with asyncio.timeout(DEADLINE_S):
            back = await node.activate(a)
        assert (back.ok, back.switched) == (True, False), back.message
        assert node.watch.violations == []
    finally:
        await node.close()
        await relay.close()


async def test_a_gang_back_out_sleep_reset_on_its_connection_still_restores_the_holder(
        engine_sim_factory: EngineSimFactory, engine_session: aiohttp.ClientSession) -> None:
    """The same in a gang switch: a TP engine's wake fails on gpu-0 and gpu-1, the
    back-out's sleep of it is reset; a is woken back on gpu-0."""
    node = await gang_node(engine_sim_factory, engine_session,
                           [("a", ("gpu-0",), 20), ("tp", ("gpu-0", "gpu-1"), 40)],
                           gpus=2, awake=("a",))
    a, tp = node.engines
    relay = await _behind_reset(tp)
    try:
        await tp.sim.faults(wake_fails=True)
        relay.arm("/sleep")
        async with asyncio.timeout(DEADLINE_S):
            failed = await node.activate(tp)
        assert (failed.ok, failed.reason) == (False, "gpu_oom"), failed.message
        assert relay.resets == 1, "the back-out's sleep was reset"
        assert all(not w.unsettled for w in node.workers.values()), "tp is known asleep"
        assert node.holders() == {"gpu-0": a.claimant.ref, "gpu-1": ""}
        assert not a.sim.engine.is_sleeping
        assert tp.sim.engine.is_sleeping
        assert node.watch.violations == []
    finally:
        await node.close()
        await relay.close()
