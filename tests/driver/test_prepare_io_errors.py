"""Prepare on a disk that fails: ENOSPC and EIO at every single file call of a batch.

Each run prepares a batch of four claims (one already prepared, three new) on a disk that
fails one call (or, for ENOSPC, every call from that one on), then restarts the driver (a
new preparer that restores) and checks that every claim answered prepared is in the ledger
with its CDI spec, that a claim refused is not, that nothing half done is left, and that a
retry on a healthy disk prepares the whole batch.
"""

from __future__ import annotations

import errno
import uuid
from pathlib import Path

import pytest
from kubernetes import client

from driver.prepare import ClaimRef
from e2e.harness.disk_simulator import DiskSimulator
from e2e.harness.preparing import NodeFiles, allocated_claim, node_devices
from rota.kit.kube import Kube

pytestmark = [pytest.mark.cluster, pytest.mark.driver]

GPU_BYTES = 150754820096  # the fake H200


async def _run(files: NodeFiles, kube: Kube, pool: str, refs: list[ClaimRef],
               disk: DiskSimulator) -> dict[str, object]:
    devices = node_devices(pool)
    await files.preparer(kube, devices, pool=pool).prepare(refs[:1])  # healthy disk
    answers = await files.preparer(kube, devices, pool=pool, disk=disk).prepare(refs)
    return dict(answers)


async def test_an_io_error_at_any_call_fails_exactly_the_claims_not_on_disk(
        kube_api: client.ApiClient, namespace: str, tmp_path: Path) -> None:
    pool = f"io-{uuid.uuid4().hex[:8]}"
    refs = [allocated_claim(kube_api, namespace, f"c{i}", pool=pool, memory="8Gi",
                            awake="30Gi") for i in range(4)]
    kube = Kube(kube_api)
    devices = node_devices(pool)
    counter = DiskSimulator()
    clean = await _run(NodeFiles(tmp_path / "clean"), kube, pool, refs, counter)
    assert all(not isinstance(a, Exception) for a in clean.values()), clean
    runs = 0
    # ENOSPC once and "the disk stays full from then on"; EIO once.
    for error, sticky in ((errno.ENOSPC, False), (errno.ENOSPC, True), (errno.EIO, False)):
        for index in range(counter.count(error)):
            name = errno.errorcode[error]
            files = NodeFiles(tmp_path / f"{name}-{sticky}-{index}")
            disk = DiskSimulator()
            disk.fail_at(index, error, sticky=sticky)
            answers = await _run(files, kube, pool, refs, disk)
            where = f"{name} {'from' if sticky else 'at'} call {index}: {disk.failures[:2]}"
            assert disk.failures, f"no call {index} failed with {name}"
            runs += 1
            # A restart: a new preparer restores from what is on disk.
            await files.preparer(kube, devices, pool=pool).restore()
            assert files.problems(GPU_BYTES) == [], where
            records = files.records()
            assert refs[0].uid in records, f"{where}: a failed batch undid an earlier prepare"
            for uid, answer in answers.items():
                if not isinstance(answer, Exception):
                    assert uid in records, f"{where}: {uid} answered prepared but not on disk"
                    assert uid in files.specs(), f"{where}: {uid} answered without a spec"
                elif uid != refs[0].uid:
                    assert uid not in records, f"{where}: {uid} refused but left prepared"
            retry = await files.preparer(kube, devices, pool=pool).prepare(refs)
            assert all(not isinstance(a, Exception) for a in retry.values()), (where, retry)
            assert set(files.records()) == {r.uid for r in refs}
    assert runs > 100, runs
