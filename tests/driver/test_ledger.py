"""The ledger: round trips, corruption, reboots, crash leftovers and the node-wide lock."""

from __future__ import annotations

import hashlib
import json
import logging
import multiprocessing
import os
from datetime import UTC, datetime, timedelta, timezone
from multiprocessing.synchronize import Event
from pathlib import Path
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from driver.errors import LedgerError
from driver.ledger import (
    API_VERSION,
    ClaimRecord,
    Ledger,
    LedgerState,
    PreparedDevice,
    current_boot_id,
    file_lock,
)

BOOT = "5b1c6c0e-2f55-4e1e-8f6d-0d0b7a9f1e21"
GIB = 2**30
WAIT_S = 30.0  # upper bound for waits on another process; never reached when things work


def device(**fields: Any) -> PreparedDevice:
    values: dict[str, Any] = {
        "request_names": ("engine",),
        "pool_name": "node-a",
        "device_name": "gpu-0",
        "share_id": "6c1b8d0e-54a1-4f07-9e6b-5a0d3e1f2a11",
        "cdi_device_ids": ("k8s.gpu.rota.dev/claim=uid-1-gpu-0-6c1b",),
        "gpu_uuid": "GPU-aaa",
        "resident_bytes": 2 * GIB,
    }
    values.update(fields)
    return PreparedDevice(**values)


def record(uid: str = "uid-1", **fields: Any) -> ClaimRecord:
    values: dict[str, Any] = {
        "uid": uid,
        "namespace": "team-a",
        "name": "llama",
        "state": "PrepareCompleted",
        "devices": (device(),),
        "gpu_uuids": ("GPU-aaa",),
        "resident_bytes": 2 * GIB,
        "awake_bytes": 60 * GIB,
        "exclusive": False,
        "prepared_at": datetime(2026, 5, 1, 12, 30, 15, tzinfo=UTC),
    }
    values.update(fields)
    return ClaimRecord(**values)


@pytest.fixture
def ledger(tmp_path: Path) -> Ledger:
    return Ledger(tmp_path / "ledger.json", boot_id=BOOT)


def test_missing_file_is_empty(ledger: Ledger) -> None:
    assert ledger.read() == LedgerState(BOOT)
    assert not ledger.path.exists()


def test_round_trip(ledger: Ledger) -> None:
    state = (
        ledger.empty()
        .with_record(record("uid-1"))
        .with_record(record("uid-2", state="PrepareStarted", devices=(device(share_id=None),)))
    )
    size = ledger.write(state)
    assert size == ledger.path.stat().st_size
    assert ledger.read() == state
    assert ledger.path.stat().st_mode & 0o777 == 0o600


def test_file_format(ledger: Ledger) -> None:
    ledger.write(ledger.empty().with_record(record(devices=(device(share_id=None),))))
    envelope = json.loads(ledger.path.read_text())
    assert envelope["apiVersion"] == "ledger.gpu.rota.dev/v1"
    assert envelope["kind"] == "Ledger"
    assert envelope["checksum"].startswith("sha256:")
    assert len(envelope["checksum"]) == len("sha256:") + 64
    data = envelope["data"]
    assert data["bootID"] == BOOT
    stored = data["claims"]["uid-1"]
    assert stored["state"] == "PrepareCompleted"
    assert stored["gpuUUIDs"] == ["GPU-aaa"]
    assert stored["residentBytes"] == 2 * GIB
    assert stored["awakeBytes"] == 60 * GIB
    assert stored["preparedAt"] == "2026-05-01T12:30:15Z"
    assert stored["devices"][0] == {
        "requestNames": ["engine"],
        "poolName": "node-a",
        "deviceName": "gpu-0",
        "cdiDeviceIDs": ["k8s.gpu.rota.dev/claim=uid-1-gpu-0-6c1b"],
        "gpuUUID": "GPU-aaa",
        "residentBytes": 2 * GIB,
    }


def test_times_are_stored_in_utc() -> None:
    local = datetime(2026, 5, 1, 14, 30, 15, tzinfo=timezone(timedelta(hours=2)))
    stored = record(prepared_at=local)
    assert stored.prepared_at.tzinfo == UTC
    assert stored.model_dump(mode="json", by_alias=True)["preparedAt"] == "2026-05-01T12:30:15Z"


def test_naive_times_are_refused() -> None:
    with pytest.raises(ValueError, match="timezone"):
        record(prepared_at=datetime(2026, 5, 1, 12, 0, 0))


