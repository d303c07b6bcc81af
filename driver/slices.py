"""GPUs as ResourceSlice bodies (resource.k8s.io/v1), and how to compare them with the server's.

Pure functions: :func:`build_slices` turns discovered :class:`~driver.devices.GpuDevice`
records into the slices of one pool (named after the node) in one of three
:class:`SharingMode` s; :func:`content_equal` tells a publisher whether the server's copy
still says what rota wrote; :func:`dropped_fields` tells it which rota fields the API
server silently dropped because a feature gate is off, and :func:`fallback_mode` which
mode to publish instead.

Modes, after NVIDIA's ConsumableShares:

- ``exclusive``: one plain device per GPU, one claim at a time.
- ``shared`` (default): one device per GPU with ``allowMultipleAllocations``; consumable
  capacity ``memory`` (bytes, rounded down to a MiB; a claim that names no memory is
  charged :data:`DEFAULT_MEMORY_REQUEST`, about what a sleeping engine keeps: its CUDA
  context and allocator pools) and ``engines`` (how many claims may share the GPU; each
  claim takes exactly one). Needs DRAConsumableCapacity (on by default from 1.36).
- ``partitioned``: the fallback without consumable capacity: ``engines`` fixed share
  devices per GPU, ``gpu-<i>-share-<k>``, each with an equal part of the memory, drawn
  from a per-GPU counter set ``gpu-<i>``. Counter sets live in slices of their own, as
  Kubernetes 1.35+ requires (the 1.34 alpha layout is not produced). Needs
  DRAPartitionableDevices (on by default from 1.36).

Schema limits respected: attribute strings <= 64 characters, <= 32 attributes and
capacities per device, <= 128 devices per slice (64 when devices consume counters),
<= 8 counter sets per slice; more GPUs spread over several slices of the pool.
"""

from __future__ import annotations

import enum
import hashlib
import re
from collections.abc import Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from driver import DRIVER_NAME
from driver.devices import GpuDevice
from rota.api.quantity import format_quantity, quantity_equal

MI = 1 << 20
GI = 1 << 30
DEFAULT_ENGINES = 8
DEFAULT_MEMORY_REQUEST = GI
MAX_DEVICES_PER_SLICE = 128
MAX_COUNTER_DEVICES_PER_SLICE = 64
MAX_COUNTER_SETS_PER_SLICE = 8
MAX_ATTRIBUTE_STRING = 64
MAX_OBJECT_NAME = 253
PCI_BUS_ID_ATTRIBUTE = "resource.kubernetes.io/pciBusID"
GATE_CONSUMABLE_CAPACITY = "DRAConsumableCapacity"
GATE_PARTITIONABLE_DEVICES = "DRAPartitionableDevices"
GATE_DEVICE_TAINTS = "DRADeviceTaints"
UNHEALTHY_TAINT_KEY = "gpu.rota.dev/unhealthy"

JSON = dict[str, Any]


class SharingMode(enum.StrEnum):
    """How each GPU is offered to claims."""

    EXCLUSIVE = "exclusive"
    SHARED = "shared"
    PARTITIONED = "partitioned"


@dataclass(frozen=True)
class PoolOptions:
    """Everything about the pool that is not a device.

    ``engines`` is how many claims may share one GPU (``shared``: the ``engines``
    capacity; ``partitioned``: share devices per GPU); ``memory_default`` the memory a
    ``shared`` claim is charged when it names none (a whole number of MiB).
    """

    node_name: str
    node_uid: str | None = None
    generation: int = 0
    mode: SharingMode = SharingMode.SHARED
    engines: int = DEFAULT_ENGINES
    memory_default: int = DEFAULT_MEMORY_REQUEST
    driver: str = DRIVER_NAME

    def __post_init__(self) -> None:
        if not self.node_name:
            raise ValueError("node_name must not be empty")
        if self.generation < 0:
            raise ValueError("generation must be >= 0")
        if self.engines < 2:
            raise ValueError("engines must be >= 2 (one claim per GPU is the exclusive mode)")
        if self.memory_default < MI or self.memory_default % MI:
            raise ValueError("memory_default must be a positive whole number of MiB")


