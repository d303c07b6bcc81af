"""One bad claim never fails the batch: each claim of a prepare or unprepare gets its own
outcome, a malformed uid included."""

from __future__ import annotations

import uuid
from pathlib import Path

import pytest
from kubernetes import client

from driver.prepare import ClaimRef
from e2e.harness.preparing import NodeFiles, allocated_claim, node_devices, set_allocation
from rota.kit.kube import Kube

pytestmark = [pytest.mark.cluster, pytest.mark.driver]

MALFORMED = ["../../etc/passwd", "x" * 65, "-leading-dash", "uid with spaces"]


async def test_a_malformed_uid_does_not_fail_the_unprepare_batch(
        kube_api: client.ApiClient, namespace: str, tmp_path: Path) -> None:
    pool = f"batch-{uuid.uuid4().hex[:8]}"
    good = allocated_claim(kube_api, namespace, "good", pool=pool)
    files = NodeFiles(tmp_path)
    preparer = files.preparer(Kube(kube_api), node_devices(pool), pool=pool)
    assert not isinstance((await preparer.prepare([good]))[good.uid], Exception)
    bad = [ClaimRef(namespace=namespace, uid=uid, name="bad") for uid in MALFORMED]
    outcomes = await preparer.unprepare([*bad, good])
    assert outcomes[good.uid] is None
    for ref in bad:
        error = outcomes[ref.uid]
        assert isinstance(error, Exception), ref.uid
        assert "not usable" in str(error), error
    assert files.records() == {}
    assert files.specs() == set()


async def test_a_malformed_uid_does_not_fail_the_prepare_batch(
        kube_api: client.ApiClient, namespace: str, tmp_path: Path) -> None:
    pool = f"batch-{uuid.uuid4().hex[:8]}"
    good = allocated_claim(kube_api, namespace, "good", pool=pool)
    allocated_claim(kube_api, namespace, "bad", pool=pool)
    files = NodeFiles(tmp_path)
    preparer = files.preparer(Kube(kube_api), node_devices(pool), pool=pool)
    bad = [ClaimRef(namespace=namespace, uid=uid, name="bad") for uid in MALFORMED]
    outcomes = await preparer.prepare([*bad, good])
    assert not isinstance(outcomes[good.uid], Exception)
    assert all(isinstance(outcomes[ref.uid], Exception) for ref in bad)
    assert set(files.records()) == {good.uid}


async def test_a_claim_allocated_anew_is_prepared_anew_not_answered_from_an_old_record(
        kube_api: client.ApiClient, namespace: str, tmp_path: Path) -> None:
    # The claim was prepared, its record stayed (the kubelet never unprepared it), and the
    # claim was deallocated and allocated again on this node, to another share.
    pool = f"batch-{uuid.uuid4().hex[:8]}"
    ref = allocated_claim(kube_api, namespace, "c", pool=pool)
    files = NodeFiles(tmp_path)
    preparer = files.preparer(Kube(kube_api), node_devices(pool), pool=pool)
    first = (await preparer.prepare([ref]))[ref.uid]
    assert not isinstance(first, Exception)
    share = set_allocation(kube_api, namespace, "c", pool=pool)["status"]["allocation"][
        "devices"]["results"][0]["shareID"]
    again = (await preparer.prepare([ref]))[ref.uid]
    assert not isinstance(again, Exception)
    assert [d.share_id for d in again] == [share], "answered the old allocation's devices"
    record = files.records()[ref.uid]
    assert [d["shareID"] for d in record["devices"]] == [share]
    spec = files.cdi_root / f"k8s.gpu.rota.dev-claim_{ref.uid}.json"
    assert share in spec.read_text()
    # The kubelet re-sending the same prepare is answered from the ledger, unchanged.
    assert (await preparer.prepare([ref]))[ref.uid] == again
