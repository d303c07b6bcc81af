"""The inspection API's attribution of GPU processes: the pod comes from the kernel (the
process's cgroup), never from anything the process can set; a claim uid from a process's
own environment is reported only for a process the kernel puts in a pod.

NVML is the fake backend with its process registry (live pids of this test run); the
``/proc`` the service reads is a folder the test writes, so each process's cgroup and
environment are what the case needs.
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from pathlib import Path

import pytest

from driver.devices import discover
from driver.inspection import InspectionService
from driver.nvml import fixture_path
from driver.nvml.fake import FakeNvml, register_process
from rota.pb.rota.v1 import inspect_pb2 as pb

GIB = 2**30
POD_A = "3f2a8c1e-5b7d-4e9f-a1c2-0d6e8b4f7a95"
POD_B = "9c1d2e3f-4a5b-4c6d-8e7f-0a1b2c3d4e5f"
CLAIM_B = "0b7f6c8e-1d2a-4e3b-9c4d-5e6f7a8b9c0d"
CID = "4b8f2d6a1c3e5f7091a2b3c4d5e6f708192a3b4c5d6e7f8091a2b3c4d5e6f708"


def _in_pod(uid: str) -> str:
    return (f"0::/kubepods.slice/kubepods-burstable.slice/kubepods-burstable-pod"
            f"{uid.replace('-', '_')}.slice/cri-containerd-{CID}.scope\n")


def _proc(root: Path, pid: int, *, cgroup: str, env: dict[str, str]) -> None:
    folder = root / str(pid)
    folder.mkdir(parents=True)
    (folder / "cgroup").write_text(cgroup)
    (folder / "environ").write_bytes(b"".join(f"{k}={v}\0".encode() for k, v in env.items()))


@pytest.fixture
def nvml(tmp_path: Path) -> Iterator[FakeNvml]:
    registry = tmp_path / "registry"
    registry.mkdir()
    fake = FakeNvml.from_path(fixture_path("h200"), registry)
    fake.init()
    try:
        yield fake
    finally:
        fake.shutdown()


def _read(nvml: FakeNvml, proc_root: Path, *, pods_from_environment: bool = False
          ) -> dict[int, pb.GpuProcess]:
    service = InspectionService(backend=nvml, gpus=discover(nvml), proc_root=proc_root,
                                pods_from_environment=pods_from_environment)
    (gpu,) = service.read(set()).gpus
    return {p.pid: p for p in gpu.processes}


@pytest.fixture
def forgers(nvml: FakeNvml, tmp_path: Path) -> tuple[int, int, Path]:
    """Two live processes that both say they are claim B's engine in pod B: one the kernel
    puts in pod A, one in no pod at all."""
    in_a, outside = os.getpid(), os.getppid()
    uuid = discover(nvml)[0].uuid
    registry = tmp_path / "registry"
    register_process(registry, in_a, uuid, 60 * GIB)
    register_process(registry, outside, uuid, 10 * GIB)
    proc_root = tmp_path / "proc"
    forged = {"ROTA_CLAIM_UID": CLAIM_B, "ROTA_POD_UID": POD_B}
    _proc(proc_root, in_a, cgroup=_in_pod(POD_A), env=forged)
    _proc(proc_root, outside, cgroup="0::/system.slice/ballast.service\n", env=forged)
    return in_a, outside, proc_root


def test_the_pod_is_the_kernels_and_a_process_outside_pods_names_no_claim(
        nvml: FakeNvml, forgers: tuple[int, int, Path]) -> None:
    in_a, outside, proc_root = forgers
    found = _read(nvml, proc_root)
    # The kernel's pod, whatever the environment says; the claim it names is reported as
    # the process's own word, for the controller to hold against the claim's pod.
    assert (found[in_a].pod_uid, found[in_a].container_id, found[in_a].claim_uid) == (
        POD_A, CID, CLAIM_B)
    # No pod from the kernel: no ROTA_POD_UID taken on trust, no claim.
    assert (found[outside].pod_uid, found[outside].claim_uid) == ("", "")
    assert found[outside].used_bytes == 10 * GIB


def test_the_fake_backend_may_name_pods_through_the_environment(
        nvml: FakeNvml, forgers: tuple[int, int, Path]) -> None:
    """Engines of a simulated node run outside any pod cgroup (or in the cgroup of the pod
    the whole simulation runs in); with the fake backend the driver is told to take their
    ROTA_POD_UID, and the cgroup's pod serves a process that names none."""
    in_a, outside, proc_root = forgers
    found = _read(nvml, proc_root, pods_from_environment=True)
    assert (found[in_a].pod_uid, found[in_a].claim_uid) == (POD_B, CLAIM_B)
    assert (found[outside].pod_uid, found[outside].claim_uid) == (POD_B, CLAIM_B)
    (proc_root / str(in_a) / "environ").write_bytes(b"PATH=/bin\0")
    found = _read(nvml, proc_root, pods_from_environment=True)
    assert (found[in_a].pod_uid, found[in_a].claim_uid) == (POD_A, "")
