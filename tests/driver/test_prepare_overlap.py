"""Overlapping calls of one claim, as the real kubelet sends them (its cache lock is not
held across gRPC calls): a later call of the same claim always wins.

The API server is slow: a prepare is still reading its claim when the pod is deleted and
the kubelet unprepares the claim. The unprepare answers first; the prepare, once it has
the claim, must not write a record or a CDI spec that nobody will ever unprepare. The
claim read is held on a gate the test opens, so the order is the same on every run.
"""

from __future__ import annotations

import asyncio
import uuid
from pathlib import Path
from typing import Any

import pytest
from kubernetes import client

from e2e.harness.preparing import NodeFiles, allocated_claim, node_devices
from rota.api.errors import ClaimError
from rota.kit.kube import Kube

pytestmark = [pytest.mark.cluster, pytest.mark.driver]

WAIT_S = 30.0  # bound of the waits on the gates; never reached when things work


class GatedKube(Kube):
    """The real API facade whose claim reads wait for the test to open a gate (an API
    server under load); ``reading`` is set once a read has started."""

    def __init__(self, api: client.ApiClient) -> None:
        super().__init__(api)
        self.reading = asyncio.Event()
        self.gate = asyncio.Event()

    async def get_claim(self, namespace: str, name: str) -> dict[str, Any]:
        self.reading.set()
        await asyncio.wait_for(self.gate.wait(), WAIT_S)
        return await super().get_claim(namespace, name)


async def test_an_unprepare_arriving_during_the_claim_read_wins(
        kube_api: client.ApiClient, namespace: str, tmp_path: Path) -> None:
    pool = f"overlap-{uuid.uuid4().hex[:8]}"
    ref = allocated_claim(kube_api, namespace, "c", pool=pool)
    files = NodeFiles(tmp_path)
    kube = GatedKube(kube_api)
    preparer = files.preparer(kube, node_devices(pool), pool=pool)
    prepare = asyncio.create_task(preparer.prepare([ref]))
    await asyncio.wait_for(kube.reading.wait(), WAIT_S)  # the prepare reads the claim ...
    # ... and the pod is deleted: the kubelet unprepares the claim; it is told "done".
    assert await preparer.unprepare([ref]) == {ref.uid: None}
    kube.gate.set()  # the API server answers the prepare's read at last
    outcome = (await prepare)[ref.uid]
    assert isinstance(outcome, ClaimError), outcome
    assert outcome.reason == "superseded"
    assert files.records() == {}, "the overtaken prepare left a record after the unprepare"
    assert files.specs() == set(), "the overtaken prepare left a CDI spec after the unprepare"
    # A prepare that arrives after the unprepare is a new call of its own and prepares.
    again = (await preparer.prepare([ref]))[ref.uid]
    assert not isinstance(again, Exception), again
    assert set(files.records()) == {ref.uid}


async def test_an_older_prepare_after_a_newer_one_answers_from_the_ledger(
        kube_api: client.ApiClient, namespace: str, tmp_path: Path) -> None:
    """A re-sent prepare overtaking the first one is no unprepare: both answer prepared."""
    pool = f"overlap-{uuid.uuid4().hex[:8]}"
    ref = allocated_claim(kube_api, namespace, "c", pool=pool)
    files = NodeFiles(tmp_path)
    kube = GatedKube(kube_api)
    slow = files.preparer(kube, node_devices(pool), pool=pool)
    first = asyncio.create_task(slow.prepare([ref]))
    await asyncio.wait_for(kube.reading.wait(), WAIT_S)
    slow.kube = Kube(kube_api)  # the next read is answered at once
    second = (await slow.prepare([ref]))[ref.uid]
    kube.gate.set()
    assert not isinstance(second, Exception), second
    assert (await first)[ref.uid] == second
    assert set(files.records()) == {ref.uid}
    assert files.specs() == {ref.uid}