def test_every_single_bit_flip_is_detected(ledger: Ledger) -> None:
    ledger.write(ledger.empty().with_record(record()))
    original = ledger.path.read_bytes()
    for offset in range(len(original)):
        damaged = bytearray(original)
        damaged[offset] ^= 0x01
        ledger.path.write_bytes(bytes(damaged))
        with pytest.raises(LedgerError):
            ledger.read()


@pytest.mark.parametrize(
    ("content", "fragment"),
    [
        (b"", "not valid JSON"),
        (b"{", "not valid JSON"),
        (b"\xff\xfe", "not valid JSON"),
        (b"[]", "not a JSON object"),
        (b'{"apiVersion": "ledger.gpu.rota.dev/v2"}', "newer rota"),
        (b'{"kind": "Ledger"}', "cannot read"),
        (b'{"apiVersion": "ledger.gpu.rota.dev/v1", "kind": "Other"}', "has kind 'Other'"),
        (
            b'{"apiVersion": "ledger.gpu.rota.dev/v1", "kind": "Ledger", "data": {}}',
            "unexpected top-level fields",
        ),
    ],
)
def test_unreadable_files_are_errors(ledger: Ledger, content: bytes, fragment: str) -> None:
    ledger.path.write_bytes(content)
    with pytest.raises(LedgerError, match=fragment):
        ledger.read()


def rewrite_data(ledger: Ledger, change: dict[str, Any]) -> None:
    """Write a ledger whose data is valid JSON with a correct checksum but ``change`` applied."""
    envelope = json.loads(ledger.path.read_text())
    envelope["data"].update(change)
    canonical = json.dumps(envelope["data"], sort_keys=True, separators=(",", ":"))
    envelope["checksum"] = "sha256:" + hashlib.sha256(canonical.encode()).hexdigest()
    ledger.path.write_text(json.dumps(envelope))


@pytest.mark.parametrize(
    ("change", "fragment"),
    [
        ({"unknown": 1}, "does not match"),
        ({"claims": {"uid-x": {"uid": "uid-x"}}}, "claims.uid-x"),
        ({"bootID": 5}, "bootID"),
    ],
)
def test_data_not_matching_the_schema_is_an_error(
    ledger: Ledger, change: dict[str, Any], fragment: str
) -> None:
    ledger.write(ledger.empty())
    rewrite_data(ledger, change)
    with pytest.raises(LedgerError, match=fragment):
        ledger.read()


def test_records_must_be_stored_under_their_uid(ledger: Ledger) -> None:
    ledger.write(ledger.empty().with_record(record("uid-1")))
    stored = json.loads(ledger.path.read_text())["data"]["claims"]["uid-1"]
    rewrite_data(ledger, {"claims": {"uid-2": stored}})
    with pytest.raises(LedgerError, match="stored under 'uid-2'"):
        ledger.read()


def test_the_checksum_ignores_formatting(ledger: Ledger) -> None:
    state = ledger.empty().with_record(record())
    ledger.write(state)
    envelope = json.loads(ledger.path.read_text())
    ledger.path.write_text(json.dumps(envelope, indent=7))
    assert ledger.read() == state


def test_another_boot_reads_as_empty_with_a_warning(
    ledger: Ledger, caplog: pytest.LogCaptureFixture
) -> None:
    ledger.write(ledger.empty().with_record(record()))
    rebooted = Ledger(ledger.path, boot_id="another-boot")
    with caplog.at_level(logging.WARNING, logger="driver.ledger"):
        assert rebooted.read() == LedgerState("another-boot")
    warnings = [r for r in caplog.records if r.levelno == logging.WARNING]
    assert len(warnings) == 1
    assert warnings[0].__dict__["dropped_claims"] == ["uid-1"]
    assert warnings[0].__dict__["ledger_boot_id"] == BOOT


def test_a_state_of_another_boot_is_not_written(ledger: Ledger) -> None:
    with pytest.raises(LedgerError, match="another-boot"):
        ledger.write(LedgerState("another-boot"))
    assert not ledger.path.exists()


