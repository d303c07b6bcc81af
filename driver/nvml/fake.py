"""A fake :class:`~driver.nvml.api.NvmlBackend` for machines without a GPU.

The GPUs come from a JSON fixture (:class:`NvmlFixture`; ``fixtures/h200.json`` holds the
answers of a real H200, recorded by ``e2e/tools/record_nvml.py``). Compute processes come from
a registry directory that other programs write, so the engine simulator can "hold" GPU
memory the way a real engine does and every layer above sees it through the same calls:

- one file per process, ``<dir>/<pid>.json``, holding
  ``{"pid": <int>, "gpu_uuid": "GPU-...", "used_bytes": <int>}``; a process in a pid
  namespace other than the machine's (an engine in a container) also writes its
  namespace's inode, ``"pid_namespace": <int>``, and names the file
  ``<namespace>-<pid>.json`` (two containers may both run pid 1);
- written atomically (a dot-named temp file in the same directory, then a rename): use
  :func:`register_process` / :func:`unregister_process`;
- files of processes that are gone (or zombies) are ignored, as NVML forgets a process
  when it exits; unreadable files are logged once and ignored.

Like NVML, the fake reports processes by their pid in the machine's pid namespace: a
namespaced record is mapped to that pid through ``/proc/<pid>/status`` (``NSpid``) and
``/proc/<pid>/ns/pid``, which a driver running with the host's pid namespace can read.

Used memory on a GPU is the fixture's baseline (what the driver holds with no process)
plus every live registered process on that GPU; free is total minus used, never below
zero. The directory is read on every call: callers poll, as they would poll NVML. Only
``<pid>.json`` and ``<namespace>-<pid>.json`` names are processes.

**Capacity.** A real GPU runs out: an allocation that does not fit fails. So that
simulated engines fail the same way, :meth:`FakeNvml.init` publishes the fixture's GPUs
(uuid, total, baseline) into the registry as ``gpus.json``, and a writer that asks for it
(``register_process(..., enforce_capacity=True)``) gets :class:`GpuMemoryExhausted` instead
of a record when its new size would not fit beside every other live process on that GPU.
The check and the write happen under one exclusive lock on ``<dir>/.lock``
(:func:`registry_lock`), so two simulators can never both take the last free bytes. A
record of a pid namespace the writer cannot see into is counted as alive (the safe side).

Tests and e2e runs can inject NVML errors (:meth:`FakeNvml.fail`, or ``failures`` in the
fixture) and health events: in the process (:meth:`FakeNvml.inject_health_event`), or from
another one through ``<dir>/events/`` (:func:`write_health_event`; the driver in a
container reads the registry directory from the node), each delivered once, in the order
written.
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import logging
import os
import queue
import re
import tempfile
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Annotated

from pydantic import BaseModel, ConfigDict, Field, ValidationError, model_validator

from driver.errors import NvmlError
from driver.nvml.api import HealthEvent, HealthEventKind, MemoryInfo, ProcessInfo
from rota.kit.errors import ConfigError

log = logging.getLogger(__name__)

PROC_DIR_ENV = "ROTA_FAKE_NVML_PROC_DIR"
"""The environment variable that names the process registry directory."""
INITIAL_PID_NAMESPACE = 0xEFFFFFFC
"""The inode of the machine's own pid namespace (``PROC_PID_INIT_INO`` in Linux)."""
GPUS_FILE = "gpus.json"
"""The registry file where :meth:`FakeNvml.init` publishes each GPU's capacity."""
LOCK_FILE = ".lock"
"""The registry's lock: held exclusively while a capacity check and its write happen."""
_PROCESS_FILE = re.compile(r"(?:[0-9]+-)?[0-9]+\.json")

CALLS = frozenset(
    {
        "init", "shutdown", "device_count", "driver_version", "cuda_driver_version", "uuid",
        "name", "brand", "architecture", "cuda_compute_capability", "pci_bus_id",
        "numa_node", "minor_number", "memory_info", "mig_mode", "compute_processes",
        "wait_health_event",
    }
)
"""The backend calls an injected failure can name."""

NonNegative = Annotated[int, Field(ge=0)]


