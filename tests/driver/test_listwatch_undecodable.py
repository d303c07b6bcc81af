"""Review F5 against the real API server: it stores ResourceClaims whose opaque parameters
nest 1,100 levels deep (arrays in 2.2 KB, or objects in 7.7 KB; the review did not check)
and gives them back as written. (Parameters must be a JSON object; a number of 5,000
digits is not stored: the server drops the connection.) A list-then-watch of claims
follows the good claims around them: each deep claim is skipped and reported, the list
succeeds and the watch goes on past it.

On the old code the list of the namespace failed for ever (RecursionError in
``json.loads`` of the whole page) and nothing was followed.
"""

from __future__ import annotations

import asyncio
import json
from typing import Any

import pytest
from kubernetes import client

from rota.kit.errors import KubeError
from rota.kit.kube import Kube
from rota.kit.listwatch import MAX_DEPTH, ListWatch, Obj, Undecodable, nesting

pytestmark = [pytest.mark.cluster]

GROUP, VERSION, PLURAL = "resource.k8s.io", "v1", "resourceclaims"
DEADLINE_S = 30.0
DEPTH = 1_100


def _claim_text(name: str, parameters: str = '{"size": 1}') -> bytes:
    """A claim of another driver (the API server checks nothing in opaque parameters but
    their size), with ``parameters`` as raw JSON text: Python's encoder cannot write them."""
    claim = {"apiVersion": f"{GROUP}/{VERSION}", "kind": "ResourceClaim",
             "metadata": {"name": name},
             "spec": {"devices": {
                 "requests": [{"name": "gpu", "exactly": {"deviceClassName": "example.com"}}],
                 "config": [{"requests": ["gpu"], "opaque": {"driver": "example.com",
                                                             "parameters": "PARAMETERS"}}]}}}
    return json.dumps(claim).replace('"PARAMETERS"', parameters).encode()


def _send(api: client.ApiClient, method: str, path: str, body: bytes | None = None
          ) -> tuple[int, bytes]:
    """A request with the admin's credentials and the body as it is (the client would
    encode it, recursively)."""
    headers = {"Accept": "application/json", "Content-Type": "application/json"}
    bearer = api.configuration.auth_settings().get("BearerToken") or {}
    if bearer.get("value"):
        headers["Authorization"] = str(bearer["value"])
    resp = api.rest_client.pool_manager.request(method, f"{api.configuration.host}{path}",
                                                body=body, headers=headers, timeout=10)
    return int(resp.status), bytes(resp.data)


class _View:
    """Claims followed by the watch, by name, and those it reported undecodable."""

    def __init__(self) -> None:
        self.items: dict[str, Obj] = {}
        self.skipped: list[Undecodable] = []
        self.changed = asyncio.Event()

    def replace(self, items: list[Obj]) -> None:
        self.items = {str(o["metadata"]["name"]): o for o in items}
        self.changed.set()

    def event(self, kind: str, obj: Obj) -> None:
        name = str(obj["metadata"]["name"])
        if kind == "DELETED":
            self.items.pop(name, None)
        else:
            self.items[name] = obj
        self.changed.set()

    async def until(self, what: str, predicate: Any) -> None:
        try:
            async with asyncio.timeout(DEADLINE_S):
                while not predicate():
                    self.changed.clear()
                    await self.changed.wait()
        except TimeoutError:
            raise AssertionError(f"{what}: not seen within {DEADLINE_S}s") from None


async def test_the_api_server_stores_deep_claims_and_the_watch_goes_past_them(
        kube_api: client.ApiClient, namespace: str) -> None:
    path = f"/apis/{GROUP}/{VERSION}/namespaces/{namespace}/{PLURAL}"
    deep = '{"a": ' + "[" * DEPTH + "]" * DEPTH + "}"  # parameters must be an object
    objects_deep = '{"a": ' * DEPTH + "1" + "}" * DEPTH
    for name, parameters in (("good-0", '{"size": 1}'), ("deep-0", deep),
                             ("deep-objects", objects_deep), ("good-1", '{"size": 2}')):
        status, answer = await asyncio.to_thread(_send, kube_api, "POST", path,
                                                 _claim_text(name, parameters))
        assert status == 201, f"{name}: {status} {answer[:300]!r}"
    # Stored and given back as written, every level there.
    for name in ("deep-0", "deep-objects"):
        status, stored = await asyncio.to_thread(_send, kube_api, "GET", f"{path}/{name}")
        assert status == 200
        assert nesting(stored) >= DEPTH
    # One claim read (the lease controller's, of its pods' claims): a clear error of the
    # read, not a RecursionError out of the client.
    with pytest.raises(KubeError, match="cannot be decoded"):
        await Kube(kube_api, timeout_s=10).get_claim(namespace, "deep-0")

    view = _View()
    objects = client.CustomObjectsApi(kube_api)
    watch = ListWatch(PLURAL, objects.list_namespaced_custom_object, GROUP, VERSION,
                      namespace, PLURAL, loop=asyncio.get_running_loop(),
                      on_replace=view.replace, on_event=view.event,
                      on_undecodable=view.skipped.append, page_size=2, watch_timeout_s=5)
    watch.start()
    try:
        await view.until("the first list", lambda: watch.listed.is_set())
        assert sorted(view.items) == ["good-0", "good-1"]
        assert sorted(str(s.meta.get("name")) for s in view.skipped) == [
            "deep-0", "deep-objects"]
        assert all(s.meta.get("uid") and s.meta.get("namespace") == namespace
                   for s in view.skipped)
        assert f"deeper than {MAX_DEPTH}" in next(
            s.reason for s in view.skipped if s.meta.get("name") == "deep-0")
        assert watch.lists == 2, "four claims in pages of two, listed once"

        for name, parameters in (("deep-1", deep), ("good-2", '{"size": 3}')):
            status, _ = await asyncio.to_thread(_send, kube_api, "POST", path,
                                                _claim_text(name, parameters))
            assert status == 201
        await view.until("the claim written after a deep one", lambda: "good-2" in view.items)
        assert "deep-1" in {s.meta.get("name") for s in view.skipped}
        assert watch.lists == 2, "the watch went past the deep claim: no list again"
    finally:
        watch.stop()
