"""Discovery: backend answers become normalised GpuDevice records."""

from __future__ import annotations

import json
import logging
import re

import pytest
from hypothesis import given
from hypothesis import strategies as st

from driver.devices import GpuDevice, cuda_version, discover, pci_bus_id, semver
from driver.errors import NvmlError
from driver.nvml import fixture_path
from driver.nvml.fake import FakeNvml, NvmlFixture

SEMVER = r"^(0|[1-9][0-9]*)\.(0|[1-9][0-9]*)\.(0|[1-9][0-9]*)(\+[0-9a-zA-Z.-]+)?$"


def _fake(name: str = "h200", fixture: NvmlFixture | None = None) -> FakeNvml:
    backend = FakeNvml(fixture) if fixture else FakeNvml.from_path(fixture_path(name))
    backend.init()
    return backend


def _fixture(**device_changes: object) -> NvmlFixture:
    data = json.loads(fixture_path("h200").read_text())
    data["devices"][0].update(device_changes)
    return NvmlFixture.model_validate(data)


def test_h200_is_discovered_with_normalised_fields() -> None:
    assert discover(_fake()) == [
        GpuDevice(
            index=0,
            name="gpu-0",
            uuid="GPU-b2d6f492-0cde-9a2c-447e-a98f56e7d2ed",
            product_name="NVIDIA H200",
            brand="Nvidia",
            architecture="Hopper",
            cuda_compute_capability="9.0.0",
            driver_version="580.159.4",
            cuda_driver_version="13.0.0",
            pci_bus_id="0000:00:06.0",
            numa_node=None,
            memory_bytes=150754820096,
            mig_enabled=False,
            minor=0,
        )
    ]


def test_eight_gpus_in_index_order() -> None:
    devices = discover(_fake("h200x8"))
    assert [d.name for d in devices] == [f"gpu-{i}" for i in range(8)]
    assert [d.numa_node for d in devices] == [0, 0, 0, 0, 1, 1, 1, 1]
    assert devices[1].pci_bus_id == "0000:2a:00.0"


@pytest.mark.parametrize(
    ("raw", "expected"),
    [
        ("580.159.04", "580.159.4"),
        ("535.104.05", "535.104.5"),
        ("550.54", "550.54.0"),
        ("560", "560.0.0"),
        ("00.00.00", "0.0.0"),
        ("31.0.15.3699", "31.0.15+3699"),
        ("580.159.04-rc1", None),
        ("", None),
        ("a.b.c", None),
    ],
)
def test_semver(raw: str, expected: str | None) -> None:
    assert semver(raw) == expected


@given(st.lists(st.integers(min_value=0, max_value=10**6), min_size=1, max_size=5),
       st.integers(min_value=0, max_value=3))
def test_semver_is_always_valid_semver(numbers: list[int], zeros: int) -> None:
    raw = ".".join("0" * zeros + str(n) for n in numbers)
    result = semver(raw)
    assert result is not None
    assert re.match(SEMVER, result), result
    assert [int(x) for x in result.split("+")[0].split(".")] == ([*numbers, 0, 0])[:3]


@pytest.mark.parametrize(
    ("encoded", "expected"),
    [(13000, "13.0.0"), (12040, "12.4.0"), (12080, "12.8.0"), (11020, "11.2.0"), (0, None)],
)
def test_cuda_version(encoded: int, expected: str | None) -> None:
    assert cuda_version(encoded) == expected


@pytest.mark.parametrize(
    ("raw", "expected"),
    [
        ("00000000:00:06.0", "0000:00:06.0"),
        ("00000000:2A:00.0", "0000:2a:00.0"),
        ("0000:AB:00.1", "0000:ab:00.1"),
        ("00010000:01:00.0", "10000:01:00.0"),
        ("01:00.0", "0000:01:00.0"),
        ("garbage", None),
        ("0000:00:06.9", None),
    ],
)
def test_pci_bus_id(raw: str, expected: str | None) -> None:
    assert pci_bus_id(raw) == expected


@pytest.mark.parametrize(
    ("arch", "brand", "arch_name", "brand_name"),
    [(7, 2, "Ampere", "Tesla"), (10, 14, "Blackwell", "Nvidia"), (42, 99, "Unknown", "Brand99")],
)
def test_enum_names(arch: int, brand: int, arch_name: str, brand_name: str) -> None:
    (device,) = discover(_fake(fixture=_fixture(architecture=arch, brand=brand)))
    assert (device.architecture, device.brand) == (arch_name, brand_name)


def test_numa_node_is_kept_when_known() -> None:
    (device,) = discover(_fake(fixture=_fixture(numa_node=1)))
    assert device.numa_node == 1


def test_mig_gpu_is_left_out_with_a_warning(caplog: pytest.LogCaptureFixture) -> None:
    with caplog.at_level(logging.WARNING, logger="driver.devices"):
        assert discover(_fake(fixture=_fixture(mig_mode=(1, 1)))) == []
    assert any("MIG" in r.getMessage() for r in caplog.records)


def test_pending_mig_change_does_not_hide_the_gpu() -> None:
    (device,) = discover(_fake(fixture=_fixture(mig_mode=(0, 1))))
    assert not device.mig_enabled


def test_one_failing_gpu_is_left_out() -> None:
    backend = _fake("h200x8")
    backend.fail("memory_info", "gpu_is_lost", index=3)
    devices = discover(backend)
    assert [d.index for d in devices] == [0, 1, 2, 4, 5, 6, 7]


@pytest.mark.parametrize("reason", ["uninitialized", "driver_not_loaded"])
def test_library_wide_failure_propagates(reason: str) -> None:
    backend = _fake("h200x8")
    backend.fail("uuid", reason, index=2)
    with pytest.raises(NvmlError) as err:
        discover(backend)
    assert err.value.reason == reason


def test_unparseable_driver_version_is_dropped() -> None:
    data = json.loads(fixture_path("h200").read_text())
    data["driver_version"] = "weird-build"
    (device,) = discover(_fake(fixture=NvmlFixture.model_validate(data)))
    assert device.driver_version is None
    assert device.cuda_driver_version == "13.0.0"
