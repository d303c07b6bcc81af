"""A pytest plugin: long scenarios marked ``sampled`` run as a bounded, rotating sample.

The whole suite (``make test``) has a time budget; some scenarios (real nodes through a
rolling upgrade, a registry install, campaigns) each take minutes. They are marked
``@pytest.mark.sampled`` and a run of the whole suite keeps only a sample of them:

- a scenario is a file: its marked tests run together or not at all (they may build on
  each other, as an install, its upgrade and its uninstall do);
- ``ROTA_SAMPLE`` says how many (default :data:`DEFAULT_SAMPLE`); ``all`` keeps every one,
  ``0`` none;
- which ones follows from a seed (``ROTA_SAMPLE_SEED``, else the checkout's commit), so one
  commit always runs the same sample, and successive commits cover all of them in turn;
- naming tests on the command line (``pytest tests/node/test_x.py``) runs what was named,
  sampled or not, unless ``ROTA_SAMPLE`` is set.

The sample and what it left out are printed in the terminal summary, with the seed, so a
run that failed can be repeated exactly.
"""

from __future__ import annotations

import hashlib
import os
import subprocess
from pathlib import Path

import pytest

DEFAULT_SAMPLE = 3
MARKER = "sampled"
_KEY = pytest.StashKey[tuple[str, list[str], list[str]]]()


def _commit(root: Path) -> str:
    try:
        done = subprocess.run(["git", "-C", str(root), "rev-parse", "HEAD"],
                              capture_output=True, text=True, timeout=10, check=False)
    except (OSError, subprocess.TimeoutExpired):
        return "no-commit"
    return done.stdout.strip() or "no-commit"


def sample_size(raw: str | None) -> int | None:
    """How many sampled scenarios to keep: None keeps every one."""
    if raw is None or raw == "":
        return DEFAULT_SAMPLE
    if raw.strip().lower() == "all":
        return None
    try:
        size = int(raw)
    except ValueError:
        raise pytest.UsageError(
            f"ROTA_SAMPLE must be a whole number or 'all', not {raw!r}") from None
    if size < 0:
        raise pytest.UsageError(f"ROTA_SAMPLE must not be negative, not {size}")
    return size


def scenario_of(item: pytest.Item) -> str:
    """The scenario a sampled test belongs to: its file."""
    return item.nodeid.split("::", 1)[0]


def choose(nodeids: list[str], size: int | None, seed: str) -> list[str]:
    """The ``size`` node ids ranked first by a hash of seed and id (all when None)."""
    if size is None or size >= len(nodeids):
        return sorted(nodeids)

    def rank(nodeid: str) -> str:
        return hashlib.sha256(f"{seed}\0{nodeid}".encode()).hexdigest()

    return sorted(sorted(nodeids, key=rank)[:size])


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    raw = os.environ.get("ROTA_SAMPLE")
    named = bool(config.option.file_or_dir)
    if raw is None and named:
        return
    sampled = [item for item in items if item.get_closest_marker(MARKER) is not None]
    if not sampled:
        return
    seed = os.environ.get("ROTA_SAMPLE_SEED") or _commit(config.rootpath)
    scenarios = sorted({scenario_of(item) for item in sampled})
    kept = set(choose(scenarios, sample_size(raw), seed))
    left = [item for item in sampled if scenario_of(item) not in kept]
    if left:
        config.hook.pytest_deselected(items=left)
        dropped = {id(item) for item in left}
        items[:] = [item for item in items if id(item) not in dropped]
    config.stash[_KEY] = (seed, sorted(kept), sorted(set(scenarios) - kept))


def pytest_terminal_summary(terminalreporter: pytest.TerminalReporter,
                            config: pytest.Config) -> None:
    if _KEY not in config.stash:
        return
    seed, kept, left = config.stash[_KEY]
    write = terminalreporter.write_line
    terminalreporter.section("sampled scenarios")
    write(f"ran {len(kept)} of {len(kept) + len(left)} (seed {seed}); "
          "ROTA_SAMPLE=all runs every one, ROTA_SAMPLE_SEED=<seed> repeats this sample")
    for scenario in kept:
        write(f"  ran      {scenario}")
    for scenario in left:
        write(f"  not run  {scenario}")
