"""CDI specs: how a prepared claim's container gets its GPU and rota's environment.

The kubelet passes the CDI device ids prepare returns to the container runtime, which reads
the matching spec from the CDI directory and applies its edits. rota writes one spec file
per claim (``<cdi_root>/k8s.gpu.rota.dev-claim_<claimUID>.json``, kind
``k8s.gpu.rota.dev/claim``) with one CDI device per allocated share, named
``<claimUID>-<device>`` or ``<claimUID>-<device>-<shareID>``. Names carry the claim uid
because runtimes cache specs; unprepare deletes the file.

Each CDI device gives the container the GPU's device nodes (``/dev/nvidia<minor>``,
``/dev/nvidiactl``, ``/dev/nvidia-uvm``, ``/dev/nvidia-uvm-tools``; host paths under a
configurable device root), those of them that exist on the node: the container runtime
stats every node a spec lists and fails the container when one is missing (many GPU nodes
have no ``nvidia-uvm-tools``). Existence is checked in a live view of the host's device
root (``dev_view``: a read-only mount of it in the driver's container), not in the
container's own ``/dev``, a copy made when it started: ``/dev/nvidia-uvm`` is often created
on first CUDA use, or by a driver container that starts after rota's. Then an
environment. The driver libraries come from the image or the NVIDIA container toolkit,
which reads ``NVIDIA_VISIBLE_DEVICES``. Every environment
value is a property of the whole claim and is the same in each of its CDI devices, so the
order in which a runtime merges them cannot matter; with several GPUs or shares the
values are comma-separated lists:

- ``NVIDIA_VISIBLE_DEVICES``, ``ROTA_GPU_UUID``: the claim's GPU uuids;
- ``ROTA_CLAIM_UID``, ``ROTA_CLAIM_NAMESPACE``, ``ROTA_CLAIM_NAME``;
- ``ROTA_SHARE_ID``: the claim's share ids (only when it holds shares);
- ``ROTA_RESIDENT_MEMORY_BYTES``, ``ROTA_AWAKE_MEMORY_BYTES``: the two budgets, so the
  engine can size its KV cache from a fixed number (``--kv-cache-memory-bytes``) rather
  than from whatever memory is free when it starts;
- with an engine config: ``ROTA_MODEL``, ``ROTA_SLEEP_LEVEL``, ``ROTA_ENGINE_PORT``,
  ``ROTA_ENGINE_ADAPTER``;
- with an engine config: ``ROTA_CONTROL_TOKEN``, the claim's own control token, which
  the engine guard checks on control calls (:mod:`driver.control_tokens`: one per claim,
  so that what one engine learns opens no other);
- with an engine config and the start gate on: ``ROTA_START_SOCKET`` and
  ``ROTA_START_TOKEN`` (the claim's own token), and a read-only mount of the start-gate
  directory (host path = container path); see :mod:`driver.startgate`.

With the fake NVML backend, the driver adds :func:`fake_nvml_edits`: a mount of its process
registry directory and ``ROTA_FAKE_NVML_PROC_DIR`` naming it, so an engine in a container
registers its GPU memory where the driver reads it, as a real engine's memory shows in NVML.

:func:`build_claim_spec` is deterministic given which device nodes exist: an idempotent
prepare rebuilds the spec and gets identical bytes from :func:`render_spec`.
``cdiVersion`` is 0.5.0, the lowest that allows device names starting with a digit (claim
uids do) and ``hostPath``, so that older runtimes load the spec too.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import re
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from driver.claims import AllocatedShare, ClaimPlan, PublishedDevice
from driver.control_tokens import ControlTokens
from driver.disk import OS_DISK, Disk, atomic_write, fsync_dir, remove_temp_files
from driver.startgate import StartGate

__all__ = [
    "CDI_CLASS",
    "CDI_KIND",
    "CDI_VENDOR",
    "CDI_VERSION",
    "FAKE_NVML_CONTAINER_DIR",
    "ExtraEdits",
    "build_claim_spec",
    "device_name",
    "fake_nvml_edits",
    "list_spec_claim_uids",
    "qualified_id",
    "remove_spec",
    "render_spec",
    "share_device_name",
    "spec_path",
    "write_spec",
]

log = logging.getLogger(__name__)

CDI_VENDOR = "k8s.gpu.rota.dev"
CDI_CLASS = "claim"
CDI_KIND = f"{CDI_VENDOR}/{CDI_CLASS}"
CDI_VERSION = "0.5.0"

_CLAIM_UID = re.compile(r"[A-Za-z0-9][A-Za-z0-9-]{0,63}")
_DEVICE_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9_.:-]*")
_SPEC_FILE = re.compile(
    r"(?P<temp>\.)?"
    + re.escape(f"{CDI_VENDOR}-{CDI_CLASS}_")
    + r"(?P<uid>[A-Za-z0-9][A-Za-z0-9-]{0,63})\.json"
    + r"(?(temp)\.[A-Za-z0-9_]+\.tmp)"
)
_SHARED_NODES = ("nvidiactl", "nvidia-uvm", "nvidia-uvm-tools")
FAKE_NVML_CONTAINER_DIR = "/var/run/rota/fake-nvml"
"""Where an engine container finds the fake NVML process registry."""
_missing_logged: set[str] = set()


@dataclass(frozen=True)
class Mount:
    host_path: str
    container_path: str
    options: tuple[str, ...] = ("rbind", "rw")


@dataclass(frozen=True)
class ExtraEdits:
    """Container edits every claim's devices get besides rota's own."""

    env: Mapping[str, str] = field(default_factory=dict)
    mounts: Sequence[Mount] = ()


def fake_nvml_edits(proc_dir: Path | str) -> ExtraEdits:
    """The edits that give an engine the fake NVML process registry at ``proc_dir`` (a
    path on the node; the driver sees it at the same path)."""
    return ExtraEdits(env={"ROTA_FAKE_NVML_PROC_DIR": FAKE_NVML_CONTAINER_DIR},
                      mounts=(Mount(str(proc_dir), FAKE_NVML_CONTAINER_DIR),))


def _check_claim_uid(claim_uid: str) -> str:
    if not _CLAIM_UID.fullmatch(claim_uid):
        raise ValueError(f"claim uid {claim_uid[:80]!r} is not usable in a CDI spec name")
    return claim_uid


def device_name(claim_uid: str, device: str, share_id: str | None = None) -> str:
    """The CDI device name of one allocated device or share of a claim.

    Raises:
        ValueError: the name would not be a valid CDI device name.
    """
    parts = [_check_claim_uid(claim_uid), device]
    if share_id is not None:
        parts.append(share_id)
    name = "-".join(parts)
    if not _DEVICE_NAME.fullmatch(name):
        raise ValueError(f"{name[:120]!r} is not a valid CDI device name")
    return name


def share_device_name(claim_uid: str, share: AllocatedShare) -> str:
    """The CDI device name of one share of a claim plan."""
    return device_name(claim_uid, share.device, share.share_id)


def qualified_id(name: str) -> str:
    """The fully qualified CDI device id the kubelet hands to the runtime."""
    return f"{CDI_KIND}={name}"


def spec_path(cdi_root: Path | str, claim_uid: str) -> Path:
    """Where the spec of one claim lives."""
    return Path(cdi_root) / f"{CDI_VENDOR}-{CDI_CLASS}_{_check_claim_uid(claim_uid)}.json"


def _joined(values: list[str]) -> str:
    return ",".join(dict.fromkeys(values))


def _environment(plan: ClaimPlan, extra: Mapping[str, str], start_gate: StartGate | None,
                 control: ControlTokens | None) -> list[str]:
    gpus = ",".join(plan.gpu_uuids)
    env = {
        "NVIDIA_VISIBLE_DEVICES": gpus,
        "ROTA_GPU_UUID": gpus,
        "ROTA_CLAIM_UID": plan.uid,
        "ROTA_CLAIM_NAMESPACE": plan.namespace,
        "ROTA_CLAIM_NAME": plan.name,
        "ROTA_RESIDENT_MEMORY_BYTES": str(plan.resident_bytes),
        "ROTA_AWAKE_MEMORY_BYTES": str(plan.awake_bytes),
    }
    share_ids = [s.share_id for s in plan.shares if s.share_id is not None]
    if share_ids:
        env["ROTA_SHARE_ID"] = _joined(share_ids)
    if plan.config is not None:
        env["ROTA_MODEL"] = plan.config.model
        env["ROTA_SLEEP_LEVEL"] = str(plan.config.sleep_level)
        env["ROTA_ENGINE_PORT"] = str(plan.config.engine_port)
        env["ROTA_ENGINE_ADAPTER"] = plan.config.adapter
        if control is not None:
            env.update(control.environment(plan.uid))
        if start_gate is not None:
            env.update(start_gate.environment(plan.uid))
    env.update(extra)
    return [f"{key}={value}" for key, value in sorted(env.items())]


def _device_nodes(device: PublishedDevice, dev_root: str, dev_view: str,
                  node_exists: Callable[[str], bool]) -> list[dict[str, str]]:
    minor = device.gpu_minor if device.gpu_minor is not None else device.gpu_index
    nodes: list[dict[str, str]] = []
    for node in (f"nvidia{minor}", *_SHARED_NODES):
        entry = {"path": f"/dev/{node}"}
        host_path = f"{dev_root.rstrip('/')}/{node}"
        if not node_exists(f"{dev_view.rstrip('/')}/{node}"):
            if host_path not in _missing_logged:
                _missing_logged.add(host_path)
                log.info("device node missing on this node; not listed in CDI specs",
                         extra={"device_node": host_path})
            continue
        if host_path != entry["path"]:
            entry["hostPath"] = host_path
        nodes.append(entry)
    return nodes


def build_claim_spec(
    plan: ClaimPlan,
    devices: Mapping[str, PublishedDevice],
    *,
    dev_root: str = "/dev",
    dev_view: str | None = None,
    extra: ExtraEdits | None = None,
    node_exists: Callable[[str], bool] = os.path.exists,
    start_gate: StartGate | None = None,
    control: ControlTokens | None = None,
) -> dict[str, Any]:
    """The CDI spec of one claim: one device per share, edits as the module docstring says.

    Args:
        plan: the claim's plan.
        devices: the devices this driver publishes, by name (every share's device must be
            there).
        dev_root: where the NVIDIA device nodes are on the host (``/dev``, or the driver
            root of a containerised driver such as ``/run/nvidia/driver/dev``).
        dev_view: where this process sees ``dev_root`` live (a mount of it); device nodes
            are looked for there. None: at ``dev_root`` itself.
        extra: edits added to every device (the fake NVML's registry mount).
        node_exists: whether a device node exists (a node that does not is left out).
        start_gate: the start gate's socket directory and key (None: no start gate); only
            claims with an engine config get it.
        control: derives the claim's control token (None: none is written); only claims
            with an engine config get it.

    Raises:
        ValueError: a share names an unknown device, or a name is not valid in CDI.
    """
    edits = extra or ExtraEdits()
    env = _environment(plan, edits.env, start_gate, control)
    mounts = [{"hostPath": m.host_path, "containerPath": m.container_path,
               "options": list(m.options)} for m in edits.mounts]
    if start_gate is not None and plan.config is not None:
        mounts.append(start_gate.mount())
    cdi_devices: list[dict[str, Any]] = []
    for share in plan.shares:
        device = devices.get(share.device)
        if device is None:
            raise ValueError(f"claim {plan.uid} holds unknown device {share.device!r}")
        container_edits: dict[str, Any] = {"env": list(env)}
        nodes = _device_nodes(device, dev_root, dev_view or dev_root, node_exists)
        if nodes:
            container_edits["deviceNodes"] = nodes
        if mounts:
            container_edits["mounts"] = [dict(m) for m in mounts]
        cdi_devices.append({"name": share_device_name(plan.uid, share),
                            "containerEdits": container_edits})
    if not cdi_devices:
        raise ValueError(f"claim {plan.uid} has no devices; a CDI spec needs at least one")
    return {"cdiVersion": CDI_VERSION, "kind": CDI_KIND, "devices": cdi_devices}


def render_spec(spec: Mapping[str, Any]) -> bytes:
    """The file content of a spec: sorted keys, indented, newline-terminated."""
    return json.dumps(spec, sort_keys=True, indent=2, ensure_ascii=False).encode() + b"\n"


def write_spec(cdi_root: Path | str, claim_uid: str, spec: Mapping[str, Any], *,
               disk: Disk = OS_DISK) -> Path:
    """Write a claim's spec atomically (temp file, fsync, rename, fsync the directory).

    The temp file is named ``.<spec file>.<random>.tmp`` so runtimes, which load only
    ``.json`` and ``.yaml`` files, never read a half-written spec.

    Returns:
        The path of the spec file.
    """
    path = spec_path(cdi_root, claim_uid)
    disk.makedirs(path.parent)
    remove_temp_files(path, disk)
    atomic_write(path, render_spec(spec), mode=0o644, disk=disk)
    return path


def remove_spec(cdi_root: Path | str, claim_uid: str, *, disk: Disk = OS_DISK) -> bool:
    """Delete a claim's spec (and temp files of an interrupted write of it).

    Returns:
        True when a spec file was removed, False when there was none.
    """
    path = spec_path(cdi_root, claim_uid)
    remove_temp_files(path, disk)
    try:
        disk.unlink(path)
    except FileNotFoundError:
        return False
    with contextlib.suppress(OSError):
        fsync_dir(path.parent, disk)
    return True


def list_spec_claim_uids(cdi_root: Path | str, *, disk: Disk = OS_DISK) -> set[str]:
    """The claim uids that have a rota spec in ``cdi_root``, or the temp file of one.

    Used at start-up to remove specs of claims the ledger does not know; files of other
    vendors are ignored.
    """
    try:
        names = disk.list_files(Path(cdi_root))
    except FileNotFoundError:
        return set()
    uids: set[str] = set()
    for name in names:
        match = _SPEC_FILE.fullmatch(name)
        if match is not None:
            uids.add(match["uid"])
    return uids
