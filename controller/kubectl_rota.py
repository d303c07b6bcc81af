"""``kubectl rota``: rota's state where kubectl users look, and a switch on request.

- ``kubectl rota status``: per node and GPU, the awake holder, its model, the fencing
  number, the Lease's state and last error, the engines awake beside the holder (an awake
  set, on a line of their own), and which controller instance holds the node's
  controller Lease, with its last renewal as the node's clock stamped it (from the GPU
  Leases and the controllers' Leases). It says nothing of whether that controller is
  alive: one read cannot tell (:data:`LIVENESS_NOTE`). With the activation token (the
  Secret, or ``--token-file``) it also asks each node's controller (``GET /v1/state``) for
  the last switch with its timings and the queue, when it can reach it. Without it (a
  user of the read-only ``rota-status`` role may not read the Secret, the credential that
  triggers switches) it shows the Leases and says once why the live columns are empty.
- ``kubectl rota switch <model>``: asks the node's activation API to make the model awake,
  through the gateway's contract (:mod:`rota.api.activation`), and prints the answer.

Installed as the ``kubectl-rota`` entry point: kubectl finds it on ``PATH``. The pure
functions below build everything from Lease, claim and answer objects; ``main`` only reads
the API server and calls the controllers.

Controllers are reached through the API server's pod proxy
(``/api/v1/namespaces/<namespace>/pods/<pod>:<port>/proxy/...``), with the kubeconfig's
own credentials: the pod is the one the node's controller Lease names as its holder, in
the controllers' namespace, and the port the one its advertised URL gives. The user needs
``get`` (status) and ``create`` (switch) on ``pods/proxy`` there. The API server keeps the
``Authorization`` header for itself, so the activation token travels in
``X-Rota-Activation-Token``. ``--direct`` calls the advertised URL (the pod IP) instead,
from where pod IPs route and the controllers' NetworkPolicy admits the caller. Either way
an answer that redirects is an error: a redirect is never followed (it would carry the
token elsewhere).
"""

from __future__ import annotations

import argparse
import base64
import datetime as dt
import http.client
import json
import sys
import textwrap
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol, TextIO
from urllib.parse import quote, urlsplit

from pydantic import ValidationError

from controller.claimants import claimants_from
from rota.api import naming
from rota.api.activation import (
    PATH,
    STATE_PATH,
    TOKEN_HEADER,
    ActivateAnswer,
    ActivateRequest,
    ErrorBody,
)
from rota.api.controller_lease import ControllerLease
from rota.api.gpu_lease import GpuLease, micro_time
from rota.kit.errors import ConfigError
from rota.kit.kube import check_kubeconfig
from rota.kit.kube_client import version

__all__ = ["Answer", "ControllerInfo", "Direct", "GpuRow", "SwitchOutcome", "ThroughApiServer",
           "Unreachable", "api_server_refusal", "controllers_from", "find_claimant",
           "interpret_activation", "main", "proxy_path", "render_status", "render_switch",
           "status_rows"]

DEFAULT_NAMESPACE = naming.DEFAULT_NAMESPACE
DEFAULT_SECRET = "rota-activation-token"
PROG = "kubectl rota"
"""Its one name in usage, errors and ``--version``: how a user types it (kubectl runs the
installed ``kubectl-rota``)."""
DESCRIPTION = ("rota's state where kubectl users look (status), and a switch on request "
               "(switch).")
STATUS_COLUMNS = ("NODE", "GPU", "STATE", "HOLDER", "MODEL", "FENCE", "CONTROLLER",
                  "CTL-RENEWED", "RENEWED", "QUEUE")
"""The columns of ``kubectl rota status``, in order (docs/operations.md shows them; a test
keeps the two equal)."""


def no_token_note(namespace: str, secret: str) -> str:
    """Why the live columns are empty when the activation token cannot be read."""
    return (f"live data not asked: no activation token (Secret {namespace}/{secret} is not "
            "readable, or --token-file not given); the Leases alone are shown")


LIVENESS_NOTE = (
    "CTL-RENEWED (the node controller's last renewal of its Lease, over the Lease's "
    "duration) and RENEWED (the GPU Lease's last write) are the node's clock's stamps read "
    "against this machine's clock, which may differ from it. One read cannot tell whether a "
    "controller is alive: the gateways and the controllers judge that by seeing its Lease "
    "change, each on its own clock.")


