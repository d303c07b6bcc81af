"""Engines' own API keys: sent on every request the gateway forwards (``/v1*`` and the rest
of the OpenAI surface), never on anything else.

vLLM started with ``--api-key`` checks it on ``/v1*`` only. A claim names the Secret that
holds its engine's key in its ``EngineConfig`` (``apiKeySecret: {name, key}``, a Secret in
the claim's namespace; ``key`` defaults to ``api-key``). The gateway reads that one Secret
by name when it first forwards to the claimant (it never lists or watches Secrets), keeps
it for ``ttl_s`` (a rotated Secret takes effect within that time) and sends
``Authorization: Bearer <key>``. The client's own ``Authorization`` header is never passed
on. A key that cannot be read is a 503 for the client, not a request sent without it; so
is a placeholder someone forgot to replace (:func:`controller.credentials.placeholder_reason`:
``changeme``, ``<your-key>``...), ``engine_key_placeholder``, whose message says how to
make a real one: sending it would give the engine's 401 and hide why.
"""

from __future__ import annotations

import asyncio
import base64
import binascii
import logging
import time
from typing import Any, Protocol

from controller.credentials import FIX, placeholder_reason
from controller.gateway.errors import Code, Unavailable

__all__ = ["EngineKeys", "KubeSecretReader", "SecretReader", "StaticSecrets"]

log = logging.getLogger(__name__)

DEFAULT_KEY = "api-key"


class SecretReader(Protocol):
    async def read(self, namespace: str, name: str) -> dict[str, str] | None:
        """The Secret's ``data`` (base64 values), None when it does not exist.

        Raises:
            Exception: it cannot be read now.
        """


class StaticSecrets:
    """Secrets given as plain values (tests, local runs)."""

    def __init__(self, secrets: dict[tuple[str, str], dict[str, str]] | None = None) -> None:
        self.secrets = secrets or {}
        self.reads = 0

    async def read(self, namespace: str, name: str) -> dict[str, str] | None:
        self.reads += 1
        values = self.secrets.get((namespace, name))
        if values is None:
            return None
        return {k: base64.b64encode(v.encode()).decode() for k, v in values.items()}


class KubeSecretReader:
    """Reads one Secret by name through the Kubernetes API (in a worker thread)."""

    def __init__(self, api: Any, *, timeout_s: float) -> None:
        self._api = api
        self._timeout_s = timeout_s

    async def read(self, namespace: str, name: str) -> dict[str, str] | None:
        from kubernetes import client

        core = client.CoreV1Api(self._api)
        try:
            secret = await asyncio.to_thread(core.read_namespaced_secret, name, namespace,
                                             _request_timeout=self._timeout_s)
        except client.ApiException as exc:
            if exc.status == 404:
                return None
            raise
        return dict(secret.data or {})


def secret_ref(config: Any) -> tuple[str, str] | None:
    """``(name, key)`` of the engine's API key Secret in an EngineConfig, if it names one."""
    ref = getattr(config, "api_key_secret", None)
    if ref is None:
        return None
    name = getattr(ref, "name", None)
    key = getattr(ref, "key", None) or DEFAULT_KEY
    return (str(name), str(key)) if name else None


class EngineKeys:
    """The engine API key of each claimant that has one, cached for ``ttl_s``."""

    def __init__(self, reader: SecretReader | None, *, ttl_s: float) -> None:
        self._reader = reader
        self._ttl_s = ttl_s
        self._cache: dict[tuple[str, str, str], tuple[float, str | Unavailable]] = {}
        """A key, or the refusal of a placeholder (kept as long: a Secret read and an error
        log per ``ttl_s``, not per request)."""

    async def key_for(self, namespace: str | None, ref: tuple[str, str] | None) -> str | None:
        """The key to send, None when the claimant's engine needs none.

        Raises:
            Unavailable: the Secret or its key cannot be read, or the key is a placeholder.
        """
        if ref is None or namespace is None:
            return None
        name, key = ref
        entry = (namespace, name, key)
        cached = self._cache.get(entry)
        now = time.monotonic()
        if cached is None or now - cached[0] >= self._ttl_s:
            cached = (now, _refused_placeholder(await self._read(namespace, name, key),
                                                namespace, name, key))
            self._cache[entry] = cached
        if isinstance(cached[1], Unavailable):
            raise cached[1]
        return cached[1]

    async def _read(self, namespace: str, name: str, key: str) -> str:
        extra = {"namespace": namespace, "secret": name, "key": key}
        problem = Unavailable(f"The engine's API key (Secret {namespace}/{name}, key '{key}') "
                              "cannot be read.", code=Code.ENGINE_KEY_UNAVAILABLE)
        if self._reader is None:
            raise problem
        try:
            data = await self._reader.read(namespace, name)
        except Exception as exc:
            log.warning("cannot read an engine's API key Secret",
                        extra=extra | {"error": repr(exc)[:200]})
            raise problem from exc
        encoded = (data or {}).get(key)
        if encoded is None:
            log.warning("an engine's API key Secret or key is missing", extra=extra)
            raise problem
        try:
            value = base64.b64decode(encoded, validate=True).decode().strip()
        except (binascii.Error, UnicodeDecodeError) as exc:
            raise problem from exc
        if not value:
            raise problem
        return value


def _refused_placeholder(value: str, namespace: str, name: str,
                         key: str) -> str | Unavailable:
    """``value``, or the refusal to send it when it is a placeholder (logged as an error:
    an engine no request can reach until someone puts a real key in the Secret)."""
    reason = placeholder_reason(value)
    if reason is None:
        return value
    log.error("an engine's API key is a placeholder; requests for it are refused", extra={
        "namespace": namespace, "secret": name, "key": key, "reason": reason})
    return Unavailable(f"The engine's API key (Secret {namespace}/{name}, key '{key}') is "
                       f"{reason}; requests for this engine are refused until the Secret "
                       f"holds a real key (the engine's --api-key the same): {FIX}.",
                       code=Code.ENGINE_KEY_PLACEHOLDER)
