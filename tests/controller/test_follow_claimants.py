"""A node's GPU workers reconcile when the claimants of their GPU change, not on every
change of the node's cache: the controller's own writes come back through its pod watch
(the state label of every engine it switched), and on the old code each of them made
every GPU of the node reconcile again (measured by the scale harness: 3-4 rounds of
Lease reads on every GPU of the node per switch)."""

from __future__ import annotations

import dataclasses
from typing import Any

import pytest

from controller.claimants import Claimant
from controller.lease.node import NodeController
from controller.lease.settings import LeaseSettings
from rota.api.engine_config import parse_engine_config

pytestmark = pytest.mark.controller


def _claimant(name: str, gpu: str) -> Claimant:
    config = parse_engine_config({"apiVersion": "gpu.rota.dev/v1alpha1",
                                  "kind": "EngineConfig", "model": name,
                                  "awakeMemory": "8Gi"})
    return Claimant(claim_uid=f"uid-{name}", namespace="ns", claim_name=name, node="node-a",
                    device=gpu, share_id=None, config=config, model=name, port=8000,
                    sleep_level=1, resident_bytes=1 << 30, pod_name=f"p-{name}",
                    pod_uid=f"pu-{name}", pod_ip="10.0.0.1", pod_ready=True,
                    pod_deleting=False)


class _CacheSimulator:
    def __init__(self, claimants: list[Claimant]) -> None:
        self.current = claimants

    def claimants(self) -> list[Claimant]:
        return list(self.current)


class _WorkerSimulator:
    def __init__(self) -> None:
        self.marks = 0

    def mark_dirty(self) -> None:
        self.marks += 1


class _Node(NodeController):
    def _worker(self, gpu: str) -> Any:
        return self.workers.setdefault(gpu, _WorkerSimulator())  # type: ignore[arg-type]


def _marks(node: _Node) -> dict[str, int]:
    return {gpu: worker.marks for gpu, worker in node.workers.items()}  # type: ignore[attr-defined]


def test_only_the_gpus_whose_claimants_changed_reconcile() -> None:
    cache = _CacheSimulator([_claimant("a", "gpu-0"), _claimant("b", "gpu-1")])
    unused: Any = None
    node = _Node(settings=LeaseSettings(node_name="node-a"), kube=unused, election=unused,
                 device=unused, session=unused, cache=cache)  # type: ignore[arg-type]
    node._follow_claimants(every_gpu=True)
    assert _marks(node) == {"gpu-0": 1, "gpu-1": 1}
    node._follow_claimants()  # an echo of the controller's own label write
    assert _marks(node) == {"gpu-0": 1, "gpu-1": 1}
    cache.current = [cache.current[0], dataclasses.replace(cache.current[1], pod_ready=False)]
    node._follow_claimants()
    assert _marks(node) == {"gpu-0": 1, "gpu-1": 2}
    node._follow_claimants(every_gpu=True)  # a new term: every GPU
    assert _marks(node) == {"gpu-0": 2, "gpu-1": 3}
