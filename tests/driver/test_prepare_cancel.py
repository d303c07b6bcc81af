"""Cancelled calls, as the kubelet's 45 s deadline cancels them: a prepare cancelled while
its worker thread still runs must never take effect after a later unprepare of the claim.

Another driver process (a rolling update) holds the node-wide lock, so the prepare's
thread waits for it; the kubelet gives up on the prepare and unprepares the claim. The
disk simulator hands the freed lock to the newest waiter first, as a polling waiter with
a shorter delay often wins on a real node.
"""

from __future__ import annotations

import asyncio
import logging
import time
import uuid
from collections.abc import Callable
from pathlib import Path

import pytest
from kubernetes import client

from driver.ledger import file_lock
from e2e.harness.disk_simulator import DiskSimulator
from e2e.harness.preparing import NodeFiles, allocated_claim, node_devices
from e2e.harness.waiting import eventually_async
from rota.kit.kube import Kube

pytestmark = [pytest.mark.cluster, pytest.mark.driver]

WAIT_S = 30.0  # bound of the waits on the worker threads; never reached when things work


async def _until(check: Callable[[], bool], what: str) -> None:
    async def holds() -> bool:
        return check()

    await eventually_async(holds, timeout=WAIT_S, interval=0.005, what=what)


async def test_a_cancelled_prepare_never_overtakes_a_later_unprepare(
        kube_api: client.ApiClient, namespace: str, tmp_path: Path,
        caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.WARNING, logger="driver.prepare")
    pool = f"cancel-{uuid.uuid4().hex[:8]}"
    ref = allocated_claim(kube_api, namespace, "c", pool=pool)
    files = NodeFiles(tmp_path)
    disk = DiskSimulator()
    preparer = files.preparer(Kube(kube_api), node_devices(pool), pool=pool, disk=disk,
                              lock_timeout_s=WAIT_S)
    with file_lock(files.lock_path, timeout_s=WAIT_S):  # the other driver process
        prepare = asyncio.create_task(preparer.prepare([ref]))
        await _until(lambda: disk.lock_waiters == 1, "the prepare waiting for the lock")
        prepare.cancel()  # the kubelet's deadline
        unprepare = asyncio.create_task(preparer.unprepare([ref]))

        def settled() -> bool:
            # Either the cancelled prepare still holds the preparer (it says so), or it
            # let go and the unprepare's thread waits for the lock beside its thread.
            holding = any("cancelled by its caller" in r.getMessage() for r in caplog.records)
            return holding or (prepare.done() and disk.lock_waiters == 2)

        await _until(settled, "the unprepare queued behind the cancelled prepare")
    assert await unprepare == {ref.uid: None}
    with pytest.raises(asyncio.CancelledError):
        await prepare
    await _until(lambda: disk.open_locks == 0, "every worker thread done with the lock")
    assert files.records() == {}, "the cancelled prepare left a record after the unprepare"
    assert files.specs() == set(), "the cancelled prepare left a CDI spec after the unprepare"


async def test_a_prepare_cancelled_before_it_gets_the_lock_does_nothing(
        kube_api: client.ApiClient, namespace: str, tmp_path: Path) -> None:
    pool = f"cancel-{uuid.uuid4().hex[:8]}"
    ref = allocated_claim(kube_api, namespace, "c", pool=pool)
    files = NodeFiles(tmp_path)
    disk = DiskSimulator()
    preparer = files.preparer(Kube(kube_api), node_devices(pool), pool=pool, disk=disk,
                              lock_timeout_s=WAIT_S)
    with file_lock(files.lock_path, timeout_s=WAIT_S):
        # The deadline passes while the thread waits for the lock: nothing is done.
        answer = asyncio.create_task(preparer.prepare([ref], deadline=time.monotonic()))
        await _until(lambda: disk.lock_waiters == 1, "the prepare waiting for the lock")
    outcome = (await answer)[ref.uid]
    assert isinstance(outcome, Exception)
    assert "deadline" in str(outcome)
    assert files.records() == {}
    assert files.specs() == set()
