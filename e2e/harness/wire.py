"""The gateway's answers as raw bytes on the wire, parsed strictly.

A client library forgives (or hides) what these helpers refuse: a second status line
inside a body, a chunked body without its last chunk, an SSE event that is not
``data:`` or a comment, anything after ``[DONE]``. Requests go over a plain socket with
``Connection: close``, so the answer is every byte up to the server's close. Whatever is
refused raises :class:`Malformed` (an ``AssertionError``, so that a test reports it as a
failed check), with the bytes that broke the rule.
"""

from __future__ import annotations

import asyncio
import json
import re
from dataclasses import dataclass
from typing import Any

DEADLINE_S = 20.0
"""How long an exchange waits for the bytes it reads, by default."""

_STATUS_LINE = re.compile(rb"HTTP/1\.[01] (\d{3}) [^\r\n]*")
_ANY_STATUS_LINE = re.compile(rb"HTTP/1\.[01] \d{3} ")
_CHUNK_SIZE = re.compile(rb"[0-9A-Fa-f]{1,8}")


class Malformed(AssertionError):
    """An answer that breaks HTTP/1.1 framing or the server-sent events format."""


def _require(condition: object, message: str) -> None:
    if not condition:
        raise Malformed(message)


@dataclass(frozen=True)
class Answer:
    """One HTTP answer: its status, headers (names lower-cased) and decoded body."""

    status: int
    headers: dict[str, str]
    body: bytes


@dataclass(frozen=True)
class Event:
    """One server-sent event: its comment lines, its type and its data (``None``:
    comments only)."""

    comments: tuple[str, ...]
    data: Any
    """The JSON value of its ``data:``, the string ``"[DONE]"``, or ``None``."""
    type: str | None = None
    """Its ``event:`` field (the Responses API's streams name each event)."""


class Exchange:
    """One request over its own connection, read as bytes."""

    def __init__(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter, *,
                 deadline_s: float = DEADLINE_S) -> None:
        self.reader = reader
        self.writer = writer
        self.deadline_s = deadline_s
        self.raw = bytearray()

    @classmethod
    async def post(cls, port: int, path: str, payload: dict[str, Any], *,
                   host: str = "127.0.0.1", deadline_s: float = DEADLINE_S) -> Exchange:
        async with asyncio.timeout(deadline_s):
            reader, writer = await asyncio.open_connection(host, port)
        body = json.dumps(payload).encode()
        writer.write(f"POST {path} HTTP/1.1\r\nHost: gateway\r\nConnection: close\r\n"
                     f"Content-Type: application/json\r\nContent-Length: {len(body)}\r\n"
                     "\r\n".encode() + body)
        await writer.drain()
        return cls(reader, writer, deadline_s=deadline_s)

    async def read_until(self, marker: bytes) -> bytes:
        """Read until ``marker`` has arrived (bounded); everything read so far."""
        async with asyncio.timeout(self.deadline_s):
            while marker not in self.raw:
                chunk = await self.reader.read(65536)
                _require(chunk, f"the connection closed before {marker!r}: {bytes(self.raw)!r}")
                self.raw += chunk
        return bytes(self.raw)

    async def read_all(self) -> bytes:
        """Read until the server closes the connection (bounded); every byte of it."""
        async with asyncio.timeout(self.deadline_s):
            while chunk := await self.reader.read(65536):
                self.raw += chunk
        return bytes(self.raw)

    async def close(self) -> None:
        self.writer.close()
        await self.writer.wait_closed()


