"""The engine guard in front of a recording upstream, and a raw HTTP client.

The upstream is a real aiohttp server that answers 200 to anything and records the request
target exactly as it arrived: what an engine would route on. The raw client writes the
request line byte for byte, because every HTTP client library normalises a URL before
sending it (dot segments, percent-encoding), which is the very thing under test.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from pathlib import Path

from aiohttp import web
from aiohttp.test_utils import TestServer

from controller.credentials import Credential
from controller.guard.proxy import make_app
from controller.guard.settings import GuardSettings
from rota.api.engine_guard import CONTROL_TOKEN_HEADER

TOKEN = "rota-control-1"
KEY = "sk-engine-1"
DEADLINE = 10.0
API_KEY_ONLY = {"Authorization": f"Bearer {KEY}"}
CONTROL_ONLY = {CONTROL_TOKEN_HEADER: TOKEN}


@dataclass(frozen=True)
class Arrival:
    """One request as the recording upstream received it."""

    method: str
    raw_path: str
    """The request target, byte for byte."""
    path: str
    """The decoded path, as a router (vLLM's included) matches it."""


@dataclass
class UpstreamRecorder:
    """A stand-in engine: answers 200 to every method and path, and remembers each."""

    arrivals: list[Arrival] = field(default_factory=list)

    async def _record(self, request: web.Request) -> web.Response:
        self.arrivals.append(Arrival(request.method, request.raw_path, request.path))
        return web.json_response({"ok": True})

    def app(self) -> web.Application:
        app = web.Application()
        app.router.add_route("*", "/{tail:.*}", self._record)
        return app


@dataclass(frozen=True)
class Answer:
    status: int
    body: bytes


@dataclass
class GuardedRecorder:
    recorder: UpstreamRecorder
    guard: TestServer

    async def send(self, method: str, target: str,
                   headers: dict[str, str] | None = None) -> Answer:
        """``method target`` sent to the guard exactly as written."""
        assert self.guard.port is not None
        return await raw_request(self.guard.host, self.guard.port, method, target,
                                 headers or {})


@contextlib.asynccontextmanager
async def guard_over_recorder(tmp_path: Path) -> AsyncIterator[GuardedRecorder]:
    """A guard with a control token and an API key, in front of an UpstreamRecorder."""
    recorder = UpstreamRecorder()
    upstream = TestServer(recorder.app(), host="127.0.0.1", port=0)
    await upstream.start_server()
    token_file, key_file = tmp_path / "token", tmp_path / "api-key"
    token_file.write_text(TOKEN + "\n")
    key_file.write_text(KEY + "\n")
    values: dict[str, object] = {"upstream": str(upstream.make_url("")),
                                 "api_key_file": key_file, "token_recheck_s": 0.0}
    if "control_token_file" in GuardSettings.model_fields:
        values["control_token_file"] = token_file  # guards before per-claim tokens (F1)
    settings = GuardSettings.model_validate(values)
    control = Credential(token_file, recheck_s=0.0)
    api_key = Credential(key_file, recheck_s=0.0)
    await control.load()
    await api_key.load()
    guard = TestServer(make_app(settings, control=control, api_key=api_key),
                       host="127.0.0.1", port=0)
    await guard.start_server()
    try:
        yield GuardedRecorder(recorder, guard)
    finally:
        await guard.close()
        await upstream.close()


async def raw_request(host: str, port: int, method: str, target: str,
                      headers: dict[str, str]) -> Answer:
    """One HTTP/1.1 request on its own connection; the answer read until the server closes."""
    lines = [f"{method} {target} HTTP/1.1", f"Host: {host}", "Content-Length: 0",
             "Connection: close", *(f"{name}: {value}" for name, value in headers.items())]
    async with asyncio.timeout(DEADLINE):
        reader, writer = await asyncio.open_connection(host, port)
        try:
            writer.write(("\r\n".join(lines) + "\r\n\r\n").encode("latin-1"))
            await writer.drain()
            data = await reader.read()
        finally:
            writer.close()
            with contextlib.suppress(ConnectionError):
                await writer.wait_closed()
    head, _, body = data.partition(b"\r\n\r\n")
    return Answer(int(head.split(b" ", 2)[1]), body)
