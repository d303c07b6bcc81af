"""The pynvml backend: error translation and decoding with pynvml stubbed, then a real GPU.

The stubbed tests replace pynvml functions one by one, so they run anywhere. The test
marked ``gpu`` talks to the real NVML and skips itself where NVML cannot start.
"""

from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pynvml
import pytest

from driver.devices import discover
from driver.errors import NvmlError
from driver.inspection import InspectionService
from driver.nvml import HealthEventKind, NvmlBackend
from driver.nvml.api import reason_for
from driver.nvml.real import PynvmlBackend

HANDLE0, HANDLE1 = object(), object()


def _raise(code: int) -> Any:
    def fail(*_: object) -> Any:
        raise pynvml.NVMLError(code)

    return fail


@pytest.fixture
def stubbed(monkeypatch: pytest.MonkeyPatch) -> PynvmlBackend:
    """A backend whose pynvml answers like a one-GPU machine of an old pynvml (bytes)."""
    answers: dict[str, Any] = {
        "nvmlInit": lambda: None,
        "nvmlShutdown": lambda: None,
        "nvmlDeviceGetCount": lambda: 2,
        "nvmlDeviceGetHandleByIndex": lambda i: (HANDLE0, HANDLE1)[i],
        "nvmlSystemGetDriverVersion": lambda: b"580.159.04",
        "nvmlSystemGetCudaDriverVersion": lambda: 13000,
        "nvmlDeviceGetUUID": lambda h: b"GPU-0" if h is HANDLE0 else "GPU-1",
        "nvmlDeviceGetName": lambda h: b"NVIDIA H200",
        "nvmlDeviceGetBrand": lambda h: 14,
        "nvmlDeviceGetArchitecture": lambda h: 9,
        "nvmlDeviceGetCudaComputeCapability": lambda h: (9, 0),
        "nvmlDeviceGetPciInfo": lambda h: SimpleNamespace(busId=b"00000000:00:06.0"),
        "nvmlDeviceGetNumaNodeId": _raise(pynvml.NVML_ERROR_NOT_SUPPORTED),
        "nvmlDeviceGetMinorNumber": lambda h: 0,
        "nvmlDeviceGetMemoryInfo": lambda h: SimpleNamespace(total=100, used=30, free=70),
        "nvmlDeviceGetMigMode": _raise(pynvml.NVML_ERROR_NOT_SUPPORTED),
        "nvmlDeviceGetComputeRunningProcesses": lambda h: [
            SimpleNamespace(pid=416, usedGpuMemory=17819500544),
            SimpleNamespace(pid=417, usedGpuMemory=None),
        ],
        "nvmlDeviceGetGraphicsRunningProcesses": lambda h: [],
        "nvmlDeviceGetMPSComputeRunningProcesses": lambda h: [],
    }
    for name, fn in answers.items():
        monkeypatch.setattr(pynvml, name, fn)
    backend = PynvmlBackend()
    backend.init()
    return backend


def test_every_nvml_error_code_has_its_own_label() -> None:
    names = [n for n in dir(pynvml) if n.startswith("NVML_ERROR_")]
    assert len(names) > 20
    for name in names:
        expected = name.removeprefix("NVML_ERROR_").lower()
        assert reason_for(getattr(pynvml, name)) == expected, name
    assert reason_for(12345) == "nvml_12345"


