"""The sample of long scenarios is bounded, reproducible and can be widened: a pytest run of
its own with rota's sampling plugin loaded, over ten scenario files of two marked tests
each (a file runs whole or not at all) and two plain tests."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.sampling import choose, sample_size

ROOT = Path(__file__).resolve().parent.parent

_LONG = "import pytest\n\npytestmark = pytest.mark.sampled\n\n\ndef test_first():\n    pass\n\n\n" \
    "def test_second():\n    pass\n"
_PLAIN = "def test_plain_a():\n    pass\n\n\ndef test_plain_b():\n    pass\n"


@pytest.fixture
def suite(pytester: pytest.Pytester, monkeypatch: pytest.MonkeyPatch) -> pytest.Pytester:
    monkeypatch.setenv("PYTHONPATH", str(ROOT))
    monkeypatch.delenv("ROTA_SAMPLE", raising=False)
    monkeypatch.setenv("ROTA_SAMPLE_SEED", "seed-1")
    pytester.makeini("[pytest]\nmarkers =\n    sampled: long\n")
    pytester.makeconftest('pytest_plugins = ["tests.sampling"]\n')
    pytester.makepyfile(**{f"test_long_{n}": _LONG for n in range(10)}, test_plain=_PLAIN)
    return pytester


def _ran(result: pytest.RunResult) -> list[str]:
    return sorted(line.split()[-1] for line in result.outlines if line.startswith("  ran "))


def test_a_whole_run_keeps_the_default_sample_and_every_plain_test(
        suite: pytest.Pytester) -> None:
    result = suite.runpytest_subprocess("-p", "no:cacheprovider")
    result.assert_outcomes(passed=3 * 2 + 2, deselected=7 * 2)
    result.stdout.fnmatch_lines(["*ran 3 of 10 (seed seed-1)*ROTA_SAMPLE=all*"])


def test_the_same_seed_runs_the_same_sample_and_another_seed_another(
        suite: pytest.Pytester, monkeypatch: pytest.MonkeyPatch) -> None:
    first = _ran(suite.runpytest_subprocess("-p", "no:cacheprovider"))
    again = _ran(suite.runpytest_subprocess("-p", "no:cacheprovider"))
    monkeypatch.setenv("ROTA_SAMPLE_SEED", "seed-2")
    other = _ran(suite.runpytest_subprocess("-p", "no:cacheprovider"))
    assert len(first) == 3
    assert first == again
    assert other != first


def test_rota_sample_widens_or_empties_the_sample(suite: pytest.Pytester,
                                                 monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("ROTA_SAMPLE", "all")
    suite.runpytest_subprocess("-p", "no:cacheprovider").assert_outcomes(passed=22)
    monkeypatch.setenv("ROTA_SAMPLE", "0")
    suite.runpytest_subprocess("-p", "no:cacheprovider").assert_outcomes(
        passed=2, deselected=20)


def test_a_named_file_runs_whole_unless_a_sample_is_asked_for(
        suite: pytest.Pytester, monkeypatch: pytest.MonkeyPatch) -> None:
    named = ("test_long_0.py", "test_long_1.py", "test_plain.py")
    suite.runpytest_subprocess("-p", "no:cacheprovider", *named).assert_outcomes(passed=6)
    monkeypatch.setenv("ROTA_SAMPLE", "1")
    suite.runpytest_subprocess("-p", "no:cacheprovider", *named).assert_outcomes(
        passed=4, deselected=2)


def test_a_bad_sample_size_is_a_usage_error(suite: pytest.Pytester,
                                            monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("ROTA_SAMPLE", "some")
    result = suite.runpytest_subprocess("-p", "no:cacheprovider")
    assert result.ret == pytest.ExitCode.USAGE_ERROR
    result.stderr.fnmatch_lines(["*ROTA_SAMPLE must be a whole number or 'all'*"])


def test_choose_is_a_bounded_subset() -> None:
    ids = [f"t{n}" for n in range(20)]
    picked = choose(ids, 5, "x")
    assert len(picked) == 5
    assert set(picked) <= set(ids)
    assert choose(ids, None, "x") == sorted(ids)
    assert choose(ids, 50, "x") == sorted(ids)
    assert sample_size("all") is None
    assert sample_size(" 4") == 4