def test_temp_leftovers_are_ignored_and_cleaned(ledger: Ledger, tmp_path: Path) -> None:
    state = ledger.empty().with_record(record())
    ledger.write(state)
    leftovers = [tmp_path / ".ledger.json.abc123.tmp", tmp_path / ".ledger.json.x_y.tmp"]
    for leftover in leftovers:
        leftover.write_bytes(b'{"half": ')
    unrelated = tmp_path / ".other.json.abc.tmp"
    unrelated.write_bytes(b"")
    assert ledger.read() == state
    ledger.write(state.without("uid-1"))
    assert not any(leftover.exists() for leftover in leftovers)
    assert unrelated.exists()
    assert sorted(p.name for p in tmp_path.iterdir()) == [".other.json.abc.tmp", "ledger.json"]
    assert ledger.read() == ledger.empty()


def test_write_leaves_no_temp_file(ledger: Ledger, tmp_path: Path) -> None:
    for count in range(3):
        ledger.write(ledger.empty().with_record(record(f"uid-{count}")))
    assert [p.name for p in tmp_path.iterdir()] == ["ledger.json"]


def test_write_creates_the_directory(tmp_path: Path) -> None:
    nested = Ledger(tmp_path / "a" / "b" / "ledger.json", boot_id=BOOT)
    nested.write(nested.empty())
    assert nested.read() == nested.empty()


def test_state_helpers_are_immutable() -> None:
    empty = LedgerState(BOOT)
    one = empty.with_record(record("uid-1"))
    two = one.with_record(
        record("uid-2", gpu_uuids=("GPU-bbb",), devices=(device(gpu_uuid="GPU-bbb"),))
    )
    replaced = two.with_record(record("uid-1", state="PrepareStarted"))
    assert empty.claims == {}
    assert sorted(two.claims) == ["uid-1", "uid-2"]
    assert two.get("uid-1") is not None
    assert replaced.get("uid-1") is not None
    assert replaced.get("uid-1").state == "PrepareStarted"  # type: ignore[union-attr]
    assert two.get("uid-1").state == "PrepareCompleted"  # type: ignore[union-attr]
    assert two.without("uid-1").get("uid-1") is None
    assert two.without("missing") == two
    with pytest.raises(TypeError):
        two.claims["uid-3"] = record("uid-3")  # type: ignore[index]


def test_budgets_on_a_gpu() -> None:
    state = (
        LedgerState(BOOT)
        .with_record(record("uid-1"))
        .with_record(
            record(
                "uid-2",
                exclusive=True,
                gpu_uuids=("GPU-aaa", "GPU-bbb"),
                resident_bytes=80 * GIB,
                awake_bytes=80 * GIB,
                devices=(
                    device(
                        device_name="gpu-1",
                        share_id=None,
                        gpu_uuid="GPU-bbb",
                        resident_bytes=70 * GIB,
                    ),
                    device(device_name="gpu-0", share_id=None, resident_bytes=10 * GIB),
                ),
            )
        )
    )
    assert [r.uid for r in state.on_gpu("GPU-aaa")] == ["uid-1", "uid-2"]
    assert [r.uid for r in state.on_gpu("GPU-bbb")] == ["uid-2"]
    budgets = state.budgets_on("GPU-aaa", exclude_uid="uid-1")
    assert len(budgets) == 1
    assert budgets[0].uid == "uid-2"
    assert budgets[0].resident_bytes == 10 * GIB
    assert budgets[0].awake_bytes == 80 * GIB
    assert budgets[0].devices == (("gpu-0", None),)
    assert state.budgets_on("GPU-bbb")[0].resident_bytes == 70 * GIB


_names = st.text(alphabet="abcdefghijklmnopqrstuvwxyz0123456789-", min_size=1, max_size=20)
_free_text = st.text(max_size=30)
# fixed_dictionaries, not builds: builds would read pydantic's alias-named signature.
_devices = st.fixed_dictionaries(
    dict(
        request_names=st.lists(_names, min_size=1, max_size=3).map(tuple),
        pool_name=_names,
        device_name=_names,
        share_id=st.none() | _names,
        cdi_device_ids=st.lists(_free_text, max_size=3).map(tuple),
        gpu_uuid=_names,
        resident_bytes=st.integers(min_value=0, max_value=2**63 - 1),
    )
).map(PreparedDevice.model_validate)
_records = st.fixed_dictionaries(
    dict(
        uid=_names,
        namespace=_free_text,
        name=_free_text,
        state=st.sampled_from(["PrepareStarted", "PrepareCompleted"]),
        devices=st.lists(_devices, max_size=3).map(tuple),
        gpu_uuids=st.lists(_names, max_size=3).map(tuple),
        resident_bytes=st.integers(min_value=0, max_value=2**63 - 1),
        awake_bytes=st.integers(min_value=0, max_value=2**63 - 1),
        exclusive=st.booleans(),
        prepared_at=st.datetimes(
            min_value=datetime(1970, 1, 2), max_value=datetime(9999, 12, 30), timezones=st.just(UTC)
        ),
    )
).map(ClaimRecord.model_validate)


