"""The leaked-task check can fail: a test that leaves a task pending errors, a clean one
passes (a pytest run of its own, with rota's check loaded)."""

from __future__ import annotations

from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent


def test_a_test_that_leaks_a_task_fails(pytester: pytest.Pytester,
                                       monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("PYTHONPATH", str(ROOT))
    pytester.makeini("[pytest]\nasyncio_mode = auto\n"
                     "asyncio_default_fixture_loop_scope = function\n")
    pytester.makeconftest('pytest_plugins = ["tests.leaks"]\n')
    pytester.makepyfile(test_leaky='''
import asyncio

import pytest


async def test_leaks_a_task():
    asyncio.create_task(asyncio.Event().wait(), name="forgotten-waiter")


async def test_awaits_its_task():
    task = asyncio.create_task(asyncio.sleep(0))
    await task


@pytest.fixture
async def server():
    task = asyncio.create_task(asyncio.Event().wait(), name="fixture-server")
    yield
    task.cancel()
    await asyncio.gather(task, return_exceptions=True)


async def test_a_fixture_that_cleans_up_is_not_a_leak(server):
    pass


def test_sync():
    pass
''')
    result = pytester.runpytest_subprocess("-p", "no:cacheprovider")
    result.assert_outcomes(passed=4, errors=1)
    result.stdout.fnmatch_lines(["*test_leaks_a_task*", "*leaked 1 asyncio task*forgotten-waiter*"])