class FakeGpu(BaseModel):
    """One GPU of a fixture, field for field what NVML answers for it."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    index: NonNegative
    uuid: str = Field(min_length=1)
    name: str
    brand: NonNegative
    architecture: NonNegative
    cuda_compute_capability: tuple[NonNegative, NonNegative]
    pci_bus_id: str
    numa_node: NonNegative | None = None
    minor_number: NonNegative
    memory_total: int = Field(gt=0)
    memory_used: NonNegative = Field(description="used bytes with no compute process")
    mig_mode: tuple[NonNegative, NonNegative] = (0, 0)


class FakeFailure(BaseModel):
    """An NVML error the fake raises on every matching call."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    call: str
    reason: str = Field(min_length=1)
    index: NonNegative | None = Field(default=None, description="None: every device")

    @model_validator(mode="after")
    def _known_call(self) -> FakeFailure:
        if self.call not in CALLS:
            raise ValueError(f"unknown call {self.call!r}; one of {sorted(CALLS)}")
        return self


class NvmlFixture(BaseModel):
    """The whole fixture file: system-wide answers and the GPUs."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    description: str = ""
    driver_version: str = Field(min_length=1)
    cuda_driver_version: NonNegative
    devices: list[FakeGpu]
    failures: list[FakeFailure] = Field(default_factory=list)

    @model_validator(mode="after")
    def _consistent(self) -> NvmlFixture:
        indices = [gpu.index for gpu in self.devices]
        if indices != list(range(len(indices))):
            raise ValueError(f"device indices must be 0..n-1 in order, got {indices}")
        uuids = [gpu.uuid for gpu in self.devices]
        if len(set(uuids)) != len(uuids):
            raise ValueError("device uuids must be unique")
        for gpu in self.devices:
            if gpu.memory_used > gpu.memory_total:
                raise ValueError(f"gpu {gpu.index}: memory_used exceeds memory_total")
        return self


class _ProcessRecord(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)

    pid: int = Field(gt=0)
    gpu_uuid: str = Field(min_length=1)
    used_bytes: NonNegative
    pid_namespace: int | None = Field(default=None, gt=0)

    @property
    def file_stem(self) -> str:
        return _file_stem(self.pid, self.pid_namespace)


def _file_stem(pid: int, namespace: int | None) -> str:
    return str(pid) if namespace is None else f"{namespace}-{pid}"


def own_pid_namespace() -> int | None:
    """This process's pid namespace inode; None for the machine's own (or no procfs)."""
    try:
        inode = os.stat("/proc/self/ns/pid").st_ino
    except OSError:
        return None
    return None if inode == INITIAL_PID_NAMESPACE else inode


class GpuCapacity(BaseModel):
    """What a registry publishes about one GPU: its total and its baseline use."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    uuid: str = Field(min_length=1)
    memory_total: int = Field(gt=0)
    memory_used: NonNegative = Field(description="used bytes with no compute process")


class _Gpus(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)

    gpus: list[GpuCapacity]


class GpuMemoryExhausted(Exception):
    """The GPU has no room for what a process asked for (CUDA would fail the allocation).

    Attributes:
        gpu_uuid: the GPU.
        requested_bytes: how much more the process asked for.
        free_bytes: what the fake NVML shows free on that GPU (this process included).
        total_bytes: the GPU's total memory.
    """

    def __init__(self, *, gpu_uuid: str, requested_bytes: int, free_bytes: int,
                 total_bytes: int) -> None:
        super().__init__(
            f"GPU {gpu_uuid}: tried to allocate {requested_bytes} bytes with {free_bytes} "
            f"bytes free of {total_bytes}"
        )
        self.gpu_uuid = gpu_uuid
        self.requested_bytes = requested_bytes
        self.free_bytes = free_bytes
        self.total_bytes = total_bytes


def load_fixture(path: str | os.PathLike[str]) -> NvmlFixture:
    """Read and validate a fixture file; :class:`ConfigError` says what is wrong."""
    try:
        text = Path(path).read_text(encoding="utf-8")
    except OSError as err:
        raise ConfigError(f"cannot read NVML fixture {path}: {err}") from err
    try:
        return NvmlFixture.model_validate_json(text)
    except ValidationError as err:
        raise ConfigError(f"invalid NVML fixture {path}: {err}") from err


def _write_atomically(folder: Path, name: str, text: str) -> Path:
    target = folder / name
    fd, tmp = tempfile.mkstemp(dir=folder, prefix=f".{name}.", suffix=".tmp")
    try:
        with os.fdopen(fd, "w", encoding="utf-8") as out:
            out.write(text)
            out.flush()
            os.fsync(out.fileno())
        os.replace(tmp, target)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
    return target


