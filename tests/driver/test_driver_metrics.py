"""The driver's metrics name what they are about: device health carries its GPU's uuid
(so it joins DCGM's series), and the info gauge the version and the sharing mode in
effect, one series at a time."""

from __future__ import annotations

from importlib import metadata
from typing import Any

from driver import metrics
from driver.claims import PublishedDevice
from driver.devices import discover
from driver.health import HealthMonitor
from driver.nvml import fixture_path
from driver.nvml.fake import FakeNvml
from driver.publisher import SlicePublisher
from driver.slices import SharingMode


def _samples(name: str) -> list[dict[str, str]]:
    return [dict(s.labels) for f in metrics.REGISTRY.collect() for s in f.samples
            if s.name == name]


def test_device_health_carries_the_gpu_uuid() -> None:
    backend = FakeNvml.from_path(fixture_path("h200"))
    backend.init()
    try:
        uuid = backend.uuid(0)
        devices = {name: PublishedDevice(name=name, gpu_uuid=uuid, gpu_index=0,
                                         gpu_memory_bytes=1 << 40,
                                         capacity_memory_bytes=1 << 39, shared=False)
                   for name in ("gpu-0-share-0", "gpu-0-share-1")}
        HealthMonitor(backend=backend, pool="node-1", devices=lambda: devices).snapshot()
    finally:
        backend.shutdown()
    for name in devices:
        assert metrics.REGISTRY.get_sample_value(
            "rota_driver_device_healthy", {"device": name, "gpu_uuid": uuid}) == 1.0


def test_the_info_gauge_follows_the_sharing_mode_in_effect() -> None:
    backend = FakeNvml.from_path(fixture_path("h200"))
    backend.init()
    try:
        gpus = discover(backend)
    finally:
        backend.shutdown()
    unused: Any = None
    publisher = SlicePublisher(kube=unused, node_name="node-1", gpus=gpus,
                               mode=SharingMode.PARTITIONED, engines=2)
    version = metadata.version("rota")
    assert _samples("rota_driver_info") == [{"version": version,
                                             "sharing_mode": "partitioned"}]
    publisher.mode = SharingMode.SHARED  # as the fallback does, then publishes it
    publisher._set_mode_metric()
    assert _samples("rota_driver_info") == [{"version": version, "sharing_mode": "shared"}]
    assert metrics.REGISTRY.get_sample_value("rota_driver_sharing_mode",
                                             {"mode": "partitioned"}) == 0.0
