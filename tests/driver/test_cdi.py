"""CDI specs per claim: shape, names, deterministic bytes, atomic files, listing."""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

import pytest

from driver.cdi import (
    CDI_KIND,
    FAKE_NVML_CONTAINER_DIR,
    build_claim_spec,
    device_name,
    fake_nvml_edits,
    list_spec_claim_uids,
    qualified_id,
    remove_spec,
    render_spec,
    share_device_name,
    spec_path,
    write_spec,
)
from driver.claims import ClaimPlan, PublishedDevice, plan_claim
from driver.settings import load

UID = "0b6f3c1e-6a55-4d1e-9a53-1c2f2f7f0a01"
SHARE = "6c1b8d0e-54a1-4f07-9e6b-5a0d3e1f2a11"
GIB = 2**30
H200 = 143771 * 2**20

DEVICES = {
    d.name: d
    for d in (
        PublishedDevice("gpu-0", "GPU-aaa", 0, H200, H200, shared=True),
        PublishedDevice("gpu-1", "GPU-bbb", 1, 80 * GIB, 80 * GIB, shared=False, gpu_minor=5),
    )
}

# From the CDI specification: vendor and class, and a device name.
CDI_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9_.:-]*")
CDI_QUALIFIED = re.compile(
    r"[A-Za-z0-9][A-Za-z0-9_.-]*[A-Za-z0-9]/[A-Za-z0-9][A-Za-z0-9_.-]*[A-Za-z0-9]="
    r"[A-Za-z0-9][A-Za-z0-9_.:-]*"
)


def make_plan(*results: dict[str, Any], config: dict[str, Any] | None = None) -> ClaimPlan:
    devices: dict[str, Any] = {"results": list(results)}
    if config is not None:
        devices["config"] = [
            {"source": "FromClaim", "opaque": {"driver": "gpu.rota.dev", "parameters": config}}
        ]
    claim = {
        "metadata": {"uid": UID, "name": "llama", "namespace": "team-a"},
        "status": {"allocation": {"devices": devices}},
    }
    return plan_claim(
        claim,
        expected_uid=UID,
        namespace="team-a",
        name="llama",
        driver="gpu.rota.dev",
        pool="node-a",
        devices=DEVICES,
    )


SHARED_RESULT = {
    "request": "engine",
    "driver": "gpu.rota.dev",
    "pool": "node-a",
    "device": "gpu-0",
    "shareID": SHARE,
    "consumedCapacity": {"memory": "2Gi"},
}
EXCLUSIVE_RESULT = {
    "request": "train",
    "driver": "gpu.rota.dev",
    "pool": "node-a",
    "device": "gpu-1",
}
ENGINE = {
    "apiVersion": "gpu.rota.dev/v1alpha1",
    "kind": "EngineConfig",
    "model": "meta-llama/Llama-3.1-8B-Instruct",
    "awakeMemory": "60Gi",
    "sleepLevel": 2,
    "enginePort": 8001,
}


def test_shared_claim_spec() -> None:
    spec = build_claim_spec(make_plan(SHARED_RESULT, config=ENGINE), DEVICES,
                            node_exists=lambda _: True)
    assert spec == {
        "cdiVersion": "0.5.0",
        "kind": "k8s.gpu.rota.dev/claim",
        "devices": [
            {
                "name": f"{UID}-gpu-0-{SHARE}",
                "containerEdits": {
                    "env": [
                        "NVIDIA_VISIBLE_DEVICES=GPU-aaa",
                        "ROTA_AWAKE_MEMORY_BYTES=64424509440",
                        "ROTA_CLAIM_NAME=llama",
                        "ROTA_CLAIM_NAMESPACE=team-a",
                        f"ROTA_CLAIM_UID={UID}",
                        "ROTA_ENGINE_ADAPTER=vllm",
                        "ROTA_ENGINE_PORT=8001",
                        "ROTA_GPU_UUID=GPU-aaa",
                        "ROTA_MODEL=meta-llama/Llama-3.1-8B-Instruct",
                        "ROTA_RESIDENT_MEMORY_BYTES=2147483648",
                        f"ROTA_SHARE_ID={SHARE}",
                        "ROTA_SLEEP_LEVEL=2",
                    ],
                    "deviceNodes": [
                        {"path": "/dev/nvidia0"},
                        {"path": "/dev/nvidiactl"},
                        {"path": "/dev/nvidia-uvm"},
                        {"path": "/dev/nvidia-uvm-tools"},
                    ],
                },
            }
        ],
    }


