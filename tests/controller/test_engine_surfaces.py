"""Every vLLM rota claims to support (0.26-0.34, vLLM-Omni 0.30), checked against its own
surface as read from its wheel (``controller/lease/engines/vllm_surfaces``): the adapter
calls only what each release serves, the engine guard lets each of those calls through,
the gateway routes or refuses each release's routes, and the engine simulator speaks each
release so the adapter's sleep and wake run against every one."""

from __future__ import annotations

from pathlib import Path

import aiohttp
import pytest

from controller.gateway.surface import OWN, REFUSED, ROUTED, routed_for
from controller.guard.paths import Access, classify
from controller.lease.engines import Timeouts, VllmAdapter
from controller.lease.engines.dialect import Dialect
from controller.lease.engines.surfaces import load_surfaces, supported, surface_for
from controller.lease.engines.vllm import calls
from e2e.tools import vllm_routes
from tests.controller.conftest import EngineSimFactory

VLLM = supported("vllm")
TABLE_026 = vllm_routes.load(Path(__file__).resolve().parents[2] / "controller"
                             / "gateway" / "vllm_routes.json")


def _dialect(version: str) -> Dialect:
    surface = surface_for(version)
    assert surface is not None
    control = surface.control("/sleep")
    return Dialect(version=version, surface=surface, served=None,
                   sleep_handles_requests=control is not None
                   and control.param("mode") is not None)


# -- the surfaces, as the wheels say -------------------------------------------------------


def test_every_supported_release_has_its_surface_read_from_its_wheel() -> None:
    specs = {spec.replace("==", "-") for spec in vllm_routes.SUPPORTED}
    assert {f"{engine}-{version}" for engine, version in load_surfaces()} == specs
    assert VLLM[0] == "0.26.0"
    assert VLLM[-1] == "0.34.0"
    surface = surface_for("0.26.0")
    assert surface is not None
    assert surface.table() == TABLE_026


def test_what_differs_per_release_is_what_the_wheels_say() -> None:
    for version in VLLM:
        surface = surface_for(version)
        assert surface is not None
        for path in ("/pause", "/resume", "/is_paused", "/sleep", "/wake_up", "/version"):
            assert surface.control(path) is not None, (version, path)
        sleep, wake = surface.control("/sleep"), surface.control("/wake_up")
        assert sleep is not None
        assert wake is not None
        new = version >= "0.32"
        assert [r.body for r in sleep.replies] == ["json" if new else "empty"], version
        assert [r.body for r in wake.replies] == ["json" if new else "empty"], version
        assert (surface.control("/release_kv_cache_memory") is not None) is (version >= "0.31")
        pause = surface.control("/pause")
        assert pause is not None
        assert pause.source.startswith(
            "vllm/entrypoints/rl/" if new else "vllm/entrypoints/serve/dev/rlhf/"), version
        assert (sleep.param("reset_connector") is not None) is (version >= "0.34")
    newest = surface_for("0.34.0")
    assert newest is not None
    sleep, wake = newest.control("/sleep"), newest.control("/wake_up")
    assert sleep is not None
    assert wake is not None
    level, mode = sleep.param("level"), sleep.param("mode")
    assert level is not None
    assert level.bounds == "ge=0 le=2"
    assert mode is not None
    assert mode.values == ("abort", "wait", "keep")
    assert sleep.replies[0].fields == {"status": ('"sleeping"',), "level": ("level",)}
    assert wake.replies[0].fields["status"] == ('"awake"', '"sleeping"')
    omni = surface_for("0.30.0", "vllm-omni")
    assert omni is not None
    assert set(omni.ack_fields) == {"task_id", "status", "stage_id", "rank", "freed_bytes",
                                    "metadata", "error_msg"}
    omni_sleep = omni.control("/v1/omni/sleep")
    assert omni_sleep is not None
    assert {r.fields["status"] for r in omni_sleep.replies} == {('"SUCCESS"',)}


# -- the adapter, the guard, the gateway against each release ---------------------------


@pytest.mark.parametrize("version", VLLM)
def test_the_adapter_calls_only_what_the_release_serves_and_the_guard_passes_it(
        version: str) -> None:
    dialect = _dialect(version)
    for method, path in calls(dialect):
        if path != "/health":
            assert dialect.surface.serves(method, path), (version, method, path)
        assert classify(method, path) in (Access.CONTROL, Access.HEALTH), (method, path)


@pytest.mark.parametrize("version", VLLM)
def test_the_gateway_routes_every_model_bearing_route_of_the_release(version: str) -> None:
    surface = surface_for(version)
    assert surface is not None
    mine = {route.path for route in routed_for(version)}
    unrouted = {r.key for r in surface.routes
                if r.model == "yes" and (r.method != "POST" or r.path not in mine)}
    assert unrouted == set()
    assert {path for path in mine if not surface.serves("POST", path)} == set()
    newer = {route.path for route in ROUTED if route.path not in mine}
    assert {path for path in newer if surface.serves("POST", path)} == set()
    for key in {r.key for r in surface.routes if r.key in TABLE_026.by_key()}:
        route = TABLE_026.by_key()[key]
        assert route.model == "yes" or OWN.get(key) or REFUSED.get(key), key


# -- the adapter against the simulator of each release -----------------------------------


@pytest.mark.parametrize("version", VLLM)
@pytest.mark.parametrize("level", [1, 2])
async def test_sleep_and_wake_on_every_release(
        version: str, level: int, engine_sim_factory: EngineSimFactory,
        engine_session: aiohttp.ClientSession) -> None:
    sim = await engine_sim_factory(vllm_version=version)
    adapter = VllmAdapter(sim.endpoint(), engine_session, Timeouts())
    assert (await adapter.probe()).ok
    await adapter.sleep(level)
    assert sim.engine.is_sleeping
    await adapter.wake(level)
    assert not sim.engine.is_sleeping
    assert (await adapter.probe()).ok
    assert (await adapter.dialect()).version == version
