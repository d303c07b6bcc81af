"""The alerts: the PrometheusRule the chart renders passes ``promtool check rules`` and the
unit tests in ``rules_test.yaml`` (``promtool test rules``: each alert fires on the series
that should fire it, at the right time, with its labels and text, and stays quiet on the
ones that should not)."""

from __future__ import annotations

from pathlib import Path

import yaml

from e2e.release.chart import render, run_tool
from tests.chart.minimal import MINIMAL

TESTS = Path(__file__).with_name("rules_test.yaml")
ALERTS = {"RotaSwitchFailing", "RotaSwitchFailureRatioHigh", "RotaGpuWithoutOwner",
          "RotaDoubleAwakeDetected", "RotaGpuUnhealthy", "RotaNodeWithoutController",
          "RotaNvmlErrors"}


def _rendered_rules(chart_bin: Path, directory: Path) -> Path:
    [rule] = render(set_values={**MINIMAL, "metrics.prometheusRule.enabled": "true"},
                    bin_dir=chart_bin).find("PrometheusRule")
    path = directory / "rules.yaml"
    path.write_text(yaml.safe_dump(rule["spec"], sort_keys=False))
    return path


def test_the_rendered_rules_are_valid(chart_bin: Path, tmp_path: Path) -> None:
    rules = _rendered_rules(chart_bin, tmp_path)
    done = run_tool("promtool", ["check", "rules", str(rules)], bin_dir=chart_bin)
    assert f"SUCCESS: {len(ALERTS)} rules found" in done.stdout
    names = {r["alert"] for g in yaml.safe_load(rules.read_text())["groups"]
             for r in g["rules"]}
    assert names == ALERTS


def test_every_alert_passes_its_unit_tests(chart_bin: Path, tmp_path: Path) -> None:
    _rendered_rules(chart_bin, tmp_path)
    tests = tmp_path / TESTS.name
    tests.write_text(TESTS.read_text())
    tested = {t["alertname"] for case in yaml.safe_load(tests.read_text())["tests"]
              for t in case["alert_rule_test"]}
    assert tested == ALERTS
    done = run_tool("promtool", ["test", "rules", str(tests)], bin_dir=chart_bin, check=False)
    assert done.returncode == 0, done.stdout + done.stderr
    assert "SUCCESS" in done.stdout


def test_a_wrong_expectation_fails(chart_bin: Path, tmp_path: Path) -> None:
    """The unit tests can fail: an alert expected where none fires is reported."""
    _rendered_rules(chart_bin, tmp_path)
    suite = yaml.safe_load(TESTS.read_text())
    case = suite["tests"][0]
    case["alert_rule_test"] = [{"eval_time": "20m", "alertname": "RotaSwitchFailing",
                                "exp_alerts": [{"exp_labels": {"node": "gpu-1"}}]}]
    suite["tests"] = [case]
    tests = tmp_path / "wrong_test.yaml"
    tests.write_text(yaml.safe_dump(suite))
    done = run_tool("promtool", ["test", "rules", str(tests)], bin_dir=chart_bin, check=False)
    assert done.returncode != 0
    assert "FAILED" in done.stdout + done.stderr