@contextlib.contextmanager
def registry_lock(directory: str | os.PathLike[str], *, shared: bool = False
                  ) -> Iterator[None]:
    """Hold the registry's lock (blocking: call it from a worker thread): exclusive for a
    writer; ``shared`` for a reader, so that what it reads of several files is one moment
    of the GPU, as NVML's own process list is, never one engine before a switch beside
    another after it. A reader of a registry nobody wrote yet (no lock file), or of one it
    cannot open, reads without the lock."""
    folder = Path(directory)
    fd: int | None
    if shared:
        try:
            fd = os.open(folder / LOCK_FILE, os.O_RDONLY)
        except OSError:
            fd = None
    else:
        folder.mkdir(parents=True, exist_ok=True)
        fd = os.open(folder / LOCK_FILE, os.O_RDWR | os.O_CREAT, 0o666)
    try:
        if fd is not None:
            fcntl.flock(fd, fcntl.LOCK_SH if shared else fcntl.LOCK_EX)
        yield
    finally:
        if fd is not None:
            os.close(fd)  # closing the descriptor releases the lock


def publish_gpus(directory: str | os.PathLike[str], fixture: NvmlFixture) -> Path:
    """Write every GPU's capacity into the registry (``gpus.json``, atomically)."""
    folder = Path(directory)
    folder.mkdir(parents=True, exist_ok=True)
    gpus = _Gpus(gpus=[GpuCapacity(uuid=g.uuid, memory_total=g.memory_total,
                                   memory_used=g.memory_used) for g in fixture.devices])
    return _write_atomically(folder, GPUS_FILE, gpus.model_dump_json())


def read_capacity(directory: str | os.PathLike[str], gpu_uuid: str) -> GpuCapacity | None:
    """The published capacity of ``gpu_uuid``; None when nothing (valid) is published."""
    try:
        raw = (Path(directory) / GPUS_FILE).read_bytes()
        gpus = _Gpus.model_validate_json(raw)
    except (OSError, ValueError):
        return None
    return next((gpu for gpu in gpus.gpus if gpu.uuid == gpu_uuid), None)


def _counted_records(folder: Path) -> list[_ProcessRecord]:
    """Every valid record that holds memory: live processes, and processes of pid
    namespaces this process cannot see into (counted, to stay on the safe side)."""
    records: list[_ProcessRecord] = []
    try:
        entries = list(folder.iterdir())
    except FileNotFoundError:
        return records
    host_pids = _HostPids()
    for path in entries:
        if not _PROCESS_FILE.fullmatch(path.name):
            continue
        try:
            record = _ProcessRecord.model_validate_json(path.read_bytes())
        except (OSError, ValueError):
            continue
        if path.stem != record.file_stem:
            continue
        pid = host_pids.resolve(record.pid_namespace, record.pid)
        if pid is None or pid_alive(pid):
            records.append(record)
    return records


def _check_room(folder: Path, record: _ProcessRecord, total_bytes: int | None) -> None:
    capacity = read_capacity(folder, record.gpu_uuid)
    total = total_bytes if total_bytes is not None else (
        capacity.memory_total if capacity is not None else None)
    if total is None:
        return  # a GPU nobody described: no limit is known
    baseline = capacity.memory_used if capacity is not None else 0
    on_gpu = [r for r in _counted_records(folder) if r.gpu_uuid == record.gpu_uuid]
    mine = sum(r.used_bytes for r in on_gpu if r.file_stem == record.file_stem)
    others = sum(r.used_bytes for r in on_gpu if r.file_stem != record.file_stem)
    if record.used_bytes <= mine:
        return  # shrinking (or not growing) always fits
    if baseline + others + record.used_bytes > total:
        raise GpuMemoryExhausted(
            gpu_uuid=record.gpu_uuid, requested_bytes=record.used_bytes - mine,
            free_bytes=max(0, total - baseline - others - mine), total_bytes=total,
        )


def register_process(
    directory: str | os.PathLike[str],
    pid: int,
    gpu_uuid: str,
    used_bytes: int,
    *,
    enforce_capacity: bool = False,
    total_bytes: int | None = None,
) -> Path:
    """Record (or update) that ``pid`` (of this process's pid namespace) holds
    ``used_bytes`` on ``gpu_uuid``; atomic.

    Args:
        enforce_capacity: check, under :func:`registry_lock`, that the new size fits on the
            GPU beside every other live process (the published baseline included), and
            raise :class:`GpuMemoryExhausted` (writing nothing) when it does not. A
            shrinking record always fits. A GPU with no published capacity and no
            ``total_bytes`` has no limit.
        total_bytes: the GPU's total memory, overriding what the registry publishes.
    """
    record = _ProcessRecord(pid=pid, gpu_uuid=gpu_uuid, used_bytes=used_bytes,
                            pid_namespace=own_pid_namespace())
    folder = Path(directory)
    folder.mkdir(parents=True, exist_ok=True)
    with registry_lock(folder):
        if enforce_capacity:
            _check_room(folder, record, total_bytes)
        return _write_atomically(folder, f"{record.file_stem}.json",
                                 record.model_dump_json(exclude_none=True))


