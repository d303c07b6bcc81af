"""docs/api.md's error table and ``/v1/models`` fields are checked against the gateway, so
they cannot drift: every fixed code of ``controller.gateway.errors.CODES`` is listed with
its status and type and nothing else is; ``upstream_<status>`` has the type the code sends;
the codes that come from a controller are switch failure reasons or activation API codes;
the ``rota`` object's fields are the ones ``/v1/models`` sends."""

from __future__ import annotations

import json
import re
from typing import Any, cast

from controller.gateway.activation import ACTIVATION_CODES, Activator
from controller.gateway.errors import CODES, Code, EngineRefused, Unavailable
from controller.gateway.routes import _model_object
from controller.gateway.routing import ModelInfo
from rota.api.activation import ERRORS, SWITCH_FAILURE_REASONS
from tests.docs.blocks import ROOT, blocks_of

API = ROOT / "docs" / "api.md"
FAMILY = "upstream_<status>"


def _section(heading: str) -> str:
    text = API.read_text()
    return text.split(f"\n## {heading}\n", 1)[1].split("\n## ", 1)[0]


def _rows(section: str) -> list[list[str]]:
    """The body rows of the section's first table, as cells."""
    lines = [line for line in section.splitlines() if line.startswith("|")]
    return [[cell.strip() for cell in line.strip("|").split("|")] for line in lines[2:]]


def _ticked(cell: str) -> list[str]:
    return re.findall(r"`([^`]+)`", cell)


def _error_rows() -> list[tuple[str, str, list[str], str]]:
    """(status, type, codes, when) of each row of the Errors table."""
    return [(status, _ticked(type_)[0], _ticked(codes), when)
            for status, type_, codes, when in _rows(_section("Errors"))]


def test_every_fixed_code_is_documented_once_with_its_status_and_type() -> None:
    documented: dict[str, tuple[str, str]] = {}
    for status, type_, codes, _ in _error_rows():
        for code in codes:
            if code in {str(c) for c in Code}:
                assert code not in documented, f"{code} is in two rows"
                documented[code] = (status, type_)
    assert set(documented) == {str(c) for c in Code}, \
        f"undocumented: {sorted({str(c) for c in Code} - set(documented))}"
    for code, shape in CODES.items():
        assert documented[code] == (str(shape.status), shape.type), code


def test_the_stream_only_engine_refusal_has_the_type_the_code_sends() -> None:
    rows = [row for row in _error_rows() if FAMILY in row[2]]
    assert len(rows) == 1
    _, type_, codes, when = rows[0]
    assert codes == [FAMILY]
    assert type_ == EngineRefused.type
    assert "stream only" in when
    refused = EngineRefused("no", status=429)
    assert (refused.code, refused.status) == ("upstream_429", 429)


def test_every_other_documented_code_comes_from_a_controller() -> None:
    """The rows of codes that are no :class:`Code`: a controller's reasons, a 503 each."""
    fixed = {str(c) for c in Code} | {FAMILY}
    from_controller = set(SWITCH_FAILURE_REASONS) | set(ERRORS)
    seen = False
    for status, type_, codes, when in _error_rows():
        others = [code for code in codes if code not in fixed]
        if not others:
            continue
        seen = True
        assert set(others) <= from_controller, others
        assert (status, type_) == (str(Unavailable.status), Unavailable.type)
        assert "operations.md" in when
    assert seen


def test_the_activation_codes_are_fixed_codes() -> None:
    assert set(Code) >= ACTIVATION_CODES


class _FakeActivator:
    """What ``/v1/models`` asks the activator: the expected wake of a model."""

    def expected_wake_s(self, model: str) -> float | None:
        return 6.4


def _sent(info: ModelInfo) -> dict[str, Any]:
    return _model_object(info, cast(Activator, _FakeActivator()))


def test_the_rota_fields_of_v1_models_are_the_documented_ones() -> None:
    failed = _sent(ModelInfo("org/model-b", "asleep", ("gpu-node-1/gpu-0",),
                             last_error="gpu_oom"))
    awake = _sent(ModelInfo("org/model-a", "awake", ("gpu-node-1/gpu-0",)))
    table = [_ticked(field)[0] for field, _ in _rows(_section("Routes").split(
        "The `rota` object holds", 1)[1])]
    assert table == list(failed["rota"]), "the table's fields, in the order the code sends"
    assert set(awake["rota"]) == set(table) - {"last_error"}


def test_the_v1_models_sample_has_the_fields_the_code_sends() -> None:
    sample = next(json.loads(b.text) for b in blocks_of(API) if b.lang == "json")
    sent = _sent(ModelInfo("org/model-b", "asleep", ("gpu-node-1/gpu-0",),
                           last_error="gpu_oom"))
    for model in sample["data"]:
        assert set(model) == set(sent)
        assert set(model["rota"]) <= set(sent["rota"])
        assert set(sent["rota"]) - set(model["rota"]) <= {"last_error"}