@dataclass(frozen=True)
class ControllerInfo:
    """A node's controller Lease (:class:`~rota.api.controller_lease.ControllerLease`,
    its one parser): the acting instance and where its API listens.

    No liveness verdict: that takes seeing the Lease change over time on the reader's own
    clock (:class:`~rota.api.controller_lease.LeaseObserver`), which a one-shot
    command cannot do. It shows the renewal as the node's clock stamped it instead.
    """

    lease: ControllerLease

    @property
    def node(self) -> str:
        """The node's label value (as GPU Leases name the node)."""
        return self.lease.node_label

    @property
    def identity(self) -> str:
        return self.lease.holder

    @property
    def activation_url(self) -> str:
        return self.lease.activation_url

    @property
    def duration_s(self) -> float:
        return self.lease.duration_s

    def renew_age_s(self, now: dt.datetime) -> float | None:
        """``now`` (this machine's wall clock) minus ``renewTime`` (the node's): includes
        whatever the two clocks disagree by. For display only, never a verdict."""
        renewed = self.lease.renew_time
        return None if renewed is None else (now - renewed).total_seconds()

    @property
    def port(self) -> int | None:
        """The port of the advertised URL (the scheme's default when it names none)."""
        try:
            parts = urlsplit(self.activation_url)
            return parts.port or {"http": 80, "https": 443}.get(parts.scheme)
        except ValueError:
            return None


@dataclass(frozen=True)
class GpuRow:
    """One GPU: its Lease, its node's controller, and what that controller said."""

    lease: GpuLease
    controller: ControllerInfo | None
    live: Mapping[str, Any] | None = None
    """The GPU's entry of the controller's ``/v1/state`` (last switch, queue), if read."""

    @property
    def gpu(self) -> str:
        return self.lease.device


def _kind(obj: Mapping[str, Any]) -> str:
    return str((obj.get("metadata", {}).get("labels") or {}).get(naming.LABEL_KIND, ""))


def controllers_from(leases: Iterable[Mapping[str, Any]]) -> dict[str, ControllerInfo]:
    """Node label value -> the controller Lease of that node."""
    out: dict[str, ControllerInfo] = {}
    for obj in leases:
        lease = ControllerLease.from_object(obj)
        if lease is not None:
            out[lease.node_label] = ControllerInfo(lease)
    return out


def status_rows(leases: Iterable[Mapping[str, Any]],
                states: Mapping[str, Mapping[str, Any]] | None = None, *,
                node: str | None = None) -> list[GpuRow]:
    """Every GPU Lease among ``leases`` (on ``node`` when given), sorted by node and GPU.

    ``states`` maps a node label value to that node's ``/v1/state`` answer.
    """
    items = list(leases)
    controllers = controllers_from(items)
    rows = []
    for obj in items:
        if _kind(obj) != naming.KIND_GPU:
            continue
        lease = GpuLease.from_object(dict(obj))
        if node is not None and lease.node != naming.label_value(node):
            continue
        state = (states or {}).get(lease.node) or {}
        live = (state.get("leases") or {}).get(lease.device)
        rows.append(GpuRow(lease=lease, controller=controllers.get(lease.node),
                           live=live if isinstance(live, Mapping) else None))
    return sorted(rows, key=lambda r: (r.lease.node, r.gpu))


def _age(moment: dt.datetime | None, now: dt.datetime) -> str:
    if moment is None:
        return "-"
    return _span(max(0, int((now - moment).total_seconds())))


def _span(seconds: int) -> str:
    if seconds < 120:
        return f"{seconds}s"
    if seconds < 7200:
        return f"{seconds // 60}m"
    return f"{seconds // 3600}h"


def _renewal(ctl: ControllerInfo | None, now: dt.datetime) -> str:
    """``<age>/<duration>`` of a controller Lease's renewal (a negative age: the node's
    clock is ahead of this one), or ``-``."""
    age = None if ctl is None else ctl.renew_age_s(now)
    if ctl is None or age is None:
        return "-"
    return f"{'-' if age < 0 else ''}{_span(int(abs(age)))}/{ctl.duration_s:g}s"


