"""The driver's part of per-claim control credentials (review F1): every claim with an
engine config gets a control token of its own in its CDI environment, with or without the
start gate; a re-prepare writes the same bytes; and the lease controller gets the same
token through the inspection API, without reading the key."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from controller.lease.device import DeviceError, DeviceReader
from driver.cdi import build_claim_spec, render_spec
from driver.claims import ClaimPlan, plan_claim
from driver.control_tokens import ControlTokens
from driver.inspection import InspectionService
from driver.nvml import fixture_path
from driver.nvml.fake import FakeNvml
from driver.startgate import KEY_BYTES, StartGate
from rota.api.control_contract import CONTROL_TOKEN_ENV
from rota.kit.sockets import UnixServer
from tests.driver.test_cdi import DEVICES, ENGINE, EXCLUSIVE_RESULT, SHARED_RESULT

KEY = bytes(range(KEY_BYTES))
UID_A = "0b6f3c1e-6a55-4d1e-9a53-1c2f2f7f0a0a"
UID_B = "0b6f3c1e-6a55-4d1e-9a53-1c2f2f7f0a0b"


def plan(uid: str, *results: dict[str, Any], config: dict[str, Any] | None = None
         ) -> ClaimPlan:
    devices: dict[str, Any] = {"results": list(results)}
    if config is not None:
        devices["config"] = [{"source": "FromClaim",
                              "opaque": {"driver": "gpu.rota.dev", "parameters": config}}]
    claim = {"metadata": {"uid": uid, "name": f"claim-{uid[-1]}", "namespace": "team-a"},
             "status": {"allocation": {"devices": devices}}}
    return plan_claim(claim, expected_uid=uid, namespace="team-a", name=f"claim-{uid[-1]}",
                      driver="gpu.rota.dev", pool="node-a", devices=DEVICES)


def environment(spec: dict[str, Any]) -> dict[str, str]:
    """The environment the spec gives a container (every device carries the same one)."""
    envs = [dict(e.split("=", 1) for e in d["containerEdits"]["env"])
            for d in spec["devices"]]
    assert all(env == envs[0] for env in envs)
    return envs[0]


def test_tokens_are_per_claim_deterministic_and_not_the_start_token() -> None:
    tokens = ControlTokens(KEY)
    assert tokens.token(UID_A) == ControlTokens(KEY).token(UID_A)
    assert tokens.token(UID_A) != tokens.token(UID_B)
    assert tokens.token(UID_A) != ControlTokens(bytes(KEY_BYTES)).token(UID_A)
    assert tokens.token(UID_A) != StartGate(Path("/run/start"), KEY).token(UID_A)
    with pytest.raises(ValueError, match="claim uid"):
        tokens.token("")
    with pytest.raises(ValueError, match="bytes"):
        ControlTokens(b"short")


def test_each_engine_claim_gets_its_own_token_and_a_reprepare_the_same_bytes() -> None:
    control = ControlTokens(KEY)
    a = build_claim_spec(plan(UID_A, SHARED_RESULT, config=ENGINE), DEVICES, control=control)
    b = build_claim_spec(plan(UID_B, SHARED_RESULT, config=ENGINE), DEVICES, control=control)
    assert environment(a)[CONTROL_TOKEN_ENV] == control.token(UID_A)
    assert environment(b)[CONTROL_TOKEN_ENV] == control.token(UID_B)
    assert environment(a)[CONTROL_TOKEN_ENV] != environment(b)[CONTROL_TOKEN_ENV]
    # A re-prepare (a restarted driver, the same key read from disk) rewrites identical bytes.
    again = build_claim_spec(plan(UID_A, SHARED_RESULT, config=ENGINE), DEVICES,
                             control=ControlTokens(bytes(KEY)))
    assert render_spec(again) == render_spec(a)


def test_the_token_does_not_depend_on_the_start_gate_and_plain_claims_get_none() -> None:
    control = ControlTokens(KEY)
    gated = build_claim_spec(plan(UID_A, SHARED_RESULT, config=ENGINE), DEVICES,
                             control=control, start_gate=StartGate(Path("/run/start"), KEY))
    ungated = build_claim_spec(plan(UID_A, SHARED_RESULT, config=ENGINE), DEVICES,
                               control=control)
    assert environment(gated)[CONTROL_TOKEN_ENV] == environment(ungated)[CONTROL_TOKEN_ENV]
    plain = build_claim_spec(plan(UID_A, EXCLUSIVE_RESULT), DEVICES, control=control)
    assert CONTROL_TOKEN_ENV not in environment(plain)


async def test_the_controller_gets_the_token_cdi_wrote_through_the_inspection_api(
        short_tmp: Path) -> None:
    control = ControlTokens(KEY)
    spec = build_claim_spec(plan(UID_A, SHARED_RESULT, config=ENGINE), DEVICES, control=control)
    backend = FakeNvml.from_path(fixture_path("h200"), short_tmp / "procs")
    service = InspectionService(backend=backend, gpus=[], proc_root=short_tmp, control=control)
    socket = short_tmp / "inspect.sock"
    server = UnixServer(socket, [service.handler()])
    await server.start()
    reader = DeviceReader(socket, timeout_s=5.0)
    try:
        assert await reader.control_token(UID_A) == environment(spec)[CONTROL_TOKEN_ENV]
        assert await reader.control_token(UID_B) == control.token(UID_B)
        with pytest.raises(DeviceError, match="INVALID_ARGUMENT"):
            await reader.control_token("")
    finally:
        await reader.close()
        await server.stop(1)


async def test_a_driver_without_a_key_gives_no_token(short_tmp: Path) -> None:
    backend = FakeNvml.from_path(fixture_path("h200"), short_tmp / "procs")
    service = InspectionService(backend=backend, gpus=[], proc_root=short_tmp)
    socket = short_tmp / "inspect.sock"
    server = UnixServer(socket, [service.handler()])
    await server.start()
    reader = DeviceReader(socket, timeout_s=5.0)
    try:
        with pytest.raises(DeviceError, match="FAILED_PRECONDITION"):
            await reader.control_token(UID_A)
    finally:
        await reader.close()
        await server.stop(1)
