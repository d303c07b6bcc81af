"""An incremental parser for server-sent events, fed whatever the network delivers.

The correctness probe reads an OpenAI stream chunk by chunk, and a chunk may end anywhere:
inside a line, between ``\\r`` and ``\\n``, inside a multi-byte UTF-8 character. This
parser keeps the unfinished part, ignores comments (``: keep-alive``) and fields other
than ``data``, joins multi-line ``data`` fields with ``\\n`` as the SSE specification says,
and hands back each event's data when its blank line arrives. Pure: no I/O.
"""

from __future__ import annotations

import codecs

__all__ = ["SseParser"]


class SseParser:
    """Feed bytes with :meth:`feed`, then call :meth:`close` at the end of the stream."""

    def __init__(self) -> None:
        self._decoder = codecs.getincrementaldecoder("utf-8")(errors="replace")
        self._buffer = ""
        self._data: list[str] = []

    def feed(self, chunk: bytes) -> list[str]:
        """The data of every event completed by ``chunk``, in order."""
        self._buffer += self._decoder.decode(chunk)
        return self._drain(final=False)

    def close(self) -> list[str]:
        """The data of an event left unterminated when the stream ended.

        The specification drops such an event; the probe keeps it, so that a ``[DONE]``
        whose final blank line was lost still counts.
        """
        self._buffer += self._decoder.decode(b"", final=True)
        events = self._drain(final=True)
        if self._buffer:
            self._line(self._buffer)
            self._buffer = ""
        if self._data:
            events.append("\n".join(self._data))
            self._data = []
        return events

    def _drain(self, *, final: bool) -> list[str]:
        events: list[str] = []
        text = self._buffer
        start = 0
        while True:
            lf = text.find("\n", start)
            cr = text.find("\r", start)
            if cr != -1 and (lf == -1 or cr < lf):
                if cr + 1 == len(text) and not final:
                    break  # a lone \r at the end may be the first half of \r\n
                end, after = cr, cr + 2 if text.startswith("\n", cr + 1) else cr + 1
            elif lf != -1:
                end, after = lf, lf + 1
            else:
                break
            event = self._line(text[start:end])
            if event is not None:
                events.append(event)
            start = after
        self._buffer = text[start:]
        return events

    def _line(self, line: str) -> str | None:
        """Take one line; the data of the event it completes, if it is a blank line."""
        if not line:
            if not self._data:
                return None
            event = "\n".join(self._data)
            self._data = []
            return event
        if line.startswith(":"):
            return None  # a comment, e.g. a keep-alive
        name, sep, value = line.partition(":")
        if sep and value.startswith(" "):
            value = value[1:]
        if name == "data":
            self._data.append(value)
        return None