def test_init_failure_becomes_nvml_error(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(pynvml, "nvmlInit", _raise(pynvml.NVML_ERROR_LIBRARY_NOT_FOUND))
    with pytest.raises(NvmlError) as err:
        PynvmlBackend().init()
    assert err.value.reason == "library_not_found"
    assert isinstance(err.value.__cause__, pynvml.NVMLError)


def test_answers_are_decoded_and_typed(stubbed: PynvmlBackend) -> None:
    assert isinstance(stubbed, NvmlBackend)
    assert stubbed.driver_version() == "580.159.04"
    assert stubbed.uuid(0) == "GPU-0"
    assert stubbed.uuid(1) == "GPU-1"
    assert stubbed.name(0) == "NVIDIA H200"
    assert stubbed.pci_bus_id(0) == "00000000:00:06.0"
    assert stubbed.cuda_compute_capability(0) == (9, 0)
    assert stubbed.numa_node(0) is None
    assert stubbed.mig_mode(0) == (0, 0)
    assert stubbed.memory_info(0).free == 70
    # usedGpuMemory None: NVML cannot tell. Not 0 bytes: an unknown amount.
    assert [(p.pid, p.used_bytes) for p in stubbed.compute_processes(0)] == [
        (416, 17819500544), (417, None)
    ]
    assert stubbed.memory_and_processes(0) == (stubbed.memory_info(0),
                                               stubbed.compute_processes(0))
    assert [d.uuid for d in discover(stubbed)] == ["GPU-0", "GPU-1"]


def test_graphics_and_mps_client_processes_are_listed_once_each(
    stubbed: PynvmlBackend, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A process with a graphics context holds memory as a compute one does; under MPS
    the compute list shows the server and the clients hold the memory. A process in two
    lists is one process; where the lists disagree on its size, the larger counts, and
    where one cannot tell, its size is unknown."""
    monkeypatch.setattr(pynvml, "nvmlDeviceGetGraphicsRunningProcesses", lambda h: [
        SimpleNamespace(pid=416, usedGpuMemory=17819500544),
        SimpleNamespace(pid=500, usedGpuMemory=3 * 2**30),
        SimpleNamespace(pid=502, usedGpuMemory=2**30),
    ])
    monkeypatch.setattr(pynvml, "nvmlDeviceGetMPSComputeRunningProcesses", lambda h: [
        SimpleNamespace(pid=501, usedGpuMemory=5 * 2**30),
        SimpleNamespace(pid=502, usedGpuMemory=None),
    ])
    assert sorted((p.pid, p.used_bytes) for p in stubbed.compute_processes(0)) == [
        (416, 17819500544), (417, None), (500, 3 * 2**30), (501, 5 * 2**30), (502, None)]


@pytest.mark.parametrize("code", [pynvml.NVML_ERROR_NOT_SUPPORTED,
                                  pynvml.NVML_ERROR_FUNCTION_NOT_FOUND])
def test_graphics_and_mps_lists_are_skipped_where_nvml_has_none(
    stubbed: PynvmlBackend, monkeypatch: pytest.MonkeyPatch, code: int
) -> None:
    monkeypatch.setattr(pynvml, "nvmlDeviceGetGraphicsRunningProcesses", _raise(code))
    monkeypatch.setattr(pynvml, "nvmlDeviceGetMPSComputeRunningProcesses", _raise(code))
    assert [p.pid for p in stubbed.compute_processes(0)] == [416, 417]
    monkeypatch.setattr(pynvml, "nvmlDeviceGetComputeRunningProcesses", _raise(code))
    with pytest.raises(NvmlError):  # the compute list is not optional
        stubbed.compute_processes(0)


def test_memory_nvml_cannot_tell_reaches_the_inspection_api_as_unknown(
    stubbed: PynvmlBackend, tmp_path: Path
) -> None:
    service = InspectionService(backend=stubbed, gpus=discover(stubbed)[:1],
                                proc_root=tmp_path)
    (gpu,) = service.read(set()).gpus
    found = {p.pid: (p.used_bytes, p.used_bytes_unknown) for p in gpu.processes}
    assert found == {416: (17819500544, False), 417: (0, True)}


def test_device_error_carries_the_call_and_reason(
    stubbed: PynvmlBackend, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(pynvml, "nvmlDeviceGetMemoryInfo", _raise(pynvml.NVML_ERROR_GPU_IS_LOST))
    with pytest.raises(NvmlError, match=r"nvmlDeviceGetMemoryInfo\(gpu 1\)") as err:
        stubbed.memory_info(1)
    assert err.value.reason == "gpu_is_lost"


@pytest.mark.parametrize(
    ("answer", "expected"),
    [(lambda h: 1, 1), (lambda h: -1, None), (_raise(pynvml.NVML_ERROR_NOT_SUPPORTED), None)],
)
def test_numa_node(
    stubbed: PynvmlBackend, monkeypatch: pytest.MonkeyPatch, answer: Any, expected: int | None
) -> None:
    monkeypatch.setattr(pynvml, "nvmlDeviceGetNumaNodeId", answer)
    assert stubbed.numa_node(0) == expected


def test_numa_node_other_errors_propagate(
    stubbed: PynvmlBackend, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(pynvml, "nvmlDeviceGetNumaNodeId", _raise(pynvml.NVML_ERROR_NO_PERMISSION))
    with pytest.raises(NvmlError) as err:
        stubbed.numa_node(0)
    assert err.value.reason == "no_permission"


@pytest.fixture
def events(stubbed: PynvmlBackend, monkeypatch: pytest.MonkeyPatch) -> list[tuple[object, int]]:
    """Event registration stubs: GPU 0 supports everything, GPU 1 no events at all."""
    registered: list[tuple[object, int]] = []
    monkeypatch.setattr(pynvml, "nvmlEventSetCreate", lambda: "event-set")
    monkeypatch.setattr(pynvml, "nvmlEventSetFree", lambda s: None)
    monkeypatch.setattr(
        pynvml, "nvmlDeviceGetSupportedEventTypes",
        lambda h: pynvml.nvmlEventTypeAll if h is HANDLE0 else _raise(
            pynvml.NVML_ERROR_NOT_SUPPORTED)(),
    )
    monkeypatch.setattr(
        pynvml, "nvmlDeviceRegisterEvents", lambda h, types, s: registered.append((h, types))
    )
    return registered


@pytest.mark.parametrize(
    ("event_type", "data", "kind", "xid"),
    [
        (pynvml.nvmlEventTypeXidCriticalError, 79, HealthEventKind.XID, 79),
        (pynvml.nvmlEventTypeDoubleBitEccError, 0, HealthEventKind.ECC_DOUBLE_BIT, None),
        (pynvml.nvmlEventTypePState, 0, HealthEventKind.OTHER, None),
    ],
)
def test_health_event_is_translated(
    stubbed: PynvmlBackend, events: list[tuple[object, int]], monkeypatch: pytest.MonkeyPatch,
    event_type: int, data: int, kind: HealthEventKind, xid: int | None,
) -> None:
    monkeypatch.setattr(
        pynvml, "nvmlEventSetWait",
        lambda s, t: SimpleNamespace(device=HANDLE0, eventType=event_type, eventData=data),
    )
    event = stubbed.wait_health_event(10)
    assert event is not None
    assert (event.gpu_uuid, event.kind, event.xid) == ("GPU-0", kind, xid)
    wanted = pynvml.nvmlEventTypeXidCriticalError | pynvml.nvmlEventTypeDoubleBitEccError
    assert events == [(HANDLE0, wanted)]  # GPU 1 skipped, registration done once
    stubbed.wait_health_event(10)
    assert len(events) == 1


def test_health_wait_timeout_is_none(
    stubbed: PynvmlBackend, events: list[tuple[object, int]], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(pynvml, "nvmlEventSetWait", _raise(pynvml.NVML_ERROR_TIMEOUT))
    assert stubbed.wait_health_event(10) is None
    monkeypatch.setattr(pynvml, "nvmlEventSetWait", _raise(pynvml.NVML_ERROR_GPU_IS_LOST))
    with pytest.raises(NvmlError) as err:
        stubbed.wait_health_event(10)
    assert err.value.reason == "gpu_is_lost"


def test_no_event_capable_gpu_just_times_out(
    stubbed: PynvmlBackend, events: list[tuple[object, int]], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(pynvml, "nvmlDeviceGetSupportedEventTypes", lambda h: 0)
    monkeypatch.setattr(pynvml, "nvmlEventSetWait", _raise(pynvml.NVML_ERROR_UNKNOWN))
    assert stubbed.wait_health_event(0) is None
    assert events == []
    stubbed.shutdown()


def _nvml_present() -> bool:
    try:
        pynvml.nvmlInit()
    except pynvml.NVMLError:
        return False
    pynvml.nvmlShutdown()
    return True


@pytest.mark.gpu
@pytest.mark.skipif(not _nvml_present(), reason="no NVIDIA driver (NVML) on this machine")
def test_real_gpu() -> None:
    backend = PynvmlBackend()
    backend.init()
    try:
        devices = discover(backend)
        assert devices, "NVML started but reports no usable GPU"
        for device in devices:
            assert device.uuid.startswith("GPU-")
            assert device.memory_bytes > 0
            assert device.pci_bus_id is not None
            assert device.driver_version is not None
            memory = backend.memory_info(device.index)
            assert memory.total == device.memory_bytes
            assert 0 <= memory.used <= memory.total
            assert all(p.pid > 0 for p in backend.compute_processes(device.index))
        event = backend.wait_health_event(10)
        assert event is None or event.gpu_uuid in {d.uuid for d in devices}
    finally:
        backend.shutdown()


def test_a_failed_registration_frees_its_event_set_and_counts_nothing(
    stubbed: PynvmlBackend, monkeypatch: pytest.MonkeyPatch
) -> None:
    """GPU 0 registers, GPU 1 fails (not "not supported"): the call raises, and the event set
    it created is freed, not left behind for the next attempt to replace. A retry on which
    no GPU registers must not count GPU 0 of the failed attempt: it just waits."""
    created: list[object] = []
    freed: list[object] = []

    def create() -> object:
        created.append(object())
        return created[-1]

    monkeypatch.setattr(pynvml, "nvmlEventSetCreate", create)
    monkeypatch.setattr(pynvml, "nvmlEventSetFree", freed.append)
    monkeypatch.setattr(pynvml, "nvmlDeviceGetSupportedEventTypes",
                        lambda h: pynvml.nvmlEventTypeAll)

    def register(handle: object, types: int, event_set: object) -> None:
        if handle is HANDLE1:
            raise pynvml.NVMLError(pynvml.NVML_ERROR_UNKNOWN)

    monkeypatch.setattr(pynvml, "nvmlDeviceRegisterEvents", register)
    for _ in range(3):
        with pytest.raises(NvmlError) as err:
            stubbed.wait_health_event(0)
        assert err.value.reason == "unknown"
    assert len(created) == 3
    assert freed == created
    # Now no GPU supports events: nothing is registered, so nothing is waited on.
    monkeypatch.setattr(pynvml, "nvmlDeviceGetSupportedEventTypes", lambda h: 0)
    monkeypatch.setattr(pynvml, "nvmlEventSetWait", _raise(pynvml.NVML_ERROR_UNKNOWN))
    assert stubbed.wait_health_event(0) is None
    stubbed.shutdown()
    assert freed == created
