"""What the chart gives the lease controller of the host is enough, and no more: a real
driver with ``--inspect-dir`` puts its inspection socket (and the symlink to it) in that
directory alone; a process with the controller's identity (uid 65532, supplemental group
0, as ``controller.podSecurityContext``) connects to it through a read-only bind mount of
the directory, as the container sees it; without group 0 it cannot; and the mount cannot
be written."""

from __future__ import annotations

import os
import shutil
import subprocess
import tempfile
import urllib.request
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest
from kubernetes import client

from e2e.cluster import LocalCluster
from e2e.harness.local_node import GpuNode
from e2e.harness.waiting import eventually

# A Python that another uid may run (not one under root's home).
OTHER_PYTHON = next((p for p in ("/usr/bin/python3", "/usr/local/bin/python3")
                     if os.access(p, os.X_OK)), None)

pytestmark = [
    pytest.mark.cluster,
    pytest.mark.skipif(os.geteuid() != 0 or not shutil.which("unshare")
                       or not shutil.which("setpriv") or OTHER_PYTHON is None,
                       reason="needs root, unshare and setpriv (util-linux) for a private "
                              "mount namespace and another uid, and a system python3"),
]

PROBE = """
import errno, os, socket, sys
path = sys.argv[1]
s = socket.socket(socket.AF_UNIX)
try:
    s.connect(os.path.join(path, "inspect.sock"))
    print("connect ok")
except PermissionError:
    print("connect refused")
try:
    open(os.path.join(path, "written-by-controller"), "w")
    print("write ok")
except OSError as exc:
    print("write refused" if exc.errno in (errno.EROFS, errno.EACCES) else repr(exc))
"""


@pytest.fixture
def inspect_dir() -> Iterator[Path]:
    root = Path(tempfile.mkdtemp(prefix="ri-", dir="/tmp"))
    root.chmod(0o755)  # as the container's mount point: its parents are traversable
    try:
        yield root / "inspect"
    finally:
        shutil.rmtree(root, ignore_errors=True)


def _as_controller(directory: Path, groups: str) -> list[str]:
    script = (f"mount --bind {directory} {directory} && "
              f"mount -o remount,bind,ro {directory} && "
              f"exec setpriv --reuid=65532 --regid=65532 --groups={groups} "
              f"{OTHER_PYTHON} -c '{PROBE}' {directory}")
    done = subprocess.run(["unshare", "--mount", "--propagation", "private", "sh", "-c",
                           script], capture_output=True, text=True, timeout=60, check=False)
    assert done.returncode == 0, done.stderr
    return done.stdout.split("\n")[:2]


def test_the_controller_reaches_only_the_inspection_socket(
        cluster: LocalCluster, kube_api: client.ApiClient, device_class: str,
        inspect_dir: Path) -> None:
    node = GpuNode(cluster=cluster, api=kube_api, name=f"gpu-{uuid.uuid4().hex[:8]}")
    try:
        # With a pod uid, as in the DaemonSet: a socket named after it, and the symlink.
        node.start_driver(wait=False, extra=[f"--inspect-dir={inspect_dir}",
                                             f"--pod-uid={uuid.uuid4()}"])

        def ready() -> bool:
            assert node.driver is not None
            assert node.driver.alive(), node.driver.log_tail()
            with urllib.request.urlopen(f"http://127.0.0.1:{node.http_port}/readyz",
                                        timeout=2) as resp:
                return resp.status == 200 and (inspect_dir / "inspect.sock").exists()

        eventually(ready, timeout=60, what="the driver ready")
        entries = sorted(p.name for p in inspect_dir.iterdir())
        assert entries[0] == "inspect-" + entries[0].removeprefix("inspect-")
        assert "inspect.sock" in entries
        assert len(entries) == 2, entries  # the socket and the symlink, nothing else
        assert (inspect_dir / "inspect.sock").is_symlink()
        # The DRA socket (and the ledger, once written) stay in the plugin directory.
        assert [p.name for p in node.dirs.plugin.iterdir() if p.name.startswith("dra-")]
        assert not (node.dirs.plugin / "inspect.sock").exists()

        assert _as_controller(inspect_dir, "0") == ["connect ok", "write refused"]
        assert _as_controller(inspect_dir, "65532") == ["connect refused", "write refused"]
    finally:
        node.close()
