"""What the policy comparison counts per request: the SLO (first token and longest gap),
whether a stream was frozen, and its text against a never-slept reference."""

from __future__ import annotations

import json
import math

from e2e.gpu.policy_slo import (
    Bounds,
    Reference,
    StreamTrace,
    correctness,
    ranking,
    rankings_agree,
    reference_of,
    verdict,
    was_frozen,
)


def _trace(times: list[float], texts: list[str], *, tokens: int | None = None,
           ended: float | None = None) -> StreamTrace:
    trace = StreamTrace(started=0.0)
    for at, text in zip(times, texts, strict=True):
        trace.feed(at, json.dumps({"choices": [{"index": 0, "text": text}]}))
    if tokens is not None:
        trace.feed(times[-1], json.dumps({"choices": [], "usage": {"completion_tokens": tokens}}))
    trace.feed(times[-1], "[DONE]")
    trace.ended = times[-1] if ended is None else ended
    return trace


def test_the_longest_gap_is_between_chunks_after_the_first() -> None:
    trace = _trace([1.0, 1.1, 4.6, 4.7], [" a", " b", " c d", " e"], tokens=5)
    assert trace.first_at == 1.0
    assert math.isclose(trace.longest_gap_s, 3.5)
    assert trace.text == " a b c d e"
    assert trace.tokens == 5
    bounds = Bounds(first_token_s=2.0, longest_freeze_s=3.0)
    assert not bounds.met(1.0, trace.longest_gap_s)  # the freeze broke its bound
    assert bounds.met(1.0, 2.9)
    assert not bounds.met(2.1, 0.0)  # late first token
    assert not bounds.met(math.inf, 0.0)  # never served


def test_a_stream_is_frozen_by_a_sleep_while_it_is_open_or_by_a_long_gap() -> None:
    bounds = Bounds(frozen_gap_s=0.5)
    steady = _trace([1.0, 1.1, 1.2], ["a", "b", "c"])
    assert not was_frozen(steady, [0.5, 1.3], bounds)  # sleeps before and after it
    assert was_frozen(steady, [1.15], bounds)
    assert was_frozen(_trace([1.0, 1.8], ["a", "b"]), [], bounds)
    assert not was_frozen(None, [1.0], bounds)


def test_each_verdict_against_the_reference() -> None:
    ref = reference_of(_trace([0.0, 0.1, 0.2], [" x", " y", " z"], tokens=3))
    assert ref == Reference(" x y z", 3)
    assert verdict(_trace([5.0, 8.0, 8.0], [" x", " y", " z"], tokens=3), ref) == "identical"
    assert verdict(_trace([5.0, 8.0, 8.1], [" x", " q", " z"], tokens=3), ref) == "altered"
    assert verdict(_trace([5.0, 8.0], [" x", " y"], tokens=2), ref) == "lost"
    assert verdict(_trace([5.0, 8.0], [" x", " z"], tokens=3), ref) == "lost"  # one cut out
    assert verdict(_trace([5.0, 8.0, 8.0, 8.1], [" x", " y", " y", " z"]), ref) == "altered"
    broken = _trace([5.0], [" x"])
    broken.error = "after its first token: ClientPayloadError"
    assert verdict(broken, ref) == "lost"
    assert verdict(_trace([5.0], [" x"]), None) == "unchecked"
    unfinished = _trace([1.0], [" x"])
    unfinished.ended = None
    assert reference_of(unfinished) is None
    assert reference_of(broken) is None


def test_an_error_event_in_the_stream_is_recorded() -> None:
    trace = StreamTrace(started=0.0)
    trace.feed(1.0, json.dumps({"choices": [{"text": " a"}]}))
    trace.feed(2.0, json.dumps({"error": {"message": "engine stopped", "code": 503}}))
    assert trace.error.startswith("error event")
    assert trace.text == " a"


def test_frozen_and_other_requests_are_counted_apart() -> None:
    counts = correctness([(True, "identical"), (True, "altered"), (False, "identical"),
                          (False, "unchecked"), (True, "lost")])
    assert counts["frozen"] == {"identical": 1, "altered": 1, "lost": 1, "unchecked": 0}
    assert counts["not_frozen"] == {"identical": 1, "altered": 0, "lost": 0, "unchecked": 1}


def test_rankings_are_compared_on_the_policies_both_ran() -> None:
    real = {"first-come": 20, "drain": 40, "rota": 55, "all-awake": 60}
    simulated = {"first-come": 10, "drain": 30, "rota": 31}
    assert ranking(real) == ["all-awake", "rota", "drain", "first-come"]
    assert rankings_agree(real, simulated)
    assert not rankings_agree(real, {"first-come": 30, "drain": 20})
    assert rankings_agree({"a": 1, "b": 1}, {"a": 2, "b": 1})  # a tie agrees with any order