class _EventRecord(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)

    gpu_uuid: str = Field(min_length=1)
    kind: HealthEventKind
    xid: int | None = None
    message: str = ""


EVENTS_DIR = "events"


def write_health_event(directory: str | os.PathLike[str], event: HealthEvent) -> Path:
    """Queue ``event`` for the fake NVML reading the registry ``directory``; atomic."""
    folder = Path(directory) / EVENTS_DIR
    folder.mkdir(parents=True, exist_ok=True)
    record = _EventRecord(gpu_uuid=event.gpu_uuid, kind=event.kind, xid=event.xid,
                          message=event.message)
    fd, tmp = tempfile.mkstemp(dir=folder, prefix=".event.", suffix=".tmp")
    try:
        with os.fdopen(fd, "w", encoding="utf-8") as out:
            out.write(record.model_dump_json())
        target = folder / f"{time.time_ns():020d}-{os.getpid()}.json"
        os.replace(tmp, target)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
    return target


def unregister_process(directory: str | os.PathLike[str], pid: int) -> None:
    """Forget ``pid`` (of this process's pid namespace); a missing entry is fine."""
    folder = Path(directory)
    if not folder.is_dir():
        return
    with registry_lock(folder):
        (folder / f"{_file_stem(pid, own_pid_namespace())}.json").unlink(missing_ok=True)


def _nspids(pid: int | str) -> list[int]:
    try:
        status = Path(f"/proc/{pid}/status").read_text(encoding="utf-8", errors="replace")
    except OSError:
        return []
    for line in status.splitlines():
        if line.startswith("NSpid:"):
            return [int(v) for v in line.split()[1:]]
    return []


def _in_namespace(host_pid: int | str, namespace: int, pid: int) -> bool:
    ids = _nspids(host_pid)
    if len(ids) < 2 or ids[-1] != pid:
        return False
    try:
        return os.stat(f"/proc/{host_pid}/ns/pid").st_ino == namespace
    except OSError:
        return False


class _HostPids:
    """Maps (pid namespace, pid) to the pid in this process's namespace, cached; a cached
    answer is checked again on every use (pids are reused)."""

    def __init__(self) -> None:
        self._known: dict[tuple[int, int], int] = {}
        self._own = own_pid_namespace()

    def resolve(self, namespace: int | None, pid: int) -> int | None:
        if namespace is None or namespace == self._own:
            return pid
        key = (namespace, pid)
        known = self._known.get(key)
        if known is not None and _in_namespace(known, namespace, pid):
            return known
        self._known.pop(key, None)
        try:
            entries = [e.name for e in os.scandir("/proc") if e.name.isdigit()]
        except OSError:
            return None
        for name in entries:
            if _in_namespace(name, namespace, pid):
                self._known[key] = int(name)
                return int(name)
        return None


def pid_alive(pid: int) -> bool:
    """True while ``pid`` names a running (not zombie) process in this pid namespace."""
    if pid <= 0:
        return False
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        pass  # exists, owned by someone else
    try:
        with open(f"/proc/{pid}/stat", encoding="utf-8", errors="replace") as file:
            stat = file.read()
    except OSError:
        return True  # no procfs: trust kill()
    state = stat.rpartition(")")[2].split()[:1]
    return state not in (["Z"], ["X"])


@dataclass
class _Failure:
    spec: FakeFailure
    remaining: int | None


