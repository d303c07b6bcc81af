"""Which vLLM an adapter talks to, and so which calls it makes and how it reads answers.

rota supports vLLM 0.26 through 0.34 (and vLLM-Omni 0.30, on the vLLM it runs on). What
differs between them, read from each release's wheel (:mod:`.surfaces`):

- 0.26-0.31: ``/sleep`` and ``/wake_up`` answer 200 with an empty body;
- 0.31 adds ``/release_kv_cache_memory``;
- 0.32 on: ``/sleep`` validates ``level`` (0-2) and ``mode`` and answers ``{"status":
  "sleeping", "level": N}``; ``/wake_up`` answers ``{"status": "awake"|"sleeping", "tags":
  [...]}``, and ``sleeping`` after a wake of some tags (a partial wake: not awake);
  ``/pause``, ``/resume``, ``/is_paused`` move to another module, same paths;
- 0.34's ``/sleep`` and ``/release_kv_cache_memory`` take ``reset_connector``.

The adapter does not guess: before its first call to an engine it reads ``GET /version``
(every release serves it) and picks that release's surface; an engine outside the range is
refused with :class:`~controller.lease.engines.errors.EngineUnsupported` (the claim's first
probe fails with ``unsupported_engine``, before any switch). Where the engine also serves
its route table (``GET /openapi.json``, unless ``--disable-fastapi-docs``), every route the
adapter will call must be in it (a vLLM without ``VLLM_SERVER_DEV_MODE=1`` serves no
``/sleep``), and the table's ``/sleep`` says whether the engine's sleep still handles
running requests (its ``mode`` parameter): vLLM RFC #51476 would make ``/sleep`` a pure
memory step and move request handling to ``/pause``, and an engine whose ``/sleep``
declares parameters but no ``mode`` is driven that way (pause with ``mode=wait`` first).

What was learnt is kept per engine run (address, pod, the pod's uid and container restarts)
while that run is a claimant of the node (:func:`keep_only`): two reads once per run, never
on a switch's path again.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from pydantic import BaseModel, ConfigDict, StrictStr, ValidationError

from controller.lease.engines.base import EngineEndpoint
from controller.lease.engines.errors import EngineProtocolError, EngineUnsupported
from controller.lease.engines.surfaces import Engine, Surface, supported, surface_for
from controller.lease.engines.transport import EngineHttp

__all__ = ["Dialect", "check_calls", "detect", "forget_all", "keep_only", "may_be_paused",
           "not_paused", "pausing", "served_routes", "supported_range"]

log = logging.getLogger(__name__)

VERSION_PATH = "/version"
OPENAPI_PATH = "/openapi.json"
_KNOWN: dict[tuple[str, str, str | None, str | None], Dialect] = {}
"""(engine, address, pod, run) -> what was learnt; pruned by :func:`keep_only`."""
_NOT_PAUSED: set[tuple[str, str, str | None, str | None]] = set()
"""Engine runs whose last wake found them not paused, and which no sleep that keeps
requests paused since: the only ones a wake need not ask whether they are paused."""


class _Version(BaseModel):
    model_config = ConfigDict(extra="ignore")

    version: StrictStr


@dataclass(frozen=True)
class Dialect:
    """How one engine speaks.

    Attributes:
        version: what the engine's ``/version`` said.
        surface: the committed surface of that release's minor.
        served: the engine's own route table (method, path) from ``/openapi.json``; None
            when it serves none.
        sleep_handles_requests: the engine's ``/sleep`` takes ``mode`` (waits for, aborts
            or keeps running requests itself); False: a pure memory step (RFC #51476).
    """

    version: str
    surface: Surface
    served: frozenset[tuple[str, str]] | None
    sleep_handles_requests: bool

    @property
    def sleep_answers_json(self) -> bool:
        """``/sleep`` answers ``{"status": "sleeping", "level": N}`` (0.32 on)."""
        return _replies_with(self.surface, "/sleep", "status")

    @property
    def wake_answers_status(self) -> bool:
        """``/wake_up`` answers ``{"status": "awake"|"sleeping", ...}`` (0.32 on)."""
        return _replies_with(self.surface, "/wake_up", "status")


    def serves(self, method: str, path: str) -> bool:
        if self.served is not None:
            return (method, path) in self.served
        return self.surface.serves(method, path)


def _replies_with(surface: Surface, path: str, field: str) -> bool:
    control = surface.control(path)
    return control is not None and any(field in r.fields for r in control.replies)


def supported_range(engine: Engine = "vllm") -> str:
    versions = supported(engine)
    return f"{versions[0]}-{versions[-1]}" if len(versions) > 1 else versions[0]


def served_routes(openapi: Mapping[str, Any]) -> dict[tuple[str, str], frozenset[str]]:
    """(METHOD, path) -> the query parameters it declares, from an OpenAPI document."""
    routes: dict[tuple[str, str], frozenset[str]] = {}
    paths = openapi.get("paths")
    if not isinstance(paths, dict):
        return routes
    for path, operations in paths.items():
        if not isinstance(operations, dict):
            continue
        for method, operation in operations.items():
            params = operation.get("parameters", []) if isinstance(operation, dict) else []
            # An engine's table is its own word, not trusted: malformed entries are skipped.
            names = frozenset(p["name"] for p in (params if isinstance(params, list) else [])
                              if isinstance(p, dict) and p.get("in") == "query"
                              and isinstance(p.get("name"), str))
            routes[(str(method).upper(), str(path))] = names
    return routes


async def _version(http: EngineHttp) -> str:
    answer = await http.read("version", VERSION_PATH, control=True, accept=frozenset({404}))
    if answer.status == 404:
        raise EngineUnsupported(
            "GET /version answered 404: not a vLLM server (every vLLM serves it), or a proxy "
            "in front of it hides it", step="version")
    try:
        return _Version.model_validate(answer.json("version")).version
    except ValidationError as exc:
        raise EngineProtocolError('version: the answer is not {"version": "..."}',
                                  step="version", body=answer.body) from exc


async def _openapi(http: EngineHttp) -> dict[tuple[str, str], frozenset[str]] | None:
    answer = await http.read("openapi", OPENAPI_PATH, control=True, accept=frozenset({404}))
    if answer.status == 404:
        return None
    body = answer.json("openapi")
    if not isinstance(body, dict):
        raise EngineProtocolError("openapi: the answer is not an OpenAPI document",
                                  step="openapi", body=answer.body)
    return served_routes(body)


def _sleep_handles_requests(surface: Surface,
                            routes: Mapping[tuple[str, str], frozenset[str]] | None) -> bool:
    """From the engine's own table where it declares ``/sleep``'s parameters (0.32 on);
    from the release's surface where it reads them raw (0.26-0.31) or serves no table."""
    control = surface.control("/sleep")
    in_surface = control is not None and control.param("mode") is not None
    declared = None if routes is None else routes.get(("POST", "/sleep"))
    if declared:
        return "mode" in declared
    return in_surface


async def detect(http: EngineHttp, engine: Engine = "vllm") -> Dialect:
    """The dialect of the engine behind ``http`` (read once per engine and process).

    Raises:
        EngineUnsupported: a release outside the supported range.
        EngineError: the engine could not be read (nothing is remembered then).
    """
    endpoint: EngineEndpoint = http.endpoint
    key = (engine, endpoint.base_url, endpoint.pod, endpoint.run)
    known = _KNOWN.get(key)
    if known is not None:
        return known
    version = await _version(http)
    surface = surface_for(version, "vllm")
    if surface is None:
        raise EngineUnsupported(
            f"the engine runs vLLM {version}; rota supports vLLM {supported_range()} "
            "(docs/concepts.md, 'Engines'): run a supported release", step="version")
    if engine == "vllm-omni":
        omni = surface_for(supported("vllm-omni")[-1], "vllm-omni")
        assert omni is not None
        surface = omni
    routes = await _openapi(http)
    dialect = Dialect(version=version, surface=surface,
                      served=None if routes is None else frozenset(routes),
                      sleep_handles_requests=_sleep_handles_requests(surface, routes))
    _KNOWN[key] = dialect
    log.info("engine release read", extra=endpoint.log_fields() | {
        "vllm_version": version, "surface": f"{surface.engine}-{surface.version}",
        "route_table": routes is not None,
        "sleep_handles_requests": dialect.sleep_handles_requests})
    return dialect


def check_calls(dialect: Dialect, calls: frozenset[tuple[str, str]],
                endpoint: EngineEndpoint) -> None:
    """Raise :class:`EngineUnsupported` unless the engine serves every call in ``calls``."""
    missing = sorted(call for call in calls if not dialect.serves(*call))
    if missing:
        named = ", ".join(" ".join(call) for call in missing)
        log.error("engine lacks routes rota calls", extra=endpoint.log_fields() | {
            "vllm_version": dialect.version, "missing": named})
        raise EngineUnsupported(
            f"vLLM {dialect.version} does not serve {named}: start it with "
            "VLLM_SERVER_DEV_MODE=1 (and --enable-sleep-mode)", step="routes")


def _key(endpoint: EngineEndpoint, engine: Engine = "vllm"
         ) -> tuple[str, str, str | None, str | None]:
    return (engine, endpoint.base_url, endpoint.pod, endpoint.run)


def may_be_paused(endpoint: EngineEndpoint) -> bool:
    """Whether the engine may be paused by a sleep that kept its requests (or by anyone,
    as far as this process knows: a run not seen since it started counts as maybe)."""
    return _key(endpoint) not in _NOT_PAUSED


def pausing(endpoint: EngineEndpoint) -> None:
    """A sleep that keeps requests is about to pause the engine."""
    _NOT_PAUSED.discard(_key(endpoint))


def not_paused(endpoint: EngineEndpoint) -> None:
    """A wake found the engine not paused (or resumed it)."""
    _NOT_PAUSED.add(_key(endpoint))


def forget_all() -> None:
    """Drop everything learnt (tests: engines come and go on reused ports)."""
    _KNOWN.clear()
    _NOT_PAUSED.clear()


def keep_only(runs: set[str | None]) -> None:
    """Drop what was learnt about every engine run not in ``runs`` (the runs of the node's
    claimants now): without it an engine restarted or deleted leaves its entry for the
    life of the process."""
    for key in [k for k in _KNOWN if k[3] not in runs]:
        del _KNOWN[key]
    for key in [k for k in _NOT_PAUSED if k[3] not in runs]:
        _NOT_PAUSED.discard(key)
