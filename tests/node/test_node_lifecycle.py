"""A second real node joins the cluster and leaves it without a trace; a node whose test
run is killed is cleaned up by its namespaces' holder and by the next start."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
from kubernetes import client

from e2e.cluster import LocalCluster
from e2e.cluster.binaries import locate
from e2e.cluster.leftovers import registry_dir, remove_leftovers, start_time
from e2e.cluster.node_cgroups import NodeCgroups
from e2e.cluster.realnode import RealNode, RealNodeOptions
from e2e.harness.waiting import eventually
from e2e.images import BuiltImages
from tests.real_node import needs_root

pytestmark = [pytest.mark.cluster, pytest.mark.node, needs_root]


def test_a_second_node_starts_and_stops_cleanly(
        cluster: LocalCluster, kube_api: client.ApiClient, rota_images: BuiltImages,
        real_node: RealNode) -> None:
    node = RealNode(cluster, "second-node", rota_images, bin_dir=locate(),
                    options=RealNodeOptions(labels={}, fake_gpu=False))
    node.start()
    try:
        assert node.pod_cidr != real_node.pod_cidr
        status = client.CoreV1Api(kube_api).read_node("second-node").status
        assert {a.address for a in status.addresses} == {node.node_ip, "second-node"}
        pids = node.cgroups.pids()
        assert pids
    finally:
        node.stop()
    assert not any(_in(pid, node.cgroups) for pid in pids)
    assert not any(d.exists() for d in node.cgroups.dirs())
    assert not node.dir.exists()
    assert not (registry_dir() / f"{node.id}.json").exists()


def _in(pid: int, cgroups: NodeCgroups) -> bool:
    """A live (not zombie) process in the node's cgroups."""
    try:
        return start_time(pid) is not None and \
            cgroups.path in Path(f"/proc/{pid}/cgroup").read_text()
    except OSError:
        return False


CHILD = textwrap.dedent("""
    import os, subprocess, sys, time
    from pathlib import Path
    from e2e.cluster.leftovers import NodeRecord, owner, start_time
    from e2e.cluster.node_cgroups import NodeCgroups
    from e2e.cluster.node_namespace import NodeNamespace
    from e2e.cluster.relays import joined
    from e2e.harness.waiting import eventually

    node_dir = Path(sys.argv[1])
    cgroups = NodeCgroups.for_node(sys.argv[2])
    cgroups.create()
    ns = NodeNamespace(node_dir=node_dir, node_ip="10.250.99.2", service_ip="10.0.0.1",
                       api_port=1, cgroup_dirs=cgroups.dirs(), freezer=None)
    holder = ns.start(die_with_parent=True)
    eventually(ns.ready_file.exists, timeout=60, what="the node's namespaces ready")
    who, since = owner()
    NodeRecord(id=sys.argv[2], name=sys.argv[2], node_dir=node_dir,
               cgroup_path=cgroups.path, cgroups_created=cgroups.created,
               holder_pid=holder.pid, holder_start=start_time(holder.pid),
               owner_pid=who, owner_start=since).save()
    env = {"PATH": os.environ["PATH"],
           "ROTA_JOIN": " ".join(str(d / "cgroup.procs") for d in cgroups.dirs("system"))}
    # What a container shim does: leave its parent's session and process tree.
    subprocess.Popen(ns.enter(joined(["setsid", "-f", "sleep", "3600"])), env=env).wait()
    print("ready", flush=True)
    time.sleep(3600)
""")


def test_a_killed_run_leaves_nothing_behind(tmp_path: Path) -> None:
    name = f"crash-{os.getpid()}"
    node_dir = tmp_path / "node"
    child = subprocess.Popen([sys.executable, "-c", CHILD, str(node_dir), name],
                             stdout=subprocess.PIPE, text=True)
    assert child.stdout is not None
    assert child.stdout.readline().strip() == "ready"
    cgroups = NodeCgroups.for_node(name)
    orphans = cgroups.pids()
    assert orphans
    os.kill(child.pid, signal.SIGKILL)
    child.wait(10)
    # The holder got its parent-death signal: it killed the node's processes and removed
    # the cgroups.
    eventually(lambda: not any(d.exists() for d in cgroups.dirs()), timeout=30,
               what="the node's cgroups removed")
    assert not any(_in(pid, cgroups) for pid in orphans)
    # The next start removes what is left on disk.
    assert (registry_dir() / f"{name}.json").exists()
    assert name in remove_leftovers()
    assert not node_dir.exists()
    assert not (registry_dir() / f"{name}.json").exists()