def env_of(spec: dict[str, Any], index: int = 0) -> dict[str, str]:
    entries = spec["devices"][index]["containerEdits"]["env"]
    return dict(entry.split("=", 1) for entry in entries)


def test_exclusive_claim_without_config() -> None:
    spec = build_claim_spec(make_plan(EXCLUSIVE_RESULT), DEVICES, node_exists=lambda _: True)
    env = env_of(spec)
    assert spec["devices"][0]["name"] == f"{UID}-gpu-1"
    assert "ROTA_SHARE_ID" not in env
    assert not {"ROTA_MODEL", "ROTA_SLEEP_LEVEL", "ROTA_ENGINE_PORT"} & env.keys()
    assert env["ROTA_RESIDENT_MEMORY_BYTES"] == env["ROTA_AWAKE_MEMORY_BYTES"] == str(80 * GIB)
    nodes = spec["devices"][0]["containerEdits"]["deviceNodes"]
    assert nodes[0] == {"path": "/dev/nvidia5"}  # the minor, not the index


def test_every_device_of_a_claim_carries_the_same_environment() -> None:
    spec = build_claim_spec(make_plan(SHARED_RESULT, EXCLUSIVE_RESULT), DEVICES,
                            node_exists=lambda _: True)
    assert [d["name"] for d in spec["devices"]] == [f"{UID}-gpu-0-{SHARE}", f"{UID}-gpu-1"]
    assert env_of(spec, 0) == env_of(spec, 1)
    env = env_of(spec)
    assert env["NVIDIA_VISIBLE_DEVICES"] == env["ROTA_GPU_UUID"] == "GPU-aaa,GPU-bbb"
    assert env["ROTA_SHARE_ID"] == SHARE
    nodes = [d["containerEdits"]["deviceNodes"][0]["path"] for d in spec["devices"]]
    assert nodes == ["/dev/nvidia0", "/dev/nvidia5"]


@pytest.mark.parametrize(
    ("dev_root", "expected"),
    [
        ("/dev", [{"path": "/dev/nvidia0"}]),
        ("/dev/", [{"path": "/dev/nvidia0"}]),
        (
            "/run/nvidia/driver/dev",
            [{"path": "/dev/nvidia0", "hostPath": "/run/nvidia/driver/dev/nvidia0"}],
        ),
    ],
)
def test_device_root(dev_root: str, expected: list[dict[str, str]]) -> None:
    spec = build_claim_spec(make_plan(SHARED_RESULT), DEVICES, dev_root=dev_root,
                            node_exists=lambda _: True)
    nodes = spec["devices"][0]["containerEdits"]["deviceNodes"]
    assert nodes[:1] == expected
    assert [n["path"] for n in nodes] == [
        "/dev/nvidia0",
        "/dev/nvidiactl",
        "/dev/nvidia-uvm",
        "/dev/nvidia-uvm-tools",
    ]


def test_names_and_ids_are_valid_cdi() -> None:
    plan = make_plan(SHARED_RESULT, EXCLUSIVE_RESULT)
    for share in plan.shares:
        name = share_device_name(plan.uid, share)
        assert CDI_NAME.fullmatch(name)
        assert CDI_QUALIFIED.fullmatch(qualified_id(name))
    assert qualified_id("x") == "k8s.gpu.rota.dev/claim=x"
    assert CDI_KIND == "k8s.gpu.rota.dev/claim"


