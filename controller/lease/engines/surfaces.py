"""What each supported vLLM (and vLLM-Omni) release serves, read from its own wheel.

``e2e/tools/vllm_routes.py --surfaces`` parses each release's ``vllm/entrypoints`` sources (never
importing vLLM) into one JSON file per release under ``vllm_surfaces/``: its whole route
table and, for the routes rota's adapters call, the query parameters each handler reads and
the answers it returns. The files ship with the controller because the adapters decide at
run time from them (which calls a version serves, how it answers a sleep and a wake,
whether its ``/sleep`` still handles running requests); the tests check the adapters, the
engine guard, the gateway and the engine simulator against the same files.

An engine reports its release at ``GET /version`` (every release serves it, dev mode or
not; vLLM-Omni answers the vLLM it runs on) and, unless started with
``--disable-fastapi-docs``, its route table at ``GET /openapi.json``.
"""

from __future__ import annotations

import functools
import re
from collections.abc import Mapping
from importlib import resources
from typing import Literal

from pydantic import BaseModel, ConfigDict

__all__ = [
    "CONTROL_PATHS",
    "Control",
    "Param",
    "Reply",
    "Route",
    "Surface",
    "load_surfaces",
    "supported",
    "surface_for",
    "version_key",
]

Body = Literal["json", "form", "raw", "none"]
HasModel = Literal["yes", "no", "unknown"]
Engine = Literal["vllm", "vllm-omni"]

CONTROL_PATHS = frozenset({
    "/sleep", "/wake_up", "/is_sleeping", "/pause", "/resume", "/is_paused",
    "/collective_rpc", "/release_kv_cache_memory", "/reset_prefix_cache", "/version",
    "/v1/omni/sleep", "/v1/omni/wakeup",
})
"""The routes whose parameters and answers a surface records."""
_PACKAGE = "controller.lease.engines.vllm_surfaces"
_VERSION = re.compile(r"^(\d+)\.(\d+)(?:\.(\d+))?")


class Route(BaseModel):
    """One route of vLLM's server."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    method: str
    """``GET``, ``POST``, ... or ``WEBSOCKET``."""
    path: str
    """As declared, path parameters included (``/v1/responses/{response_id}``)."""
    body: Body
    request_class: str | None
    model: HasModel
    source: str
    """``<file inside the wheel>:<handler>``."""

    @property
    def key(self) -> tuple[str, str]:
        return self.method, self.path


class RouteTable(BaseModel):
    """Every route of one vLLM release."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    vllm: str
    routes: tuple[Route, ...]

    def by_key(self) -> dict[tuple[str, str], Route]:
        return {route.key: route for route in self.routes}


class Param(BaseModel):
    """One parameter a control handler reads: a query parameter or a JSON body field."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    name: str
    where: Literal["query", "body"]
    type: str
    """The annotation as written (``int``, ``PauseMode``, ``list[int]``), ``str`` for a raw
    ``query_params.get``."""
    default: str | None
    """The default as written (``'1'``, ``True``), None when required or a list."""
    bounds: str | None = None
    """``Query(ge=0, le=2)``'s constraints as written (``ge=0 le=2``), if any."""
    values: tuple[str, ...] = ()
    """The values a ``Literal`` type (``PauseMode``) allows."""


class Reply(BaseModel):
    """One success answer a handler returns."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    body: Literal["empty", "json"]
    fields: dict[str, tuple[str, ...]] = {}
    """Each top-level key and what its value may be: a JSON constant (``"sleeping"``) or
    the expression that computes it (``level``)."""


class Control(BaseModel):
    """One route rota's adapters may call, as the release's handler reads and answers it."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    method: str
    path: str
    params: tuple[Param, ...]
    replies: tuple[Reply, ...]
    source: str

    def param(self, name: str) -> Param | None:
        return next((p for p in self.params if p.name == name), None)


class Surface(BaseModel):
    """One release: its route table and its control handlers."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    engine: Engine
    version: str
    routes: tuple[Route, ...]
    controls: tuple[Control, ...]
    ack_fields: tuple[str, ...] = ()
    """vLLM-Omni: the fields of its ``OmniACK`` (one per stage and rank in its answers)."""

    def serves(self, method: str, path: str) -> bool:
        return any(r.method == method and r.path == path for r in self.routes)

    def control(self, path: str) -> Control | None:
        return next((c for c in self.controls if c.path == path), None)

    def table(self) -> RouteTable:
        return RouteTable(vllm=self.version, routes=self.routes)


def version_key(version: str) -> tuple[int, int, int] | None:
    """``(major, minor, patch)`` of a release string (``0.31.0``, ``0.34.0+cu130``,
    ``0.33.1.dev12``); None when it does not start with a version."""
    found = _VERSION.match(version.strip())
    if not found:
        return None
    return int(found.group(1)), int(found.group(2)), int(found.group(3) or 0)


@functools.cache
def load_surfaces() -> Mapping[tuple[Engine, str], Surface]:
    """Every committed surface, by (engine, version)."""
    found: dict[tuple[Engine, str], Surface] = {}
    for entry in resources.files(_PACKAGE).iterdir():
        if entry.name.endswith(".json"):
            surface = Surface.model_validate_json(entry.read_text(encoding="utf-8"))
            found[(surface.engine, surface.version)] = surface
    return found


def supported(engine: Engine = "vllm") -> tuple[str, ...]:
    """The releases of ``engine`` rota has a surface for, oldest first."""
    versions = [v for (e, v) in load_surfaces() if e == engine]
    return tuple(sorted(versions, key=lambda v: version_key(v) or (0, 0, 0)))


def surface_for(version: str, engine: Engine = "vllm") -> Surface | None:
    """The surface that speaks for a running ``version`` of ``engine``: the committed
    release of the same minor (patch releases of a minor keep its HTTP surface: the
    committed one is the latest patch PyPI served); None when rota supports no release of
    that minor."""
    key = version_key(version)
    if key is None:
        return None
    for (e, v), surface in load_surfaces().items():
        other = version_key(v)
        if e == engine and other is not None and other[:2] == key[:2]:
            return surface
    return None
