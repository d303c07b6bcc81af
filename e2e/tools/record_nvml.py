"""Record what NVML says about every GPU of this machine, as a fixture for the fake backend.

Run it on a GPU machine; the output is the format ``driver/nvml/fake.py`` reads
(``NvmlFixture``), so the fake answers like the recorded hardware::

    python e2e/tools/record_nvml.py                     # JSON on stdout
    python e2e/tools/record_nvml.py h200.json           # or into a file
    python e2e/tools/record_nvml.py --description "..." h200.json

It needs only ``pynvml`` (package nvidia-ml-py) and the standard library. When rota's
package and pydantic are importable too, the result is validated against the fixture
model before it is written.

``memory_used`` is the baseline a GPU shows with no compute process: processes running
while recording are subtracted (and named on stderr), since the fake adds the processes
registered with it on top of the baseline.
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any, TypeVar

T = TypeVar("T")


def _text(value: object) -> str:
    return value.decode("utf-8", errors="replace") if isinstance(value, bytes) else str(value)


def _or_default(nvml: Any, fn: Callable[[], T], default: T) -> T:
    """``fn()``, or ``default`` where NVML says the query is not supported."""
    try:
        return fn()
    except nvml.NVMLError_NotSupported:
        return default


def _record_device(nvml: Any, index: int) -> dict[str, Any]:
    handle = nvml.nvmlDeviceGetHandleByIndex(index)
    memory = nvml.nvmlDeviceGetMemoryInfo(handle)
    procs: list[Any] = _or_default(
        nvml, lambda: list(nvml.nvmlDeviceGetComputeRunningProcesses(handle)), []
    )
    held = sum(int(p.usedGpuMemory or 0) for p in procs)
    if procs:
        pids = ", ".join(str(p.pid) for p in procs)
        sys.stderr.write(
            f"gpu {index}: {len(procs)} compute process(es) running ({pids}), "
            f"{held} bytes subtracted from memory_used\n"
        )
    numa = _or_default(nvml, lambda: int(nvml.nvmlDeviceGetNumaNodeId(handle)), None)
    major, minor = nvml.nvmlDeviceGetCudaComputeCapability(handle)
    current, pending = _or_default(nvml, lambda: nvml.nvmlDeviceGetMigMode(handle), [0, 0])
    return {
        "index": index,
        "uuid": _text(nvml.nvmlDeviceGetUUID(handle)),
        "name": _text(nvml.nvmlDeviceGetName(handle)),
        "brand": int(nvml.nvmlDeviceGetBrand(handle)),
        "architecture": int(nvml.nvmlDeviceGetArchitecture(handle)),
        "cuda_compute_capability": [int(major), int(minor)],
        "pci_bus_id": _text(nvml.nvmlDeviceGetPciInfo(handle).busId),
        "numa_node": numa if numa is not None and numa >= 0 else None,
        "minor_number": int(nvml.nvmlDeviceGetMinorNumber(handle)),
        "memory_total": int(memory.total),
        "memory_used": max(0, int(memory.used) - held),
        "mig_mode": [int(current), int(pending)],
    }


def record(nvml: Any, description: str) -> dict[str, Any]:
    """The fixture for every GPU NVML sees; ``nvml`` is the pynvml module."""
    nvml.nvmlInit()
    try:
        return {
            "description": description,
            "driver_version": _text(nvml.nvmlSystemGetDriverVersion()),
            "cuda_driver_version": int(nvml.nvmlSystemGetCudaDriverVersion()),
            "devices": [_record_device(nvml, i) for i in range(nvml.nvmlDeviceGetCount())],
        }
    finally:
        nvml.nvmlShutdown()


def _validate(fixture: dict[str, Any]) -> None:
    try:
        from driver.nvml.fake import NvmlFixture
    except ImportError as err:
        sys.stderr.write(f"fixture not validated: rota's fixture model is not importable ({err})\n")
        return
    NvmlFixture.model_validate(fixture)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    parser.add_argument("output", nargs="?", help="file to write (default: stdout)")
    parser.add_argument("--description", default="", help="free text stored in the fixture")
    args = parser.parse_args(argv)
    try:
        import pynvml
    except ImportError:
        sys.stderr.write("pynvml is missing: pip install nvidia-ml-py\n")
        return 2
    try:
        fixture = record(pynvml, args.description)
    except pynvml.NVMLError as err:
        sys.stderr.write(f"NVML failed: {err}\n")
        return 1
    _validate(fixture)
    text = json.dumps(fixture, indent=2) + "\n"
    if args.output:
        Path(args.output).write_text(text, encoding="utf-8")
    else:
        sys.stdout.write(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
