"""Which Kubernetes pod a process belongs to, from its cgroup path.

NVML names the processes on a GPU by pid only. The inspection API must say whose they are
(a claimant's engine, or an unknown process holding memory), and the kubelet puts every
container in a cgroup whose path carries the pod uid and the container id:

- systemd driver: ``/kubepods.slice/kubepods-burstable.slice/
  kubepods-burstable-pod<uid with _ for ->.slice/cri-containerd-<id>.scope``
  (guaranteed pods sit directly under ``kubepods.slice``; kind and some distributions
  add a ``kubelet-`` prefix or a parent slice);
- cgroupfs driver: ``/kubepods/burstable/pod<uid>/<id>`` (``/kubepods/pod<uid>/<id>`` for
  guaranteed);
- containerd using cgroupfs under a systemd kubelet:
  ``/system.slice/containerd.service/kubepods-burstable-pod<uid>.slice:cri-containerd:<id>``.

:func:`parse_cgroup` reads the text of ``/proc/<pid>/cgroup`` (cgroup v2 ``0::<path>``
and v1 ``<n>:<controllers>:<path>`` lines) and is pure; :func:`pod_of_pid` reads the file
under a given proc root. A process the kubelet did not start, or one seen from inside
another cgroup namespace (its path then starts below the pod), gives None.
"""

from __future__ import annotations

import logging
import re
from dataclasses import dataclass
from pathlib import Path

log = logging.getLogger(__name__)

_QOS = ("burstable", "besteffort")
# systemd: "...kubepods-burstable-pod<uid>.slice" / "...kubepods-pod<uid>.slice"
_SYSTEMD_POD = re.compile(
    r"^(?:[a-z0-9_.-]*-)?kubepods(?:-(?P<qos>burstable|besteffort))?-pod(?P<uid>[0-9a-f_]+)\.slice$"
)
# cgroupfs: "pod<uid>"
_CGROUPFS_POD = re.compile(r"^pod(?P<uid>[0-9a-f-]+)$")
# "cri-containerd-<id>.scope", "crio-<id>.scope", "docker-<id>.scope", or a bare "<id>"
_CONTAINER = re.compile(r"^(?:[a-z][a-z-]*-)?(?P<id>[0-9a-f]{12,})(?:\.scope)?$")
# containerd with systemd cgroups but its own cgroupfs setting: the kubelet's cgroupsPath
# spec "<pod slice>:<prefix>:<id>" ends up verbatim as one path component
_SPEC_PATH = re.compile(r"^(?P<slice>[^:]+\.slice):[a-z-]+:(?P<id>[0-9a-f]{12,})$")
_UID_LENGTHS = (32, 36)  # a static pod's uid is a 32-digit hash; an API pod's a UUID


@dataclass(frozen=True)
class PodRef:
    """The pod (and container, when the path reaches one) a process runs in."""

    pod_uid: str
    container_id: str | None
    qos_class: str  # "guaranteed", "burstable" or "besteffort"


def _pod_in_path(path: str) -> PodRef | None:
    parts = [p for p in path.split("/") if p]
    for i, part in enumerate(parts):
        spec_path = _SPEC_PATH.match(part)
        if spec_path is not None:
            parts[i:i + 1] = [spec_path["slice"], spec_path["id"]]
            part = parts[i]
        systemd = _SYSTEMD_POD.match(part)
        if systemd is not None:
            uid, qos = systemd["uid"].replace("_", "-"), systemd["qos"] or "guaranteed"
        else:
            cgroupfs = _CGROUPFS_POD.match(part)
            if cgroupfs is None or not any(p.startswith("kubepods") for p in parts[:i]):
                continue
            uid = cgroupfs["uid"]
            qos = parts[i - 1] if parts[i - 1] in _QOS else "guaranteed"
        if len(uid) not in _UID_LENGTHS:
            continue
        container = _CONTAINER.match(parts[i + 1]) if i + 1 < len(parts) else None
        return PodRef(uid, container["id"] if container else None, qos)
    return None


def parse_cgroup(text: str) -> PodRef | None:
    """The pod in ``/proc/<pid>/cgroup`` content, or None for a process outside any pod.

    The unified (v2) line is tried first, then the v1 lines in file order.
    """
    unified: list[str] = []
    legacy: list[str] = []
    for line in text.splitlines():
        fields = line.strip().split(":", 2)
        if len(fields) != 3:
            continue
        (unified if fields[0] == "0" and fields[1] == "" else legacy).append(fields[2])
    for path in unified + legacy:
        found = _pod_in_path(path)
        if found is not None:
            return found
    return None


def pod_of_pid(pid: int, proc_root: str | Path = "/proc") -> PodRef | None:
    """Read ``<proc_root>/<pid>/cgroup``; None if the process is gone or not in a pod."""
    if pid <= 0:
        return None
    path = f"{proc_root}/{pid}/cgroup"  # a plain string: read every few ms, pathlib costs
    try:
        with open(path, encoding="utf-8", errors="replace") as file:
            text = file.read()
    except (FileNotFoundError, ProcessLookupError):
        return None
    except OSError as err:
        log.debug("cannot read cgroup of process", extra={"pid": pid, "error": str(err)})
        return None
    return parse_cgroup(text)
