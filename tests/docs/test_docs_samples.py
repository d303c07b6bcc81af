"""Sample outputs in the docs are checked against the code that prints them, so they
cannot drift: ``kubectl rota status``'s table in docs/operations.md has the columns, in
order, that controller/kubectl_rota.py prints, and a row of each."""

from __future__ import annotations

from controller.kubectl_rota import STATUS_COLUMNS
from tests.docs.blocks import ROOT


def _status_sample() -> list[str]:
    text = (ROOT / "docs" / "operations.md").read_text()
    after = text.split("$ kubectl rota status\n", 1)[1]
    return after.split("```", 1)[0].strip("\n").splitlines()


def test_the_kubectl_rota_status_sample_has_the_codes_columns() -> None:
    header, *rows = _status_sample()
    assert tuple(header.split()) == STATUS_COLUMNS
    assert rows
    for row in rows:
        assert len(row.split()) == len(STATUS_COLUMNS), row
