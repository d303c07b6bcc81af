"""Fuzzing claims as the gateway's watch delivers them (issue 28, review F5): whatever
shape a claim has in the fields rota reads (``status.allocation``, ``reservedFor``,
``spec.devices.config``, the opaque parameters), nested as deep as its bytes allow, each
one is decoded and applied to the routing state, or skipped and reported (counted); no
exception escapes the list or the watch, and the good claims around it are followed.

The claims go through the gateway's own claim stream (:class:`kube_source._Watch`: its
``keep`` and ``cut``, the shared :class:`~rota.kit.listwatch.ListWatch`, the routing state),
one list page and one watch event at a time, as JSON text; the stream's loop is a fake
that runs each delivery at once (the thread and HTTP around it are covered by
test_kube_source_undecodable). Example counts are modest and derandomized.
"""

from __future__ import annotations

import asyncio
import json
from typing import Any, cast

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from controller.gateway.binding import ModelBinding
from controller.gateway.kube_source import _Watch
from controller.gateway.routing import RoutingState
from controller.gateway.settings import GatewaySettings
from rota.kit.listwatch import MAX_DEPTH, decode_event, decode_page
from tests.gateway.conftest import claim_obj

GOOD = ("org/a", "org/b", "org/c")
FUZZED_MODEL = "org/fuzzed"
CONFIG = ("spec", "devices", "config", 0, "opaque", "parameters")
PATHS: tuple[tuple[str | int, ...], ...] = (
    ("status",), ("status", "allocation"), ("status", "allocation", "devices"),
    ("status", "allocation", "devices", "results"),
    ("status", "allocation", "devices", "results", 0),
    *(("status", "allocation", "devices", "results", 0, key)
      for key in ("driver", "pool", "device", "request", "consumedCapacity")),
    ("status", "allocation", "devices", "config"),
    ("status", "reservedFor"), ("status", "reservedFor", 0),
    ("status", "reservedFor", 0, "uid"),
    ("spec",), ("spec", "devices"), ("spec", "devices", "config"),
    ("spec", "devices", "config", 0), ("spec", "devices", "config", 0, "requests"),
    ("spec", "devices", "config", 0, "opaque"),
    ("spec", "devices", "config", 0, "opaque", "driver"), CONFIG,
    *((*CONFIG, key) for key in ("model", "awakeMemory", "sleepLevel", "enginePort",
                                 "adapter", "omniStageIds", "http", "probe", "priority")),
)
"""Where a claim is given an arbitrary value: the fields rota reads."""

LEAVES = (st.none() | st.booleans() | st.integers(min_value=-(2**70), max_value=2**70)
          | st.floats(allow_nan=False, allow_infinity=False) | st.text(max_size=12)
          | st.sampled_from(["gpu.rota.dev", "pods", "10Gi", "gpu", "node-a", "gpu-0"]))
JSON = st.recursive(LEAVES, lambda inner: st.lists(inner, max_size=3)
                    | st.dictionaries(st.text(max_size=8) | st.sampled_from(
                        ["driver", "parameters", "results", "devices", "opaque", "uid"]),
                        inner, max_size=3), max_leaves=8)
DEEP = st.integers(min_value=MAX_DEPTH - 3, max_value=1_500)
"""Nesting around the bound and past Python's recursion limit."""
STORED = (JSON.map(json.dumps)
          | DEEP.map(lambda n: "[" * n + "]" * n)
          | DEEP.map(lambda n: '{"a": ' * n + "1" + "}" * n)
          | st.sampled_from(["1e99999", "9" * 5000, '"\\ud800"', '"\\u0000"']))
"""JSON text for one field, as the API server may store it: any value, deep nesting, what
Python does not decode (a number of 5,000 digits) or decodes oddly (a lone surrogate)."""
BROKEN = STORED | st.sampled_from(['"', "[", "{]", "NaN", "tru"])
"""And text that is no JSON: a broken answer, never a stored object (one watch event)."""


def _place(claim: Any, path: tuple[str | int, ...], marker: str) -> None:
    """Put ``marker`` at ``path`` where the claim still has such a place."""
    try:
        for step in path[:-1]:
            claim = claim[step]
        claim[path[-1]] = marker
    except (KeyError, IndexError, TypeError):
        pass


