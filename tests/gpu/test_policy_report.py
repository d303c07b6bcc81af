"""The policy comparison's tables (``python -m e2e.gpu.report policy.json ...``): the
summary per window and policy, and whether two runs (the simulator's and the real
engines') rank the policies alike."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from e2e.gpu import report
from e2e.gpu.policy_slo import Bounds


def _run(mode: str, requests: int, slo: int, *, frozen: int = 0, altered: int = 0
         ) -> dict[str, Any]:
    row = {"requests": requests, "served": requests, "goodput": slo, "slo_goodput": slo,
           "wakes": 2, "wasted": 0, "sent_back": 0, "frozen": frozen,
           "identical": frozen - altered, "altered": altered, "lost": 0, "unchecked": 0}
    return {"mode": mode, "rows": [row], "slo_goodput": slo,
            "not_frozen": {"identical": requests - frozen, "altered": 0, "lost": 0,
                           "unchecked": 0}}


def _result(launcher: str, goodputs: dict[str, int]) -> dict[str, Any]:
    runs: list[dict[str, Any]] = [_run(m, 40, g, frozen=5 if m == "rota" else 0)
                                  for m, g in goodputs.items()]
    runs.insert(0, {"mode": "all-awake", "fits": False, "need_mib": 90000, "gpu_mib": 81559})
    return {"benchmark": "policy_on_engines", "launcher": launcher, "device": "H100",
            "engines_count": 3, "trace": "azure", "ttft_slo_s": 2.0, "longest_freeze_s": 3.0,
            "windows": [{"start_s": 600.0, "runs": runs},
                        {"start_s": 1800.0, "runs": [_run(m, 30, g // 2)
                                                     for m, g in goodputs.items()]}]}


def test_the_summary_says_what_users_felt_and_what_did_not_fit() -> None:
    real = _result("vllm", {"first-come": 10, "drain": 20, "rota": 37})
    text = report.policy_summary(real["windows"], Bounds())
    assert "| 600 s | all-awake |  | does not fit (90000 of 81559 MiB) |" in text
    assert "| 600 s | rota | 40 | 37 | **37** | 92.5 | 5 | 5 / 0 / 0 | 0 | 2 |" in text
    assert "| **all** | **rota** | 70 | 55 | **55** | 78.6 | 5 | 5 / 0 / 0 | 0 | 4 |" in text


def test_two_runs_are_ranked_side_by_side(tmp_path: Path) -> None:
    real = _result("vllm", {"first-come": 10, "drain": 20, "rota": 37})
    simulated = _result("simulator", {"first-come": 12, "drain": 30, "rota": 35})
    differs = _result("simulator", {"first-come": 25, "drain": 20, "rota": 37})
    assert "| 600 s | rota 37 > drain 20 > first-come 10 | rota 35 > drain 30 > first-come " \
           "12 | yes |" in report.policy_rankings([real, simulated])
    assert "| **no** |" in report.policy_rankings([real, differs])
    paths = []
    for name, result in (("real", real), ("sim", simulated)):
        paths.append(tmp_path / f"{name}.json")
        paths[-1].write_text(json.dumps(result))
    assert report.main([str(p) for p in paths]) == 0