def build_slices(devices: Iterable[GpuDevice], options: PoolOptions) -> list[JSON]:
    """The complete, ordered list of slices of the node's pool."""
    gpus = sorted(devices, key=lambda d: d.index)
    specs: list[JSON] = []
    if options.mode is SharingMode.PARTITIONED:
        counter_sets = [_counter_set(gpu) for gpu in gpus]
        specs += [{"sharedCounters": chunk}
                  for chunk in _chunks(counter_sets, MAX_COUNTER_SETS_PER_SLICE)]
        shares = [share for gpu in gpus for share in _share_devices(gpu, options.engines)]
        specs += [{"devices": chunk} for chunk in _chunks(shares, MAX_COUNTER_DEVICES_PER_SLICE)]
    else:
        whole = [_whole_device(gpu, options) for gpu in gpus]
        specs += [{"devices": chunk} for chunk in _chunks(whole, MAX_DEVICES_PER_SLICE)]
    return [_slice(options, i, len(specs), body) for i, body in enumerate(specs)]


def slice_name(node_name: str, index: int, driver: str = DRIVER_NAME) -> str:
    """``<node>-<driver>-<index>``; a node name too long for that is cut and hashed."""
    suffix = f"-{driver}-{index}"
    name = node_name + suffix
    if len(name) <= MAX_OBJECT_NAME:
        return name
    digest = hashlib.sha256(node_name.encode()).hexdigest()[:10]
    keep = MAX_OBJECT_NAME - len(suffix) - len(digest) - 1
    return f"{node_name[:keep].rstrip('-.')}-{digest}{suffix}"


def _slice(options: PoolOptions, index: int, count: int, body: JSON) -> JSON:
    metadata: JSON = {"name": slice_name(options.node_name, index, options.driver)}
    if options.node_uid:
        metadata["ownerReferences"] = [
            {"apiVersion": "v1", "kind": "Node", "name": options.node_name,
             "uid": options.node_uid, "controller": True}
        ]
    spec: JSON = {
        "driver": options.driver,
        "pool": {"name": options.node_name, "generation": options.generation,
                 "resourceSliceCount": count},
        "nodeName": options.node_name,
        **body,
    }
    return {"apiVersion": "resource.k8s.io/v1", "kind": "ResourceSlice",
            "metadata": metadata, "spec": spec}


def _chunks(items: Sequence[JSON], size: int) -> Iterator[list[JSON]]:
    for start in range(0, len(items), size):
        yield list(items[start:start + size])


def _round_mi(value: int) -> int:
    return value // MI * MI


def _text(value: str) -> JSON:
    return {"string": value[:MAX_ATTRIBUTE_STRING]}


def _attributes(gpu: GpuDevice, mode: SharingMode) -> JSON:
    attrs: JSON = {
        "uuid": _text(gpu.uuid),
        "productName": _text(gpu.product_name),
        "brand": _text(gpu.brand),
        "architecture": _text(gpu.architecture),
        "cudaComputeCapability": {"version": gpu.cuda_compute_capability},
        "index": {"int": gpu.index},
        "sharing": _text(mode.value),
    }
    if gpu.driver_version is not None:
        attrs["driverVersion"] = {"version": gpu.driver_version}
    if gpu.cuda_driver_version is not None:
        attrs["cudaDriverVersion"] = {"version": gpu.cuda_driver_version}
    if gpu.pci_bus_id is not None:
        attrs[PCI_BUS_ID_ATTRIBUTE] = _text(gpu.pci_bus_id)
    if gpu.numa_node is not None:
        attrs["numaNode"] = {"int": gpu.numa_node}
    return dict(sorted(attrs.items()))


def _consumable(value: int, default: int, minimum: int, step: int, maximum: int) -> JSON:
    return {
        "value": format_quantity(value),
        "requestPolicy": {
            "default": format_quantity(default),
            "validRange": {"min": format_quantity(minimum), "max": format_quantity(maximum),
                           "step": format_quantity(step)},
        },
    }


