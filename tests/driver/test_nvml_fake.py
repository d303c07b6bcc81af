"""The fake NVML backend: fixture loading, the process registry, injected errors and events."""

from __future__ import annotations

import contextlib
import json
import logging
import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from types import SimpleNamespace

import pytest

import driver.nvml.fake as fake_module
from driver.errors import NvmlError
from driver.nvml import HealthEvent, HealthEventKind, MemoryInfo, NvmlBackend, fixture_path
from driver.nvml.fake import (
    LOCK_FILE,
    FakeNvml,
    NvmlFixture,
    load_fixture,
    pid_alive,
    register_process,
    unregister_process,
)
from e2e.tools.record_nvml import record
from rota.kit.errors import ConfigError

H200_UUID = "GPU-b2d6f492-0cde-9a2c-447e-a98f56e7d2ed"
H200_TOTAL = 150754820096
H200_BASELINE = 644939776
GIB = 1 << 30


@pytest.fixture
def proc_dir(tmp_path: Path) -> Path:
    return tmp_path / "procs"


@pytest.fixture
def fake(proc_dir: Path) -> FakeNvml:
    backend = FakeNvml.from_path(fixture_path("h200"), proc_dir)
    backend.init()
    return backend


@pytest.fixture
def dead_pid() -> int:
    """The pid of a process that has exited and been reaped."""
    child = subprocess.Popen([sys.executable, "-c", "pass"])
    child.wait()
    return child.pid


def test_fake_satisfies_the_protocol(fake: FakeNvml) -> None:
    assert isinstance(fake, NvmlBackend)


def test_h200_fixture_answers_like_the_recorded_gpu(fake: FakeNvml) -> None:
    assert fake.device_count() == 1
    assert fake.driver_version() == "580.159.04"
    assert fake.cuda_driver_version() == 13000
    assert fake.uuid(0) == H200_UUID
    assert fake.name(0) == "NVIDIA H200"
    assert fake.brand(0) == 14
    assert fake.architecture(0) == 9
    assert fake.cuda_compute_capability(0) == (9, 0)
    assert fake.pci_bus_id(0) == "00000000:00:06.0"
    assert fake.numa_node(0) is None
    assert fake.minor_number(0) == 0
    assert fake.mig_mode(0) == (0, 0)
    assert fake.memory_info(0) == MemoryInfo(
        H200_TOTAL, H200_BASELINE, H200_TOTAL - H200_BASELINE
    )
    assert fake.compute_processes(0) == []


def test_eight_gpu_fixture_is_consistent() -> None:
    fixture = load_fixture(fixture_path("h200x8"))
    assert [gpu.index for gpu in fixture.devices] == list(range(8))
    assert len({gpu.uuid for gpu in fixture.devices}) == 8
    assert len({gpu.pci_bus_id for gpu in fixture.devices}) == 8


def test_unknown_fixture_name_is_a_config_error() -> None:
    with pytest.raises(ConfigError, match="h200"):
        fixture_path("a100")


def test_calls_before_init_fail_like_nvml(proc_dir: Path) -> None:
    backend = FakeNvml.from_path(fixture_path("h200"), proc_dir)
    with pytest.raises(NvmlError) as err:
        backend.device_count()
    assert err.value.reason == "uninitialized"


def test_index_out_of_range_is_invalid_argument(fake: FakeNvml) -> None:
    with pytest.raises(NvmlError) as err:
        fake.uuid(1)
    assert err.value.reason == "invalid_argument"


def test_registered_live_process_holds_memory(fake: FakeNvml, proc_dir: Path) -> None:
    me = os.getpid()
    register_process(proc_dir, me, H200_UUID, 16 * GIB)
    procs = fake.compute_processes(0)
    assert [(p.pid, p.used_bytes) for p in procs] == [(me, 16 * GIB)]
    mem = fake.memory_info(0)
    assert mem.used == H200_BASELINE + 16 * GIB
    assert mem.free == H200_TOTAL - H200_BASELINE - 16 * GIB

    register_process(proc_dir, me, H200_UUID, 610 << 20)  # update: asleep
    assert fake.memory_info(0).used == H200_BASELINE + (610 << 20)

    unregister_process(proc_dir, me)
    unregister_process(proc_dir, me)  # twice is fine
    assert fake.compute_processes(0) == []
    assert fake.memory_info(0).used == H200_BASELINE