@pytest.mark.parametrize(
    ("uid", "device", "share_id"),
    [
        ("../etc", "gpu-0", None),
        ("", "gpu-0", None),
        ("a/b", "gpu-0", None),
        (UID, "gpu 0", None),
        (UID, "gpu-0", "a/b"),
        ("u" * 65, "gpu-0", None),
    ],
)
def test_invalid_names_are_refused(uid: str, device: str, share_id: str | None) -> None:
    with pytest.raises(ValueError, match="not"):
        device_name(uid, device, share_id)


def test_rebuild_gives_identical_bytes() -> None:
    first = render_spec(build_claim_spec(make_plan(SHARED_RESULT, config=ENGINE), DEVICES))
    second = render_spec(build_claim_spec(make_plan(SHARED_RESULT, config=ENGINE), DEVICES))
    assert first == second
    assert first.endswith(b"\n")
    assert json.loads(first)["kind"] == CDI_KIND


def test_unknown_device_is_an_error() -> None:
    plan = make_plan(SHARED_RESULT)
    with pytest.raises(ValueError, match="unknown device 'gpu-0'"):
        build_claim_spec(plan, {})


def test_write_is_atomic_and_idempotent(tmp_path: Path) -> None:
    spec = build_claim_spec(make_plan(SHARED_RESULT, config=ENGINE), DEVICES)
    path = write_spec(tmp_path, UID, spec)
    assert path == tmp_path / f"k8s.gpu.rota.dev-claim_{UID}.json"
    assert path == spec_path(tmp_path, UID)
    content = path.read_bytes()
    assert json.loads(content) == spec
    assert path.stat().st_mode & 0o777 == 0o644
    write_spec(tmp_path, UID, spec)
    assert path.read_bytes() == content
    assert [p.name for p in tmp_path.iterdir()] == [path.name]


def test_write_replaces_and_cleans_leftovers(tmp_path: Path) -> None:
    leftover = tmp_path / f".k8s.gpu.rota.dev-claim_{UID}.json.k2j4_x.tmp"
    leftover.write_bytes(b"{")
    write_spec(tmp_path, UID, {"old": True})
    spec = build_claim_spec(make_plan(EXCLUSIVE_RESULT), DEVICES)
    path = write_spec(tmp_path, UID, spec)
    assert json.loads(path.read_bytes()) == spec
    assert not leftover.exists()


def test_write_creates_the_root(tmp_path: Path) -> None:
    spec = build_claim_spec(make_plan(SHARED_RESULT), DEVICES)
    path = write_spec(tmp_path / "run" / "cdi", UID, spec)
    assert path.exists()


def test_remove(tmp_path: Path) -> None:
    spec = build_claim_spec(make_plan(SHARED_RESULT), DEVICES)
    write_spec(tmp_path, UID, spec)
    leftover = tmp_path / f".k8s.gpu.rota.dev-claim_{UID}.json.abc.tmp"
    leftover.write_bytes(b"")
    assert remove_spec(tmp_path, UID) is True
    assert list(tmp_path.iterdir()) == []
    assert remove_spec(tmp_path, UID) is False
    assert remove_spec(tmp_path / "missing", UID) is False


def test_listing_finds_only_our_specs(tmp_path: Path) -> None:
    other_uid = "11111111-2222-3333-4444-555555555555"
    crashed_uid = "99999999-2222-3333-4444-555555555555"
    write_spec(tmp_path, UID, build_claim_spec(make_plan(SHARED_RESULT), DEVICES))
    write_spec(tmp_path, other_uid, {"devices": []})
    for name in (
        f".k8s.gpu.rota.dev-claim_{crashed_uid}.json.x1y2.tmp",
        f"k8s.gpu.nvidia.com-claim_{UID}.json",
        f"k8s.gpu.rota.dev-gpu_{UID}.json",
        f"k8s.gpu.rota.dev-claim_{UID}.yaml",
        "k8s.gpu.rota.dev-claim_.json",
        "k8s.gpu.rota.dev-claim_../x.json",
        "nvidia.yaml",
    ):
        if "/" not in name:
            (tmp_path / name).write_bytes(b"{}")
    (tmp_path / "k8s.gpu.rota.dev-claim_dir.json").mkdir()
    assert list_spec_claim_uids(tmp_path) == {UID, other_uid, crashed_uid}
    assert remove_spec(tmp_path, crashed_uid) is False
    assert list_spec_claim_uids(tmp_path) == {UID, other_uid}


