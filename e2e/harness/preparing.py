"""The driver's preparer in this process, over the real API server and a chosen disk.

Tests of prepare's guarantees and the driver crash campaign build on this: claims are
created in the API server and allocated by writing their status (as the scheduler would),
the preparer reads them through the driver's own API facade, and its ledger, lock and CDI
specs live in one directory, on the real disk or on a :mod:`e2e.harness.disk_simulator`.
"""

from __future__ import annotations

import json
import uuid
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from kubernetes import client

from driver import DRIVER_NAME, cdi
from driver.claims import PublishedDevice
from driver.devices import discover
from driver.disk import OS_DISK, Disk
from driver.ledger import Ledger
from driver.nvml import fixture_path
from driver.nvml.fake import FakeNvml
from driver.prepare import ClaimRef, Preparer
from driver.publisher import published_devices
from driver.slices import PoolOptions, build_slices
from e2e.harness.objects import GROUP, VERSION, claim, create_claim, engine_config
from rota.kit.kube import Kube

BOOT_ID = "00000000-0000-4000-8000-b00700000001"


def node_devices(pool: str, fixture: str = "h200") -> dict[str, PublishedDevice]:
    """The devices the driver would publish for one node with the fake GPUs of ``fixture``."""
    backend = FakeNvml.from_path(fixture_path(fixture))
    backend.init()
    try:
        gpus = discover(backend)
    finally:
        backend.shutdown()
    return published_devices(build_slices(gpus, PoolOptions(node_name=pool)), gpus)


def set_allocation(api: client.ApiClient, namespace: str, name: str, *, pool: str,
                   device: str = "gpu-0", memory: str = "12Gi") -> dict[str, Any]:
    """Allocate a claim to one share of ``device`` in ``pool`` (or move it there: an
    allocation cannot change in place, so it is removed first, as a deallocation does)."""
    objects = client.CustomObjectsApi(api)
    current = objects.get_namespaced_custom_object(GROUP, VERSION, namespace,
                                                   "resourceclaims", name)
    if current.get("status", {}).get("allocation"):
        current["status"] = {}
        current = objects.replace_namespaced_custom_object_status(
            GROUP, VERSION, namespace, "resourceclaims", name, current)
    current["status"] = {"allocation": {"devices": {"results": [{
        "request": "gpu", "driver": DRIVER_NAME, "pool": pool, "device": device,
        "shareID": str(uuid.uuid4()),
        "consumedCapacity": {"memory": memory, "engines": "1"}}]}}}
    return dict(objects.replace_namespaced_custom_object_status(
        GROUP, VERSION, namespace, "resourceclaims", name, current))


def allocated_claim(api: client.ApiClient, namespace: str, name: str, *, pool: str,
                    memory: str = "12Gi", awake: str = "40Gi") -> ClaimRef:
    """A new claim with an engine config, allocated in ``pool``."""
    create_claim(api, namespace, claim(name, memory=memory,
                                       config=engine_config(model=name, awake=awake)))
    meta = set_allocation(api, namespace, name, pool=pool, memory=memory)["metadata"]
    return ClaimRef(namespace=namespace, uid=meta["uid"], name=name)


@dataclass
class NodeFiles:
    """The driver's files on one simulated node: ledger, lock and CDI specs."""

    root: Path

    @property
    def ledger_path(self) -> Path:
        return self.root / "plugin" / "ledger.json"

    @property
    def lock_path(self) -> Path:
        return self.root / "plugin" / "ledger.lock"

    @property
    def cdi_root(self) -> Path:
        return self.root / "cdi"

    def preparer(self, kube: Kube, devices: Mapping[str, PublishedDevice], *, pool: str,
                 disk: Disk = OS_DISK, lock_timeout_s: float = 10.0) -> Preparer:
        """A preparer as the driver builds it, over ``disk``."""
        self.ledger_path.parent.mkdir(parents=True, exist_ok=True)
        return Preparer(kube=kube, ledger=Ledger(self.ledger_path, boot_id=BOOT_ID, disk=disk),
                        cdi_root=self.cdi_root, dev_root=Path("/dev"), driver_name=DRIVER_NAME,
                        pool=pool, devices=lambda: devices, lock_path=self.lock_path,
                        lock_timeout_s=lock_timeout_s, disk=disk)

    def records(self) -> dict[str, dict[str, Any]]:
        """The ledger's claim records as stored (empty when there is no ledger)."""
        if not self.ledger_path.exists():
            return {}
        claims: dict[str, dict[str, Any]] = json.loads(self.ledger_path.read_text())[
            "data"]["claims"]
        return claims

    def specs(self) -> set[str]:
        """Claim uids with a CDI spec."""
        return {uid for uid in cdi.list_spec_claim_uids(self.cdi_root)
                if cdi.spec_path(self.cdi_root, uid).exists()}

    def temp_files(self) -> list[str]:
        """Temp files left next to the ledger or the specs."""
        return sorted(p.name for d in (self.ledger_path.parent, self.cdi_root) if d.exists()
                      for p in d.iterdir() if p.name.endswith(".tmp"))

    def problems(self, gpu_memory_bytes: int) -> list[str]:
        """What is wrong with the files of a driver that has restored: half-done records,
        records and specs that disagree, over-committed GPUs. Empty when all is well."""
        records, specs = self.records(), self.specs()
        found = [f"claim {uid} left {r['state']}" for uid, r in records.items()
                 if r["state"] != "PrepareCompleted"]
        found += [f"claim {uid} recorded without a CDI spec" for uid in records
                  if uid not in specs]
        found += [f"CDI spec of {uid} without a record" for uid in specs - set(records)]
        found += [f"temp file {name} left" for name in self.temp_files()]
        found += overcommits(records, gpu_memory_bytes)
        return found


def overcommits(records: Mapping[str, Mapping[str, Any]], gpu_memory_bytes: int) -> list[str]:
    """Budget violations among ledger records (one GPU): residents beyond the GPU, or a
    claim that could not wake beside every other resident."""
    resident = sum(int(r["residentBytes"]) for r in records.values())
    found = []
    if resident > gpu_memory_bytes:
        found.append(f"resident budgets {resident} exceed the GPU's {gpu_memory_bytes}")
    for uid, r in records.items():
        others = resident - int(r["residentBytes"])
        if int(r["awakeBytes"]) + others > gpu_memory_bytes:
            found.append(f"claim {uid} could not wake: {r['awakeBytes']} + {others} > "
                         f"{gpu_memory_bytes}")
    return found