def test_process_on_another_gpu_is_not_counted(fake: FakeNvml, proc_dir: Path) -> None:
    register_process(proc_dir, os.getpid(), "GPU-00000000-other", GIB)
    assert fake.compute_processes(0) == []
    assert fake.memory_info(0).used == H200_BASELINE


def test_dead_process_is_ignored(fake: FakeNvml, proc_dir: Path, dead_pid: int) -> None:
    register_process(proc_dir, dead_pid, H200_UUID, GIB)
    assert not pid_alive(dead_pid)
    assert fake.compute_processes(0) == []
    assert fake.memory_info(0).used == H200_BASELINE


def test_a_dead_process_leaves_the_registry_at_the_next_read(
        fake: FakeNvml, proc_dir: Path, dead_pid: int) -> None:
    """As the GPU's driver frees a dead process's memory: its record is removed, so
    that engines that crashed do not leave files each later read parses again (the
    chaos campaign's reads grew with every crash). A live process stays; so does a record
    of a pid namespace this process cannot see into."""
    register_process(proc_dir, dead_pid, H200_UUID, GIB)
    register_process(proc_dir, os.getpid(), H200_UUID, GIB)
    foreign = proc_dir / "4026599999-77.json"
    foreign.write_text(json.dumps({"pid": 77, "gpu_uuid": H200_UUID, "used_bytes": GIB,
                                   "pid_namespace": 4026599999}))
    assert [p.pid for p in fake.compute_processes(0)] == [os.getpid()]
    left = sorted(p.name for p in proc_dir.glob("*.json") if p.name != "gpus.json")
    assert left == sorted([foreign.name, f"{os.getpid()}.json"])


def test_a_registry_that_may_not_be_written_is_still_read(
        fake: FakeNvml, proc_dir: Path, dead_pid: int, monkeypatch: pytest.MonkeyPatch) -> None:
    """A reader that may not take the writers' lock (a read-only mount) reads as before,
    and does not try again at every read."""
    register_process(proc_dir, dead_pid, H200_UUID, GIB)
    register_process(proc_dir, os.getpid(), H200_UUID, GIB)
    shared_lock = fake_module.registry_lock
    refused: list[bool] = []

    @contextlib.contextmanager
    def read_only(directory: Path, *, shared: bool = False) -> Iterator[None]:
        if not shared:
            refused.append(True)
            raise PermissionError(13, "Read-only file system")
        with shared_lock(directory, shared=True):
            yield

    monkeypatch.setattr(fake_module, "registry_lock", read_only)
    for _ in range(3):
        assert [p.pid for p in fake.compute_processes(0)] == [os.getpid()]
    assert (proc_dir / f"{dead_pid}.json").exists()
    assert refused == [True]


def test_free_never_negative(fake: FakeNvml, proc_dir: Path) -> None:
    register_process(proc_dir, os.getpid(), H200_UUID, 2 * H200_TOTAL)
    mem = fake.memory_info(0)
    assert mem.free == 0
    assert mem.used == H200_BASELINE + 2 * H200_TOTAL


def test_registry_file_format_is_the_documented_one(proc_dir: Path) -> None:
    path = register_process(proc_dir, 4242, H200_UUID, 123)
    assert path == proc_dir / "4242.json"
    assert json.loads(path.read_text()) == {"pid": 4242, "gpu_uuid": H200_UUID, "used_bytes": 123}
    left = sorted(p.name for p in proc_dir.iterdir() if p.name != LOCK_FILE)
    assert left == ["4242.json"]  # no temp left over


def test_register_rejects_negative_bytes(proc_dir: Path) -> None:
    with pytest.raises(ValueError, match="used_bytes"):
        register_process(proc_dir, 1, H200_UUID, -1)


def test_missing_registry_dir_means_no_processes(tmp_path: Path) -> None:
    backend = FakeNvml.from_path(fixture_path("h200"), tmp_path / "absent")
    backend.init()
    assert backend.compute_processes(0) == []


