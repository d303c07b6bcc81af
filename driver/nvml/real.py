"""The :class:`~driver.nvml.api.NvmlBackend` of a real GPU node, through pynvml.

This is the only module that imports ``pynvml``. Every ``pynvml.NVMLError`` leaves it as
:class:`driver.errors.NvmlError` with a stable ``reason`` label, and byte strings that
older pynvml releases return are decoded here, so nothing above depends on the binding's
version.

Health events: on the first :meth:`PynvmlBackend.wait_health_event` call the backend
creates one NVML event set and registers every device for critical XID and double-bit
ECC events, as far as the device supports them. A device that supports neither is
logged once and skipped; with no device registered the call just waits out its timeout.
A registration that fails frees its event set and counts nothing; the next call tries
again from scratch.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable
from typing import Any, TypeVar

import pynvml

from driver.errors import NvmlError
from driver.nvml.api import (
    HealthEvent,
    HealthEventKind,
    MemoryInfo,
    ProcessInfo,
    reason_for,
)

log = logging.getLogger(__name__)

T = TypeVar("T")

_XID = int(pynvml.nvmlEventTypeXidCriticalError)
_ECC_DBE = int(pynvml.nvmlEventTypeDoubleBitEccError)
_HEALTH_EVENTS = _XID | _ECC_DBE
_NOT_SUPPORTED = int(pynvml.NVML_ERROR_NOT_SUPPORTED)
_TIMEOUT = int(pynvml.NVML_ERROR_TIMEOUT)
_PROCESS_LISTS = (
    ("nvmlDeviceGetComputeRunningProcesses", False),
    ("nvmlDeviceGetGraphicsRunningProcesses", True),
    ("nvmlDeviceGetMPSComputeRunningProcesses", True),
)
"""The NVML process lists of a device, and whether the device may have none."""
_NO_SUCH_LIST = frozenset({reason_for(_NOT_SUPPORTED),
                           reason_for(int(pynvml.NVML_ERROR_FUNCTION_NOT_FOUND))})


def _text(value: object) -> str:
    """pynvml returns ``bytes`` for strings in older releases and ``str`` in newer ones."""
    if isinstance(value, bytes):
        return value.decode("utf-8", errors="replace")
    return str(value)


def _code(err: BaseException) -> int:
    return int(getattr(err, "value", 999))


def _call(what: str, fn: Callable[..., T], *args: Any) -> T:
    """Run one pynvml function, translating its error into :class:`NvmlError`."""
    try:
        return fn(*args)
    except pynvml.NVMLError as err:
        code = _code(err)
        raise NvmlError(f"{what}: {err} (NVML error {code})", reason=reason_for(code)) from err


class PynvmlBackend:
    """NVML through pynvml. Thread-safe as NVML is; one event waiter at a time."""

    def __init__(self) -> None:
        self._handles: dict[int, Any] = {}
        self._event_lock = threading.Lock()
        self._event_set: Any = None
        self._events_registered = 0
        self._events_ready = False
        self._stopped = threading.Event()

    # lifecycle

    def init(self) -> None:
        _call("nvmlInit", pynvml.nvmlInit)
        self._stopped.clear()

    def shutdown(self) -> None:
        self._stopped.set()
        # Waits for a pending wait_health_event (at most its timeout) before freeing the set.
        with self._event_lock:
            if self._event_set is not None:
                try:
                    _call("nvmlEventSetFree", pynvml.nvmlEventSetFree, self._event_set)
                except NvmlError as err:
                    log.warning("could not free the NVML event set", extra={"error": str(err)})
            self._event_set = None
            self._events_ready = False
            self._events_registered = 0
        self._handles.clear()
        _call("nvmlShutdown", pynvml.nvmlShutdown)

    # system

    def device_count(self) -> int:
        return int(_call("nvmlDeviceGetCount", pynvml.nvmlDeviceGetCount))

    def driver_version(self) -> str:
        return _text(_call("nvmlSystemGetDriverVersion", pynvml.nvmlSystemGetDriverVersion))

    def cuda_driver_version(self) -> int:
        return int(
            _call("nvmlSystemGetCudaDriverVersion", pynvml.nvmlSystemGetCudaDriverVersion)
        )

    # per device

    def _handle(self, index: int) -> Any:
        handle = self._handles.get(index)
        if handle is None:
            handle = _call(
                f"nvmlDeviceGetHandleByIndex({index})", pynvml.nvmlDeviceGetHandleByIndex, index
            )
            self._handles[index] = handle
        return handle

    def _device(self, what: str, fn: Callable[..., T], index: int) -> T:
        return _call(f"{what}(gpu {index})", fn, self._handle(index))

    def uuid(self, index: int) -> str:
        return _text(self._device("nvmlDeviceGetUUID", pynvml.nvmlDeviceGetUUID, index))

    def name(self, index: int) -> str:
        return _text(self._device("nvmlDeviceGetName", pynvml.nvmlDeviceGetName, index))

    def brand(self, index: int) -> int:
        return int(self._device("nvmlDeviceGetBrand", pynvml.nvmlDeviceGetBrand, index))

    def architecture(self, index: int) -> int:
        return int(
            self._device("nvmlDeviceGetArchitecture", pynvml.nvmlDeviceGetArchitecture, index)
        )

    def cuda_compute_capability(self, index: int) -> tuple[int, int]:
        major, minor = self._device(
            "nvmlDeviceGetCudaComputeCapability", pynvml.nvmlDeviceGetCudaComputeCapability, index
        )
        return int(major), int(minor)

    def pci_bus_id(self, index: int) -> str:
        info = self._device("nvmlDeviceGetPciInfo", pynvml.nvmlDeviceGetPciInfo, index)
        return _text(info.busId)

    def numa_node(self, index: int) -> int | None:
        try:
            node = self._device("nvmlDeviceGetNumaNodeId", pynvml.nvmlDeviceGetNumaNodeId, index)
        except NvmlError as err:
            if err.reason == reason_for(_NOT_SUPPORTED):
                return None
            raise
        return int(node) if int(node) >= 0 else None

    def minor_number(self, index: int) -> int:
        return int(
            self._device("nvmlDeviceGetMinorNumber", pynvml.nvmlDeviceGetMinorNumber, index)
        )

    def memory_info(self, index: int) -> MemoryInfo:
        mem = self._device("nvmlDeviceGetMemoryInfo", pynvml.nvmlDeviceGetMemoryInfo, index)
        return MemoryInfo(total=int(mem.total), used=int(mem.used), free=int(mem.free))

    def mig_mode(self, index: int) -> tuple[int, int]:
        try:
            current, pending = self._device(
                "nvmlDeviceGetMigMode", pynvml.nvmlDeviceGetMigMode, index
            )
        except NvmlError as err:
            if err.reason == reason_for(_NOT_SUPPORTED):
                return 0, 0
            raise
        return int(current), int(pending)

    def memory_and_processes(self, index: int) -> tuple[MemoryInfo, list[ProcessInfo]]:
        return self.memory_info(index), self.compute_processes(index)

    def compute_processes(self, index: int) -> list[ProcessInfo]:
        """Compute, graphics and MPS client processes, merged by pid (a process may have
        contexts of several kinds). The compute list must answer; the others are skipped
        where NVML or the binding has none. ``usedGpuMemory`` is None where NVML cannot
        tell: that stays None (an unknown amount, not 0 bytes); where the lists disagree
        on a process, unknown wins, then the larger size."""
        found: dict[int, int | None] = {}
        for what, optional in _PROCESS_LISTS:
            fn = getattr(pynvml, what, None)
            if fn is None:  # an older binding
                if optional:
                    continue
                raise NvmlError(f"pynvml has no {what}", reason="function_not_found")
            try:
                procs = self._device(what, fn, index)
            except NvmlError as err:
                if optional and err.reason in _NO_SUCH_LIST:
                    continue
                raise
            for proc in procs:
                pid = int(proc.pid)
                used = None if proc.usedGpuMemory is None else int(proc.usedGpuMemory)
                if pid not in found:
                    found[pid] = used
                elif found[pid] is not None:
                    found[pid] = None if used is None else max(used, found[pid] or 0)
        return [ProcessInfo(pid=pid, used_bytes=used) for pid, used in found.items()]

    # health events

    def _register_events(self) -> None:
        """Create the event set and register each device for the events it supports.

        All or nothing: when a registration fails, the set is freed and nothing counted, so
        the next call starts again from scratch (no set leaked per failed attempt, no GPU
        counted twice)."""
        event_set = _call("nvmlEventSetCreate", pynvml.nvmlEventSetCreate)
        try:
            registered = self._register_devices(event_set)
        except BaseException:
            try:
                _call("nvmlEventSetFree", pynvml.nvmlEventSetFree, event_set)
            except NvmlError as err:
                log.warning("could not free the NVML event set", extra={"error": str(err)})
            raise
        self._event_set = event_set
        self._events_registered = registered
        self._events_ready = True

    def _register_devices(self, event_set: Any) -> int:
        """Register every device that supports health events in ``event_set``; how many."""
        registered = 0
        for index in range(self.device_count()):
            handle = self._handle(index)
            try:
                supported = int(
                    _call(
                        f"nvmlDeviceGetSupportedEventTypes(gpu {index})",
                        pynvml.nvmlDeviceGetSupportedEventTypes,
                        handle,
                    )
                )
                wanted = supported & _HEALTH_EVENTS
                if wanted:
                    _call(
                        f"nvmlDeviceRegisterEvents(gpu {index})",
                        pynvml.nvmlDeviceRegisterEvents,
                        handle,
                        wanted,
                        event_set,
                    )
            except NvmlError as err:
                if err.reason != reason_for(_NOT_SUPPORTED):
                    raise
                wanted = 0
            if wanted:
                registered += 1
                log.info(
                    "registered for NVML health events",
                    extra={"gpu_index": index, "xid": bool(wanted & _XID),
                           "ecc_double_bit": bool(wanted & _ECC_DBE)},
                )
            else:
                log.warning(
                    "GPU supports no XID or ECC events; its health is not watched",
                    extra={"gpu_index": index},
                )
        return registered

    def wait_health_event(self, timeout_ms: int) -> HealthEvent | None:
        with self._event_lock:
            if not self._events_ready:
                self._register_events()
            if self._events_registered == 0:
                self._stopped.wait(timeout_ms / 1000)
                return None
            try:
                data = pynvml.nvmlEventSetWait(self._event_set, timeout_ms)
            except pynvml.NVMLError as err:
                if _code(err) == _TIMEOUT:
                    return None
                raise NvmlError(
                    f"nvmlEventSetWait: {err}", reason=reason_for(_code(err))
                ) from err
            uuid = _text(_call("nvmlDeviceGetUUID", pynvml.nvmlDeviceGetUUID, data.device))
        return _event_from(uuid, int(data.eventType), int(data.eventData))


def _event_from(uuid: str, event_type: int, event_data: int) -> HealthEvent:
    if event_type & _XID:
        return HealthEvent(uuid, HealthEventKind.XID, event_data, f"XID {event_data} on {uuid}")
    if event_type & _ECC_DBE:
        return HealthEvent(
            uuid, HealthEventKind.ECC_DOUBLE_BIT, None, f"double-bit ECC error on {uuid}"
        )
    return HealthEvent(
        uuid, HealthEventKind.OTHER, None, f"NVML event 0x{event_type:x} on {uuid}"
    )
