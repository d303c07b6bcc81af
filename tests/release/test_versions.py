"""What ``make release`` builds on a commit as it is: a snapshot of any commit, a release
only from a clean tree tagged with the version it names (in memory and a local git clone;
nothing is built).

A clone of main has no CHANGELOG section for pyproject's version and no tag: it builds a
snapshot, whose versions sort before the next release and name the commit.
"""

from __future__ import annotations

import re
import subprocess
import time
from pathlib import Path

import pytest
from packaging.version import Version

from e2e.release.artifacts import (
    SEMVER,
    ReleaseError,
    project_version,
    release_plan,
    snapshot_versions,
    stage_source,
)
from tests.release.releases import clone, git, prepare_release_commit

HELM_SEMVER = re.compile(
    r"^v?(\d+)\.(\d+)\.(\d+)(-([0-9A-Za-z-]+(\.[0-9A-Za-z-]+)*))?(\+[0-9A-Za-z-.]+)?$")
"""The SemVer 2 that Helm's chart versions and ``--version`` take (Masterminds semver)."""
OCI_TAG = re.compile(r"^[A-Za-z0-9_][A-Za-z0-9._-]{0,127}$")


@pytest.fixture
def repo(tmp_path: Path) -> Path:
    return clone(tmp_path / "rota")


def _commit_stamp(repo: Path) -> tuple[str, str]:
    revision = git(repo, "rev-parse", "HEAD")
    seconds = int(git(repo, "show", "-s", "--format=%ct", "HEAD"))
    return revision, time.strftime("%Y%m%d%H%M%S", time.gmtime(seconds))


def test_a_clone_of_main_builds_a_snapshot_of_its_commit(repo: Path) -> None:
    plan = release_plan(repo, None)
    revision, stamp = _commit_stamp(repo)
    base = Version(project_version(repo)).base_version
    assert plan.snapshot
    assert plan.revision == revision
    assert plan.version == f"{base}-dev.{stamp}.g{revision[:12]}"
    assert plan.python == f"{base}.dev{stamp}+g{revision[:12]}"
    assert plan.tree_state == "clean"
    assert SEMVER.match(plan.version)
    assert HELM_SEMVER.match(plan.version)
    assert OCI_TAG.match(plan.version)
    assert Version(plan.python) < Version(base)  # a pre-release of the next release
    assert Version(plan.python).is_devrelease


def test_a_dirty_tree_is_a_snapshot_that_says_so(repo: Path) -> None:
    (repo / "stray.txt").write_text("not committed\n")
    readme = repo / "README.md"
    readme.write_text(readme.read_text() + "\nchanged\n")
    plan = release_plan(repo, None)
    assert plan.snapshot
    assert plan.version.endswith(".dirty")
    assert plan.python.endswith(".dirty")
    assert plan.tree_state == "dirty"
    assert {line[3:] for line in plan.changed} == {"README.md", "stray.txt"}
    assert OCI_TAG.match(plan.version)
    assert HELM_SEMVER.match(plan.version)
    Version(plan.python)  # valid PEP 440


def test_snapshots_sort_by_commit_time_and_an_all_digit_sha_stays_semver() -> None:
    earlier = snapshot_versions("0.2.0rc1", "1" * 40, 1_700_000_000, dirty=False)
    later = snapshot_versions("0.2.0rc1", "a" * 40, 1_700_000_060, dirty=False)
    assert earlier[0] == "0.2.0-dev.20231114221320.g111111111111"
    assert SEMVER.match(earlier[0])  # 'g' keeps the sha from being a number
    assert Version(earlier[1]) < Version(later[1]) < Version("0.2.0")


def test_a_tagged_release_commit_builds_that_release_without_version(repo: Path) -> None:
    prepare_release_commit(repo, "0.0.0-test.1")
    plan = release_plan(repo, None)
    assert (plan.snapshot, plan.version, plan.python) == (False, "0.0.0-test.1",
                                                          "0.0.0+test.1")
    assert release_plan(repo, "0.0.0-test.1") == plan
    (repo / "stray.txt").write_text("not committed\n")
    assert release_plan(repo, None).snapshot  # the tag's release, but not its tree
    with pytest.raises(ReleaseError, match="not clean"):
        release_plan(repo, "0.0.0-test.1")


def test_an_explicit_version_keeps_every_release_check(repo: Path) -> None:
    with pytest.raises(ReleaseError, match=r"pyproject\.toml"):
        release_plan(repo, "0.0.0-test.1")
    prepare_release_commit(repo, "0.0.0-test.1")
    git(repo, "tag", "-d", "v0.0.0-test.1")
    with pytest.raises(ReleaseError, match=r"not tagged v0\.0\.0-test\.1.*git tag -a"):
        release_plan(repo, "0.0.0-test.1")
    assert release_plan(repo, None).snapshot  # untagged: a snapshot of the commit


def test_the_source_is_staged_with_the_snapshot_version_and_the_tree_as_it_is(
        repo: Path, tmp_path: Path) -> None:
    (repo / "stray.py").write_text("# untracked, not ignored\n")
    (repo / ".venv").mkdir()
    (repo / ".venv" / "ignored").write_text("ignored\n")
    plan = release_plan(repo, None)
    staged = stage_source(repo, tmp_path / "src", plan.python)
    assert f'version = "{plan.python}"' in (staged / "pyproject.toml").read_text()
    assert (staged / "stray.py").is_file()
    assert not (staged / ".venv").exists()
    assert (staged / "controller").is_dir()
    status = subprocess.run(["git", "-C", str(repo), "diff", "--quiet", "pyproject.toml"],
                            check=False)
    assert status.returncode == 0  # the checkout itself is left as it was