@pytest.mark.parametrize(
    ("name", "content"),
    [
        ("777.json", "{not json"),
        ("778.json", '{"pid": 778, "gpu_uuid": "GPU-x"}'),
        ("779.json", '{"pid": 779, "gpu_uuid": "GPU-x", "used_bytes": 1, "extra": 1}'),
        ("780.json", '{"pid": 1, "gpu_uuid": "GPU-x", "used_bytes": 1}'),
        ("781.json", b"\xff\xfe".decode("latin-1")),
    ],
)
def test_unreadable_registry_file_is_logged_once(
    fake: FakeNvml, proc_dir: Path, caplog: pytest.LogCaptureFixture, name: str, content: str
) -> None:
    register_process(proc_dir, os.getpid(), H200_UUID, GIB)
    (proc_dir / name).write_text(content, encoding="latin-1")
    with caplog.at_level(logging.WARNING, logger="driver.nvml.fake"):
        for _ in range(3):
            assert [p.pid for p in fake.compute_processes(0)] == [os.getpid()]
    warnings = [r for r in caplog.records if r.levelno == logging.WARNING]
    assert len(warnings) == 1
    assert getattr(warnings[0], "path", "").endswith(name)


def test_temp_files_of_writers_are_ignored(
    fake: FakeNvml, proc_dir: Path, caplog: pytest.LogCaptureFixture
) -> None:
    proc_dir.mkdir(exist_ok=True)  # init() made it to publish the GPUs
    (proc_dir / f".{os.getpid()}.abc.tmp").write_text("{half")
    (proc_dir / ".hidden.json").write_text("{half")
    with caplog.at_level(logging.WARNING):
        assert fake.compute_processes(0) == []
    assert caplog.records == []


def test_injected_failure_raises_with_reason(fake: FakeNvml) -> None:
    fake.fail("memory_info", "gpu_is_lost", index=0, times=2)
    for _ in range(2):
        with pytest.raises(NvmlError) as err:
            fake.memory_info(0)
        assert err.value.reason == "gpu_is_lost"
    assert fake.memory_info(0).total == H200_TOTAL  # used up
    fake.fail("uuid", "unknown")
    with pytest.raises(NvmlError):
        fake.uuid(0)
    fake.clear_failures()
    assert fake.uuid(0) == H200_UUID


def test_failure_for_another_index_does_not_fire(fake: FakeNvml) -> None:
    fake.fail("name", "gpu_is_lost", index=3)
    assert fake.name(0) == "NVIDIA H200"


def test_fixture_failures_apply_from_the_start(tmp_path: Path) -> None:
    data = json.loads(fixture_path("h200").read_text())
    data["failures"] = [{"call": "init", "reason": "driver_not_loaded"}]
    path = tmp_path / "broken.json"
    path.write_text(json.dumps(data))
    backend = FakeNvml.from_path(path)
    with pytest.raises(NvmlError) as err:
        backend.init()
    assert err.value.reason == "driver_not_loaded"


def test_unknown_call_name_is_rejected(fake: FakeNvml) -> None:
    with pytest.raises(ValueError, match="unknown call"):
        fake.fail("memory", "gpu_is_lost")


def test_health_events_are_delivered_in_order(fake: FakeNvml) -> None:
    assert fake.wait_health_event(0) is None
    first = HealthEvent(H200_UUID, HealthEventKind.XID, 79, "XID 79")
    second = HealthEvent(H200_UUID, HealthEventKind.ECC_DOUBLE_BIT, None, "DBE")
    fake.inject_health_event(first)
    fake.inject_health_event(second)
    assert fake.wait_health_event(1000) == first
    assert fake.wait_health_event(0) == second
    assert fake.wait_health_event(0) is None


@pytest.mark.parametrize(
    ("xid", "application"),
    [(13, True), (31, True), (43, True), (45, True), (48, False), (79, False), (None, False)],
)
def test_application_xids_are_told_apart(xid: int | None, application: bool) -> None:
    kind = HealthEventKind.XID if xid is not None else HealthEventKind.ECC_DOUBLE_BIT
    assert HealthEvent("GPU-x", kind, xid, "").is_application_error is application


def _fixture_with(**changes: object) -> dict[str, object]:
    data: dict[str, object] = json.loads(fixture_path("h200").read_text())
    device = dict(data["devices"][0])  # type: ignore[index]
    device.update(changes)
    data["devices"] = [device]
    return data


