"""A node's activation API as ``kubectl rota`` meets it, on an address of this machine that
the API server may proxy to.

:class:`ActivationApiSimulator` checks the token as the controller does (``Authorization:
Bearer`` or ``X-Rota-Activation-Token``, every other call ``unauthorized``), refuses a body
over the contract's limit (``request_too_large``), validates ``POST /v1/activate`` bodies
with the contract's model (``invalid_request`` otherwise), answers ``unknown_model`` for a
model it does not serve and ``failures[model]`` (an error code) when one is set, and
records every request with its headers. Every error is the contract's
:class:`~rota.api.activation.ErrorBody`, sent with the status and ``Retry-After``
that the contract's table gives its code, as the controller sends it. ``redirect_to``
makes it answer every call with a 302 to another URL instead, as a pod that is not rota's
controller might.
"""

from __future__ import annotations

import ipaddress
import json
import shutil
import subprocess
import threading
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

from pydantic import ValidationError

from controller.urls import http_url
from rota.api.activation import (
    MAX_BODY_BYTES,
    PATH,
    STATE_PATH,
    TOKEN_HEADER,
    ActivateAnswer,
    ActivateRequest,
    ErrorBody,
    StateAnswer,
    refusal_of,
)


def proxyable_address() -> str | None:
    """A global IPv4 address of this machine (the API server refuses to proxy to loopback
    and link-local addresses), or None when it has none."""
    ip = shutil.which("ip")
    if ip is None:
        return None
    done = subprocess.run([ip, "-j", "-4", "addr", "show", "scope", "global"],
                          capture_output=True, text=True, check=False, timeout=10)
    if done.returncode != 0:
        return None
    for link in json.loads(done.stdout or "[]"):
        for info in link.get("addr_info", []):
            address = str(info.get("local", ""))
            try:
                parsed = ipaddress.ip_address(address)
            except ValueError:
                continue
            if not (parsed.is_loopback or parsed.is_link_local or parsed.is_unspecified):
                return address
    return None


@dataclass(frozen=True)
class Seen:
    method: str
    path: str
    headers: Mapping[str, str]
    body: bytes


@dataclass
class ActivationApiSimulator:
    host: str
    token: str | None
    """None: every call is admitted (a controller without a token file)."""
    state: StateAnswer | dict[str, Any] = field(default_factory=dict)
    """What ``GET /v1/state`` answers (a dict: as it is, for answers the model refuses)."""
    serves: dict[str, ActivateAnswer] = field(default_factory=dict)
    """model -> the answer of ``POST /v1/activate`` for it."""
    failures: dict[str, str] = field(default_factory=dict)
    """model -> the error code ``POST /v1/activate`` answers for it."""
    redirect_to: str | None = None
    seen: list[Seen] = field(default_factory=list)
    _lock: threading.Lock = field(default_factory=threading.Lock)

    def admits(self, headers: Mapping[str, str]) -> bool:
        if self.token is None:
            return True
        return headers.get("Authorization") == f"Bearer {self.token}" or \
            headers.get(TOKEN_HEADER) == self.token

    def answer(self, method: str, path: str, headers: Mapping[str, str], body: bytes
               ) -> tuple[int, dict[str, str], bytes]:
        with self._lock:
            self.seen.append(Seen(method, path, dict(headers), body))
        if self.redirect_to is not None:
            return 302, {"Location": self.redirect_to + path}, b""
        if not path.startswith("/v1/"):
            return 404, {}, b"not found\n"
        if not self.admits(headers):
            return _error("unauthorized", "a valid bearer token is required")
        if len(body) > MAX_BODY_BYTES:
            return _error("request_too_large", f"longer than {MAX_BODY_BYTES} bytes")
        if method == "GET" and path == STATE_PATH:
            state = self.state.model_dump(mode="json") if isinstance(self.state, StateAnswer) \
                else self.state
            return 200, {"Content-Type": "application/json"}, json.dumps(state).encode()
        if method == "POST" and path == PATH:
            try:
                request = ActivateRequest.model_validate_json(body)
            except ValidationError as exc:
                return _error("invalid_request", str(exc)[:200])
            if request.model in self.failures:
                return _error(self.failures[request.model], "the simulated switch failed")
            answer = self.serves.get(request.model)
            if answer is None:
                return _error("unknown_model", f"no claimant serves {request.model}")
            return 200, {"Content-Type": "application/json"}, answer.model_dump_json().encode()
        return _error("not_found", f"{method} {path}")


def _error(code: str, message: str) -> tuple[int, dict[str, str], bytes]:
    """The contract's answer for ``code``: its status and Retry-After from the table."""
    row = refusal_of(code)
    body = ErrorBody.of(code, message).model_dump_json()
    return row.status, {"Content-Type": "application/json", **row.headers()}, body.encode()


@contextmanager
def serving(sim: ActivationApiSimulator) -> Iterator[str]:
    """Serve ``sim`` on its host, port picked by the kernel; yields its URL."""

    class Handler(BaseHTTPRequestHandler):
        def _serve(self) -> None:
            length = int(self.headers.get("Content-Length") or 0)
            body = self.rfile.read(length) if length else b""
            status, headers, payload = sim.answer(self.command, self.path,
                                                  dict(self.headers.items()), body)
            self.send_response(status)
            for key, value in {**headers, "Content-Length": str(len(payload))}.items():
                self.send_header(key, value)
            self.end_headers()
            self.wfile.write(payload)

        do_GET = do_POST = _serve

        def log_message(self, format: str, *args: Any) -> None:
            pass

    server = ThreadingHTTPServer((sim.host, 0), Handler)
    thread = threading.Thread(target=server.serve_forever, name="activation-simulator",
                              daemon=True)
    thread.start()
    try:
        yield http_url(sim.host, int(server.server_address[1]))
    finally:
        server.shutdown()
        server.server_close()
        thread.join(timeout=10)
