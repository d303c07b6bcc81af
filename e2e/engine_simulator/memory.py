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

**Tensor parallelism** (``tensor_parallel_size`` N above 1, fake backend only): vLLM runs
one worker process per GPU, and NVML shows each on its own GPU. The holder still counts the
engine's bytes as one; a :class:`TensorParallelRegistration` splits every count into N
shards (1/N each, rank 0 taking the odd bytes) and registers shard *k* on the rank's GPU
under the rank's own pid: rank 0 is this process, every other rank a :class:`WorkerProcess`
(a child that only lives, with this process's environment, cgroup and pid namespace, so
the driver attributes it to the same pod and claim, and that ends when this process closes
its pipe or dies). A growth is checked on each GPU in rank order; one that does not fit on
some GPU is undone on the GPUs it already grew on, so every portion is mapped on all the
ranks or on none. A worker that dies takes its record with it (the fake NVML drops the
records of dead processes), as a crashed vLLM worker's memory is freed on its GPU.

A holder carries out the operations of one call in order and stops at the first that
does not fit: operations are applied one at a time by the engine, so a wake that runs out
halfway keeps its partial mappings, as vLLM's CuMem allocator does.
"""

from __future__ import annotations

import asyncio
import contextlib
import importlib
import logging
import subprocess
import sys
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
    "Registration",
    "TensorParallelRegistration",
    "Transfer",
    "WorkerProcess",
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


class Registration(Protocol):
    """Where the engine's GPU memory shows: one GPU's registry record, or one per rank."""

    async def publish(self, used_bytes: int) -> None:
        """Register ``used_bytes`` (the engine's whole count); :class:`DeviceOutOfMemory`,
        and nothing changed, when the growth does not fit."""
        ...

    async def remove(self) -> None:
        """Unregister everything (and end the processes that stood for it)."""
        ...

    def describe(self) -> list[dict[str, Any]]:
        """Each rank: its pid, GPU and the bytes registered there."""
        ...


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

    @property
    def used_bytes(self) -> int:
        """What is registered now."""
        return self._used

    def describe(self) -> list[dict[str, Any]]:
        return [{"rank": 0, "pid": self.pid, "gpu_uuid": self.gpu_uuid,
                 "used_bytes": self._used}]

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


_WORKER_SCRIPT = (
    "import signal, sys\n"
    # Ctrl-C reaches the whole process group: the server shuts down first and ends us.
    "signal.signal(signal.SIGINT, signal.SIG_IGN)\n"
    "sys.stdin.buffer.read()\n"
)
"""A worker only lives: until its stdin (a pipe this process holds) reaches its end, which
happens when this process closes it or dies, however it dies."""


class WorkerProcess:
    """A child process standing for one tensor-parallel vLLM worker on its GPU: the pid the
    fake NVML shows there. It inherits this process's environment (``ROTA_POD_UID``,
    ``ROTA_CLAIM_UID``), cgroup and pid namespace, so it belongs to the same pod."""

    def __init__(self, rank: int) -> None:
        self.rank = rank
        self._proc: subprocess.Popen[bytes] | None = None

    def start(self) -> int:
        """Start it (blocking, a few milliseconds); its pid."""
        self._proc = subprocess.Popen(
            [sys.executable, "-I", "-S", "-c", _WORKER_SCRIPT, f"rota-sim-worker-tp{self.rank}"],
            stdin=subprocess.PIPE, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
            close_fds=True)
        return self._proc.pid

    @property
    def pid(self) -> int | None:
        return self._proc.pid if self._proc is not None else None

    @property
    def alive(self) -> bool:
        return self._proc is not None and self._proc.poll() is None

    def kill(self) -> None:
        """End it at once (SIGKILL), as a crashed worker ends."""
        if self._proc is not None and self._proc.poll() is None:
            self._proc.kill()
            self._proc.wait(timeout=10)

    def stop(self, timeout_s: float = 5.0) -> None:
        """Close its pipe and reap it (blocking); SIGKILL after ``timeout_s``."""
        proc = self._proc
        if proc is None:
            return
        if proc.stdin is not None:
            with contextlib.suppress(OSError):
                proc.stdin.close()
        try:
            proc.wait(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(timeout=timeout_s)


def shards(used_bytes: int, ranks: int) -> list[int]:
    """``used_bytes`` split over ``ranks`` GPUs: 1/N each, rank 0 taking the odd bytes."""
    share, odd = divmod(used_bytes, ranks)
    return [share + odd] + [share] * (ranks - 1)


class TensorParallelRegistration:
    """The records of a tensor-parallel engine: one per rank, each on the rank's GPU under
    the rank's own pid (this process for rank 0, a :class:`WorkerProcess` for each other
    rank, started with the first record). Without a registry directory only the numbers are
    kept (and checked against ``total_bytes``), and no worker is started."""

    def __init__(self, directory: Path | None, *, pid: int, gpu_uuids: Sequence[str],
                 total_bytes: int | None = None, enforce: bool = True) -> None:
        if len(gpu_uuids) < 2:
            raise ValueError("a tensor-parallel registration needs at least two GPUs")
        self.directory = directory
        self.pid = pid
        self.gpu_uuids = tuple(gpu_uuids)
        self.total_bytes = total_bytes
        self.enforce = enforce
        self.workers: list[WorkerProcess] = []
        self._ranks: list[NvmlRegistration] = []

    async def _start(self) -> None:
        pids = [self.pid]
        for rank in range(1, len(self.gpu_uuids)):
            if self.directory is None:
                pids.append(self.pid)
                continue
            worker = WorkerProcess(rank)
            self.workers.append(worker)
            pids.append(await asyncio.to_thread(worker.start))
        self._ranks = [NvmlRegistration(self.directory, pid=pid, gpu_uuid=gpu,
                                        total_bytes=self.total_bytes, enforce=self.enforce)
                       for pid, gpu in zip(pids, self.gpu_uuids, strict=True)]
        log.info("tensor-parallel workers started", extra={
            "tensor_parallel_size": len(self.gpu_uuids), "pids": pids,
            "gpu_uuids": list(self.gpu_uuids)})

    async def publish(self, used_bytes: int) -> None:
        if not self._ranks:
            await self._start()
        grown: list[tuple[NvmlRegistration, int]] = []
        try:
            for rank, size in zip(self._ranks, shards(used_bytes, len(self._ranks)),
                                  strict=True):
                before = rank.used_bytes
                await rank.publish(size)
                grown.append((rank, before))
        except DeviceOutOfMemory:
            for rank, before in reversed(grown):  # a shrink always fits
                await rank.publish(before)
            raise

    async def remove(self) -> None:
        for rank in self._ranks:
            await rank.remove()
        for worker in self.workers:
            await asyncio.to_thread(worker.stop)

    def describe(self) -> list[dict[str, Any]]:
        ranks = []
        for index, rank in enumerate(self._ranks):
            entry = rank.describe()[0] | {"rank": index}
            if index > 0 and self.workers:
                entry["alive"] = self.workers[index - 1].alive
            ranks.append(entry)
        return ranks


class FakeMemory:
    """Counts bytes; no device is touched."""

    def __init__(
        self, *, resident_bytes: int, portions: Mapping[str, int], registration: Registration,
        leak_per_cycle_bytes: int = 0,
    ) -> None:
        self._resident = resident_bytes
        self._sizes = dict(portions)
        self._on_device = set(self._sizes)
        self._on_host: set[str] = set()
        self._registration = registration
        self._leak = leak_per_cycle_bytes
        self._released = False
        """Something was freed since the engine was last wholly on the device."""
        self.leaked_bytes = 0
        """What the ``leak_per_cycle_mib`` test knob left resident so far."""

    async def _leak_a_cycle(self) -> None:
        """A sleep/wake cycle just completed: leave ``_leak`` bytes more resident (the
        ``leak_per_cycle_mib`` test knob; an engine whose footprint creeps)."""
        self._released = False
        if not self._leak:
            return
        self._resident += self._leak
        try:
            await self._registration.publish(self.used_bytes)
        except DeviceOutOfMemory:
            self._resident -= self._leak
            raise
        self.leaked_bytes += self._leak

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
                    self._released = True
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
        if self._released and self._on_device == set(self._sizes):
            await self._leak_a_cycle()
        return transfers

    async def close(self) -> None:
        self._on_device.clear()
        self._resident = 0
        await self._registration.remove()

    def describe(self) -> dict[str, Any]:
        return {
            "backend": "fake",
            "leaked_bytes": self.leaked_bytes,
            "host_bytes": sum(self._sizes[name] for name in self._on_host),
            "portions": {name: name in self._on_device for name in sorted(self._sizes)},
            "ranks": self._registration.describe(),
        }


class CudaMemory:
    """Holds real GPU memory with PyTorch on the current CUDA device.

    ``resident_bytes`` is allocated on top of the CUDA context PyTorch creates (about
    0.5 GiB on an H200), so NVML shows a little more than the knob asks for.
    """

    def __init__(
        self, *, resident_bytes: int, portions: Mapping[str, int], registration: Registration
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
    """The holder ``settings.memory_backend`` names (its records one per tensor-parallel
    rank when ``settings.tensor_parallel_size`` is above 1)."""
    registration: Registration
    if settings.tensor_parallel_size > 1:
        registration = TensorParallelRegistration(
            settings.fake_nvml_dir, pid=pid, gpu_uuids=settings.worker_gpus,
            total_bytes=settings.gpu_memory_bytes, enforce=settings.memory_backend == "fake")
    else:
        registration = NvmlRegistration(
            settings.fake_nvml_dir, pid=pid, gpu_uuid=settings.gpu_uuid,
            total_bytes=settings.gpu_memory_bytes, enforce=settings.memory_backend == "fake")
    portions = plan_portions(settings)
    if settings.memory_backend == "cuda":
        return CudaMemory(resident_bytes=settings.resident_memory_bytes, portions=portions,
                          registration=registration)
    return FakeMemory(resident_bytes=settings.resident_memory_bytes, portions=portions,
                      registration=registration,
                      leak_per_cycle_bytes=settings.leak_per_cycle_mib * 2**20)
