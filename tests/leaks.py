"""A pytest plugin: an async test fails when it leaves asyncio tasks pending on its loop.

Every async test (of a function-scoped loop) gets the async fixture :func:`_no_leaked_tasks`
first, so its teardown runs in the test's own loop after every other fixture of the test
has been torn down, and before pytest-asyncio closes the loop (which would cancel the
leftovers silently). A task still pending then was started by the test, or by code it
called, and nobody awaited it: the test errors at teardown naming the tasks, and they are
cancelled so the next test starts clean. Sync tests run no loop of pytest-asyncio and are
not checked.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator

import pytest
import pytest_asyncio
from pytest_asyncio import is_async_test

_FIXTURE = "_no_leaked_tasks"


def _describe(task: asyncio.Task[object]) -> str:
    coro = task.get_coro()
    code = getattr(coro, "cr_code", None) or getattr(coro, "gi_code", None)
    where = f" at {code.co_filename}:{code.co_firstlineno}" if code is not None else ""
    return f"{task.get_name()} ({getattr(coro, '__qualname__', coro)!s}{where})"


@pytest_asyncio.fixture(loop_scope="function")
async def _no_leaked_tasks() -> AsyncIterator[None]:
    yield
    current = asyncio.current_task()
    pending = [t for t in asyncio.all_tasks() if t is not current and not t.done()]
    if not pending:
        return
    names = sorted(_describe(t) for t in pending)
    for task in pending:
        task.cancel()
    await asyncio.gather(*pending, return_exceptions=True)
    pytest.fail(f"test leaked {len(pending)} asyncio task(s): {', '.join(names)}",
                pytrace=False)


def _function_loop(item: pytest.Item) -> bool:
    marker = item.get_closest_marker("asyncio")
    scope = marker.kwargs.get("loop_scope") if marker is not None else None
    return bool((scope or item.config.getini("asyncio_default_test_loop_scope")) == "function")


@pytest.hookimpl(trylast=True)
def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    for item in items:
        if is_async_test(item) and _function_loop(item):
            names = item.fixturenames
            if _FIXTURE not in names:
                names.insert(0, _FIXTURE)
