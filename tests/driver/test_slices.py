"""ResourceSlice bodies: schema rules of resource.k8s.io/v1, determinism, and comparison."""

from __future__ import annotations

import copy
import dataclasses
import re
from collections.abc import Sequence
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from driver.devices import GpuDevice, discover
from driver.nvml import fixture_path
from driver.nvml.fake import FakeNvml
from driver.slices import (
    GATE_CONSUMABLE_CAPACITY,
    GATE_DEVICE_TAINTS,
    GATE_PARTITIONABLE_DEVICES,
    PoolOptions,
    SharingMode,
    build_slices,
    content_equal,
    dropped_fields,
    dropped_gates,
    fallback_mode,
    slice_name,
    unhealthy_taint,
    with_taints,
)
from rota.api.naming import physical_device
from rota.api.quantity import parse_quantity

JSON = dict[str, Any]
MI = 1 << 20
DNS_LABEL = re.compile(r"^[a-z0-9]([-a-z0-9]{0,61}[a-z0-9])?$")
DNS_SUBDOMAIN = re.compile(r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?(\.[a-z0-9]([-a-z0-9]*[a-z0-9])?)*$")
C_IDENTIFIER = re.compile(r"^[A-Za-z_][A-Za-z0-9_]{0,31}$")
SEMVER = re.compile(r"^(0|[1-9][0-9]*)\.(0|[1-9][0-9]*)\.(0|[1-9][0-9]*)(\+[0-9A-Za-z.-]+)?$")


def _devices(name: str) -> list[GpuDevice]:
    backend = FakeNvml.from_path(fixture_path(name))
    backend.init()
    return discover(backend)


H200 = _devices("h200")
H200X8 = _devices("h200x8")


def _many(count: int) -> list[GpuDevice]:
    return [dataclasses.replace(H200[0], index=i, name=f"gpu-{i}", uuid=f"GPU-{i:08d}")
            for i in range(count)]


def _check_qualified_name(name: str) -> None:
    domain, _, ident = name.rpartition("/")
    assert C_IDENTIFIER.match(ident), name
    if domain:
        assert len(domain) <= 63, name
        assert DNS_SUBDOMAIN.match(domain), name


def _check_capacity(device: JSON, key: str, capacity: JSON) -> None:
    value = parse_quantity(capacity["value"])
    policy = capacity.get("requestPolicy")
    if policy is None:
        return
    assert device.get("allowMultipleAllocations") is True, "requestPolicy needs sharing"
    assert not ("validValues" in policy and "validRange" in policy)
    default = parse_quantity(policy["default"])
    valid_range = policy["validRange"]
    low = parse_quantity(valid_range["min"])
    assert low <= value, key
    assert default >= low, key
    if "max" in valid_range:
        high = parse_quantity(valid_range["max"])
        assert low <= high <= value, key
        assert default <= high, key
    if "step" in valid_range:
        step = parse_quantity(valid_range["step"])
        assert low + step <= value, key
        assert (default - low) % step == 0, key
        if "max" in valid_range:
            assert (high - low) % step == 0, key


def validate_pool(slices: Sequence[JSON], node: str = "node-a") -> None:
    """The validation rules of dra-facts §4 that rota's slices can run into."""
    assert slices
    names: set[str] = set()
    device_names: set[str] = set()
    counter_sets: dict[str, dict[str, int]] = {}
    consumed: dict[tuple[str, str], int] = {}
    generations = {s["spec"]["pool"]["generation"] for s in slices}
    assert len(generations) == 1
    for item in slices:
        assert item["apiVersion"] == "resource.k8s.io/v1"
        assert item["kind"] == "ResourceSlice"
        name = item["metadata"]["name"]
        assert len(name) <= 253, name
        assert DNS_SUBDOMAIN.match(name), name
        assert name not in names
        names.add(name)
        spec = item["spec"]
        assert spec["driver"] == "gpu.rota.dev"
        assert spec["pool"]["name"] == node == spec["nodeName"]
        assert spec["pool"]["resourceSliceCount"] == len(slices)
        assert ("devices" in spec) != ("sharedCounters" in spec), "one of them per slice"
        for counter_set in spec.get("sharedCounters", []):
            assert DNS_LABEL.match(counter_set["name"])
            assert counter_set["name"] not in counter_sets, "counter sets unique per pool"
            assert 0 < len(counter_set["counters"]) <= 32
            counter_sets[counter_set["name"]] = {
                k: parse_quantity(v["value"]) for k, v in counter_set["counters"].items()
            }
        assert len(spec.get("sharedCounters", [])) <= 8
        devices = spec.get("devices", [])
        with_counters = any("consumesCounters" in d for d in devices)
        assert len(devices) <= (64 if with_counters else 128)
        for device in devices:
            assert DNS_LABEL.match(device["name"]), device["name"]
            assert device["name"] not in device_names
            device_names.add(device["name"])
            attributes, capacity = device["attributes"], device.get("capacity", {})
            assert len(attributes) + len(capacity) <= 32
            for key, attribute in attributes.items():
                _check_qualified_name(key)
                assert len(attribute) == 1
                ((kind, value),) = attribute.items()
                assert kind in ("int", "bool", "string", "version")
                if kind == "string":
                    assert len(value) <= 64
                if kind == "version":
                    assert len(value) <= 64, value
                    assert SEMVER.match(value), value
            for key, cap in capacity.items():
                _check_qualified_name(key)
                _check_capacity(device, key, cap)
            assert len(device.get("consumesCounters", [])) <= 2
            for use in device.get("consumesCounters", []):
                for counter, amount in use["counters"].items():
                    key = (use["counterSet"], counter)
                    consumed[key] = consumed.get(key, 0) + parse_quantity(amount["value"])
    for (counter_set, counter), total in consumed.items():
        assert counter in counter_sets[counter_set], "consumes a published counter"
        assert total <= counter_sets[counter_set][counter]


MODES = list(SharingMode)


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("gpus", [H200, H200X8, _many(20)], ids=["h200", "h200x8", "20gpus"])
def test_every_mode_passes_schema_validation(mode: SharingMode, gpus: list[GpuDevice]) -> None:
    validate_pool(build_slices(gpus, PoolOptions("node-a", "uid-1", 3, mode)))


def test_shared_device_of_the_h200() -> None:
    (item,) = build_slices(H200, PoolOptions("node-a"))
    (device,) = item["spec"]["devices"]
    assert device["name"] == "gpu-0"
    assert device["allowMultipleAllocations"] is True
    assert device["capacity"] == {
        "memory": {
            "value": "143771Mi",
            "requestPolicy": {"default": "1Gi",
                              "validRange": {"min": "1Mi", "max": "143771Mi", "step": "1Mi"}},
        },
        "engines": {
            "value": "8",
            "requestPolicy": {"default": "1", "validRange": {"min": "1", "max": "1", "step": "1"}},
        },
    }
    assert device["attributes"] == {
        "architecture": {"string": "Hopper"},
        "brand": {"string": "Nvidia"},
        "cudaComputeCapability": {"version": "9.0.0"},
        "cudaDriverVersion": {"version": "13.0.0"},
        "driverVersion": {"version": "580.159.4"},
        "index": {"int": 0},
        "productName": {"string": "NVIDIA H200"},
        "resource.kubernetes.io/pciBusID": {"string": "0000:00:06.0"},
        "sharing": {"string": "shared"},
        "uuid": {"string": "GPU-b2d6f492-0cde-9a2c-447e-a98f56e7d2ed"},
    }


def test_memory_is_rounded_down_to_a_mebibyte() -> None:
    odd = dataclasses.replace(H200[0], memory_bytes=10 * MI + 12345)
    (item,) = build_slices([odd], PoolOptions("node-a", engines=3))
    memory = item["spec"]["devices"][0]["capacity"]["memory"]
    assert memory["value"] == "10Mi"
    assert memory["requestPolicy"]["default"] == "10Mi"  # the 1Gi default does not fit


def test_exclusive_device_has_no_sharing_fields() -> None:
    (item,) = build_slices(H200X8, PoolOptions("node-a", mode=SharingMode.EXCLUSIVE))
    for device in item["spec"]["devices"]:
        assert "allowMultipleAllocations" not in device
        assert device["capacity"] == {"memory": {"value": "143771Mi"}}
        assert device["attributes"]["sharing"] == {"string": "exclusive"}
        assert device["attributes"]["numaNode"]["int"] in (0, 1)


def test_partitioned_layout_for_eight_gpus() -> None:
    slices = build_slices(H200X8, PoolOptions("node-a", mode=SharingMode.PARTITIONED))
    assert [sorted(s["spec"]) for s in slices] == [
        ["driver", "nodeName", "pool", "sharedCounters"],
        ["devices", "driver", "nodeName", "pool"],
    ]
    counter_sets = slices[0]["spec"]["sharedCounters"]
    assert [c["name"] for c in counter_sets] == [f"gpu-{i}" for i in range(8)]
    devices = slices[1]["spec"]["devices"]
    assert len(devices) == 64
    share = devices[9]
    assert share["name"] == "gpu-1-share-1"
    assert share["capacity"] == {"memory": {"value": "17971Mi"}}  # 143771Mi // 8
    assert share["consumesCounters"] == [
        {"counterSet": "gpu-1", "counters": {"memory": {"value": "17971Mi"}}}
    ]


@pytest.mark.parametrize(
    ("mode", "count", "sizes"),
    [
        (SharingMode.EXCLUSIVE, 130, [("devices", 128), ("devices", 2)]),
        (SharingMode.SHARED, 8, [("devices", 8)]),
        (SharingMode.PARTITIONED, 20, [("sharedCounters", 8), ("sharedCounters", 8),
                                       ("sharedCounters", 4), ("devices", 64),
                                       ("devices", 64), ("devices", 32)]),
    ],
)
def test_large_pools_are_split(mode: SharingMode, count: int, sizes: list[tuple[str, int]]) -> None:
    slices = build_slices(_many(count), PoolOptions("node-a", mode=mode))
    assert [(next(k for k in ("devices", "sharedCounters") if k in s["spec"]),
             len(s["spec"].get("devices", s["spec"].get("sharedCounters", []))))
            for s in slices] == sizes
    assert [s["metadata"]["name"] for s in slices] == [
        f"node-a-gpu.rota.dev-{i}" for i in range(len(sizes))
    ]


def test_output_is_deterministic() -> None:
    options = PoolOptions("node-a", "uid", 2, SharingMode.PARTITIONED)
    assert build_slices(H200X8, options) == build_slices(list(reversed(H200X8)), options)


def test_owner_reference_only_with_a_node_uid() -> None:
    (with_uid,) = build_slices(H200, PoolOptions("node-a", node_uid="1234"))
    assert with_uid["metadata"]["ownerReferences"] == [
        {"apiVersion": "v1", "kind": "Node", "name": "node-a", "uid": "1234", "controller": True}
    ]
    (without,) = build_slices(H200, PoolOptions("node-a"))
    assert "ownerReferences" not in without["metadata"]


def test_long_attribute_strings_are_cut() -> None:
    long_name = dataclasses.replace(H200[0], product_name="X" * 100)
    (item,) = build_slices([long_name], PoolOptions("node-a"))
    assert item["spec"]["devices"][0]["attributes"]["productName"] == {"string": "X" * 64}


def test_unknown_numa_and_versions_are_left_out() -> None:
    bare = dataclasses.replace(H200[0], driver_version=None, pci_bus_id=None, numa_node=None)
    (item,) = build_slices([bare], PoolOptions("node-a"))
    attributes = item["spec"]["devices"][0]["attributes"]
    assert not {"driverVersion", "numaNode", "resource.kubernetes.io/pciBusID"} & set(attributes)


NODE_LABEL = st.from_regex(r"[a-z0-9]([a-z0-9-]{0,40}[a-z0-9])?", fullmatch=True)


@settings(max_examples=200)
@given(st.lists(NODE_LABEL, min_size=1, max_size=12).map(".".join).filter(lambda n: len(n) <= 253),
       st.integers(min_value=0, max_value=999))
def test_slice_names_are_valid_and_distinct(node: str, index: int) -> None:
    name = slice_name(node, index)
    assert len(name) <= 253, name
    assert DNS_SUBDOMAIN.match(name), name
    assert name.endswith(f"-gpu.rota.dev-{index}")
    assert slice_name(node, index) == name
    assert slice_name(node, index + 1) != name


def test_long_node_names_are_hashed_apart() -> None:
    base = "n" * 63 + "." + "a" * 63 + "." + "b" * 63 + "." + "c" * 61
    first, second = base[:-1] + "x", base[:-1] + "y"
    assert len(first) == 253
    slices = build_slices(H200, PoolOptions(first))
    validate_pool(slices, node=first)
    assert slice_name(first, 0) != slice_name(second, 0)
    assert len(slice_name(first, 0)) <= 253


def test_names_that_end_in_a_dot_after_cutting_stay_valid() -> None:
    node = "a" * 226 + "." + "b" * 26  # the cut falls right after the dot
    name = slice_name(node, 5)
    assert ".-" not in name
    assert DNS_SUBDOMAIN.match(name), name


@pytest.mark.parametrize(
    "kwargs",
    [{"node_name": ""}, {"engines": 1}, {"generation": -1}, {"memory_default": MI + 1},
     {"memory_default": 0}],
)
def test_bad_options_are_refused(kwargs: dict[str, Any]) -> None:
    with pytest.raises(ValueError, match=r"\w"):
        PoolOptions(**{"node_name": "node-a", **kwargs})


# --- comparing with what the server returns ----------------------------------------------


def _desired(mode: SharingMode = SharingMode.SHARED) -> JSON:
    return build_slices(H200, PoolOptions("node-a", "uid-1", 1, mode))[0]


def _as_returned(desired: JSON) -> JSON:
    returned = copy.deepcopy(desired)
    returned["metadata"].update(
        uid="abc", resourceVersion="42", generation=1, creationTimestamp="2026-01-01T00:00:00Z",
        managedFields=[{"manager": "rota"}],
    )
    returned["spec"]["pool"]["generation"] = 7
    memory = returned["spec"]["devices"][0]["capacity"]["memory"]
    memory["value"] = "150754820096"
    memory["requestPolicy"]["default"] = str(1 << 30)
    memory["requestPolicy"]["validRange"]["step"] = "1024Ki"
    returned["spec"]["devices"][0]["taints"] = []
    return returned


def test_server_copy_with_other_spellings_is_equal() -> None:
    desired = _desired()
    assert content_equal(desired, desired)
    assert content_equal(desired, _as_returned(desired))


def _edit(path: Sequence[str | int], value: object) -> JSON:
    changed = _as_returned(_desired())
    target: Any = changed
    for step in path[:-1]:
        target = target[step]
    if value is ...:
        del target[path[-1]]
    else:
        target[path[-1]] = value
    return changed


DEV0 = ("spec", "devices", 0)


@pytest.mark.parametrize(
    "observed",
    [
        _edit((*DEV0, "attributes", "uuid"), {"string": "GPU-other"}),
        _edit((*DEV0, "allowMultipleAllocations"), ...),
        _edit((*DEV0, "capacity", "memory", "value"), "143770Mi"),
        _edit((*DEV0, "capacity", "engines", "requestPolicy"), ...),
        _edit((*DEV0, "taints"), [{"key": "k", "effect": "NoSchedule"}]),
        _edit(("spec", "devices"), []),
        _edit(("spec", "pool", "resourceSliceCount"), 2),
        _edit(("metadata", "ownerReferences"), ...),
        _edit((*DEV0, "attributes", "index"), {"int": True}),
    ],
)
def test_real_differences_are_seen(observed: JSON) -> None:
    assert not content_equal(_desired(), observed)


def _drop_consumable_capacity(returned: JSON) -> None:
    for device in returned["spec"].get("devices", []):
        device.pop("allowMultipleAllocations", None)
        for capacity in device.get("capacity", {}).values():
            capacity.pop("requestPolicy", None)


def _drop_partitionable(returned: JSON) -> None:
    returned["spec"].pop("sharedCounters", None)
    for device in returned["spec"].get("devices", []):
        device.pop("consumesCounters", None)


def test_nothing_dropped_when_server_kept_everything() -> None:
    for mode in MODES:
        for desired in build_slices(H200X8, PoolOptions("node-a", mode=mode)):
            assert dropped_fields(desired, _respelled(desired)) == []
            assert dropped_gates(desired, desired) == frozenset()


def _respelled(desired: JSON) -> JSON:
    returned = copy.deepcopy(desired)
    returned["metadata"]["uid"] = "x"
    return returned


def test_dropped_consumable_capacity_is_named() -> None:
    desired = _desired()
    returned = copy.deepcopy(desired)
    _drop_consumable_capacity(returned)
    assert dropped_fields(desired, returned) == [
        "spec.devices[gpu-0].allowMultipleAllocations (gate DRAConsumableCapacity off?)",
        "spec.devices[gpu-0].capacity[engines].requestPolicy (gate DRAConsumableCapacity off?)",
        "spec.devices[gpu-0].capacity[memory].requestPolicy (gate DRAConsumableCapacity off?)",
    ]
    assert dropped_gates(desired, returned) == {GATE_CONSUMABLE_CAPACITY}
    assert not content_equal(desired, returned)


def test_dropped_partitionable_fields_are_named() -> None:
    counters, devices = build_slices(H200, PoolOptions("node-a", mode=SharingMode.PARTITIONED))
    for desired in (counters, devices):
        returned = copy.deepcopy(desired)
        _drop_partitionable(returned)
        assert dropped_gates(desired, returned) == {GATE_PARTITIONABLE_DEVICES}
    returned = copy.deepcopy(counters)
    _drop_partitionable(returned)
    assert dropped_fields(counters, returned) == [
        "spec.sharedCounters (gate DRAPartitionableDevices off?)"
    ]
    returned = copy.deepcopy(devices)
    _drop_partitionable(returned)
    assert len(dropped_fields(devices, returned)) == 8
    assert all(f.endswith(".consumesCounters (gate DRAPartitionableDevices off?)")
               for f in dropped_fields(devices, returned))


def test_device_missing_from_the_answer_blames_no_gate() -> None:
    desired = _desired()
    returned = copy.deepcopy(desired)
    returned["spec"]["devices"] = []
    assert dropped_gates(desired, returned) == {"unknown"}


@pytest.mark.parametrize(
    ("mode", "gates", "expected"),
    [
        (SharingMode.SHARED, [], None),
        (SharingMode.SHARED, [GATE_CONSUMABLE_CAPACITY], SharingMode.PARTITIONED),
        (SharingMode.SHARED, [GATE_CONSUMABLE_CAPACITY, GATE_PARTITIONABLE_DEVICES],
         SharingMode.EXCLUSIVE),
        (SharingMode.SHARED, [GATE_PARTITIONABLE_DEVICES], None),
        (SharingMode.PARTITIONED, [GATE_PARTITIONABLE_DEVICES], SharingMode.EXCLUSIVE),
        (SharingMode.PARTITIONED, [GATE_CONSUMABLE_CAPACITY], None),
        (SharingMode.PARTITIONED, ["unknown"], SharingMode.EXCLUSIVE),
        (SharingMode.EXCLUSIVE, [GATE_CONSUMABLE_CAPACITY, "unknown"], None),
    ],
)
def test_fallback_mode(mode: SharingMode, gates: list[str], expected: SharingMode | None) -> None:
    assert fallback_mode(mode, gates) is expected


def test_taints_land_on_their_gpu_and_dropping_them_is_no_mode_change() -> None:
    (gpu,) = H200
    desired = build_slices([gpu], PoolOptions(node_name="n"))
    taint = unhealthy_taint("xid 79: fallen off the bus", "2026-11-29T12:00:00Z")
    assert taint["value"] == "xid-79--fallen-off-the-bus"
    tainted = with_taints(desired, {gpu.uuid: [taint]})
    assert tainted[0]["spec"]["devices"][0]["taints"] == [taint]
    assert "taints" not in desired[0]["spec"]["devices"][0], "the input must not change"
    assert dropped_gates(tainted[0], desired[0]) == {GATE_DEVICE_TAINTS}
    assert fallback_mode(SharingMode.SHARED, {GATE_DEVICE_TAINTS}) is None


@pytest.mark.parametrize(("name", "gpu"), [
    ("gpu-0", "gpu-0"), ("gpu-3-share-0", "gpu-3"), ("gpu-12-share-7", "gpu-12"),
    ("gpu-1-share-x", "gpu-1-share-x"), ("other", "other"),
])
def test_physical_device_names_the_gpu_behind_every_published_name(name: str, gpu: str) -> None:
    assert physical_device(name) == gpu



@pytest.mark.parametrize("mode", list(SharingMode))
def test_every_published_device_maps_to_the_gpu_whose_uuid_it_carries(mode: SharingMode) -> None:
    by_uuid = {gpu.uuid: gpu.name for gpu in H200X8}
    for body in build_slices(H200X8, PoolOptions("node-a", mode=mode)):
        for device in body["spec"].get("devices", []):
            uuid = device["attributes"]["uuid"]["string"]
            assert physical_device(device["name"]) == by_uuid[uuid]
