"""The lease controller's cache of control tokens follows the node's claims, also while
an ask of the driver is in flight: the old cache stored an answer that arrived after
:meth:`ControlTokens.keep_only` had dropped the claim, so a claim that left kept a token."""

from __future__ import annotations

import asyncio

from controller.lease.control_tokens import ControlTokens

WAIT = 5.0


class FakeDriverTokens:
    """A driver's inspection API whose answers wait until the test lets them go."""

    def __init__(self) -> None:
        self.asked: list[str] = []
        self.answer = asyncio.Event()
        self.changed = asyncio.Condition()

    async def fetch(self, claim_uid: str) -> str:
        async with self.changed:
            self.asked.append(claim_uid)
            self.changed.notify_all()
        await self.answer.wait()
        return f"token-of-{claim_uid}-{len(self.asked)}"


async def _until_asked(driver: FakeDriverTokens, count: int) -> None:
    async with asyncio.timeout(WAIT), driver.changed:
        await driver.changed.wait_for(lambda: len(driver.asked) >= count)


async def test_an_answer_for_a_claim_dropped_meanwhile_is_not_kept() -> None:
    driver = FakeDriverTokens()
    tokens = ControlTokens(driver.fetch)
    call = asyncio.ensure_future(tokens.get("claim-a"))
    await _until_asked(driver, 1)
    tokens.keep_only(set())          # the claim left the node while the driver answered
    driver.answer.set()
    async with asyncio.timeout(WAIT):
        assert await call == "token-of-claim-a-1"
    assert await tokens.get("claim-a") == "token-of-claim-a-2"  # asked again: not kept
    assert driver.asked == ["claim-a", "claim-a"]


async def test_a_kept_claims_answer_is_kept() -> None:
    driver = FakeDriverTokens()
    tokens = ControlTokens(driver.fetch)
    call = asyncio.ensure_future(tokens.get("claim-a"))
    await _until_asked(driver, 1)
    tokens.keep_only({"claim-a"})
    driver.answer.set()
    async with asyncio.timeout(WAIT):
        assert await call == "token-of-claim-a-1"
    assert await tokens.get("claim-a") == "token-of-claim-a-1"
    assert driver.asked == ["claim-a"]


async def test_an_ask_after_the_drop_is_kept_though_the_dropped_one_answers_last() -> None:
    driver = FakeDriverTokens()
    tokens = ControlTokens(driver.fetch)
    first = asyncio.ensure_future(tokens.get("claim-a"))
    await _until_asked(driver, 1)
    tokens.keep_only(set())
    second = asyncio.ensure_future(tokens.get("claim-a"))   # the claim came back
    await _until_asked(driver, 2)
    driver.answer.set()
    async with asyncio.timeout(WAIT):
        await asyncio.gather(first, second)
    assert await tokens.get("claim-a") == "token-of-claim-a-2"
    assert driver.asked == ["claim-a", "claim-a"]
