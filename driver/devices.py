"""GPU discovery: what NVML says about each GPU, as frozen records ready to publish.

:func:`discover` asks an :class:`~driver.nvml.api.NvmlBackend` (already initialised) about
every GPU and normalises the answers into the forms a ResourceSlice needs: versions as
semantic versions, the PCI address as Kubernetes' ``resource.kubernetes.io/pciBusID``
expects it, NVML's enum numbers as names. It has no other effect than logging, so the
same fake backend always gives the same devices.

GPUs in MIG mode are left out (rota shares whole GPUs; a MIG GPU's memory belongs to its
instances), as are GPUs whose NVML queries fail; both are logged.
"""

from __future__ import annotations

import logging
import re
from dataclasses import dataclass

from driver.errors import NvmlError
from driver.nvml.api import GLOBAL_REASONS, MIG_ENABLED, NvmlBackend

log = logging.getLogger(__name__)

# nvmlDeviceArchitecture_t
ARCHITECTURES: dict[int, str] = {
    2: "Kepler",
    3: "Maxwell",
    4: "Pascal",
    5: "Volta",
    6: "Turing",
    7: "Ampere",
    8: "Ada Lovelace",
    9: "Hopper",
    10: "Blackwell",
    13: "Rubin",
}

# nvmlBrandType_t
BRANDS: dict[int, str] = {
    0: "Unknown",
    1: "Quadro",
    2: "Tesla",
    3: "NVS",
    4: "Grid",
    5: "GeForce",
    6: "Titan",
    7: "NvidiaVApps",
    8: "NvidiaVPC",
    9: "NvidiaVCS",
    10: "NvidiaVWS",
    11: "NvidiaCloudGaming",
    12: "QuadroRTX",
    13: "NvidiaRTX",
    14: "Nvidia",
    15: "GeForceRTX",
    16: "TitanRTX",
}

_PCI = re.compile(
    r"^(?:(?P<domain>[0-9a-fA-F]{1,8}):)?(?P<bus>[0-9a-fA-F]{2}):"
    r"(?P<device>[0-9a-fA-F]{2})\.(?P<function>[0-7])$"
)
_NUMERIC = re.compile(r"^[0-9]+$")


@dataclass(frozen=True)
class GpuDevice:
    """One whole GPU as rota publishes it. Versions are semver strings or None if unknown."""

    index: int
    name: str  # the DRA device name, gpu-<index>
    uuid: str
    product_name: str
    brand: str
    architecture: str
    cuda_compute_capability: str  # "9.0.0"
    driver_version: str | None  # "580.159.4"
    cuda_driver_version: str | None  # "13.0.0"
    pci_bus_id: str | None  # "0000:00:06.0"
    numa_node: int | None
    memory_bytes: int
    mig_enabled: bool
    minor: int


def device_name(index: int) -> str:
    """The DRA device name of the GPU with this NVML index."""
    return f"gpu-{index}"


def semver(version: str) -> str | None:
    """A dotted numeric version as semver 2.0: ``580.159.04`` -> ``580.159.4``.

    Leading zeros go (semver forbids them), missing components become 0, components past
    the third become build metadata (``1.2.3.4`` -> ``1.2.3+4``). None if not numeric.
    """
    parts = version.strip().split(".")
    if not parts or not all(_NUMERIC.match(p) for p in parts):
        return None
    numbers = [str(int(p)) for p in parts]
    core = [*numbers, "0", "0"][:3]
    extra = numbers[3:]
    return ".".join(core) + ("+" + ".".join(extra) if extra else "")


def cuda_version(encoded: int) -> str | None:
    """NVML's CUDA version number as semver: 13000 -> ``13.0.0``, 12040 -> ``12.4.0``."""
    if encoded <= 0:
        return None
    return f"{encoded // 1000}.{(encoded % 1000) // 10}.0"


def pci_bus_id(nvml_bus_id: str) -> str | None:
    """NVML's ``00000000:00:06.0`` as ``0000:00:06.0`` (lower case, 4-digit domain).

    A domain that needs more than four digits keeps them. None if it is not a PCI address.
    """
    match = _PCI.match(nvml_bus_id.strip())
    if match is None:
        return None
    domain = int(match["domain"] or "0", 16)
    return (
        f"{domain:04x}:{match['bus'].lower()}:{match['device'].lower()}.{match['function']}"
    )


def discover(backend: NvmlBackend) -> list[GpuDevice]:
    """Every usable GPU the backend reports, by index.

    Errors that concern NVML as a whole (not initialised, driver gone) propagate; an error
    about one GPU leaves that GPU out.
    """
    raw_driver = backend.driver_version()
    driver = semver(raw_driver)
    if driver is None:
        log.warning("driver version is not numeric; not published", extra={"version": raw_driver})
    cuda = cuda_version(backend.cuda_driver_version())
    devices: list[GpuDevice] = []
    for index in range(backend.device_count()):
        try:
            device = _describe(backend, index, driver, cuda)
        except NvmlError as err:
            if err.reason in GLOBAL_REASONS:
                raise
            log.warning(
                "GPU left out: NVML query failed",
                extra={"gpu_index": index, "reason": err.reason, "error": str(err)},
            )
            continue
        if device.mig_enabled:
            log.warning(
                "GPU left out: MIG mode is enabled; rota shares whole GPUs only",
                extra={"gpu_index": index, "gpu_uuid": device.uuid},
            )
            continue
        devices.append(device)
    return devices


def _describe(
    backend: NvmlBackend, index: int, driver: str | None, cuda: str | None
) -> GpuDevice:
    uuid = backend.uuid(index)
    raw_bus = backend.pci_bus_id(index)
    bus = pci_bus_id(raw_bus)
    if bus is None:
        log.warning(
            "PCI bus id not understood; not published",
            extra={"gpu_index": index, "pci_bus_id": raw_bus},
        )
    current, pending = backend.mig_mode(index)
    if pending != current:
        log.info(
            "MIG mode change pending until GPU reset",
            extra={"gpu_index": index, "current": current, "pending": pending},
        )
    major, minor = backend.cuda_compute_capability(index)
    arch = backend.architecture(index)
    brand = backend.brand(index)
    return GpuDevice(
        index=index,
        name=device_name(index),
        uuid=uuid,
        product_name=backend.name(index),
        brand=BRANDS.get(brand, f"Brand{brand}"),
        architecture=ARCHITECTURES.get(arch, "Unknown"),
        cuda_compute_capability=f"{major}.{minor}.0",
        driver_version=driver,
        cuda_driver_version=cuda,
        pci_bus_id=bus,
        numa_node=backend.numa_node(index),
        memory_bytes=backend.memory_info(index).total,
        mig_enabled=current == MIG_ENABLED,
        minor=backend.minor_number(index),
    )
