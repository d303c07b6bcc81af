"""The driver's part of start-up admission: per-claim tokens from a node key that is made
once and kept, the CDI edits that give a claim's containers the gate (its environment and
a read-only mount), and the inspection RPC through which the lease controller checks a
token without reading the key."""

from __future__ import annotations

from pathlib import Path

import grpc
import pytest

from driver.cdi import build_claim_spec, render_spec
from driver.inspection import InspectionService
from driver.nvml import fixture_path
from driver.nvml.fake import FakeNvml
from driver.startgate import KEY_BYTES, StartGate, load_or_create_key
from rota.kit.grpc_services import unary_client
from rota.kit.sockets import UnixServer
from rota.pb.rota.v1 import inspect_pb2 as pb
from tests.driver.test_cdi import DEVICES, ENGINE, EXCLUSIVE_RESULT, SHARED_RESULT, UID, make_plan

GATE_DIR = Path("/var/run/rota/start")
KEY = bytes(range(KEY_BYTES))


def test_tokens_are_per_claim_and_deterministic() -> None:
    gate = StartGate(GATE_DIR, KEY)
    assert gate.token("uid-a") == StartGate(GATE_DIR, KEY).token("uid-a")
    assert gate.token("uid-a") != gate.token("uid-b")
    assert gate.token("uid-a") != StartGate(GATE_DIR, bytes(KEY_BYTES)).token("uid-a")
    assert gate.verify("uid-a", gate.token("uid-a"))
    assert not gate.verify("uid-b", gate.token("uid-a"))
    assert not gate.verify("uid-a", "")
    assert not gate.verify("", gate.token(""))


def test_a_short_key_or_a_relative_directory_is_refused() -> None:
    with pytest.raises(ValueError, match="bytes"):
        StartGate(GATE_DIR, b"short")
    with pytest.raises(ValueError, match="absolute"):
        StartGate(Path("start"), KEY)


def test_the_key_is_made_once_and_kept(tmp_path: Path) -> None:
    path = tmp_path / "data" / "start-gate.key"
    first = load_or_create_key(path)
    assert len(first) == KEY_BYTES
    assert path.stat().st_mode & 0o777 == 0o600
    assert load_or_create_key(path) == first
    assert not [p for p in path.parent.iterdir() if p.name != path.name], "no temp files"
    path.write_bytes(b"truncated")
    with pytest.raises(ValueError, match="bytes"):
        load_or_create_key(path)


def test_an_engine_claim_gets_the_gate_and_a_plain_share_does_not() -> None:
    gate = StartGate(GATE_DIR, KEY)
    spec = build_claim_spec(make_plan(SHARED_RESULT, config=ENGINE), DEVICES, start_gate=gate)
    edits = spec["devices"][0]["containerEdits"]
    assert f"ROTA_START_SOCKET={GATE_DIR / 'start.sock'}" in edits["env"]
    assert f"ROTA_START_TOKEN={gate.token(UID)}" in edits["env"]
    assert edits["mounts"] == [{"hostPath": str(GATE_DIR), "containerPath": str(GATE_DIR),
                                "options": ["rbind", "ro", "nosuid", "nodev", "noexec"]}]
    # An idempotent prepare rebuilds the same bytes.
    again = build_claim_spec(make_plan(SHARED_RESULT, config=ENGINE), DEVICES,
                             start_gate=StartGate(GATE_DIR, KEY))
    assert render_spec(again) == render_spec(spec)
    plain = build_claim_spec(make_plan(EXCLUSIVE_RESULT), DEVICES, start_gate=gate)
    plain_edits = plain["devices"][0]["containerEdits"]
    assert "mounts" not in plain_edits
    assert not [e for e in plain_edits["env"] if e.startswith("ROTA_START_")]


def test_without_a_gate_nothing_changes() -> None:
    spec = build_claim_spec(make_plan(SHARED_RESULT, config=ENGINE), DEVICES)
    edits = spec["devices"][0]["containerEdits"]
    assert "mounts" not in edits
    assert not [e for e in edits["env"] if e.startswith("ROTA_START_")]


async def test_the_controller_checks_a_token_through_the_inspection_api(
        short_tmp: Path) -> None:
    gate = StartGate(GATE_DIR, KEY)
    backend = FakeNvml.from_path(fixture_path("h200"), short_tmp / "procs")
    service = InspectionService(backend=backend, gpus=[], proc_root=short_tmp,
                                start_gate=gate)
    socket = short_tmp / "inspect.sock"
    server = UnixServer(socket, [service.handler()])
    await server.start()
    try:
        async with grpc.aio.insecure_channel(f"unix://{socket}") as channel:
            call = unary_client(channel, pb.DESCRIPTOR.services_by_name["NodeInspection"],
                                "VerifyStartToken")
            good = await call(pb.VerifyStartTokenRequest(claim_uid="uid-a",
                                                         token=gate.token("uid-a")), timeout=5)
            bad = await call(pb.VerifyStartTokenRequest(claim_uid="uid-b",
                                                        token=gate.token("uid-a")), timeout=5)
    finally:
        await server.stop(1)
    assert good.valid is True
    assert bad.valid is False