@pytest.mark.parametrize(
    ("data", "problem"),
    [
        (_fixture_with(index=1), "indices"),
        (_fixture_with(memory_used=H200_TOTAL + 1), "memory_used"),
        (_fixture_with(colour="green"), "colour"),
        ({**_fixture_with(), "devices": [_fixture_with()["devices"][0]] * 2}, "indices"),  # type: ignore[index]
    ],
)
def test_bad_fixture_is_a_config_error(
    tmp_path: Path, data: dict[str, object], problem: str
) -> None:
    path = tmp_path / "bad.json"
    path.write_text(json.dumps(data))
    with pytest.raises(ConfigError, match=problem):
        load_fixture(path)


def test_duplicate_uuids_are_rejected() -> None:
    first = _fixture_with()["devices"][0]  # type: ignore[index]
    data = {**_fixture_with(), "devices": [first, {**first, "index": 1}]}
    with pytest.raises(ValueError, match="unique"):
        NvmlFixture.model_validate(data)


def test_pid_alive_for_self_and_nonsense() -> None:
    assert pid_alive(os.getpid())
    assert not pid_alive(0)
    assert not pid_alive(-5)


class _NotSupportedError(Exception):
    pass


def _unsupported(*_: object) -> object:
    raise _NotSupportedError


def test_recorder_output_loads_into_the_fake() -> None:
    nvml = SimpleNamespace(
        NVMLError_NotSupported=_NotSupportedError,
        nvmlInit=lambda: None,
        nvmlShutdown=lambda: None,
        nvmlSystemGetDriverVersion=lambda: b"580.159.04",
        nvmlSystemGetCudaDriverVersion=lambda: 13000,
        nvmlDeviceGetCount=lambda: 1,
        nvmlDeviceGetHandleByIndex=lambda i: "h",
        nvmlDeviceGetUUID=lambda h: H200_UUID,
        nvmlDeviceGetName=lambda h: b"NVIDIA H200",
        nvmlDeviceGetBrand=lambda h: 14,
        nvmlDeviceGetArchitecture=lambda h: 9,
        nvmlDeviceGetCudaComputeCapability=lambda h: (9, 0),
        nvmlDeviceGetPciInfo=lambda h: SimpleNamespace(busId="00000000:00:06.0"),
        nvmlDeviceGetNumaNodeId=_unsupported,
        nvmlDeviceGetMinorNumber=lambda h: 0,
        nvmlDeviceGetMigMode=lambda h: [0, 0],
        nvmlDeviceGetMemoryInfo=lambda h: SimpleNamespace(
            total=H200_TOTAL, used=H200_BASELINE + GIB, free=H200_TOTAL - H200_BASELINE - GIB
        ),
        nvmlDeviceGetComputeRunningProcesses=lambda h: [SimpleNamespace(pid=9, usedGpuMemory=GIB)],
    )
    recorded = NvmlFixture.model_validate(record(nvml, "stub"))
    shipped = load_fixture(fixture_path("h200"))
    assert recorded.devices == shipped.devices  # running processes are not baseline
    assert (recorded.driver_version, recorded.cuda_driver_version) == ("580.159.04", 13000)


@pytest.mark.skipif(os.geteuid() != 0, reason="a pid namespace needs root")
def test_a_process_in_a_container_pid_namespace_is_reported_by_its_host_pid(
        fake: FakeNvml, proc_dir: Path) -> None:
    # NVML reports host pids; an engine in a container knows only its own pid (often 1).
    from e2e.harness.waiting import eventually

    script = ("import os, signal, sys; from driver.nvml.fake import register_process; "
              f"register_process(sys.argv[1], os.getpid(), {H200_UUID!r}, {GIB}); "
              "signal.pause()")
    holder = subprocess.Popen(["unshare", "--pid", "--fork", "--kill-child", "--",
                               sys.executable, "-c", script, str(proc_dir)])
    try:
        def child() -> int:
            kids = Path(f"/proc/{holder.pid}/task/{holder.pid}/children").read_text().split()
            return int(kids[0]) if kids else 0

        host_pid = eventually(child, timeout=10, what="the namespaced process")
        namespace = os.stat(f"/proc/{host_pid}/ns/pid").st_ino
        eventually(lambda: (proc_dir / f"{namespace}-1.json").exists(), timeout=20,
                   what="its registry file")
        assert [(p.pid, p.used_bytes) for p in fake.compute_processes(0)] == [(host_pid, GIB)]
    finally:
        holder.kill()
        holder.wait(10)
    eventually(lambda: fake.compute_processes(0) == [], timeout=10,
               what="the gone process forgotten")


