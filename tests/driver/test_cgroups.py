"""pid -> pod through /proc/<pid>/cgroup, for the kubelet's systemd and cgroupfs layouts."""

from __future__ import annotations

from pathlib import Path

import pytest

from driver.cgroups import PodRef, parse_cgroup, pod_of_pid

UID = "3f2a8c1e-5b7d-4e9f-a1c2-0d6e8b4f7a95"
UID_ = UID.replace("-", "_")
CID = "4b8f2d6a1c3e5f7091a2b3c4d5e6f708192a3b4c5d6e7f8091a2b3c4d5e6f708"
STATIC = "6fb8a1b1e3f6a1d7b8d9c0e1f2a3b4c5"


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        pytest.param(
            f"0::/kubepods.slice/kubepods-burstable.slice/kubepods-burstable-pod{UID_}.slice/"
            f"cri-containerd-{CID}.scope\n",
            PodRef(UID, CID, "burstable"), id="v2-systemd-burstable-containerd"),
        pytest.param(
            f"0::/kubepods.slice/kubepods-besteffort.slice/kubepods-besteffort-pod{UID_}.slice/"
            f"crio-{CID}.scope\n",
            PodRef(UID, CID, "besteffort"), id="v2-systemd-besteffort-crio"),
        pytest.param(
            f"0::/kubepods.slice/kubepods-pod{UID_}.slice/cri-containerd-{CID}.scope\n",
            PodRef(UID, CID, "guaranteed"), id="v2-systemd-guaranteed"),
        pytest.param(
            f"0::/kubelet.slice/kubelet-kubepods.slice/kubelet-kubepods-besteffort.slice/"
            f"kubelet-kubepods-besteffort-pod{UID_}.slice/cri-containerd-{CID}.scope\n",
            PodRef(UID, CID, "besteffort"), id="v2-kind-kubelet-prefix"),
        pytest.param(
            f"0::/kubepods.slice/kubepods-burstable.slice/kubepods-burstable-pod{UID_}.slice/"
            f"cri-containerd-{CID}.scope/init.scope\n",
            PodRef(UID, CID, "burstable"), id="v2-nested-below-container"),
        pytest.param(
            f"0::/kubepods.slice/kubepods-burstable.slice/kubepods-burstable-pod{STATIC}.slice/"
            f"docker-{CID}.scope\n",
            PodRef(STATIC, CID, "burstable"), id="v2-static-pod-docker"),
        pytest.param(
            f"0::/kubepods/burstable/pod{UID}/{CID}\n",
            PodRef(UID, CID, "burstable"), id="v2-cgroupfs-burstable"),
        pytest.param(
            f"0::/kubepods/pod{UID}/{CID}\n",
            PodRef(UID, CID, "guaranteed"), id="v2-cgroupfs-guaranteed"),
        pytest.param(
            f"0::/kubepods/besteffort/pod{UID}\n",
            PodRef(UID, None, "besteffort"), id="v2-pod-level-only"),
        pytest.param(
            "12:pids:/user.slice\n"
            f"11:memory:/kubepods/besteffort/pod{UID}/{CID}\n"
            f"10:cpu,cpuacct:/kubepods/besteffort/pod{UID}/{CID}\n"
            "1:name=systemd:/user.slice/user-1000.slice/session-3.scope\n",
            PodRef(UID, CID, "besteffort"), id="v1-cgroupfs"),
        pytest.param(
            f"11:memory:/kubepods.slice/kubepods-burstable.slice/kubepods-burstable-pod{UID_}"
            f".slice/cri-containerd-{CID}.scope\n"
            "0::/\n",
            PodRef(UID, CID, "burstable"), id="hybrid-v1-carries-the-pod"),
        pytest.param(
            f"0::/system.slice/containerd.service/kubepods-burstable-pod{UID_}.slice:cri-containerd:{CID}\n",
            PodRef(UID, CID, "burstable"), id="containerd-cgroupfs-under-systemd-kubelet"),
        pytest.param(
            "".join(f"{i}:{c}:/process_api/7944d08b/rota-gpu-node-1/kubepods/besteffort/"
                    f"pod{UID}/{CID}\n"
                    for i, c in ((9, "name=systemd"), (8, "pids"), (4, "memory"), (1, "cpu")))
            + f"0::/process_api/7944d08b/rota-gpu-node-1/kubepods/besteffort/pod{UID}/{CID}\n",
            PodRef(UID, CID, "besteffort"), id="hybrid-cgroupfs-under-a-cgroup-root-real-node"),
        pytest.param("0::/user.slice/user-1000.slice/session-2.scope\n", None, id="host-session"),
        pytest.param("0::/system.slice/nvidia-persistenced.service\n", None, id="host-service"),
        pytest.param("0::/\n", None, id="private-cgroup-namespace"),
        pytest.param(f"0::/pod{UID}/{CID}\n", None, id="pod-dir-outside-kubepods"),
        pytest.param("0::/kubepods/burstable/podnot-a-uid/abc\n", None, id="bad-uid"),
        pytest.param("", None, id="empty"),
        pytest.param("garbage without colons\n", None, id="garbage"),
    ],
)
def test_parse_cgroup(text: str, expected: PodRef | None) -> None:
    assert parse_cgroup(text) == expected


def test_unified_line_wins_over_v1(tmp_path: Path) -> None:
    other = "11111111-2222-3333-4444-555555555555"
    text = (f"4:memory:/kubepods/besteffort/pod{other}/{CID}\n"
            f"0::/kubepods.slice/kubepods-pod{UID_}.slice/cri-containerd-{CID}.scope\n")
    found = parse_cgroup(text)
    assert found is not None
    assert found.pod_uid == UID


def test_pod_of_pid_reads_under_the_proc_root(tmp_path: Path) -> None:
    (tmp_path / "416").mkdir()
    (tmp_path / "416" / "cgroup").write_text(f"0::/kubepods/burstable/pod{UID}/{CID}\n")
    assert pod_of_pid(416, tmp_path) == PodRef(UID, CID, "burstable")


@pytest.mark.parametrize("pid", [417, 0, -1])
def test_pod_of_missing_process_is_none(tmp_path: Path, pid: int) -> None:
    assert pod_of_pid(pid, tmp_path) is None