def parse_answer(raw: bytes) -> Answer:
    """Exactly one HTTP/1.1 answer, framed exactly: one status line, headers, and a body
    whose framing (chunked, with its last chunk, or Content-Length) ends at the last byte.
    """
    _require(len(_ANY_STATUS_LINE.findall(raw)) == 1, f"not exactly one status line: {raw!r}")
    head, sep, rest = raw.partition(b"\r\n\r\n")
    _require(sep, f"no end of headers: {raw!r}")
    first, *lines = head.split(b"\r\n")
    status = _STATUS_LINE.fullmatch(first)
    if status is None:
        raise Malformed(f"bad status line: {first!r}")
    headers: dict[str, str] = {}
    for line in lines:
        name, colon, value = line.partition(b":")
        _require(colon, f"bad header line: {line!r}")
        _require(name, f"bad header line: {line!r}")
        _require(name == name.strip(), f"bad header line: {line!r}")
        _require(name.lower().decode() not in headers, f"repeated header: {line!r}")
        headers[name.lower().decode()] = value.strip().decode()
    if headers.get("transfer-encoding") == "chunked":
        _require("content-length" not in headers, f"chunked with a length: {headers}")
        body = _dechunk(rest)
    else:
        _require("content-length" in headers, f"no framing: {headers}")
        _require(len(rest) == int(headers["content-length"]), f"bad length: {raw!r}")
        body = rest
    return Answer(int(status.group(1)), headers, body)


def _dechunk(data: bytes) -> bytes:
    body = bytearray()
    at = 0
    while True:
        end = data.find(b"\r\n", at)
        _require(end >= 0, f"a chunk without its size line: {data[at:]!r}")
        size_line = data[at:end]
        _require(_CHUNK_SIZE.fullmatch(size_line), f"bad chunk size {size_line!r}: {data!r}")
        size = int(size_line, 16)
        start = end + 2
        if size == 0:
            _require(data[start:] == b"\r\n", f"bytes after the last chunk: {data[start:]!r}")
            return bytes(body)
        chunk, after = data[start:start + size], data[start + size:start + size + 2]
        _require(len(chunk) == size, f"a cut chunk: {data[at:]!r}")
        _require(after == b"\r\n", f"a chunk without its end: {data[at:]!r}")
        body += chunk
        at = start + size + 2


def parse_sse(body: bytes) -> list[Event]:
    """Well-formed server-sent events: each line a comment, an ``event:`` or one
    ``data:`` (JSON or ``[DONE]``), each event ended by a blank line, nothing after
    ``[DONE]``."""
    text = body.decode()
    _require("\r" not in text, f"carriage returns in the stream: {text!r}")
    _require(text.endswith("\n\n"), f"the stream does not end with a whole event: {text!r}")
    events: list[Event] = []
    for block in text[:-2].split("\n\n"):
        comments: list[str] = []
        data: Any = None
        kind: str | None = None
        for line in block.split("\n"):
            if line.startswith(":"):
                comments.append(line[1:].strip())
                continue
            if line.startswith("event: ") and kind is None:
                kind = line.removeprefix("event: ")
                continue
            _require(line.startswith("data: "), f"not an SSE line: {line!r} in {text!r}")
            _require(data is None, f"two data lines in one event: {block!r}")
            payload = line.removeprefix("data: ")
            data = payload if payload == "[DONE]" else json.loads(payload)
        _require(kind is None or data is not None, f"an event without data: {block!r}")
        events.append(Event(tuple(comments), data, kind))
    done = [i for i, e in enumerate(events) if e.data == "[DONE]"]
    _require(done in ([], [len(events) - 1]), f"[DONE] is not the one last event: {text!r}")
    return events


def closing_error(events: list[Event]) -> dict[str, Any]:
    """The error of a stream that ends with an error event and ``[DONE]``."""
    data = [e.data for e in events if e.data is not None]
    _require(data[-1:] == ["[DONE]"], f"no [DONE] at the end: {events}")
    _require(len(data) >= 2, f"nothing before [DONE]: {events}")
    last = data[-2]
    _require(isinstance(last, dict), f"no error event before [DONE]: {events}")
    error = last.get("error")
    if not isinstance(error, dict):
        raise Malformed(f"no error event before [DONE]: {events}")
    _require(isinstance(error.get("message"), str) and error["message"],
             f"an error without a message: {error}")
    _require({"message", "type", "code", "param"} <= error.keys(),
             f"an error without OpenAI's fields: {error}")
    return error