def test_listing_a_missing_root(tmp_path: Path) -> None:
    assert list_spec_claim_uids(tmp_path / "missing") == set()


def test_device_nodes_missing_on_the_node_are_not_listed(tmp_path: Path) -> None:
    # A node without /dev/nvidia-uvm-tools (many have none): the container runtime stats
    # every node a spec lists and fails the container on a missing one.
    for name in ("nvidia0", "nvidiactl", "nvidia-uvm"):
        (tmp_path / name).touch()
    spec = build_claim_spec(make_plan(SHARED_RESULT), DEVICES, dev_root=str(tmp_path))
    nodes = spec["devices"][0]["containerEdits"]["deviceNodes"]
    assert [n["path"] for n in nodes] == ["/dev/nvidia0", "/dev/nvidiactl", "/dev/nvidia-uvm"]
    assert nodes[0]["hostPath"] == str(tmp_path / "nvidia0")


def test_device_nodes_are_looked_for_in_the_hosts_live_view(tmp_path: Path) -> None:
    """A containerised driver's own /dev is a copy made when it started: a node the host
    creates later (nvidia-uvm on first CUDA use) would never be listed. The driver looks in
    a mount of the host's device root instead, and the spec still names host paths."""
    view = tmp_path / "host-dev"
    view.mkdir()
    for name in ("nvidia0", "nvidiactl"):
        (view / name).touch()

    def listed() -> list[dict[str, str]]:
        spec = build_claim_spec(make_plan(SHARED_RESULT), DEVICES, dev_root="/dev",
                                dev_view=str(view))
        nodes: list[dict[str, str]] = spec["devices"][0]["containerEdits"]["deviceNodes"]
        return nodes

    assert listed() == [{"path": "/dev/nvidia0"}, {"path": "/dev/nvidiactl"}]
    (view / "nvidia-uvm").touch()  # created on the host after the driver started
    assert [n["path"] for n in listed()] == ["/dev/nvidia0", "/dev/nvidiactl",
                                             "/dev/nvidia-uvm"]
    # A driver root elsewhere on the host: host paths under it, looked for in the view.
    spec = build_claim_spec(make_plan(SHARED_RESULT), DEVICES,
                            dev_root="/run/nvidia/driver/dev", dev_view=str(view))
    assert spec["devices"][0]["containerEdits"]["deviceNodes"][0] == {
        "path": "/dev/nvidia0", "hostPath": "/run/nvidia/driver/dev/nvidia0"}


def test_the_driver_takes_the_view_of_the_host_device_root_from_its_settings() -> None:
    settings = load(["--node-name", "n", "--dev-root", "/run/nvidia/driver/dev",
                     "--dev-root-mount", "/run/rota/host-dev"], environ={})
    assert settings.dev_root == Path("/run/nvidia/driver/dev")
    assert settings.dev_root_mount == Path("/run/rota/host-dev")
    assert load(["--node-name", "n"], environ={}).dev_root_mount is None


def test_extra_edits_add_mounts_and_environment() -> None:
    edits = fake_nvml_edits(Path("/var/lib/rota/fake-nvml"))
    spec = build_claim_spec(make_plan(SHARED_RESULT), DEVICES, extra=edits,
                            node_exists=lambda _: True)
    container = spec["devices"][0]["containerEdits"]
    assert container["mounts"] == [{"hostPath": "/var/lib/rota/fake-nvml",
                                    "containerPath": FAKE_NVML_CONTAINER_DIR,
                                    "options": ["rbind", "rw"]}]
    assert env_of(spec)["ROTA_FAKE_NVML_PROC_DIR"] == FAKE_NVML_CONTAINER_DIR
    # Still sorted, still the same in every device of the claim.
    assert container["env"] == sorted(container["env"])
