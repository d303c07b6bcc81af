"""A GPU worker forgets the start state of claims that left: the old worker kept each
claim's start spacing (``_start_backoff``) and started run (``_started``) forever, so both
grew with every claim the node ever had. In-memory node, real simulators."""

from __future__ import annotations

import aiohttp
import pytest

from rota.api import naming
from tests.controller.conftest import EngineSimFactory
from tests.controller.test_start_failover import DEADLINE_S, _a_awake_b_asleep, _granted

pytestmark = pytest.mark.controller


async def test_a_claim_that_left_leaves_no_start_state(
        engine_sim_factory: EngineSimFactory, engine_session: aiohttp.ClientSession) -> None:
    node = await _a_awake_b_asleep(engine_sim_factory, engine_session)
    a, b = node.engines
    worker = node.workers["gpu-0"]
    uid = b.claimant.claim_uid
    try:
        await _granted(node, b)
        await node.adapter(b.claimant).wake(1)
        await node.until(lambda: node.lease("gpu-0").state == naming.STATE_AWAKE
                         and worker.last_switch.get("ok") is True,
                         within_s=DEADLINE_S, what="b's start done, a woken back")
        assert uid in worker._start_backoff
        assert uid in worker._started
        node.engines.remove(b)  # the claim left the node
        assert uid not in {c.claim_uid for c in worker.claimants()}
        seen = worker.reconciliations
        worker.mark_dirty()
        await node.until(lambda: worker.reconciliations > seen, within_s=DEADLINE_S,
                         what="the worker reconciled its new claimants")
        assert uid not in worker._start_backoff
        assert uid not in worker._started
        assert a.claimant.claim_uid in {c.claim_uid for c in worker.claimants()}
    finally:
        if b not in node.engines:
            node.engines.append(b)
        await node.close()
