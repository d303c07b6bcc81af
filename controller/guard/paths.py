"""Which requests the engine guard lets through, and with which credential. Pure.

- ``client``: the surface the gateway forwards (every path of
  :data:`rota.api.client_routes.CLIENT_PATHS`: generation, pooling, scoring,
  reranking, tokens, ...) and vLLM's other ``/v1`` client routes (:data:`V1_CLIENT_PATHS`):
  the engine's API key, when one is configured;
- ``control``: rota's control calls: rota's control token;
- ``health``: ``GET /health``, open (kubelet probes; vLLM answers 503 once dead);
- ``hidden``: everything else (vLLM's ``/abort_requests``, ``/update_weights``,
  profiling, ``/v1/load_lora_adapter``, ``/v1/fault_tolerance/*``, ...): 404, never
  forwarded.

A request target is classified and forwarded as ONE path (:func:`target`). Whatever some
server, client or proxy on the way could rewrite is refused rather than interpreted: dot
segments, encoded separators, dots and escapes (``%2f``, ``%5c``, ``%2e``, ``%25``),
backslashes, empty segments, ``;`` parameters, control characters, fragments and any
percent-encoding that is not the canonical one. Otherwise ``/v1/../wake_up`` would be
classified as the OpenAI surface and reach the engine as ``/wake_up`` once a client library
normalised it.
"""

from __future__ import annotations

import enum
import re
from dataclasses import dataclass
from urllib.parse import quote, unquote

from rota.api.client_routes import CLIENT_PATHS

__all__ = [
    "CONTROL_CALLS", "V1_CLIENT_PATHS", "Access", "PathRefused", "Target", "classify", "target",
]


class Access(enum.StrEnum):
    CLIENT = "client"
    CONTROL = "control"
    HEALTH = "health"
    HIDDEN = "hidden"


CONTROL_CALLS: frozenset[tuple[str, str]] = frozenset({
    ("POST", "/sleep"), ("POST", "/wake_up"), ("GET", "/is_sleeping"),
    ("POST", "/collective_rpc"), ("POST", "/reset_prefix_cache"), ("GET", "/metrics"),
    ("GET", "/metrics/"), ("GET", "/version"), ("GET", "/openapi.json"),
    ("POST", "/pause"), ("POST", "/resume"), ("GET", "/is_paused"),
})
"""What rota's engine adapters call (vLLM's development routes they need, and metrics):
``/version`` and ``/openapi.json`` say which release the engine runs; ``/pause`` and
``/resume`` hold requests around a ``/sleep`` that no longer does (vLLM RFC #51476) and
freeze them around a sleep that keeps them, and ``/is_paused`` tells a wake whether the
engine is still paused. A tenant's pause would stop its neighbours' turns as surely as its
sleep: all need the claim's control token.
``tests/controller/test_engine_surfaces.py`` checks every supported release's calls."""
_CONTROL_PREFIX = "/v1/omni/"
"""vLLM-Omni's stage-aware sleep and wakeup: control calls, though under ``/v1``."""


V1_CLIENT_PATHS: frozenset[str] = frozenset({
    "/v1/models", "/v1/audio/generate", "/v1/audio/speech", "/v1/audio/speech/batch",
    "/v1/audio/voices", "/v1/decisions", "/v1/images/edits", "/v1/images/generations",
    "/v1/messages/render", "/v1/realtime/sessions", "/v1/responses/render",
    "/v1/systemone", "/v1/videos", "/v1/videos/sync",
})
"""The ``/v1`` client routes of vLLM's committed surfaces that the gateway does not route
by model (besides :data:`CLIENT_PATHS`). Under ``/v1`` only client routes pass with the
API key: vLLM serves engine administration there too (``/v1/load_lora_adapter``,
``/v1/unload_lora_adapter``, ``/v1/fault_tolerance/*``), and a tenant's key must not reach
it. Everything else under ``/v1`` is hidden; ``tests/guard/test_guard_v1_routes.py`` checks
this list against the surfaces."""
_V1_CLIENT_TEMPLATES: tuple[re.Pattern[str], ...] = tuple(re.compile(t) for t in (
    r"/v1/responses/[^/]+", r"/v1/responses/[^/]+/cancel", r"/v1/audio/voices/[^/]+",
    r"/v1/videos/[^/]+", r"/v1/videos/[^/]+/content",
    r"/v1/realtime/sessions/[^/]+/(close|reset|status|step)",
))
"""The ``/v1`` client routes with a path parameter (a stored response, voice, video or
realtime session of the tenant's own)."""


def classify(method: str, path: str) -> Access:
    """How the guard treats ``method path``."""
    if path.startswith(_CONTROL_PREFIX):
        return Access.CONTROL if method == "POST" else Access.HIDDEN
    if (method, path) in CONTROL_CALLS:
        return Access.CONTROL
    if path == "/health" and method in ("GET", "HEAD"):
        return Access.HEALTH
    if path in CLIENT_PATHS or path in V1_CLIENT_PATHS:
        return Access.CLIENT
    if any(template.fullmatch(path) for template in _V1_CLIENT_TEMPLATES):
        return Access.CLIENT
    return Access.HIDDEN


_PCHARS = "-._~!$&'()*+,=:@"
"""What stays unencoded in a path segment (RFC 3986 pchar, less ``;``, which is refused)."""
_ENCODED_SEPARATOR = re.compile(r"%(2f|5c|2e|25)", re.IGNORECASE)
"""Escapes a second decoder or a normaliser would read as structure: ``/``, ``\\``, ``.``,
and ``%`` itself (``%252e`` decoded twice is ``.``)."""
_CONTROL_CHARACTER = re.compile(r"[\x00-\x1f\x7f]")


class PathRefused(ValueError):
    """A request target the guard will not interpret; the message says why (for a 400)."""


@dataclass(frozen=True)
class Target:
    """A request target the guard accepted: ``path`` is what the engine routes on (decoded)
    and what :func:`classify` is given; ``raw`` is the exact target sent to the engine,
    ``path`` in its canonical encoding plus the query as received."""

    path: str
    raw: str


def target(raw: str) -> Target:
    """The one path ``raw`` (the request target as received) means, or PathRefused.

    Accepted only when no normalisation of the target (dot-segment removal, slash merging,
    percent-decoding, backslash folding, ``;`` stripping) could yield another path: then
    the classified path and the one the engine receives cannot differ.
    """
    if "#" in raw:
        raise PathRefused("the request target has a fragment")
    raw_path, mark, query = raw.partition("?")
    if not raw_path.startswith("/"):
        raise PathRefused("the request target must be an absolute path")
    if _ENCODED_SEPARATOR.search(raw_path):
        raise PathRefused("the path has an encoded '/', '\\', '.' or '%'")
    try:
        path = unquote(raw_path, errors="strict")
    except UnicodeDecodeError:
        raise PathRefused("the path's percent-encoding is not UTF-8") from None
    _check_decoded(path)
    if quote(path, safe="/" + _PCHARS) != raw_path:
        raise PathRefused("the path is not in its canonical percent-encoding")
    return Target(path=path, raw=raw_path + mark + query)


def _check_decoded(path: str) -> None:
    if "\\" in path:
        raise PathRefused("the path has a backslash")
    if ";" in path:
        raise PathRefused("the path has a ';' parameter")
    if _CONTROL_CHARACTER.search(path):
        raise PathRefused("the path has a control character")
    segments = path[1:].split("/")
    if any(segment in (".", "..") for segment in segments):
        raise PathRefused("the path has a '.' or '..' segment")
    if "" in segments[:-1]:
        raise PathRefused("the path has an empty segment ('//')")
