"""What a user of the policy comparison feels, request by request (pure: records in, counts
out).

A turn at token granularity freezes the holder's streams while another model holds the
GPU, so the first token alone no longer tells whether a request was served well. For each
request this module keeps what its client read (:class:`StreamTrace`: when each chunk came,
the text, the engine's token count) and derives:

- **SLO met**: the first token within the first-token objective *and* no gap between two
  chunks longer than the freeze bound (:class:`Bounds`, 2 s and 3 s by default, the lease
  controller's ``--first-token-objective-s`` and ``--longest-freeze-s``). Goodput is the
  count of requests that met both.
- **frozen**: the stream was open when its engine was put to sleep (a switch away from its
  model ended between its first chunk and its last), or it waited longer than
  ``frozen_gap_s`` between two chunks.
- **correctness**: its text against a never-slept reference of the same engine (greedy,
  the same prompt, the same ``max_tokens``): ``identical``, ``altered`` (different text),
  ``lost`` (tokens missing: the reference with a piece cut out, fewer tokens, or an error
  after the first token) or ``unchecked`` (no reference). Requests that were never frozen
  are counted too, apart: greedy decoding in batches of different shapes may differ in the
  last bits, so their ``altered`` count is the noise floor the frozen ones are read against.
"""

from __future__ import annotations

import json
import math
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Literal

__all__ = ["VERDICTS", "Bounds", "Reference", "StreamTrace", "Verdict", "correctness",
           "ranking", "rankings_agree", "verdict", "was_frozen"]

Verdict = Literal["identical", "altered", "lost", "unchecked"]
VERDICTS: tuple[Verdict, ...] = ("identical", "altered", "lost", "unchecked")


@dataclass(frozen=True)
class Bounds:
    """The objectives a request is held to (the lease controller's node defaults)."""

    first_token_s: float = 2.0
    """The first token's objective, from the request's arrival."""
    longest_freeze_s: float = 3.0
    """The longest gap a started stream may suffer between two chunks."""
    frozen_gap_s: float = 0.5
    """A gap longer than this counts the stream as frozen even without a recorded sleep."""

    def met(self, ttft_s: float, longest_gap_s: float) -> bool:
        """Both objectives met (a request never served has an infinite TTFT)."""
        return ttft_s <= self.first_token_s and longest_gap_s <= self.longest_freeze_s


@dataclass
class StreamTrace:
    """One streamed completion as its client read it (times on the client's clock)."""

    started: float
    """When the request was sent to the engine."""
    chunk_at: list[float] = field(default_factory=list)
    """When each chunk with a choice came: the first is the first token."""
    parts: list[str] = field(default_factory=list)
    tokens: int | None = None
    """The engine's ``usage.completion_tokens`` (the stream's last chunk), when sent."""
    ended: float | None = None
    error: str = ""

    def feed(self, now: float, data: str) -> None:
        """One SSE ``data:`` payload: a chunk, the usage chunk, an error event or [DONE]."""
        if data == "[DONE]":
            return
        try:
            chunk = json.loads(data)
        except ValueError:
            return
        if not isinstance(chunk, dict):
            return
        if chunk.get("error") is not None:
            self.error = f"error event: {json.dumps(chunk['error'])[:200]}"
            return
        usage = chunk.get("usage")
        if isinstance(usage, dict) and isinstance(usage.get("completion_tokens"), int):
            self.tokens = usage["completion_tokens"]
        choices = chunk.get("choices")
        if not choices:
            return
        first = choices[0]
        text = first.get("text")
        if text is None:  # a chat chunk
            text = (first.get("delta") or {}).get("content")
        self.chunk_at.append(now)
        self.parts.append(text or "")

    @property
    def text(self) -> str:
        return "".join(self.parts)

    @property
    def first_at(self) -> float | None:
        return self.chunk_at[0] if self.chunk_at else None

    @property
    def longest_gap_s(self) -> float:
        """The longest wait between two chunks after the first (0 for one chunk)."""
        return max((b - a for a, b in zip(self.chunk_at, self.chunk_at[1:], strict=False)),
                   default=0.0)


def was_frozen(trace: StreamTrace | None, sleeps_at: Iterable[float], bounds: Bounds) -> bool:
    """Whether the stream was open when its engine was put to sleep (a switch away from
    its model ended between its first chunk and its last), or waited longer than the
    bounds' ``frozen_gap_s`` between two chunks."""
    if trace is None or trace.first_at is None:
        return False
    if trace.longest_gap_s > bounds.frozen_gap_s:
        return True
    last = trace.chunk_at[-1]
    return any(trace.first_at < at <= last for at in sleeps_at)


@dataclass(frozen=True)
class Reference:
    """What a never-slept engine answered for one prompt and length."""

    text: str
    tokens: int | None


RefKey = tuple[int, int, int]
"""(model index, prompt tokens, max_tokens): the request as the engine got it."""


def reference_of(trace: StreamTrace | None) -> Reference | None:
    """A finished, error-free stream as a reference (None otherwise)."""
    if trace is None or trace.error or trace.ended is None or not trace.chunk_at:
        return None
    return Reference(trace.text, trace.tokens)


def verdict(trace: StreamTrace | None, reference: Reference | None) -> Verdict:
    """This stream against its reference: the same text, another text, or tokens missing."""
    if reference is None or trace is None or trace.first_at is None:
        return "unchecked"
    if trace.error or trace.ended is None:
        return "lost"
    if trace.text == reference.text:
        if (trace.tokens is not None and reference.tokens is not None
                and trace.tokens < reference.tokens):
            return "lost"
        return "identical"
    if _missing_from(trace.text, reference.text):
        return "lost"
    return "altered"


def _missing_from(text: str, reference: str) -> bool:
    """``text`` is ``reference`` with one piece cut out (at its end, or within it):
    tokens lost, the rest as it should be."""
    if len(text) >= len(reference):
        return False
    same = next((i for i, (a, b) in enumerate(zip(text, reference, strict=False)) if a != b),
                len(text))
    return reference.endswith(text[same:])


def correctness(checked: Iterable[tuple[bool, Verdict]]) -> dict[str, dict[str, int]]:
    """Counts of each verdict for the frozen requests and, apart, for the others."""
    out: dict[str, dict[str, int]] = {"frozen": dict.fromkeys(VERDICTS, 0),
                                      "not_frozen": dict.fromkeys(VERDICTS, 0)}
    for frozen, v in checked:
        out["frozen" if frozen else "not_frozen"][v] += 1
    return out


def ranking(goodput: Mapping[str, float]) -> list[str]:
    """Policies from the highest goodput down (ties in name order)."""
    return sorted(goodput, key=lambda p: (-goodput[p], p))


def rankings_agree(a: Mapping[str, float], b: Mapping[str, float]) -> bool:
    """Whether two runs order the policies both ran the same way (ties agree with any
    order)."""
    common = [p for p in a if p in b]
    for i, p in enumerate(common):
        for q in common[i + 1:]:
            da, db = a[p] - a[q], b[p] - b[q]
            if da * db < 0:
                return False
    return True


def share(part: int, whole: int) -> float:
    """``part`` of ``whole`` in percent (NaN of nothing)."""
    return round(100.0 * part / whole, 1) if whole else math.nan


def gap_summary(gaps: Sequence[float]) -> dict[str, Any]:
    """Median and largest of the longest gaps of the served streams."""
    if not gaps:
        return {"p50": None, "max": None}
    ordered = sorted(gaps)
    return {"p50": round(ordered[len(ordered) // 2], 3), "max": round(ordered[-1], 3)}
