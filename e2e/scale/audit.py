"""The API server's own record of every request: an audit policy at level ``Metadata`` and
a reader that counts the log's entries by component, verb and resource.

At ``Metadata`` every request is recorded with its ``userAgent``, verb, object reference and
URI, never a body. The ``RequestReceived`` stage is left out, so a request that completes
is one ``ResponseComplete`` entry; a watch is counted by its ``ResponseStarted`` entry (it
completes only when it closes, possibly after the phase). Each entry is placed in time by
its ``requestReceivedTimestamp``.

A component is the User-Agent's product (the text before the first ``/``): rota's
processes name themselves (``rota-controller/<version>``, ``rota-driver/<version>``,
``rota-gateway/<version>``), kwok and Kubernetes' own components do too.
"""

from __future__ import annotations

import datetime as dt
import json
from collections import Counter
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from urllib.parse import parse_qs, urlsplit

POLICY = """\
apiVersion: audit.k8s.io/v1
kind: Policy
omitStages: ["RequestReceived"]
rules:
- level: Metadata
"""

ROTA_COMPONENTS = ("rota-controller", "rota-driver", "rota-gateway")
PER_NODE_COMPONENTS = ("rota-controller", "rota-driver")


@dataclass(frozen=True)
class Request:
    """One API request as the audit log recorded it."""

    at: dt.datetime
    component: str
    user_agent: str
    verb: str
    resource: str
    namespace: str
    uri: str
    code: int

    @property
    def relist(self) -> bool:
        """A list that starts from nothing: no resourceVersion, no continue token (a
        client that lost its cache, or a first list)."""
        if self.verb != "list":
            return False
        query = parse_qs(urlsplit(self.uri).query)
        return not query.get("resourceVersion") and not query.get("continue")


def component_of(user_agent: str) -> str:
    product = user_agent.split("/", 1)[0].strip()
    return product or "(none)"


def _timestamp(value: str) -> dt.datetime:
    return dt.datetime.fromisoformat(value.replace("Z", "+00:00"))


def read(path: Path) -> Iterator[Request]:
    """Every counted request of an audit log (see the module docstring)."""
    with path.open() as log:
        for line in log:
            if not line.strip():
                continue
            try:
                entry = json.loads(line)
            except ValueError:
                continue  # a line the API server was writing when the log was read
            verb = str(entry.get("verb", ""))
            stage = entry.get("stage")
            if (verb == "watch") != (stage == "ResponseStarted"):
                continue
            if stage not in ("ResponseStarted", "ResponseComplete"):
                continue
            ref = entry.get("objectRef") or {}
            resource = str(ref.get("resource") or urlsplit(entry.get("requestURI", "")).path)
            if ref.get("subresource"):
                resource += "/" + str(ref["subresource"])
            agent = str(entry.get("userAgent", ""))
            yield Request(at=_timestamp(entry["requestReceivedTimestamp"]),
                          component=component_of(agent), user_agent=agent, verb=verb,
                          resource=resource, namespace=str(ref.get("namespace") or ""),
                          uri=str(entry.get("requestURI", "")),
                          code=int((entry.get("responseStatus") or {}).get("code") or 0))


WRITES = frozenset({"create", "update", "patch", "delete"})


def writes_rota_state(request: Request, lease_namespace: str) -> bool:
    """A write only rota's processes make: a Lease in rota's namespace (GPU and controller
    Leases), a ResourceSlice, a patch of a pod (the engine's state label)."""
    if request.verb not in WRITES:
        return False
    return ((request.resource == "leases" and request.namespace == lease_namespace)
            or request.resource == "resourceslices"
            or (request.resource == "pods" and request.verb == "patch"))


@dataclass
class Tally:
    """Requests of one time window."""

    by_component: Counter[str] = field(default_factory=Counter)
    by_kind: Counter[tuple[str, str, str]] = field(default_factory=Counter)
    """(component, verb, resource) -> requests."""
    relists: Counter[str] = field(default_factory=Counter)
    """``"<component> <resource>"`` -> lists from scratch."""
    agents: dict[str, set[str]] = field(default_factory=dict)
    """component -> every full User-Agent it sent."""

    def add(self, request: Request) -> None:
        self.by_component[request.component] += 1
        self.by_kind[(request.component, request.verb, request.resource)] += 1
        if request.relist:
            self.relists[f"{request.component} {request.resource}"] += 1
        self.agents.setdefault(request.component, set()).add(request.user_agent)

    def rota(self, components: Iterable[str] = ROTA_COMPONENTS) -> int:
        return sum(self.by_component[c] for c in components)


def tally(requests: Iterable[Request], start: dt.datetime, end: dt.datetime) -> Tally:
    """The requests received in ``[start, end)``."""
    found = Tally()
    for request in requests:
        if start <= request.at < end:
            found.add(request)
    return found