def test_an_event_written_by_another_process_is_delivered_once(fake: FakeNvml,
                                                               proc_dir: Path) -> None:
    # How a test reaches the fake NVML of a driver running in a container.
    from driver.nvml.fake import write_health_event

    event = HealthEvent(H200_UUID, HealthEventKind.XID, 79, "GPU has fallen off the bus")
    subprocess.run([sys.executable, "-c",
                    "import sys; from driver.nvml import HealthEvent, HealthEventKind; "
                    "from driver.nvml.fake import write_health_event; "
                    "write_health_event(sys.argv[1], HealthEvent(sys.argv[2], "
                    "HealthEventKind.XID, 79, 'GPU has fallen off the bus'))",
                    str(proc_dir), H200_UUID], check=True)
    assert fake.wait_health_event(2000) == event
    assert fake.wait_health_event(0) is None
    write_health_event(proc_dir, event)
    write_health_event(proc_dir, HealthEvent(H200_UUID, HealthEventKind.ECC_DOUBLE_BIT, None,
                                             "dbe"))
    assert fake.wait_health_event(1000) == event
    assert fake.wait_health_event(1000).kind is HealthEventKind.ECC_DOUBLE_BIT  # type: ignore[union-attr]


def test_a_read_of_the_process_list_is_one_moment_of_the_gpu(
        fake: FakeNvml, proc_dir: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A switch (the first engine down to its resident memory, then the second up) that
    lands while the registry is being read is seen whole or not at all, as NVML's own
    process list is: never the first engine before it beside the second after it. The old
    reader took the files one by one, and such a torn read showed two engines awake."""
    import threading

    other = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        pids = (os.getpid(), other.pid)
        for pid, size in zip(pids, (80 * GIB, 2 * GIB), strict=True):
            register_process(proc_dir, pid, H200_UUID, size)
        original = FakeNvml._read
        switched: list[threading.Thread] = []

        def read_then_switch(self: FakeNvml, path: Path, seen: set[tuple[str, int, int]]
                             ) -> object:
            record = original(self, path, seen)
            if not switched and record is not None:
                first = record.pid
                second = next(p for p in pids if p != first)
                high = record.used_bytes > 40 * GIB

                def switch() -> None:  # the holder sleeps, then the target wakes
                    register_process(proc_dir, first, H200_UUID, 2 * GIB if high else 80 * GIB)
                    register_process(proc_dir, second, H200_UUID, 80 * GIB if high else 2 * GIB)

                thread = threading.Thread(target=switch)
                switched.append(thread)
                thread.start()
                thread.join(0.5)  # unhindered, the switch is done long before this
            return record

        monkeypatch.setattr(FakeNvml, "_read", read_then_switch)
        seen = {p.pid: p.used_bytes or 0 for p in fake.compute_processes(0)}
        switched[0].join(5)
        assert not switched[0].is_alive()
        assert sorted(seen.values()) == [2 * GIB, 80 * GIB], seen
        after = {p.pid: p.used_bytes or 0 for p in fake.compute_processes(0)}
        assert sorted(after.values()) == [2 * GIB, 80 * GIB]
        assert after != seen, "the switch happened, after the read"
    finally:
        other.kill()
        other.wait()


def test_memory_and_processes_are_one_read(fake: FakeNvml, proc_dir: Path) -> None:
    """The inspection's read: free memory and the process list from the same moment, and
    a failure injected into either call fails it."""
    register_process(proc_dir, os.getpid(), H200_UUID, 16 * GIB)
    memory, processes = fake.memory_and_processes(0)
    assert [(p.pid, p.used_bytes) for p in processes] == [(os.getpid(), 16 * GIB)]
    assert memory.used == H200_BASELINE + 16 * GIB
    assert (memory, processes) == (fake.memory_info(0), fake.compute_processes(0))
    for call in ("memory_info", "compute_processes"):
        fake.fail(call, "gpu_is_lost", index=0, times=1)
        with pytest.raises(NvmlError) as err:
            fake.memory_and_processes(0)
        assert err.value.reason == "gpu_is_lost"