def _last_switch(live: Mapping[str, Any] | None) -> str:
    switch = (live or {}).get("last_switch") or {}
    if not isinstance(switch, Mapping) or not switch:
        return "-"
    timings = switch.get("timings") or {}
    total = timings.get("total")
    head = f"{switch.get('from') or '(none)'} -> {switch.get('to')} "
    head += "ok" if switch.get("ok") else f"failed ({switch.get('reason') or '?'})"
    if isinstance(total, int | float):
        head += f" in {total:.2f}s"
    steps = [f"{k} {v:.2f}s" for k, v in sorted(timings.items())
             if k != "total" and isinstance(v, int | float)]
    return head + (f" [{', '.join(steps)}]" if steps else "")


def _queue(live: Mapping[str, Any] | None) -> str:
    queue = (live or {}).get("queue")
    if isinstance(queue, int):
        return str(queue)
    if isinstance(queue, list):
        return ",".join(str(q) for q in queue) or "0"
    return "-"


def render_status(rows: Sequence[GpuRow], now: dt.datetime,
                  unread: Mapping[str, str] | None = None) -> str:
    """A table, one line per GPU; the engines awake beside its holder, the last error and
    the last switch on indented lines; then, per node in ``unread``, why its controller's
    live data is missing."""
    notes = "".join(f"live data of node {node} not read: {why}\n"
                    for node, why in sorted((unread or {}).items()))
    if not rows:
        return "No GPU Leases: no lease controller has run yet in this namespace.\n" + notes
    header = STATUS_COLUMNS
    lines = [header]
    details: dict[int, list[str]] = {}
    for i, row in enumerate(rows):
        lease, ctl = row.lease, row.controller
        acting = "-" if ctl is None else (ctl.identity or "(none)")
        model = lease.holder_model or "-"
        if lease.state == naming.STATE_SWITCHING and lease.target_model:
            model = f"{lease.draining_model or model} -> {lease.target_model}"
        lines.append((lease.node, row.gpu, lease.state, lease.holder or "-", model,
                      str(lease.fence), acting, _renewal(ctl, now), _age(lease.renewed, now),
                      _queue(row.live)))
        extra = []
        if lease.companions:
            extra.append(f"awake with: {_members(lease)}")
        if row.live is not None:
            extra.append(f"last switch: {_last_switch(row.live)}")
        if lease.last_error:
            extra.append(f"last error: {lease.last_error}")
        details[i + 1] = extra
    widths = [max(len(line[c]) for line in lines) for c in range(len(header))]
    out = []
    for i, line in enumerate(lines):
        out.append("  ".join(cell.ljust(w) for cell, w in zip(line, widths, strict=True))
                   .rstrip())
        out += [f"    {d}" for d in details.get(i, [])]
    if any(row.controller is not None for row in rows):
        out.append(textwrap.fill(LIVENESS_NOTE, 100))
    return "\n".join(out) + "\n" + notes


def _members(lease: GpuLease) -> str:
    """The engines awake beside the holder (:attr:`GpuLease.companions`), in wake order:
    ``<namespace>/<claim> (<model>)`` each."""
    return ", ".join(f"{m.claim} ({m.model or '?'})" for m in lease.companions)


def _controller_json(ctl: ControllerInfo, now: dt.datetime) -> dict[str, Any]:
    """No ``alive``: one read cannot tell (see :data:`LIVENESS_NOTE`)."""
    renewed = ctl.lease.renew_time
    return {"identity": ctl.identity, "url": ctl.activation_url,
            "renew_time": None if renewed is None else micro_time(renewed),
            "renew_age_s": ctl.renew_age_s(now), "duration_s": ctl.duration_s}


def status_json(rows: Sequence[GpuRow], now: dt.datetime,
                unread: Mapping[str, str] | None = None) -> list[dict[str, Any]]:
    return [{"node": r.lease.node, "gpu": r.gpu, "state": r.lease.state,
             "holder": r.lease.holder, "model": r.lease.holder_model, "fence": r.lease.fence,
             "target_model": r.lease.target_model, "last_error": r.lease.last_error,
             "awake_with": [{"claim": m.claim, "uid": m.uid, "model": m.model}
                            for m in r.lease.companions],
             "gpu_uuid": r.lease.gpu_uuid,
             "controller": None if r.controller is None else _controller_json(r.controller, now),
             "last_switch": (r.live or {}).get("last_switch"),
             "queue": (r.live or {}).get("queue"),
             "live_error": (unread or {}).get(r.lease.node)} for r in rows]