@settings(
    deadline=None, max_examples=60, suppress_health_check=[HealthCheck.function_scoped_fixture]
)
@given(records=st.lists(_records, max_size=5, unique_by=lambda r: r.uid), boot=_free_text)
def test_hypothesis_round_trip(tmp_path: Path, records: list[ClaimRecord], boot: str) -> None:
    target = Ledger(tmp_path / "ledger.json", boot_id=boot)
    state = LedgerState(boot)
    for item in records:
        state = state.with_record(item)
    target.write(state)
    assert target.read() == state
    assert target.render(target.read()) == target.path.read_bytes()


def _hold_lock(path: str, held: Event, release: Event) -> None:
    with file_lock(path, timeout_s=WAIT_S):
        held.set()
        release.wait(WAIT_S)


def test_lock_excludes_another_process(tmp_path: Path) -> None:
    lock_path = str(tmp_path / "ledger.lock")
    context = multiprocessing.get_context("fork")
    held, release = context.Event(), context.Event()
    holder = context.Process(target=_hold_lock, args=(lock_path, held, release))
    holder.start()
    try:
        assert held.wait(WAIT_S), "the other process never took the lock"
        with (
            pytest.raises(LedgerError, match=r"timed out after 0\.05 s"),
            file_lock(lock_path, timeout_s=0.05),
        ):
            pass
        release.set()
        with file_lock(lock_path, timeout_s=WAIT_S):
            holder.join(WAIT_S)
            assert holder.exitcode == 0
    finally:
        release.set()
        holder.join(WAIT_S)
        if holder.is_alive():
            holder.kill()


def test_waiter_gets_the_lock_once_it_is_released(tmp_path: Path) -> None:
    lock_path = str(tmp_path / "ledger.lock")
    context = multiprocessing.get_context("fork")
    held, release = context.Event(), context.Event()
    with file_lock(lock_path, timeout_s=1.0):
        waiter = context.Process(target=_hold_lock, args=(lock_path, held, release))
        waiter.start()
        assert not held.is_set()
    try:
        assert held.wait(WAIT_S), "the waiting process never got the lock"
    finally:
        release.set()
        waiter.join(WAIT_S)
    assert waiter.exitcode == 0


def test_lock_excludes_a_second_open_in_one_process(tmp_path: Path) -> None:
    lock_path = tmp_path / "ledger.lock"
    with (
        file_lock(lock_path, timeout_s=1.0),
        pytest.raises(LedgerError, match="timed out"),
        file_lock(lock_path, timeout_s=0),
    ):
        pass
    with file_lock(lock_path, timeout_s=0):
        pass


def test_lock_in_a_missing_directory_is_an_error(tmp_path: Path) -> None:
    with (
        pytest.raises(LedgerError, match="cannot open lock file"),
        file_lock(tmp_path / "missing" / "ledger.lock", timeout_s=0),
    ):
        pass


@pytest.mark.parametrize(
    ("content", "expected"),
    [(f"{BOOT}\n", BOOT), (f"  {BOOT}", BOOT), ("", None), ("\n", None)],
)
def test_current_boot_id(tmp_path: Path, content: str, expected: str | None) -> None:
    target = tmp_path / "sys" / "kernel" / "random"
    target.mkdir(parents=True)
    (target / "boot_id").write_text(content)
    if expected is None:
        with pytest.raises(LedgerError, match="empty"):
            current_boot_id(tmp_path)
    else:
        assert current_boot_id(tmp_path) == expected


def test_current_boot_id_missing(tmp_path: Path) -> None:
    with pytest.raises(LedgerError, match="cannot read boot id"):
        current_boot_id(tmp_path)


@pytest.mark.skipif(not os.path.exists("/proc/sys/kernel/random/boot_id"), reason="no procfs")
def test_current_boot_id_of_this_machine() -> None:
    assert len(current_boot_id()) == 36


def test_api_version_constant() -> None:
    assert API_VERSION == "ledger.gpu.rota.dev/v1"
