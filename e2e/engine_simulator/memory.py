"""GPU memory the simulated engine holds: counted (fake) or real (cuda).

The engine's memory is a resident part (what a sleeping vLLM keeps: CUDA context, graphs,
allocator reservations) plus one *portion* per tag and stage (``stage0/weights``,
``stage0/kv_cache``, ...). Sleep and wake turn into :class:`~.state.MemoryOp` s that a
:class:`MemoryHolder` carries out:

- :class:`FakeMemory` only counts bytes. When a fake NVML process directory is
  configured it registers the count there (``<dir>/<pid>.json``, written atomically by
  :func:`driver.nvml.fake.register_process`) after every change and removes the entry on a
  clean close, so rota's fake NVML sees this process use exactly what it would on a GPU.
  Like a real GPU, the fake one runs out: every allocation is checked, under the
  registry's lock, against what the fake NVML shows free on that GPU (every live process
  of every simulator on it, plus the driver's baseline), and one that does not fit fails
  with :class:`DeviceOutOfMemory`, leaving what was allocated before it in place.
- :class:`CudaMemory` holds real device memory through PyTorch (imported only here, only
  when chosen; torch is not a dependency of rota). Level 1 copies the weights to pinned
  host memory and frees the device tensor; wake copies them back. Every device call runs
  in a worker thread, and the measured copy times are reported. A real CUDA
  out-of-memory error becomes :class:`DeviceOutOfMemory` as well.

A holder carries out the operations of one call in order and stops at the first that
does not fit: operations are applied one at a time by the engine, so a wake that runs out
halfway keeps its partial mappings, as vLLM's CuMem allocator does.
"""

from __future__ import annotations

import asyncio
import importlib
import logging
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

from driver.nvml.fake import GpuMemoryExhausted, register_process, unregister_process
from e2e.engine_simulator.settings import Settings
from e2e.engine_simulator.state import ALL_TAGS, MemoryAction, MemoryOp, portion_name

__all__ = [
    "CudaMemory",
    "DeviceOutOfMemory",
    "FakeMemory",
    "MemoryHolder",
    "NvmlRegistration",
    "Transfer",
    "make_memory",
    "plan_portions",
]

log = logging.getLogger(__name__)


_MIB = 2**20
_GIB = 2**30


class DeviceOutOfMemory(Exception):
    """An allocation found no room on the GPU (CUDA's out-of-memory error).

    Attributes:
        requested_bytes: what the failed allocation asked for.
        free_bytes: what the GPU had free; None when not known (a real CUDA error).
        total_bytes: the GPU's total memory; None when not known.
    """

    def __init__(self, message: str, *, requested_bytes: int, free_bytes: int | None = None,
                 total_bytes: int | None = None) -> None:
        super().__init__(message)
        self.requested_bytes = requested_bytes
        self.free_bytes = free_bytes
        self.total_bytes = total_bytes

    @classmethod
    def from_exhausted(cls, exc: GpuMemoryExhausted) -> DeviceOutOfMemory:
        return cls(str(exc), requested_bytes=exc.requested_bytes, free_bytes=exc.free_bytes,
                   total_bytes=exc.total_bytes)

    def torch_message(self) -> str:
        """The line PyTorch's caching allocator prints for this failure."""
        text = (f"torch.OutOfMemoryError: CUDA out of memory. Tried to allocate "
                f"{self.requested_bytes / _MIB:.2f} MiB.")
        if self.total_bytes is not None and self.free_bytes is not None:
            text += (f" GPU 0 has a total capacity of {self.total_bytes / _GIB:.2f} GiB of "
                     f"which {self.free_bytes / _MIB:.2f} MiB is free.")
        return text


@dataclass(frozen=True)
class Transfer:
    """What one memory operation did, and how long it took."""

    portion: str
    action: MemoryAction
    nbytes: int
    seconds: float
    """Wall time of the whole operation (allocation, copy, free)."""
    copy_seconds: float
    """Time of the device/host copy alone; 0 when nothing was copied."""

    def as_dict(self) -> dict[str, Any]:
        return {
            "portion": self.portion,
            "action": self.action.value,
            "bytes": self.nbytes,
            "seconds": self.seconds,
            "copy_seconds": self.copy_seconds,
        }


class MemoryHolder(Protocol):
    """Holds the engine's GPU memory and moves it on sleep and wake."""

    @property
    def used_bytes(self) -> int:
        """Device memory held now (resident part plus portions on the device)."""
        ...

    def holds(self, portion: str) -> bool:
        """True while ``portion`` is on the device."""
        ...

    async def start(self) -> None:
        """Allocate the awake footprint; :class:`DeviceOutOfMemory` when it does not fit."""
        ...

    async def apply(self, ops: Sequence[MemoryOp]) -> list[Transfer]:
        """Carry out ``ops`` in order. Operations on a portion already there are no-ops.
        :class:`DeviceOutOfMemory` at the first allocation that does not fit; the
        operations before it stay done."""
        ...

    async def close(self) -> None:
        """Free everything and unregister."""
        ...

    def describe(self) -> dict[str, Any]:
        """Backend details for ``/sim/state``."""
        ...


