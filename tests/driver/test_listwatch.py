"""List-then-watch against the real API server: the first list (paginated) replaces, the
watch delivers every change from the list's version, and an object that stops matching
``keep`` is handed on as deleted."""

from __future__ import annotations

import asyncio
from typing import Any

import pytest
from kubernetes import client

from e2e.harness.waiting import eventually_async
from rota.kit.listwatch import ListWatch, Obj

pytestmark = [pytest.mark.cluster]

DEADLINE_S = 30.0


class _View:
    """What a cache built on the watch holds, by name, and a way to wait on it."""

    def __init__(self) -> None:
        self.items: dict[str, Obj] = {}
        self.replaced = 0
        self.changed = asyncio.Event()

    def _name(self, obj: Obj) -> str:
        return str(obj["metadata"]["name"])

    def replace(self, items: list[Obj]) -> None:
        self.items = {self._name(o): o for o in items}
        self.replaced += 1
        self.changed.set()

    def event(self, kind: str, obj: Obj) -> None:
        if kind == "DELETED":
            self.items.pop(self._name(obj), None)
        else:
            self.items[self._name(obj)] = obj
        self.changed.set()

    async def until(self, predicate: Any) -> None:
        async with asyncio.timeout(DEADLINE_S):
            while not predicate(self.items):
                self.changed.clear()
                await self.changed.wait()


def _configmap(name: str, colour: str) -> dict[str, Any]:
    return {"metadata": {"name": name, "labels": {"rota-test": "listwatch"}},
            "data": {"colour": colour}}


async def test_list_then_watch_keeps_a_filtered_view(kube_api: client.ApiClient,
                                                     namespace: str) -> None:
    core = client.CoreV1Api(kube_api)
    for i in range(5):
        core.create_namespaced_config_map(namespace, _configmap(f"cm-{i}", "red"))
    core.create_namespaced_config_map(namespace, {"metadata": {"name": "unlabelled"}})
    view = _View()
    watch = ListWatch("configmaps", core.list_namespaced_config_map, namespace,
                      loop=asyncio.get_running_loop(), on_replace=view.replace,
                      on_event=view.event, label_selector="rota-test=listwatch",
                      keep=lambda o: (o.get("data") or {}).get("colour") != "blue",
                      page_size=2, watch_timeout_s=5)
    watch.start()
    try:
        async with asyncio.timeout(DEADLINE_S):
            await watch.listed.wait()
        assert sorted(view.items) == [f"cm-{i}" for i in range(5)]
        assert watch.lists == 3, "five items in pages of two"
        core.create_namespaced_config_map(namespace, _configmap("cm-5", "red"))
        core.patch_namespaced_config_map("cm-0", namespace, {"data": {"colour": "green"}})
        core.patch_namespaced_config_map("cm-1", namespace, {"data": {"colour": "blue"}})
        core.delete_namespaced_config_map("cm-2", namespace)
        await view.until(lambda items: "cm-5" in items and "cm-1" not in items
                         and "cm-2" not in items
                         and items["cm-0"]["data"]["colour"] == "green")
        # The server closes the watch after 5 s; it is re-opened from the last version,
        # without a new list.
        async def reopened() -> bool:
            return watch.watches >= 2

        await eventually_async(reopened, timeout=DEADLINE_S, what="the watch re-opened")
        core.create_namespaced_config_map(namespace, _configmap("cm-6", "red"))
        await view.until(lambda items: "cm-6" in items)
        assert view.replaced == 1
        assert watch.lists == 3
    finally:
        watch.stop()
