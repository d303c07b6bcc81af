"""The fake memory backend and its fake-NVML registration."""

from __future__ import annotations

import json
from pathlib import Path

from driver.nvml.fake import LOCK_FILE
from e2e.engine_simulator import Settings
from e2e.engine_simulator.memory import plan_portions
from tests.simulator.conftest import GIB, PID, SimFactory


def names(nvml_dir: Path) -> list[str]:
    """The registry's files, its lock file left out."""
    if not nvml_dir.is_dir():
        return []
    return sorted(p.name for p in nvml_dir.iterdir() if p.name != LOCK_FILE)


def record(nvml_dir: Path) -> dict[str, object]:
    body: dict[str, object] = json.loads((nvml_dir / f"{PID}.json").read_text())
    return body


async def test_registry_follows_sleep_and_wake_and_goes_at_shutdown(
    make_sim: SimFactory, nvml_dir: Path
) -> None:
    sim = await make_sim(gpu_uuid="GPU-12345678-aaaa-bbbb-cccc-0123456789ab")
    expected = {"pid": PID, "gpu_uuid": "GPU-12345678-aaaa-bbbb-cccc-0123456789ab"}
    assert record(nvml_dir) == expected | {"used_bytes": 10 * GIB}

    await sim.post_empty("/sleep", level=1)
    assert record(nvml_dir) == expected | {"used_bytes": 1 * GIB}
    await sim.post_empty("/wake_up", tags="weights")
    assert record(nvml_dir)["used_bytes"] == 7 * GIB
    await sim.post_empty("/wake_up", tags="kv_cache")
    assert record(nvml_dir)["used_bytes"] == 10 * GIB

    await sim.post_empty("/sleep", level=2)
    assert record(nvml_dir)["used_bytes"] == 1 * GIB
    await sim.post_empty("/wake_up")
    assert record(nvml_dir)["used_bytes"] == 10 * GIB
    assert names(nvml_dir) == [f"{PID}.json"]  # no temp files left

    await sim.client.close()
    assert names(nvml_dir) == []


async def test_without_a_directory_only_the_number_is_kept(
    make_sim: SimFactory, nvml_dir: Path
) -> None:
    sim = await make_sim(fake_nvml_dir=None)
    await sim.post_empty("/sleep", level=1)
    state = await sim.state()
    assert state["memory_bytes"] == 1 * GIB
    assert state["memory"]["backend"] == "fake"
    assert state["memory"]["host_bytes"] == 6 * GIB
    assert names(nvml_dir) == []


def test_portions_split_evenly_across_stages() -> None:
    settings = Settings(awake_memory_bytes=10 * GIB + 1, resident_memory_bytes=GIB,
                        weights_bytes=5 * GIB, omni=True, omni_stages=3)
    sizes = plan_portions(settings)
    assert sum(sizes.values()) == settings.releasable_bytes
    weights = [sizes[f"stage{i}/weights"] for i in range(3)]
    assert sum(weights) == 5 * GIB
    assert max(weights) - min(weights) <= 2
    assert set(sizes) == {f"stage{i}/{t}" for i in range(3) for t in ("weights", "kv_cache")}


def test_plain_engine_has_one_stage() -> None:
    sizes = plan_portions(Settings(awake_memory_bytes=9 * GIB, resident_memory_bytes=GIB))
    assert sizes == {"stage0/weights": 4 * GIB, "stage0/kv_cache": 4 * GIB}