def find_claimant(claims: Iterable[Mapping[str, Any]], model: str,
                  claim: str | None = None) -> tuple[str, str]:
    """(node, ``<namespace>/<claim>``) of an allocated claimant serving ``model``.

    Raises:
        LookupError: none does (the message lists the models that do exist).
    """
    found = claimants_from(claims, {})
    matching = [c for c in found if c.model == model and (claim is None or c.ref == claim)]
    if not matching:
        known = sorted({c.model for c in found})
        raise LookupError(f"no allocated claim serves model {model!r}"
                          + (f" as {claim}" if claim else "")
                          + (f"; models: {', '.join(known)}" if known else ""))
    if claim is None and len({c.node for c in matching}) > 1:
        refs = ", ".join(c.ref for c in matching)
        raise LookupError(f"model {model!r} is served on several nodes ({refs}): "
                          f"name one with --claim")
    return matching[0].node, matching[0].ref


@dataclass(frozen=True)
class SwitchOutcome:
    ok: bool
    status: int
    answer: ActivateAnswer | None = None
    error: str = ""
    message: str = ""
    retry_after: str | None = None
    extra: dict[str, Any] = field(default_factory=dict)


def interpret_activation(status: int, body: bytes, retry_after: str | None) -> SwitchOutcome:
    """The activation API's answer, read through its contract."""
    if status == 200:
        try:
            return SwitchOutcome(True, status, answer=ActivateAnswer.model_validate_json(body))
        except ValidationError as exc:
            return SwitchOutcome(False, status, error="bad_answer", message=str(exc)[:300])
    try:
        detail = ErrorBody.model_validate_json(body).error
        return SwitchOutcome(False, status, error=detail.type, message=detail.message,
                             retry_after=retry_after)
    except ValidationError:
        return SwitchOutcome(False, status, error=f"http_{status}",
                             message=body[:300].decode(errors="replace"),
                             retry_after=retry_after)


def render_switch(outcome: SwitchOutcome, model: str) -> str:
    if outcome.ok and outcome.answer is not None:
        a = outcome.answer
        verb = "switched to" if a.switched else "already awake:"
        timings = ", ".join(f"{k} {v:.2f}s" for k, v in sorted(a.timings.items()))
        return (f"{verb} {a.model} ({a.claim}), fence {a.fence}"
                + (f" [{timings}]" if timings else "") + "\n")
    retry = f" (retry after {outcome.retry_after}s)" if outcome.retry_after else ""
    return f"could not switch to {model}: {outcome.error}: {outcome.message}{retry}\n"


# -- how a controller is called ------------------------------------------------------------

MAX_ANSWER_BYTES = 1 << 20


class Unreachable(Exception):
    """The controller could not be asked; the message says why."""


@dataclass(frozen=True)
class Answer:
    """The controller's own answer."""

    status: int
    body: bytes
    retry_after: str | None = None


def proxy_path(namespace: str, pod: str, port: int, path: str) -> str:
    """The API server's path that proxies ``path`` to ``pod``'s ``port``."""
    return (f"/api/v1/namespaces/{quote(namespace, safe='')}/pods/"
            f"{quote(pod, safe='')}:{port}/proxy{path}")


def api_server_refusal(status: int, body: bytes, content_type: str) -> str | None:
    """What the API server said, when an answer is its own error (a ``Status``) rather
    than the controller's; None otherwise."""
    if status < 400 or "json" not in content_type:
        return None
    try:
        doc = json.loads(body)
    except ValueError:
        return None
    if not isinstance(doc, dict) or doc.get("kind") != "Status" or "error" in doc:
        return None
    message = str(doc.get("message") or doc.get("reason") or f"HTTP {status}")[:300]
    hint = {403: " (the kubeconfig's user needs get and create on pods/proxy in the "
                 "controllers' namespace)",
            404: " (the controller Lease's holder is not a pod of this namespace; --direct "
                 "calls its advertised URL)",
            503: " (the API server cannot reach the pod: the controllers' NetworkPolicy must "
                 "admit it, see networkPolicy.controllerFrom)"}.get(status, "")
    return f"the API server answered {status}: {message}{hint}"


