"""The start-gate contract has one home (rota/api/start_contract.py): the lease controller's
models carry exactly its fields, and the driver's CDI environment uses its names (the gate's
zipapp carries it: ``test_engine_gate.py`` runs the installed copy without rota)."""

from __future__ import annotations

import typing
from pathlib import Path

from controller.lease import starts
from driver.startgate import KEY_BYTES, StartGate
from rota.api import start_contract
from rota.api.start_contract import StartAnswer, StartQuestion


def test_the_controllers_models_carry_the_contracts_fields() -> None:
    assert set(starts.StartRequest.model_fields) == set(typing.get_type_hints(StartQuestion))
    assert set(starts.StartReply.model_fields) == set(typing.get_type_hints(StartAnswer))
    assert starts.PATH == start_contract.PATH


def test_the_cdi_environment_is_what_the_gate_reads(tmp_path: Path) -> None:
    gate = StartGate(tmp_path, b"k" * KEY_BYTES)
    env = gate.environment("uid-1")
    assert set(env) == {start_contract.SOCKET_ENV, start_contract.TOKEN_ENV}