def plan_portions(settings: Settings) -> dict[str, int]:
    """Split weights and KV cache bytes evenly across the stages (the last takes the rest)."""
    stages = settings.omni_stages if settings.omni else 1
    sizes: dict[str, int] = {}
    for tag, total in zip(
        ALL_TAGS, (settings.effective_weights_bytes, settings.kv_cache_bytes), strict=True
    ):
        share = total // stages
        for stage in range(stages):
            last = stage == stages - 1
            sizes[portion_name(stage, tag)] = total - share * (stages - 1) if last else share
    return sizes


class NvmlRegistration:
    """This process's entry in rota's fake NVML process directory (none when no directory),
    and the capacity check every growth of it passes."""

    def __init__(self, directory: Path | None, *, pid: int, gpu_uuid: str,
                 total_bytes: int | None = None, enforce: bool = True) -> None:
        self.directory = directory
        self.pid = pid
        self.gpu_uuid = gpu_uuid
        self.total_bytes = total_bytes
        """The GPU's total memory, overriding what the registry publishes; None: use that."""
        self.enforce = enforce
        """Check capacity (the fake GPU); False where a real GPU does it (cuda backend)."""
        self._used = 0

    async def publish(self, used_bytes: int) -> None:
        """Register ``used_bytes``; :class:`DeviceOutOfMemory` (and nothing registered)
        when the growth does not fit on the GPU."""
        if self.directory is None:
            total = self.total_bytes if self.enforce else None
            if total is not None and used_bytes > max(self._used, total):
                raise DeviceOutOfMemory(
                    f"GPU {self.gpu_uuid}: tried to allocate {used_bytes - self._used} bytes "
                    f"with {total - self._used} bytes free of {total}",
                    requested_bytes=used_bytes - self._used,
                    free_bytes=max(0, total - self._used), total_bytes=total)
            self._used = used_bytes
            return
        try:
            await asyncio.to_thread(
                register_process, self.directory, self.pid, self.gpu_uuid, used_bytes,
                enforce_capacity=self.enforce, total_bytes=self.total_bytes,
            )
        except GpuMemoryExhausted as exc:
            raise DeviceOutOfMemory.from_exhausted(exc) from exc
        self._used = used_bytes
        log.debug("registered gpu memory", extra={"pid": self.pid, "used_bytes": used_bytes,
                                                  "gpu_uuid": self.gpu_uuid})

    async def remove(self) -> None:
        if self.directory is None:
            return
        await asyncio.to_thread(unregister_process, self.directory, self.pid)
        log.info("unregistered gpu memory", extra={"pid": self.pid})


class FakeMemory:
    """Counts bytes; no device is touched."""

    def __init__(
        self, *, resident_bytes: int, portions: Mapping[str, int], registration: NvmlRegistration
    ) -> None:
        self._resident = resident_bytes
        self._sizes = dict(portions)
        self._on_device = set(self._sizes)
        self._on_host: set[str] = set()
        self._registration = registration

    @property
    def used_bytes(self) -> int:
        return self._resident + sum(self._sizes[name] for name in self._on_device)

    def holds(self, portion: str) -> bool:
        return portion in self._on_device

    async def start(self) -> None:
        """Allocate as an engine loads: the resident part, then each portion in turn."""
        wanted = list(self._on_device)
        self._on_device.clear()
        await self._registration.publish(self.used_bytes)
        for name in wanted:
            self._on_device.add(name)
            try:
                await self._registration.publish(self.used_bytes)
            except DeviceOutOfMemory:
                self._on_device.discard(name)
                raise

    async def apply(self, ops: Sequence[MemoryOp]) -> list[Transfer]:
        transfers = []
        released = False
        for op in ops:
            name = op.portion
            moved = 0
            if op.action in (MemoryAction.OFFLOAD, MemoryAction.DISCARD):
                if name in self._on_device:
                    self._on_device.discard(name)
                    moved = self._sizes[name]
                    released = True
                    if op.action is MemoryAction.OFFLOAD:
                        self._on_host.add(name)
                    else:
                        self._on_host.discard(name)
            elif name not in self._on_device:
                self._on_device.add(name)
                try:
                    await self._registration.publish(self.used_bytes)
                except DeviceOutOfMemory:
                    self._on_device.discard(name)
                    if released:
                        await self._registration.publish(self.used_bytes)
                    raise
                released = False
                moved = self._sizes[name]
                self._on_host.discard(name)
            transfers.append(Transfer(name, op.action, moved, 0.0, 0.0))
        if released:
            await self._registration.publish(self.used_bytes)
        return transfers

    async def close(self) -> None:
        self._on_device.clear()
        self._resident = 0
        await self._registration.remove()

    def describe(self) -> dict[str, Any]:
        return {
            "backend": "fake",
            "host_bytes": sum(self._sizes[name] for name in self._on_host),
            "portions": {name: name in self._on_device for name in sorted(self._sizes)},
        }