def _redirect(status: int) -> str | None:
    if 300 <= status < 400:
        return f"the controller answered {status}, a redirect, which is never followed"
    return None


class ControllerCalls(Protocol):
    def call(self, ctl: ControllerInfo, path: str, *, body: bytes | None,
             timeout_s: float) -> Answer:
        """GET (``body`` None) or POST ``path`` of the node's activation API.

        Raises:
            Unreachable: the controller could not be asked, or its answer redirects.
        """


class ThroughApiServer:
    """Calls through the API server's pod proxy with the kubeconfig's credentials (the
    client's own TLS and auth); never follows a redirect."""

    def __init__(self, api: Any, namespace: str, token: str | None) -> None:
        self._api = api
        self._namespace = namespace
        self._token = token

    def call(self, ctl: ControllerInfo, path: str, *, body: bytes | None,
             timeout_s: float) -> Answer:
        import urllib3

        if not ctl.identity:
            raise Unreachable("no controller instance holds the node's Lease")
        port = ctl.port
        if port is None:
            raise Unreachable(f"the advertised URL {ctl.activation_url!r} names no port")
        headers = {"Accept": "application/json"}
        if body is not None:
            headers["Content-Type"] = "application/json"
        if self._token:
            headers[TOKEN_HEADER] = self._token
        method = "GET" if body is None else "POST"
        method, url, headers, _, _ = self._api.param_serialize(
            method, proxy_path(self._namespace, ctl.identity, port, path),
            header_params=headers, auth_settings=["BearerToken"])
        try:
            resp = self._api.rest_client.pool_manager.request(
                method, url, body=body, headers=headers, redirect=False, retries=False,
                preload_content=False,
                timeout=urllib3.Timeout(connect=min(timeout_s, 10.0), read=timeout_s))
        except urllib3.exceptions.HTTPError as exc:
            raise Unreachable(f"the API server cannot be reached: {exc}") from exc
        try:
            data = resp.read(MAX_ANSWER_BYTES)
        finally:
            resp.release_conn()
        status = int(resp.status)
        refusal = (_redirect(status)
                   or api_server_refusal(status, data, resp.headers.get("Content-Type", "")))
        if refusal is not None:
            raise Unreachable(refusal)
        return Answer(status, data, resp.headers.get("Retry-After"))


class Direct:
    """Calls the URL the controller Lease advertises (the pod IP); never follows a
    redirect (``http.client`` has no notion of one)."""

    def __init__(self, token: str | None) -> None:
        self._token = token

    def call(self, ctl: ControllerInfo, path: str, *, body: bytes | None,
             timeout_s: float) -> Answer:
        try:
            parts = urlsplit(ctl.activation_url)
            host, port = parts.hostname, parts.port
        except ValueError as exc:
            raise Unreachable(f"the advertised URL {ctl.activation_url!r}: {exc}") from exc
        if parts.scheme not in ("http", "https") or not host:
            raise Unreachable(f"the advertised URL {ctl.activation_url!r} is not http(s)")
        kind = http.client.HTTPSConnection if parts.scheme == "https" else \
            http.client.HTTPConnection
        conn = kind(host, port, timeout=timeout_s)
        headers = {"Accept": "application/json"}
        if self._token:
            headers["Authorization"] = f"Bearer {self._token}"
        if body is not None:
            headers["Content-Type"] = "application/json"
        try:
            conn.request("GET" if body is None else "POST", parts.path.rstrip("/") + path,
                         body=body, headers=headers)
            resp = conn.getresponse()
            data = resp.read(MAX_ANSWER_BYTES)
        except (OSError, http.client.HTTPException) as exc:
            raise Unreachable(f"{ctl.activation_url} cannot be reached: {exc}") from exc
        finally:
            conn.close()
        refusal = _redirect(resp.status)
        if refusal is not None:
            raise Unreachable(refusal)
        return Answer(int(resp.status), data, resp.getheader("Retry-After"))


# -- the thin part: the API server and the controllers -------------------------------------


def _calls(args: argparse.Namespace, api: Any) -> ControllerCalls:
    return _through(args, api, _token(args, api))


