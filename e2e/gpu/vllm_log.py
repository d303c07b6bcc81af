"""What a vLLM server's own log says about its start, sleeps and wakes.

vLLM logs the time its executor spent in each sleep and wake (inside the engine core,
without HTTP and the API server), what a sleep freed, and the phases of its start. The
bench reads the new part of each engine's log after every step (:class:`LogCursor`) and
keeps the numbers beside rota's own, so that a wake's time splits into vLLM's internal
work and the rest. Pure text parsing; every pattern is optional (another vLLM version may
word a line differently, and then that number is simply missing).
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path

__all__ = ["LogCursor", "LogEvent", "parse", "summarise_start"]

_ANSI = re.compile(r"\x1b\[[0-9;]*m")
_NUMBER = r"([0-9]+(?:\.[0-9]+)?)"
_PATTERNS: tuple[tuple[str, re.Pattern[str], tuple[str, ...]], ...] = (
    ("wake", re.compile(rf"It took {_NUMBER} seconds to wake up tags"), ("seconds",)),
    ("sleep", re.compile(rf"It took {_NUMBER} seconds to fall asleep"), ("seconds",)),
    ("sleep_freed", re.compile(rf"Sleep mode freed {_NUMBER} GiB memory, {_NUMBER} GiB "
                               r"memory is still in use"), ("freed_gib", "in_use_gib")),
    ("cumem_sleep", re.compile(rf"sleep freed {_NUMBER} GiB memory in total, of which "
                               rf"{_NUMBER} GiB is backed up in CPU"),
     ("freed_gib", "backed_up_gib")),
    ("model_loading", re.compile(rf"Model loading took {_NUMBER} GiB(?: memory)? and "
                                 rf"{_NUMBER} seconds"), ("gib", "seconds")),
    ("init_engine", re.compile(rf"init engine \(profile, create kv cache, warmup model\) "
                               rf"took {_NUMBER} seconds"), ("seconds",)),
    ("compile", re.compile(rf"torch\.compile takes {_NUMBER} s in total"), ("seconds",)),
    ("graph_capture", re.compile(rf"Graph capturing finished in {_NUMBER} secs?, took "
                                 rf"{_NUMBER} GiB"), ("seconds", "gib")),
    ("kv_cache_tokens", re.compile(r"GPU KV cache size: ([0-9,]+) tokens"), ("tokens",)),
    ("oom", re.compile(r"out of memory", re.IGNORECASE), ()),
    ("engine_dead", re.compile(r"EngineDeadError|Engine core .*died|EngineCore .*died"), ()),
    ("exception", re.compile(r"^Traceback \(most recent call last\)|\bValueError: Pointer "
                             r"argument"), ()),
)


@dataclass(frozen=True)
class LogEvent:
    """One recognised line: its kind, its numbers, and the line (cut to 300 characters)."""

    kind: str
    values: dict[str, float]
    line: str


def parse(text: str) -> list[LogEvent]:
    """Every recognised line of ``text``, in order."""
    events: list[LogEvent] = []
    for raw in text.splitlines():
        line = _ANSI.sub("", raw)
        for kind, pattern, names in _PATTERNS:
            found = pattern.search(line)
            if found is None:
                continue
            values = {name: float(found.group(i + 1).replace(",", ""))
                      for i, name in enumerate(names)}
            events.append(LogEvent(kind, values, line.strip()[:300]))
            break
    return events


def summarise_start(events: list[LogEvent]) -> dict[str, float]:
    """The start-up phases found in ``events`` (seconds, GiB, tokens), last value wins."""
    found: dict[str, float] = {}
    for event in events:
        if event.kind in ("model_loading", "init_engine", "compile", "graph_capture",
                          "kv_cache_tokens"):
            for name, value in event.values.items():
                found[f"{event.kind}_{name}"] = value
    return found


class LogCursor:
    """Reads what a log file gained since the last read (bounded per read)."""

    def __init__(self, path: Path, *, max_bytes: int = 4 * 2**20) -> None:
        self.path = path
        self.offset = 0
        self.max_bytes = max_bytes

    def skip_to_end(self) -> None:
        try:
            self.offset = self.path.stat().st_size
        except OSError:
            self.offset = 0

    def read_new(self) -> str:
        try:
            with self.path.open("rb") as handle:
                size = handle.seek(0, 2)
                if size < self.offset:  # the file was replaced: start again
                    self.offset = 0
                start = max(self.offset, size - self.max_bytes)
                handle.seek(start)
                data = handle.read(size - start)
                self.offset = size
        except OSError:
            return ""
        return data.decode("utf-8", errors="replace")

    def events(self) -> list[LogEvent]:
        return parse(self.read_new())


def tail(path: Path, lines: int = 40) -> str:
    """The last ``lines`` lines of a log (for error messages)."""
    try:
        with path.open("rb") as handle:
            size = handle.seek(0, 2)
            handle.seek(max(0, size - 64 * 1024))
            text = handle.read().decode("utf-8", errors="replace")
    except OSError:
        return "(no log)"
    return "\n".join(_ANSI.sub("", x) for x in text.splitlines()[-lines:])