class FakeNvml:
    """An :class:`~driver.nvml.api.NvmlBackend` answering from a fixture and a registry."""

    def __init__(
        self, fixture: NvmlFixture, proc_dir: str | os.PathLike[str] | None = None
    ) -> None:
        self._fixture = fixture
        self._proc_dir = Path(proc_dir) if proc_dir is not None else None
        self._may_forget = True
        """False once the registry refused the removal of a dead process's record."""
        self._lock = threading.Lock()
        self._failures = [_Failure(f, None) for f in fixture.failures]
        self._events: queue.Queue[HealthEvent] = queue.Queue()
        self._initialised = False
        self._warned: set[tuple[str, int, int]] = set()
        self._host_pids = _HostPids()

    @classmethod
    def from_path(
        cls, path: str | os.PathLike[str], proc_dir: str | os.PathLike[str] | None = None
    ) -> FakeNvml:
        return cls(load_fixture(path), proc_dir)

    @property
    def fixture(self) -> NvmlFixture:
        return self._fixture

    # test controls

    def fail(self, call: str, reason: str, *, index: int | None = None,
             times: int | None = None) -> None:
        """Make ``call`` raise ``NvmlError(reason=reason)`` (``times`` times; None: always)."""
        spec = FakeFailure(call=call, reason=reason, index=index)
        with self._lock:
            self._failures.append(_Failure(spec, times))

    def clear_failures(self) -> None:
        with self._lock:
            self._failures.clear()

    def inject_health_event(self, event: HealthEvent) -> None:
        """Queue an event for the next :meth:`wait_health_event`."""
        self._events.put(event)

    # the backend

    def _check(self, call: str, index: int | None = None) -> None:
        if call not in ("init", "shutdown") and not self._initialised:
            raise NvmlError(f"{call}: NVML is not initialised", reason="uninitialized")
        with self._lock:
            for failure in self._failures:
                spec = failure.spec
                if spec.call != call or (spec.index is not None and spec.index != index):
                    continue
                if failure.remaining is not None:
                    if failure.remaining <= 0:
                        continue
                    failure.remaining -= 1
                raise NvmlError(f"{call}: injected failure ({spec.reason})", reason=spec.reason)

    def _gpu(self, call: str, index: int) -> FakeGpu:
        self._check(call, index)
        if not 0 <= index < len(self._fixture.devices):
            raise NvmlError(f"{call}: no GPU with index {index}", reason="invalid_argument")
        return self._fixture.devices[index]

    def init(self) -> None:
        self._check("init")
        if self._proc_dir is not None:
            publish_gpus(self._proc_dir, self._fixture)
        self._initialised = True

    def shutdown(self) -> None:
        self._check("shutdown")
        self._initialised = False

    def device_count(self) -> int:
        self._check("device_count")
        return len(self._fixture.devices)

    def driver_version(self) -> str:
        self._check("driver_version")
        return self._fixture.driver_version

    def cuda_driver_version(self) -> int:
        self._check("cuda_driver_version")
        return self._fixture.cuda_driver_version

    def uuid(self, index: int) -> str:
        return self._gpu("uuid", index).uuid

    def name(self, index: int) -> str:
        return self._gpu("name", index).name

    def brand(self, index: int) -> int:
        return self._gpu("brand", index).brand

    def architecture(self, index: int) -> int:
        return self._gpu("architecture", index).architecture

    def cuda_compute_capability(self, index: int) -> tuple[int, int]:
        return self._gpu("cuda_compute_capability", index).cuda_compute_capability

    def pci_bus_id(self, index: int) -> str:
        return self._gpu("pci_bus_id", index).pci_bus_id

    def numa_node(self, index: int) -> int | None:
        return self._gpu("numa_node", index).numa_node

    def minor_number(self, index: int) -> int:
        return self._gpu("minor_number", index).minor_number

    def mig_mode(self, index: int) -> tuple[int, int]:
        return self._gpu("mig_mode", index).mig_mode

    def memory_info(self, index: int) -> MemoryInfo:
        gpu = self._gpu("memory_info", index)
        return self._memory(gpu, self._live())

    def compute_processes(self, index: int) -> list[ProcessInfo]:
        gpu = self._gpu("compute_processes", index)
        return self._processes(gpu, self._live())

    def memory_and_processes(self, index: int) -> tuple[MemoryInfo, list[ProcessInfo]]:
        """Both from one read of the registry: one moment of the GPU."""
        gpu = self._gpu("memory_info", index)
        self._check("compute_processes", index)
        live = self._live()
        return self._memory(gpu, live), self._processes(gpu, live)

    @staticmethod
    def _memory(gpu: FakeGpu, live: list[_ProcessRecord]) -> MemoryInfo:
        used = gpu.memory_used + sum(r.used_bytes for r in live if r.gpu_uuid == gpu.uuid)
        return MemoryInfo(total=gpu.memory_total, used=used, free=max(0, gpu.memory_total - used))

    @staticmethod
    def _processes(gpu: FakeGpu, live: list[_ProcessRecord]) -> list[ProcessInfo]:
        return [ProcessInfo(pid=r.pid, used_bytes=r.used_bytes)
                for r in live if r.gpu_uuid == gpu.uuid]

    def wait_health_event(self, timeout_ms: int) -> HealthEvent | None:
        self._check("wait_health_event")
        deadline = time.monotonic() + max(0, timeout_ms) / 1000
        while True:
            written = self._written_event()
            if written is not None:
                return written
            remaining = deadline - time.monotonic()
            try:
                if remaining <= 0:
                    return self._events.get_nowait()
                return self._events.get(timeout=min(remaining, 0.1))
            except queue.Empty:
                if remaining <= 0:
                    return None

    def _written_event(self) -> HealthEvent | None:
        """The oldest event another process wrote, taken (removed) first."""
        if self._proc_dir is None:
            return None
        folder = self._proc_dir / EVENTS_DIR
        try:
            names = sorted(p.name for p in folder.iterdir()
                           if p.suffix == ".json" and not p.name.startswith("."))
        except FileNotFoundError:
            return None
        for name in names:
            taken = folder / f".{name}.taken"
            try:
                os.replace(folder / name, taken)
                raw = taken.read_bytes()
            except FileNotFoundError:
                continue
            finally:
                taken.unlink(missing_ok=True)
            try:
                record = _EventRecord.model_validate_json(raw)
            except ValueError as err:
                log.warning("ignoring an unreadable health event file",
                            extra={"path": str(folder / name), "problem": str(err)[:300]})
                continue
            return HealthEvent(record.gpu_uuid, record.kind, record.xid, record.message)
        return None

    # the registry

    def _live(self) -> list[_ProcessRecord]:
        """Every parseable record of a live process, sorted by pid; read fresh."""
        if self._proc_dir is None:
            return []
        with registry_lock(self._proc_dir, shared=True):
            try:
                entries = sorted(
                    p for p in self._proc_dir.iterdir() if _PROCESS_FILE.fullmatch(p.name)
                )
            except FileNotFoundError:
                return []
            seen: set[tuple[str, int, int]] = set()
            read = [(path, r) for path in entries if (r := self._read(path, seen)) is not None]
        records: list[_ProcessRecord] = []
        dead: list[Path] = []
        for path, record in read:
            pid = self._host_pids.resolve(record.pid_namespace, record.pid)
            if pid is not None and pid_alive(pid):
                records.append(record.model_copy(update={"pid": pid, "pid_namespace": None}))
            elif record.pid_namespace == own_pid_namespace():
                dead.append(path)
        with self._lock:
            self._warned &= seen
        if dead:
            self._forget_dead(dead)
        return sorted(records, key=lambda r: r.pid)

    def _forget_dead(self, paths: list[Path]) -> None:
        """Remove the records of processes that died, as the GPU's driver frees a dead
        process's memory: otherwise every engine that crashed leaves a file that each
        later read of the registry parses again. Only records of this pid namespace,
        whose death this process can see for certain; a registry it may not write is
        left as it is (and not tried again)."""
        if self._proc_dir is None or not self._may_forget:
            return
        try:
            with registry_lock(self._proc_dir):
                for path in paths:
                    record = self._read(path, set())
                    if record is not None and record.pid_namespace == own_pid_namespace() \
                            and not pid_alive(record.pid):
                        path.unlink(missing_ok=True)
        except OSError as err:
            self._may_forget = False
            log.info("cannot remove dead processes from the registry",
                     extra={"registry": str(self._proc_dir), "error": str(err)[:200]})

    def _read(self, path: Path, seen: set[tuple[str, int, int]]) -> _ProcessRecord | None:
        """Parse one registry file; log a bad one once per version of its content."""
        try:
            stat = path.stat()
            raw = path.read_bytes()
        except FileNotFoundError:
            return None  # unregistered between listing and reading
        except OSError as err:
            key, problem = (path.name, 0, 0), str(err)
        else:
            key = (path.name, stat.st_mtime_ns, stat.st_size)
            try:
                record = _ProcessRecord.model_validate(json.loads(raw))
            except ValueError as err:  # bad UTF-8, bad JSON, or a ValidationError
                problem = str(err)
            else:
                if path.stem == record.file_stem:
                    return record
                problem = f"file name does not match pid {record.file_stem}"
        seen.add(key)
        with self._lock:
            first = key not in self._warned
            self._warned.add(key)
        if first:
            log.warning(
                "ignoring unreadable process registry file",
                extra={"path": str(path), "problem": problem[:500]},
            )
        return None