def _through(args: argparse.Namespace, api: Any, token: str | None) -> ControllerCalls:
    if args.direct:
        return Direct(token)
    return ThroughApiServer(api, args.namespace, token)


def _token(args: argparse.Namespace, api: Any) -> str | None:
    from kubernetes import client

    if args.token_file:
        try:
            with open(args.token_file, encoding="utf-8") as f:
                lines = [x.strip() for x in f if x.strip() and not x.startswith("#")]
        except (OSError, UnicodeDecodeError) as exc:
            raise ConfigError(f"cannot read --token-file {args.token_file}: {exc}") from None
        return lines[0] if lines else None
    try:
        secret = client.CoreV1Api(api).read_namespaced_secret(args.secret, args.namespace,
                                                              _request_timeout=10)
    except client.ApiException:
        return None
    raw = (secret.data or {}).get("token")
    return base64.b64decode(raw).decode().splitlines()[0].strip() if raw else None


def _api(args: argparse.Namespace) -> Any:
    from kubernetes import config

    from rota.kit.kube import ClientAgent, apply_client_agent

    api = config.new_client_from_config(config_file=args.kubeconfig, context=args.context)
    return apply_client_agent(api, ClientAgent(component="kubectl-rota", qps=20.0, burst=40))


def _leases(api: Any, namespace: str) -> list[dict[str, Any]]:
    from kubernetes import client

    resp = client.CoordinationV1Api(api).list_namespaced_lease(
        namespace, label_selector=f"{naming.LABEL_MANAGED_BY}={naming.MANAGED_BY}",
        _preload_content=False, _request_timeout=10)
    return list(json.loads(resp.data).get("items", []))


def _live_state(calls: ControllerCalls, ctl: ControllerInfo, timeout_s: float
                ) -> Mapping[str, Any]:
    """The controller's ``/v1/state`` answer.

    Raises:
        Unreachable: it could not be read (the message says why).
    """
    if not ctl.activation_url:
        raise Unreachable("the controller Lease advertises no URL")
    answer = calls.call(ctl, STATE_PATH, body=None, timeout_s=timeout_s)
    if answer.status != 200:
        outcome = interpret_activation(answer.status, answer.body, answer.retry_after)
        raise Unreachable(f"the controller answered {answer.status}: {outcome.error}"
                          + (f": {outcome.message}" if outcome.message else ""))
    try:
        state = json.loads(answer.body)
    except ValueError as exc:
        raise Unreachable(f"the controller's answer is not JSON: {exc}") from exc
    if not isinstance(state, dict):
        raise Unreachable("the controller's answer is not a JSON object")
    return state


def _status(args: argparse.Namespace, out: TextIO) -> int:
    api = _api(args)
    try:
        leases = _leases(api, args.namespace)
        states: dict[str, Mapping[str, Any]] = {}
        unread: dict[str, str] = {}
        token = None if args.no_live else _token(args, api)
        if not args.no_live and token is None:
            unread = {node: no_token_note(args.namespace, args.secret)
                      for node in controllers_from(leases)
                      if args.node is None or node == naming.label_value(args.node)}
        elif not args.no_live:
            calls = _through(args, api, token)
            for node, ctl in controllers_from(leases).items():
                if args.node is not None and node != naming.label_value(args.node):
                    continue
                try:
                    states[node] = _live_state(calls, ctl, args.request_timeout)
                except Unreachable as exc:
                    unread[node] = str(exc)  # the Leases still say enough
        rows = status_rows(leases, states, node=args.node)
        now = dt.datetime.now(dt.UTC)
        if args.output == "json":
            out.write(json.dumps(status_json(rows, now, unread), indent=2, default=str) + "\n")
        else:
            out.write(render_status(rows, now, unread))
        return 0
    finally:
        api.close()