@st.composite
def fuzzed_claims(draw: st.DrawFn, name: str, fragments: st.SearchStrategy[str] = STORED
                  ) -> tuple[str, int]:
    """A claim as JSON text with arbitrary texts in the fields rota reads, and how deeply
    its deepest field nests."""
    claim = claim_obj(name, model=FUZZED_MODEL, port=8000, pod_uid=f"uid-pod-{name}")
    texts: dict[str, str] = {}
    for i, path in enumerate(sorted(draw(st.sets(st.sampled_from(PATHS), min_size=1,
                                                 max_size=3)), key=len)):
        texts[f"@@{i}@@"] = draw(fragments)
        _place(claim, path, f"@@{i}@@")
    text = json.dumps(claim)
    depth = 0
    for marker, fragment in texts.items():
        if f'"{marker}"' in text:
            text = text.replace(f'"{marker}"', fragment)
            depth = max(depth, fragment.count("[") if fragment.startswith("[[")
                        else fragment.count("{") if fragment.startswith('{"a"') else 0)
    return text, depth


class ImmediateLoopFake:
    """The stream's event loop, as a fake: runs what is handed to it at once."""

    def call_soon_threadsafe(self, fn: Any, *args: Any) -> None:
        fn(*args)


def _stream(state: RoutingState, undecodable: list[str]) -> _Watch:
    return _Watch("resourceclaims", "claim", None, lambda *a, **k: None, (), {},
                  loop=cast(asyncio.AbstractEventLoop, ImmediateLoopFake()), state=state,
                  settings=GatewaySettings(controller_namespace="rota-system"),
                  after_event=lambda: None, on_restart=lambda resource: None,
                  on_undecodable=undecodable.append)


def _good(i: int) -> str:
    return json.dumps(claim_obj(f"good-{i}", model=GOOD[i], port=8000,
                                pod_uid=f"uid-pod-good-{i}"))


def _page(items: list[str]) -> bytes:
    return ('{"kind": "List", "metadata": {"resourceVersion": "1"}, "items": ['
            + ", ".join(items) + "]}").encode()


def _event(kind: str, obj: str) -> str:
    return f'{{"type": "{kind}", "object": {obj}}}'


FUZZ = settings(max_examples=60, derandomize=True, deadline=None,
                suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])


@FUZZ
@given(listed=st.lists(fuzzed_claims("listed"), max_size=2).map(list),
       watched=st.lists(fuzzed_claims("watched", BROKEN), min_size=1, max_size=3))
def test_every_claim_is_followed_or_skipped_and_reported(
        listed: list[tuple[str, int]], watched: list[tuple[str, int]]) -> None:
    state = RoutingState(binding=ModelBinding(namespaces=("*",)))
    undecodable: list[str] = []
    stream = _stream(state, undecodable)
    follow = stream._follow

    # One list page: the good claims around the fuzzed ones are followed.
    page = decode_page(_page([_good(0), *(text for text, _ in listed), _good(1)]))
    follow._hand_over(list(follow._take(page.items)))
    assert state.knows(GOOD[0])
    assert state.knows(GOOD[1])
    deep = sum(1 for _, depth in listed if depth > MAX_DEPTH)
    assert len(undecodable) >= deep, "every claim too deep to decode is reported"

    # The watch: the fuzzed claims written and modified, then a good one, then every
    # fuzzed one deleted; nothing stops the stream, nothing fuzzed is left behind.
    reported = len(undecodable)
    for text, _ in watched:
        follow._hand_on(decode_event(_event("ADDED", text)))
    for text, _ in listed:
        follow._hand_on(decode_event(_event("MODIFIED", text)))
    follow._hand_on(decode_event(_event("ADDED", _good(2))))
    assert all(state.knows(model) for model in GOOD)
    deep = sum(1 for _, depth in [*watched, *listed] if depth > MAX_DEPTH)
    assert len(undecodable) - reported >= deep
    for text, _ in [*watched, *listed]:
        follow._hand_on(decode_event(_event("DELETED", text)))
    assert not state.knows(FUZZED_MODEL)
    assert all(state.knows(model) for model in GOOD)
    assert set(undecodable) <= {"resourceclaims"}


def test_a_followed_claim_that_becomes_undecodable_is_dropped() -> None:
    """A MODIFIED event that cannot be decoded takes back what was handed on (DELETED):
    the state never keeps a version the watch could not read."""
    state = RoutingState(binding=ModelBinding(namespaces=("*",)))
    undecodable: list[str] = []
    follow = _stream(state, undecodable)._follow
    follow._hand_over(list(follow._take(decode_page(_page([_good(0)])).items)))
    assert state.knows(GOOD[0])
    deep = _good(0).replace('"sleepLevel": 1', '"sleepLevel": ' + "[" * 1_100 + "]" * 1_100)
    follow._hand_on(decode_event(_event("MODIFIED", deep)))
    assert not state.knows(GOOD[0])
    assert undecodable == ["resourceclaims"]
