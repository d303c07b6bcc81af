"""A TCP relay between the lease controllers and the API server that can stall or cut the
connections passing through it: the API server timeouts and resets of a real network,
without touching the API server itself (TLS passes through untouched)."""

from __future__ import annotations

import asyncio
import contextlib
import logging

__all__ = ["FlakyRelay"]

log = logging.getLogger(__name__)


class FlakyRelay:
    """Listens on 127.0.0.1:<port> and relays to ``target``.

    ``stall_s`` > 0 holds every byte that arrives for that long (calls time out);
    :meth:`cut` resets every open connection.
    """

    def __init__(self, target_host: str, target_port: int) -> None:
        self.target = (target_host, target_port)
        self.stall_s = 0.0
        self.port = 0
        self._server: asyncio.Server | None = None
        self._writers: set[asyncio.StreamWriter] = set()
        self._handlers: set[asyncio.Task[None]] = set()

    async def start(self) -> None:
        self._server = await asyncio.start_server(self._serve, "127.0.0.1", 0)
        self.port = self._server.sockets[0].getsockname()[1]

    async def close(self) -> None:
        """Stop listening, reset every connection and wait for their handlers to end."""
        if self._server is not None:
            self._server.close()
        self.cut()
        await asyncio.gather(*self._handlers, return_exceptions=True)
        if self._server is not None:
            await self._server.wait_closed()

    def cut(self) -> int:
        """Reset every connection now (both sides see it closed); how many there were."""
        writers = list(self._writers)
        for writer in writers:
            with contextlib.suppress(Exception):
                writer.transport.abort()
        self._writers.clear()
        return len(writers)

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        handler = asyncio.current_task()
        assert handler is not None
        self._handlers.add(handler)
        try:
            await self._relay(reader, writer)
        finally:
            self._handlers.discard(handler)

    async def _relay(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            up_reader, up_writer = await asyncio.wait_for(
                asyncio.open_connection(*self.target), 5)
        except (OSError, TimeoutError):
            writer.transport.abort()
            return
        self._writers |= {writer, up_writer}
        pumps = [asyncio.create_task(self._pump(reader, up_writer)),
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

    async def _pump(self, source: asyncio.StreamReader, sink: asyncio.StreamWriter) -> None:
        with contextlib.suppress(OSError, asyncio.IncompleteReadError):
            while data := await source.read(65536):
                if self.stall_s > 0:
                    await asyncio.sleep(self.stall_s)
                sink.write(data)
                await sink.drain()
