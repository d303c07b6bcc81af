"""Property-based tests of the engine guard's paths and methods (review F2, issue 28).

Every request target built from the pieces path tricks are made of (dot segments, encoded
separators, backslashes, ``;``, doubled slashes, control routes under ``/v1``...) is either
refused with a 4xx and reaches nothing, or reaches the engine byte for byte as sent, on a
path that no normaliser could read as another; and a control route is never reached
without the control token. A real recording upstream stands in for the engine; requests
are written raw, since every client library normalises URLs.
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from pathlib import Path
from urllib.parse import quote, unquote

import pytest
from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st

from controller.guard.paths import Access, PathRefused, classify, target
from tests.guard.guard_kit import API_KEY_ONLY, CONTROL_ONLY, GuardedRecorder, guard_over_recorder

FUZZ = settings(max_examples=150, deadline=None, derandomize=True,
                suppress_health_check=[HealthCheck.function_scoped_fixture])
"""Modest, deterministic (the same examples on every run), no per-example deadline."""

PIECES = ["/", "/", "/", ".", "..", "%2e", "%2E", "%2f", "%2F", "%5c", "%5C", "%25", "%",
          "\\", ";", ";x=1", "//", "v1", "V1", "omni", "sleep", "wake_up", "is_sleeping",
          "collective_rpc", "reset_prefix_cache", "metrics", "health", "models", "chat",
          "completions", "tokenize", "pause", "%73", "%2e%2e", "?", "?x=/../sleep", "#",
          "%00", "%0a", "%20", "@", ":", "~", "%C3%A9", "%c3", "é", "*", "http://x"]
METHODS = ["GET", "POST", "HEAD", "PUT", "DELETE", "OPTIONS", "PATCH", "TRACE", "SLEEP"]
CREDENTIALS = {"none": {}, "api_key": API_KEY_ONLY, "control": CONTROL_ONLY,
               "both": API_KEY_ONLY | CONTROL_ONLY}
NAMES = ["v1", "omni", "sleep", "wake_up", "is_sleeping", "collective_rpc", "metrics",
         "health", "models", "chat", "completions", "tokenize", "pause", "x", "a%20b",
         "caf%C3%A9", "a:b", "~u", "@", "v2", "embed"]
ENDS = ["", "", "/", "?x=1", "?x=/../sleep", "?%2e%2e"]
tricky = st.lists(st.sampled_from(PIECES), min_size=1, max_size=9).map("".join)
PREFIXES = ["", "", "/v1", "/v1", "/v1", "/v1/omni", "/health", "/metrics", "/tokenize"]
plain = st.builds(lambda prefix, names, end: prefix + "/" + "/".join(names) + end,
                  st.sampled_from(PREFIXES), st.lists(st.sampled_from(NAMES), max_size=3),
                  st.sampled_from(ENDS))
"""Paths of real segments, which the guard forwards when the credential fits."""
escapes = st.builds(
    lambda prefix, ups, sep, name, end: prefix + "".join(ups) + sep + name + end,
    st.sampled_from(["/v1", "/v1/models", "/v1/omni", "/tokenize", "/health", "/v1/"]),
    st.lists(st.sampled_from(["/..", "/%2e%2e", "/%2E%2e", "/.%2e", "/..%2f", "%2f..",
                              "\\..", "%5c..", ";x/..", "/./..", "/%252e%252e", "//..",
                              "/.", ""]), min_size=1, max_size=3),
    st.sampled_from(["/", "%2f", "%2F", "\\", "%5c", "//"]),
    st.sampled_from(["sleep", "wake_up", "collective_rpc", "is_sleeping",
                     "reset_prefix_cache", "metrics", "metrics/", "pause"]),
    st.sampled_from(["", "?level=1", "#x"]))
"""Attempts to climb from a client path to a control route."""
targets = st.sampled_from([plain, plain, plain, tricky, st.builds("".join, st.tuples(
    plain, tricky))]).flatmap(lambda strategy: strategy)


def every_reading(path: str) -> str:
    """``path`` as the most eager normaliser on the way might read it: decoded until
    stable, backslashes as slashes, ``;`` parameters dropped, empty and dot segments
    resolved (a trailing slash kept)."""
    for _ in range(4):
        path = unquote(path)
    segments: list[str] = []
    parts = path.replace("\\", "/").split("/")
    for segment in (part.partition(";")[0] for part in parts):
        if segment == "..":
            if segments:
                segments.pop()
        elif segment not in ("", "."):
            segments.append(segment)
    trailing = "/" if parts[-1] == "" and segments else ""
    return "/" + "/".join(segments) + trailing


def allowed(access: Access, credential: str) -> bool:
    if access is Access.CONTROL:
        return credential in ("control", "both")
    if access is Access.CLIENT:
        return credential in ("api_key", "both")
    return access is Access.HEALTH


@pytest.fixture
async def guarded(tmp_path: Path) -> AsyncIterator[GuardedRecorder]:
    async with guard_over_recorder(tmp_path) as guarded:
        yield guarded


@settings(max_examples=500, deadline=None, derandomize=True)
@given(st.one_of(targets, st.text(max_size=40)))
def test_an_accepted_target_means_one_path_only(raw: str) -> None:
    """What :func:`target` accepts, every normaliser reads as the path it classifies, and
    its raw form is that path's canonical encoding."""
    try:
        accepted = target(raw)
    except PathRefused:
        return
    raw_path = accepted.raw.partition("?")[0]
    assert every_reading(raw_path) == accepted.path
    assert quote(accepted.path, safe="/-._~!$&'()*+,=:@") == raw_path


@FUZZ
@given(method=st.sampled_from(METHODS), raw=targets,
       credential=st.sampled_from(sorted(CREDENTIALS)))
async def test_every_request_is_refused_or_forwarded_as_classified(
    guarded: GuardedRecorder, method: str, raw: str, credential: str
) -> None:
    guarded.recorder.arrivals.clear()
    answer = await guarded.send(method, raw, CREDENTIALS[credential])
    arrivals = guarded.recorder.arrivals
    event("forwarded" if arrivals else f"refused {answer.status}")
    if not arrivals:
        assert 400 <= answer.status < 500, (answer.status, answer.body[:200])
        return
    [arrival] = arrivals
    assert (arrival.method, arrival.raw_path) == (method, raw)
    assert every_reading(arrival.path) == arrival.path  # no other reading of it exists
    assert allowed(classify(method, arrival.path), credential), arrival
    assert answer.status == 200


@FUZZ
@given(method=st.sampled_from(["POST", "GET", "PUT"]), raw=st.one_of(escapes, targets))
async def test_the_api_key_alone_never_reaches_a_control_route(
    guarded: GuardedRecorder, method: str, raw: str
) -> None:
    guarded.recorder.arrivals.clear()
    await guarded.send(method, raw, API_KEY_ONLY)
    for arrival in guarded.recorder.arrivals:
        reading = every_reading(arrival.path)
        assert classify(method, reading) in (Access.CLIENT, Access.HEALTH), arrival