def _switch(args: argparse.Namespace, out: TextIO) -> int:
    from kubernetes import client

    api = _api(args)
    try:
        claims = client.CustomObjectsApi(api).list_cluster_custom_object(
            "resource.k8s.io", "v1", "resourceclaims", _request_timeout=30)["items"]
        try:
            node, ref = find_claimant(claims, args.model, args.claim)
        except LookupError as exc:
            out.write(f"{exc}\n")
            return 1
        ctl = controllers_from(_leases(api, args.namespace)).get(naming.label_value(node))
        if ctl is None or not ctl.activation_url:
            out.write(f"no lease controller acts for node {node}\n")
            return 1
        request = ActivateRequest(model=args.model, claim=ref)
        try:
            answer = _calls(args, api).call(ctl, PATH, body=request.model_dump_json().encode(),
                                            timeout_s=args.timeout)
        except Unreachable as exc:
            out.write(f"the lease controller of {node} ({ctl.identity or '-'}) cannot be "
                      f"asked: {exc}\n")
            return 1
        outcome = interpret_activation(answer.status, answer.body, answer.retry_after)
        out.write(render_switch(outcome, args.model))
        return 0 if outcome.ok else (3 if answer.status == 409 else 2)
    finally:
        api.close()


def _common(parser: argparse.ArgumentParser, *, defaults: bool) -> None:
    """Flags every command takes, before or after the command's name."""
    def default(value: str | bool | None) -> Any:
        return value if defaults else argparse.SUPPRESS

    parser.add_argument("-n", "--namespace", default=default(DEFAULT_NAMESPACE),
                        help="Namespace of rota's components and Leases. Default: "
                             f"{DEFAULT_NAMESPACE}.")
    parser.add_argument("--kubeconfig", default=default(None), help="kubeconfig file "
                        "(default: $KUBECONFIG or ~/.kube/config).")
    parser.add_argument("--context", default=default(None), help="kubeconfig context.")
    parser.add_argument("--secret", default=default(DEFAULT_SECRET), help="Secret holding "
                        f"the activation token (key token). Default: {DEFAULT_SECRET}.")
    parser.add_argument("--token-file", default=default(None), help="Read the activation "
                        "token from this file instead of the Secret.")
    parser.add_argument("--direct", action="store_true", default=default(False),
                        help="Call each controller at the URL its Lease advertises (its pod "
                             "IP) instead of through the API server's pod proxy: from where "
                             "pod IPs route and the controllers' NetworkPolicy admits you.")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog=PROG, description=DESCRIPTION)
    parser.add_argument("--version", action="version", version=f"{PROG} {version()}")
    _common(parser, defaults=True)
    common = argparse.ArgumentParser(add_help=False)
    _common(common, defaults=False)
    sub = parser.add_subparsers(dest="command", required=True)
    status = sub.add_parser("status", parents=[common], help="GPU -> holder, fence, state, "
                                                             "last switch, per node.",
                            description="Per node and GPU: the awake holder, its model, the "
                            "fencing number, the Lease's state and last error, the engines "
                            "awake beside the holder (an awake set), the controller "
                            "instance that holds the node's controller Lease and its last "
                            "renewal. " + LIVENESS_NOTE)
    status.add_argument("--node", default=None, help="Only this node's GPUs.")
    status.add_argument("--no-live", action="store_true", help="Leases only; do not ask "
                        "the controllers for their last switch and queue.")
    status.add_argument("--request-timeout", type=float, default=5.0, help="Timeout of "
                        "each controller call, in seconds. Default: 5.")
    status.add_argument("-o", "--output", choices=("table", "json"), default="table")
    switch = sub.add_parser("switch", parents=[common], help="Make a model awake on its GPU.")
    switch.add_argument("model", help="The model name (EngineConfig model).")
    switch.add_argument("--claim", default=None, help="<namespace>/<claim> when several "
                        "claims serve the model.")
    switch.add_argument("--timeout", type=float, default=330.0, help="Wait this long for "
                        "the switch, in seconds. Default: 330.")
    return parser


def main(argv: Sequence[str] | None = None, out: TextIO | None = None) -> int:
    """Exit codes: 0 done, 1 nothing to act on, 2 the switch failed or the flags or the
    kubeconfig are wrong (one line on stderr), 3 refused for now (another controller
    instance acts; retry)."""
    args = build_parser().parse_args(argv)
    stream = out or sys.stdout
    try:
        check_kubeconfig(args.kubeconfig, context=args.context, in_cluster=False)
        if args.command == "status":
            return _status(args, stream)
        return _switch(args, stream)
    except ConfigError as exc:
        print(f"{PROG}: {exc}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
