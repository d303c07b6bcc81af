"""Smoke test of the policy benchmark (e2e/bench/policy.py): a few hundred arrivals of the
Azure LLM inference trace 2023 through every policy. No timing is asserted.

Trace data: Azure LLM inference trace 2023 (AzurePublicDataset), CC-BY 4.0; Pratyush
Patel, Esha Choukse, Chaojie Zhang, Aashaka Shah, Íñigo Goiri, Saeed Maleki, Ricardo
Bianchini, "Splitwise: Efficient generative LLM inference using phase splitting", ISCA 2024.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from e2e.bench import policy as bench_policy


@pytest.mark.skipif(not bench_policy.DATA.exists(), reason="no trace data")
def test_every_policy_runs_on_a_few_hundred_arrivals(capsys: pytest.CaptureFixture[str]
                                                     ) -> None:
    assert bench_policy.main(["--limit", "300", "--speed", "1", "--step-s", "0.05"]) == 0
    out = capsys.readouterr().out
    for policy in bench_policy.POLICIES:
        assert f"| **{policy}** | **all** |" in out
    assert "CC-BY 4.0" in out


def test_a_users_own_csv_is_replayed(tmp_path: Path, capsys: pytest.CaptureFixture[str]
                                     ) -> None:
    trace = tmp_path / "mine.csv"
    rows = ["timestamp,model,context_tokens,generated_tokens"]
    rows += [f"{i * 0.5},{'ab'[i % 2]},100,10" for i in range(40)]
    trace.write_text("\n".join(rows) + "\n")
    assert bench_policy.main(["--trace", str(trace), "--models", "2", "--speed", "1",
                              "--policies", "on-demand,rota"]) == 0
    out = capsys.readouterr().out
    assert "| rota | m1 (16 GB) | 20 | 20 |" in out
