"""A tenant's attempts on other tenants, run from inside the tenant's own engine pod.

The tenant-isolation tests (``tests/node/test_tenant_isolation.py``) run this module in a
tenant's container (``kubectl exec``), so every attempt comes from where a tenant really
is: its pod IP and network namespace, its own claim's CDI environment (start token,
control credential, start-gate socket), its own mounted Secrets. Usage::

    python -m e2e.harness.tenant_probe '<JSON list of attempts>'

prints a JSON list of results, one per attempt, in order. An attempt is

- ``{"name", "kind": "http", "method", "url", "headers": {...}, "body": "..."}``: one
  HTTP/1.1 request written byte for byte (the path is sent exactly as given: no client
  normalises ``/v1/../wake_up`` away);
- ``{"name", "kind": "start", "claim_uid", "token"}``: one question to the node's
  start gate over the socket in ``ROTA_START_SOCKET``.

In a header value or token, ``$NAME`` stands for the environment variable ``NAME``, and
a value ``@PATH`` for the first line of the file ``PATH``, so the tenant's own credentials are used
without the test ever seeing them. A result is ``{"name", "status", "body"}``: the HTTP
status (0 when no answer came) and the first 300 characters of the answer or of the
error (the whole answer, up to 64 KiB, when the attempt says ``"whole": true``). Standard
library only: it runs in any image that has rota's harness.
"""

from __future__ import annotations

import asyncio
import json
import os
import re
import sys
from typing import Any
from urllib.parse import urlsplit

__all__ = ["main", "run_attempts"]

TIMEOUT_S = 10.0
"""The longest any attempt may take (a start gate that holds the question is an answer)."""
START_PATH = "/v1/start"
START_SOCKET_ENV = "ROTA_START_SOCKET"


_VARIABLE = re.compile(r"\$([A-Za-z_][A-Za-z0-9_]*)")


def _resolve(value: str) -> str | None:
    """``$NAME`` from the environment, ``@PATH`` from a file, anything else as is; None
    when this tenant lacks what it names."""
    names = _VARIABLE.findall(value)
    if any(name not in os.environ for name in names):
        return None
    value = _VARIABLE.sub(lambda m: os.environ[m.group(1)], value)
    if value.startswith("@"):
        try:
            with open(value[1:], encoding="utf-8") as handle:
                return handle.readline().strip()
        except OSError:
            return None
    return value


def _request_bytes(method: str, target: str, host: str, headers: dict[str, str],
                   body: bytes) -> bytes:
    lines = [f"{method} {target} HTTP/1.1", f"Host: {host}", "Connection: close",
             f"Content-Length: {len(body)}"]
    lines += [f"{name}: {value}" for name, value in headers.items()]
    if body:
        lines.append("Content-Type: application/json")
    return ("\r\n".join(lines) + "\r\n\r\n").encode("latin-1") + body


SHORT_ANSWER = 300
WHOLE_ANSWER = 64 * 1024


def _parse_answer(raw: bytes, limit: int) -> tuple[int, str]:
    head, _, rest = raw.partition(b"\r\n\r\n")
    status_line = head.split(b"\r\n", 1)[0].decode("latin-1", "replace")
    parts = status_line.split(" ", 2)
    status = int(parts[1]) if len(parts) > 1 and parts[1].isdigit() else 0
    return status, rest.decode("utf-8", "replace")[:limit]


async def _exchange(reader: asyncio.StreamReader, writer: asyncio.StreamWriter,
                    request: bytes, limit: int = SHORT_ANSWER) -> tuple[int, str]:
    try:
        writer.write(request)
        await writer.drain()
        raw = await reader.read()
    finally:
        writer.close()
    return _parse_answer(raw, limit)


async def _http(attempt: dict[str, Any]) -> tuple[int, str]:
    url = urlsplit(str(attempt["url"]))
    target = url.path or "/"
    if url.query:
        target += "?" + url.query
    headers: dict[str, str] = {}
    for name, value in dict(attempt.get("headers", {})).items():
        resolved = _resolve(str(value))
        if resolved is None:
            return 0, f"this tenant has no {value}"
        headers[str(name)] = resolved
    body = str(attempt.get("body", "")).encode()
    limit = WHOLE_ANSWER if attempt.get("whole") else SHORT_ANSWER
    reader, writer = await asyncio.open_connection(url.hostname, url.port or 80)
    return await _exchange(reader, writer, _request_bytes(
        str(attempt.get("method", "GET")), target, url.netloc, headers, body), limit)


async def _start(attempt: dict[str, Any]) -> tuple[int, str]:
    socket = os.environ.get(START_SOCKET_ENV)
    if not socket:
        return 0, f"this tenant has no {START_SOCKET_ENV}"
    token = _resolve(str(attempt.get("token", "")))
    body = json.dumps({"claim_uid": attempt["claim_uid"], "token": token or "",
                       "attempt": 0}).encode()
    reader, writer = await asyncio.open_unix_connection(socket)
    return await _exchange(reader, writer,
                           _request_bytes("POST", START_PATH, "localhost", {}, body))


async def _one(attempt: dict[str, Any]) -> dict[str, Any]:
    kind = attempt.get("kind", "http")
    try:
        status, body = await asyncio.wait_for(
            _start(attempt) if kind == "start" else _http(attempt), TIMEOUT_S)
    except TimeoutError:
        status, body = 0, f"no answer within {TIMEOUT_S:g} s"
    except OSError as exc:
        status, body = 0, f"{type(exc).__name__}: {exc}"[:300]
    return {"name": attempt.get("name", ""), "status": status, "body": body}


async def run_attempts(attempts: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Every attempt, one after the other (so they are listed in the order made)."""
    return [await _one(attempt) for attempt in attempts]


def main(argv: list[str] | None = None) -> int:
    args = sys.argv[1:] if argv is None else argv
    if len(args) != 1:
        print("usage: python -m e2e.harness.tenant_probe '<JSON list of attempts>'",
              file=sys.stderr)
        return 2
    attempts = json.loads(args[0])
    print(json.dumps(asyncio.run(run_attempts(list(attempts)))))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
