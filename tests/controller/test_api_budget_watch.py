"""A list-watch that loses its connection resumes from the last resourceVersion it saw,
as client-go's reflector does, instead of listing everything again: against the real API
server, through a relay that resets every connection."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from typing import Any

import pytest
from kubernetes import client

from e2e.chaos.proxy import FlakyRelay
from e2e.cluster import LocalCluster
from e2e.harness.waiting import eventually_async
from rota.kit.aio import Backoff
from rota.kit.listwatch import ListWatch, Obj

pytestmark = [pytest.mark.cluster, pytest.mark.controller]

DEADLINE_S = 30.0


@pytest.fixture
async def relayed_api(cluster: LocalCluster
                      ) -> AsyncIterator[tuple[client.ApiClient, FlakyRelay]]:
    relay = FlakyRelay("127.0.0.1", cluster.api_port)
    await relay.start()
    api = cluster.api_client(server=f"https://127.0.0.1:{relay.port}")
    try:
        yield api, relay
    finally:
        api.close()
        await relay.close()


async def test_a_watch_cut_off_resumes_without_a_new_list(
        relayed_api: tuple[client.ApiClient, FlakyRelay], kube_api: client.ApiClient,
        namespace: str) -> None:
    api, relay = relayed_api
    seen: dict[str, Obj] = {}
    errors: list[BaseException] = []

    def replace(items: list[Obj]) -> None:
        seen.clear()
        seen.update({o["metadata"]["name"]: o for o in items})

    def event(kind: str, obj: Obj) -> None:
        if kind == "DELETED":
            seen.pop(obj["metadata"]["name"], None)
        else:
            seen[obj["metadata"]["name"]] = obj

    direct = client.CoreV1Api(kube_api)
    body: dict[str, Any] = {"metadata": {"name": "before"}}
    direct.create_namespaced_config_map(namespace, body)
    watch = ListWatch("configmaps", client.CoreV1Api(api).list_namespaced_config_map,
                      namespace, loop=asyncio.get_running_loop(), on_replace=replace,
                      on_event=event, watch_timeout_s=60, on_error=errors.append,
                      backoff=Backoff(first_s=0.1, max_s=0.5))
    watch.start()
    try:
        async with asyncio.timeout(DEADLINE_S):
            await watch.listed.wait()
        assert "before" in seen
        async def watching() -> bool:
            return watch.watches >= 1

        async def cut() -> bool:
            return relay.cut() > 0

        await eventually_async(watching, timeout=DEADLINE_S, what="the watch is open")
        for round_ in range(3):
            opened = watch.watches
            await eventually_async(cut, timeout=DEADLINE_S, what="a connection to cut")
            name = f"after-{round_}"
            direct.create_namespaced_config_map(namespace, {"metadata": {"name": name}})

            async def arrived(name: str = name, opened: int = opened) -> bool:
                return name in seen and watch.watches > opened

            await eventually_async(arrived, timeout=DEADLINE_S,
                                   what="the change after the cut")
        assert errors, "the cuts were seen as errors"
        assert watch.lists == 1, "resumed from the last version, never listed again"
        assert watch.watches >= 4
    finally:
        watch.stop()