def _whole_device(gpu: GpuDevice, options: PoolOptions) -> JSON:
    memory = _round_mi(gpu.memory_bytes)
    device: JSON = {"name": gpu.name, "attributes": _attributes(gpu, options.mode)}
    if options.mode is SharingMode.SHARED:
        device["allowMultipleAllocations"] = True
        device["capacity"] = {
            "engines": _consumable(options.engines, 1, 1, 1, 1),
            "memory": _consumable(memory, min(options.memory_default, memory), MI, MI, memory),
        }
    else:
        device["capacity"] = {"memory": {"value": format_quantity(memory)}}
    return device


def counter_set_name(gpu: GpuDevice) -> str:
    """The counter set that holds one GPU's memory in ``partitioned`` mode."""
    return gpu.name


def _counter_set(gpu: GpuDevice) -> JSON:
    memory = format_quantity(_round_mi(gpu.memory_bytes))
    return {"name": counter_set_name(gpu), "counters": {"memory": {"value": memory}}}




def share_device_name(gpu: GpuDevice, k: int) -> str:
    """The name of share ``k`` of one GPU in ``partitioned`` mode."""
    return f"{gpu.name}-share-{k}"


def _share_devices(gpu: GpuDevice, shares: int) -> list[JSON]:
    part = format_quantity(_round_mi(gpu.memory_bytes // shares))
    return [
        {
            "name": share_device_name(gpu, k),
            "attributes": _attributes(gpu, SharingMode.PARTITIONED),
            "capacity": {"memory": {"value": part}},
            "consumesCounters": [
                {"counterSet": counter_set_name(gpu), "counters": {"memory": {"value": part}}}
            ],
        }
        for k in range(shares)
    ]


# --- comparing with the server's copy -----------------------------------------------------

_QUANTITY_MAPS = frozenset({"capacity", "counters"})


def _rota_fields(obj: Mapping[str, Any]) -> JSON:
    """The parts of a slice rota sets: name, owner references, spec without generation."""
    metadata = obj.get("metadata") or {}
    spec = dict(obj.get("spec") or {})
    spec["pool"] = {k: v for k, v in (spec.get("pool") or {}).items() if k != "generation"}
    return {
        "apiVersion": obj.get("apiVersion"),
        "kind": obj.get("kind"),
        "metadata": {k: metadata[k] for k in ("name", "ownerReferences") if k in metadata},
        "spec": spec,
    }


def _empty(value: object) -> bool:
    return value is None or value is False or value in ("", [], {})


def _same(desired: object, observed: object, quantities: bool) -> bool:
    if isinstance(desired, Mapping):
        if not isinstance(observed, Mapping):
            return False
        for key, value in desired.items():
            if key not in observed:
                if not _empty(value):
                    return False
            elif not _same(value, observed[key], quantities or key in _QUANTITY_MAPS):
                return False
        # Keys only the server has are fine while empty (defaults), not when someone filled them.
        return all(_empty(v) for k, v in observed.items() if k not in desired)
    if isinstance(desired, list):
        return (isinstance(observed, list) and len(desired) == len(observed)
                and all(_same(d, o, quantities) for d, o in zip(desired, observed, strict=True)))
    if quantities and isinstance(desired, str | int) and isinstance(observed, str | int):
        return quantity_equal(desired, observed)
    return type(desired) is type(observed) and desired == observed


def content_equal(desired: Mapping[str, Any], observed: Mapping[str, Any]) -> bool:
    """True when ``observed`` says what ``desired`` says in every field rota sets.

    Server-set metadata, labels, annotations and the pool generation are ignored;
    quantities compare by value; fields the server added are ignored while empty.
    """
    return _same(_rota_fields(desired), _rota_fields(observed), False)


def _dropped(desired: Mapping[str, Any], returned: Mapping[str, Any]) -> list[tuple[str, str]]:
    found: list[tuple[str, str]] = []
    want = desired.get("spec") or {}
    got = returned.get("spec") or {}
    if want.get("sharedCounters") and not got.get("sharedCounters"):
        found.append(("spec.sharedCounters", GATE_PARTITIONABLE_DEVICES))
    got_devices = {d.get("name"): d for d in got.get("devices") or []}
    for device in want.get("devices") or []:
        name = device.get("name")
        path = f"spec.devices[{name}]"
        back = got_devices.get(name)
        if back is None:
            found.append((path, "unknown"))
            continue
        if device.get("allowMultipleAllocations") and not back.get("allowMultipleAllocations"):
            found.append((f"{path}.allowMultipleAllocations", GATE_CONSUMABLE_CAPACITY))
        back_capacity = back.get("capacity") or {}
        for key, capacity in sorted((device.get("capacity") or {}).items()):
            if "requestPolicy" in capacity and not (back_capacity.get(key) or {}).get(
                "requestPolicy"
            ):
                found.append((f"{path}.capacity[{key}].requestPolicy", GATE_CONSUMABLE_CAPACITY))
        if device.get("consumesCounters") and not back.get("consumesCounters"):
            found.append((f"{path}.consumesCounters", GATE_PARTITIONABLE_DEVICES))
        if device.get("taints") and not back.get("taints"):
            found.append((f"{path}.taints", GATE_DEVICE_TAINTS))
    return found


def with_taints(slices: Sequence[JSON], taints: Mapping[str, Sequence[JSON]]) -> list[JSON]:
    """``slices`` with ``taints[gpu uuid]`` on every device of that GPU (pure; the input is
    not changed). Devices of GPUs without an entry are left as they are."""
    if not taints:
        return list(slices)
    tainted: list[JSON] = []
    for body in slices:
        spec = dict(body["spec"])
        if "devices" in spec:
            devices = []
            for device in spec["devices"]:
                uuid = device.get("attributes", {}).get("uuid", {}).get("string")
                found = taints.get(uuid) if uuid else None
                devices.append({**device, "taints": [dict(t) for t in found]} if found else device)
            spec["devices"] = devices
        tainted.append({**body, "spec": spec})
    return tainted


def unhealthy_taint(reason: str, since: str) -> JSON:
    """The NoSchedule taint of an unhealthy GPU; ``since`` is RFC 3339 (seconds)."""
    value = re.sub(r"[^A-Za-z0-9_.-]", "-", reason)[:63].strip("-_.") or "unhealthy"
    return {"key": UNHEALTHY_TAINT_KEY, "value": value, "effect": "NoSchedule",
            "timeAdded": since}


def dropped_fields(desired: Mapping[str, Any], returned: Mapping[str, Any]) -> list[str]:
    """Fields rota wrote that the server's answer lacks, each naming the gate to blame.

    E.g. ``spec.devices[gpu-0].allowMultipleAllocations (gate DRAConsumableCapacity off?)``.
    Empty when nothing was dropped.
    """
    return [f"{path} (gate {gate} off?)" for path, gate in _dropped(desired, returned)]


def dropped_gates(desired: Mapping[str, Any], returned: Mapping[str, Any]) -> frozenset[str]:
    """The feature gates that :func:`dropped_fields` blames (``unknown`` for the rest)."""
    return frozenset(gate for _, gate in _dropped(desired, returned))


def fallback_mode(mode: SharingMode, gates_off: Iterable[str]) -> SharingMode | None:
    """The mode to publish instead of ``mode`` once ``gates_off`` are known to be off.

    None when ``mode`` needs none of them. ``shared`` falls back to ``partitioned`` unless
    partitionable devices are off too; ``partitioned`` falls back to ``exclusive``.
    """
    off = set(gates_off)
    if mode is SharingMode.SHARED and GATE_CONSUMABLE_CAPACITY in off:
        if GATE_PARTITIONABLE_DEVICES in off:
            return SharingMode.EXCLUSIVE
        return SharingMode.PARTITIONED
    if mode is SharingMode.PARTITIONED and GATE_PARTITIONABLE_DEVICES in off:
        return SharingMode.EXCLUSIVE
    if mode is not SharingMode.EXCLUSIVE and "unknown" in off:
        return SharingMode.EXCLUSIVE
    return None