class CudaMemory:
    """Holds real GPU memory with PyTorch on the current CUDA device.

    ``resident_bytes`` is allocated on top of the CUDA context PyTorch creates (about
    0.5 GiB on an H200), so NVML shows a little more than the knob asks for.
    """

    def __init__(
        self, *, resident_bytes: int, portions: Mapping[str, int], registration: NvmlRegistration
    ) -> None:
        self._resident_bytes = resident_bytes
        self._sizes = dict(portions)
        self._registration = registration
        self._torch: Any = None
        self._resident: Any = None
        self._device: dict[str, Any] = {}
        self._host: dict[str, Any] = {}
        """Pinned host buffers, kept once allocated (so only the first level-1 sleep pays)."""
        self._host_valid: set[str] = set()

    @property
    def used_bytes(self) -> int:
        return self._resident_bytes + sum(self._sizes[name] for name in self._device)

    def holds(self, portion: str) -> bool:
        return portion in self._device

    def _empty(self, nbytes: int) -> Any:
        try:
            return self._torch.empty(nbytes, dtype=self._torch.uint8, device="cuda")
        except self._torch.OutOfMemoryError as exc:
            raise DeviceOutOfMemory(str(exc), requested_bytes=nbytes) from exc

    def _start_sync(self) -> None:
        try:
            torch = importlib.import_module("torch")
        except ModuleNotFoundError as exc:
            raise RuntimeError("--memory-backend cuda needs PyTorch (pip install torch)") from exc
        if not torch.cuda.is_available():
            raise RuntimeError("--memory-backend cuda needs a CUDA device and PyTorch with CUDA")
        self._torch = torch
        self._resident = self._empty(self._resident_bytes)
        for name, size in self._sizes.items():
            self._device[name] = self._empty(size)
        torch.cuda.synchronize()

    async def start(self) -> None:
        await asyncio.to_thread(self._start_sync)
        log.info("cuda memory allocated", extra={"used_bytes": self.used_bytes})
        await self._registration.publish(self.used_bytes)

    def _apply_one(self, op: MemoryOp) -> Transfer:
        torch = self._torch
        name = op.portion
        size = self._sizes[name]
        began = time.perf_counter()
        copy_seconds = 0.0
        if op.action in (MemoryAction.OFFLOAD, MemoryAction.DISCARD):
            tensor = self._device.pop(name, None)
            if tensor is None:
                return Transfer(name, op.action, 0, 0.0, 0.0)
            if op.action is MemoryAction.OFFLOAD:
                host = self._host.get(name)
                if host is None:
                    host = torch.empty(size, dtype=torch.uint8, pin_memory=True)
                    self._host[name] = host
                copy_began = time.perf_counter()
                host.copy_(tensor)
                torch.cuda.synchronize()
                copy_seconds = time.perf_counter() - copy_began
                self._host_valid.add(name)
            else:
                self._host_valid.discard(name)
            del tensor
            torch.cuda.empty_cache()
        else:
            if name in self._device:
                return Transfer(name, op.action, 0, 0.0, 0.0)
            tensor = self._empty(size)
            if op.action is MemoryAction.RESTORE and name in self._host_valid:
                copy_began = time.perf_counter()
                tensor.copy_(self._host[name], non_blocking=True)
                torch.cuda.synchronize()
                copy_seconds = time.perf_counter() - copy_began
            self._host_valid.discard(name)
            self._device[name] = tensor
        return Transfer(name, op.action, size, time.perf_counter() - began, copy_seconds)

    def _apply_sync(self, ops: Sequence[MemoryOp]) -> list[Transfer]:
        return [self._apply_one(op) for op in ops]

    async def apply(self, ops: Sequence[MemoryOp]) -> list[Transfer]:
        try:
            return await asyncio.to_thread(self._apply_sync, list(ops))
        finally:
            if ops:
                await self._registration.publish(self.used_bytes)

    def _free_sync(self) -> None:
        self._device.clear()
        self._host.clear()
        self._host_valid.clear()
        self._resident = None
        if self._torch is not None:
            self._torch.cuda.empty_cache()

    async def close(self) -> None:
        await asyncio.to_thread(self._free_sync)
        await self._registration.remove()

    def describe(self) -> dict[str, Any]:
        reserved = None
        if self._torch is not None:
            reserved = int(self._torch.cuda.memory_reserved())
        return {
            "backend": "cuda",
            "torch_reserved_bytes": reserved,
            "host_pinned_bytes": sum(self._sizes[name] for name in self._host),
            "portions": {name: name in self._device for name in sorted(self._sizes)},
        }


def make_memory(settings: Settings, *, pid: int) -> MemoryHolder:
    """The holder ``settings.memory_backend`` names."""
    registration = NvmlRegistration(settings.fake_nvml_dir, pid=pid, gpu_uuid=settings.gpu_uuid,
                                    total_bytes=settings.gpu_memory_bytes,
                                    enforce=settings.memory_backend == "fake")
    portions = plan_portions(settings)
    if settings.memory_backend == "cuda":
        return CudaMemory(resident_bytes=settings.resident_memory_bytes, portions=portions,
                          registration=registration)
    return FakeMemory(resident_bytes=settings.resident_memory_bytes, portions=portions,
                      registration=registration)
