"""The NVML calls rota needs, as one narrow Protocol, and the records they return.

Everything that touches a GPU goes through :class:`NvmlBackend`. Two implementations
exist: :mod:`driver.nvml.real` (pynvml, on a GPU node) and :mod:`driver.nvml.fake` (a JSON
description of GPUs, on machines without one). Nothing above this layer knows which one it
talks to, so discovery, slices, the inspection API and the lease controller's memory
check run unchanged in tests.

The Protocol mirrors NVML: devices are addressed by index, calls may raise
:class:`driver.errors.NvmlError` whose ``reason`` is one of the labels in
:data:`REASONS` (stable across pynvml versions, used as a metric label).
"""

from __future__ import annotations

import enum
from dataclasses import dataclass
from typing import Protocol, runtime_checkable

# NVML return codes (nvmlReturn_t, part of NVML's C ABI) and the label rota reports: the
# constant's name without NVML_ERROR_, in lower case.
REASONS: dict[int, str] = {
    1: "uninitialized",
    2: "invalid_argument",
    3: "not_supported",
    4: "no_permission",
    5: "already_initialized",
    6: "not_found",
    7: "insufficient_size",
    8: "insufficient_power",
    9: "driver_not_loaded",
    10: "timeout",
    11: "irq_issue",
    12: "library_not_found",
    13: "function_not_found",
    14: "corrupted_inforom",
    15: "gpu_is_lost",
    16: "reset_required",
    17: "operating_system",
    18: "lib_rm_version_mismatch",
    19: "in_use",
    20: "memory",
    21: "no_data",
    22: "vgpu_ecc_not_supported",
    23: "insufficient_resources",
    24: "freq_not_supported",
    25: "argument_version_mismatch",
    26: "deprecated",
    27: "not_ready",
    28: "gpu_not_found",
    29: "invalid_state",
    30: "reset_type_not_supported",
    999: "unknown",
}

# Reasons that concern the whole NVML library rather than one device: when one of these
# comes back, asking the next device will not help.
GLOBAL_REASONS = frozenset(
    {
        "uninitialized",
        "driver_not_loaded",
        "library_not_found",
        "function_not_found",
        "lib_rm_version_mismatch",
    }
)

# XIDs caused by an application (illegal address, page fault in user code, context reset
# requested by the program, ...). They arrive as critical XID events but say nothing about
# the device's health; NVIDIA's own device plugin skips the same set.
APPLICATION_XIDS = frozenset({13, 31, 43, 45, 68, 109})

MIG_ENABLED = 1
"""``nvmlDeviceGetMigMode`` answers 1 (NVML_DEVICE_MIG_ENABLE) for an enabled mode."""


def reason_for(code: int) -> str:
    """The stable label for an NVML return code (``nvml_<code>`` for codes rota does not know)."""
    return REASONS.get(code, f"nvml_{code}")


@dataclass(frozen=True)
class MemoryInfo:
    """Device memory in bytes, as ``nvmlDeviceGetMemoryInfo`` reports it."""

    total: int
    used: int
    free: int


@dataclass(frozen=True)
class ProcessInfo:
    """A process on a device: its pid (host namespace) and the bytes it holds.

    ``used_bytes`` is None where NVML cannot tell (``usedGpuMemory`` not available): the
    process holds an unknown amount, which is not the same as none.
    """

    pid: int
    used_bytes: int | None


class HealthEventKind(enum.StrEnum):
    """What an NVML event says about a device."""

    XID = "xid"
    ECC_DOUBLE_BIT = "ecc_double_bit"
    OTHER = "other"


@dataclass(frozen=True)
class HealthEvent:
    """One NVML event about a device's health.

    ``xid`` is the XID code for :attr:`HealthEventKind.XID` events, else None.
    """

    gpu_uuid: str
    kind: HealthEventKind
    xid: int | None
    message: str

    @property
    def is_application_error(self) -> bool:
        """True for XIDs that a program caused; the device itself is fine."""
        return self.kind is HealthEventKind.XID and self.xid in APPLICATION_XIDS


@runtime_checkable
class NvmlBackend(Protocol):
    """The NVML calls rota makes. Every method may raise :class:`driver.errors.NvmlError`.

    Call :meth:`init` before anything else and :meth:`shutdown` at the end. Per-device
    calls take NVML's device index (0 .. ``device_count() - 1``).
    """

    def init(self) -> None:
        """Load and initialise NVML (``nvmlInit``)."""
        ...

    def shutdown(self) -> None:
        """Release NVML and any event registration (``nvmlShutdown``)."""
        ...

    def device_count(self) -> int:
        """Number of GPUs NVML sees."""
        ...

    def driver_version(self) -> str:
        """The kernel driver's version string, e.g. ``580.159.04``."""
        ...

    def cuda_driver_version(self) -> int:
        """The CUDA version the driver supports as NVML encodes it: 13000 for 13.0."""
        ...

    def uuid(self, index: int) -> str:
        """The device's uuid, ``GPU-xxxxxxxx-...``."""
        ...

    def name(self, index: int) -> str:
        """The product name, e.g. ``NVIDIA H200``."""
        ...

    def brand(self, index: int) -> int:
        """NVML's ``nvmlBrandType_t`` (14 = NVIDIA)."""
        ...

    def architecture(self, index: int) -> int:
        """NVML's ``nvmlDeviceArchitecture_t`` (9 = Hopper)."""
        ...

    def cuda_compute_capability(self, index: int) -> tuple[int, int]:
        """(major, minor), e.g. (9, 0)."""
        ...

    def pci_bus_id(self, index: int) -> str:
        """The PCI address as NVML writes it: ``00000000:00:06.0`` (8-digit domain)."""
        ...

    def numa_node(self, index: int) -> int | None:
        """The device's NUMA node, or None where NVML says it is not supported."""
        ...

    def minor_number(self, index: int) -> int:
        """The minor number of ``/dev/nvidia<minor>``."""
        ...

    def memory_info(self, index: int) -> MemoryInfo:
        """Total, used and free device memory in bytes, read now."""
        ...

    def mig_mode(self, index: int) -> tuple[int, int]:
        """(current, pending) MIG mode; (0, 0) on GPUs without MIG support."""
        ...

    def compute_processes(self, index: int) -> list[ProcessInfo]:
        """Every process holding memory on the device now, once each, with the bytes it
        holds: compute processes, and (where NVML lists them) graphics and MPS clients."""
        ...

    def memory_and_processes(self, index: int) -> tuple[MemoryInfo, list[ProcessInfo]]:
        """:meth:`memory_info` and :meth:`compute_processes` together, read as close to
        one moment as the backend can (NVML: one call after the other)."""
        ...

    def wait_health_event(self, timeout_ms: int) -> HealthEvent | None:
        """Block up to ``timeout_ms`` for the next health event of any device.

        Returns None when the time passed without an event. Run it in a worker thread.
        """
        ...
