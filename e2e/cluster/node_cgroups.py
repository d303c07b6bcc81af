"""A real node's cgroups: one root per node under the caller's own cgroup, in every
hierarchy, created, emptied and removed without touching anything else.

The machine's cgroup mounts are used as they are. The node's root is the same path in
every v1 hierarchy (and the unified one of a hybrid set-up): the caller's deepest cgroup
path plus ``rota-<node>``, so it sits under the caller's cgroup wherever the caller is not
at the root. Directories are created level by level and ``cpuset.cpus``/``cpuset.mems``
copied down, as the cpuset controller requires; only directories created here are
removed. The kubelet gets the root as its ``cgroupRoot``; containerd, the kubelet and the
node's relays run in ``<root>/system``, and the kubelet puts pods in ``<root>/kubepods``,
so every process of the node is in the subtree. :meth:`NodeCgroups.kill` freezes the
subtree, kills every process in it and thaws it, so nothing escapes by forking.
"""

from __future__ import annotations

import contextlib
import logging
import os
import signal
import time
from dataclasses import dataclass, field
from pathlib import Path

log = logging.getLogger(__name__)

CGROUP_MOUNT = Path("/sys/fs/cgroup")
SYSTEM = "system"


class CgroupError(RuntimeError):
    """The cgroup layout is not one the node can run in."""


def caller_cgroup_path(proc_self_cgroup: str) -> str:
    """The deepest cgroup path of the calling process among its hierarchies."""
    paths = [line.split(":", 2)[2] for line in proc_self_cgroup.splitlines()
             if line.count(":") >= 2]
    if not paths:
        raise CgroupError("no cgroup membership in /proc/self/cgroup")
    return max(paths, key=lambda p: (len([x for x in p.split("/") if x]), p))


def hierarchies(mount: Path = CGROUP_MOUNT) -> list[Path]:
    """Every cgroup hierarchy mounted under ``mount`` (v1 controllers, a named one, and
    the unified one of a hybrid set-up), once each: ``cpu,cpuacct`` links are skipped."""
    if not mount.is_dir():
        raise CgroupError(f"{mount} is not mounted")
    if (mount / "cgroup.controllers").exists():
        return [mount]  # pure cgroup v2
    found: list[Path] = []
    seen: set[str] = set()
    for entry in sorted(mount.iterdir()):
        if not entry.is_dir() or not (entry / "cgroup.procs").exists():
            continue
        real = os.path.realpath(entry)
        if real in seen:
            continue
        seen.add(real)
        found.append(entry)
    if not found:
        raise CgroupError(f"no cgroup hierarchy under {mount}")
    return found


@dataclass
class NodeCgroups:
    """The cgroup root of one node (a path like ``/a/b/rota-node-1``)."""

    path: str
    mount: Path = CGROUP_MOUNT
    created: list[Path] = field(default_factory=list)
    """Directories made by :meth:`create`, parents first."""

    @classmethod
    def for_node(cls, name: str, mount: Path = CGROUP_MOUNT) -> NodeCgroups:
        base = caller_cgroup_path(Path("/proc/self/cgroup").read_text())
        return cls(path=f"{base.rstrip('/')}/rota-{name}", mount=mount)

    def dirs(self, child: str = "") -> list[Path]:
        relative = f"{self.path.strip('/')}/{child}".rstrip("/")
        return [h / relative for h in hierarchies(self.mount)]

    def create(self) -> None:
        for hierarchy in hierarchies(self.mount):
            here = hierarchy
            for part in [p for p in f"{self.path}/{SYSTEM}".split("/") if p]:
                parent, here = here, here / part
                if here.is_dir():
                    continue
                here.mkdir()
                self.created.append(here)
                for name in ("cpuset.cpus", "cpuset.mems"):
                    if (parent / name).exists():
                        (here / name).write_text((parent / name).read_text())

    def join(self, pid: int) -> None:
        """Move ``pid`` into ``<root>/system`` in every hierarchy."""
        for directory in self.dirs(SYSTEM):
            (directory / "cgroup.procs").write_text(str(pid))

    def pids(self) -> set[int]:
        found: set[int] = set()
        for root in self.dirs():
            if not root.is_dir():
                continue
            for procs in root.rglob("cgroup.procs"):
                with contextlib.suppress(OSError):
                    found.update(int(p) for p in procs.read_text().split())
        return found

    def _freezer(self) -> Path | None:
        for root in self.dirs():
            if (root / "freezer.state").exists():
                return root
        return None

    def kill(self, timeout_s: float = 10.0) -> None:
        """SIGKILL every process of the node, repeatedly, until none is left."""
        freezer = self._freezer()
        deadline = time.monotonic() + timeout_s
        while (pids := self.pids()) and time.monotonic() < deadline:
            if freezer is not None:
                with contextlib.suppress(OSError):
                    (freezer / "freezer.state").write_text("FROZEN")
            for pid in pids:
                with contextlib.suppress(ProcessLookupError):
                    os.kill(pid, signal.SIGKILL)
            if freezer is not None:
                with contextlib.suppress(OSError):
                    (freezer / "freezer.state").write_text("THAWED")
            time.sleep(0.05)
        if self.pids():
            log.warning("processes of the node survived SIGKILL",
                        extra={"cgroup": self.path, "pids": sorted(self.pids())})

    def remove(self) -> None:
        """Remove the node's cgroups, deepest first (the kubelet's included), and the
        parents :meth:`create` made. Leaves anything that still has processes."""
        for root in self.dirs():
            if not root.is_dir():
                continue
            for directory in sorted((p for p in root.rglob("*") if p.is_dir()),
                                    key=lambda p: len(p.parts), reverse=True):
                with contextlib.suppress(OSError):
                    directory.rmdir()
            with contextlib.suppress(OSError):
                root.rmdir()
        for directory in reversed(self.created):
            with contextlib.suppress(OSError):
                directory.rmdir()
        self.created.clear()
