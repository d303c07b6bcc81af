"""A gateway replica told to stop (SIGTERM, as in every rollout) drops no work (review M9).

Two real gateway processes serve one engine simulator. A client plays the Service: it
sends each request to the first replica while that replica reports ready, and to the
second once it does not (as endpoints do, after a propagation delay the gateway waits
out). The first replica gets SIGTERM while a stream longer than 30 s (the default
termination grace) runs through it and requests keep coming.
"""

from __future__ import annotations

import asyncio
import json
import signal
import sys
from pathlib import Path
from typing import Any

import aiohttp
import pytest
import yaml

from controller.gateway.binding import parse_binding
from controller.gateway.settings import load
from e2e.cluster.local import free_port
from e2e.harness.objects import MANIFESTS
from e2e.harness.waiting import eventually_async
from tests.gateway.conftest import (
    MODEL_A,
    NAMESPACE,
    claim_obj,
    controller_lease,
    gpu_lease,
    pod_obj,
    start_sim,
)

pytestmark = pytest.mark.gateway

STREAM_TOKENS = 64
TOKENS_PER_SECOND = 2.0  # the stream lasts 32 s


def _tail(log: Path) -> str:
    return log.read_text(errors="replace")[-2000:]


async def _replica(objects: Path, log: Path) -> tuple[asyncio.subprocess.Process, str]:
    port = free_port()
    proc = await asyncio.create_subprocess_exec(
        sys.executable, "-m", "tests.gateway.static_gateway", str(objects),
        "--host=127.0.0.1", f"--port={port}", f"--serving-namespaces={NAMESPACE}",
        "--shutdown-delay-s=2", "--shutdown-grace-s=120", "--stream-keepalive-s=0",
        stdout=log.open("wb"), stderr=asyncio.subprocess.STDOUT)
    url = f"http://127.0.0.1:{port}"

    async def ready() -> bool:
        assert proc.returncode is None, _tail(log)
        async with aiohttp.ClientSession() as session, session.get(f"{url}/readyz") as resp:
            return resp.status == 200

    await eventually_async(ready, timeout=60, what="gateway replica ready")
    return proc, url


@pytest.mark.slow
async def test_sigterm_under_load_with_a_long_stream_drops_nothing(tmp_path: Path) -> None:
    sim = await start_sim(MODEL_A, f"{NAMESPACE}/claim-a",
                          tokens_per_second=TOKENS_PER_SECOND)
    procs: list[asyncio.subprocess.Process] = []
    try:
        objects = tmp_path / "objects.json"
        objects.write_text(json.dumps({
            "claims": [claim_obj("claim-a", model=MODEL_A, port=sim.port, pod_uid="pod-a")],
            "pods": [pod_obj("pod-claim-a", uid="pod-a")],
            "leases": [gpu_lease(holder=sim.claim, state="awake", model=MODEL_A),
                       controller_lease("http://127.0.0.1:9")]}))
        first, first_url = await _replica(objects, tmp_path / "gateway-0.log")
        procs.append(first)
        second, second_url = await _replica(objects, tmp_path / "gateway-1.log")
        procs.append(second)
        await _drive(first, first_url, second_url, tmp_path)
    finally:
        for proc in procs:
            if proc.returncode is None:
                proc.kill()
                await proc.wait()
        await sim.client.close()


async def _drive(first: asyncio.subprocess.Process, first_url: str, second_url: str,
                 tmp_path: Path) -> None:
    errors: list[str] = []
    answers: dict[str, int] = {first_url: 0, second_url: 0}
    done = asyncio.Event()

    async def pick(session: aiohttp.ClientSession) -> str:
        """The Service: the first replica while its readiness probe passes, else the
        second. The probe has the kubelet's default timeout (1 s): a connection that the
        stopping replica accepted just before its listener closed is never served (aiohttp
        ignores a request that arrives after its shutdown began), and a probe without a
        timeout would hang there, holding that replica up for its whole grace period."""
        try:
            async with session.get(f"{first_url}/readyz",
                                   timeout=aiohttp.ClientTimeout(total=1)) as resp:
                return first_url if resp.status == 200 else second_url
        except (aiohttp.ClientError, TimeoutError):
            return second_url

    async def steady(session: aiohttp.ClientSession) -> None:
        body = {"model": MODEL_A, "messages": [{"role": "user", "content": "3 + 4"}]}
        while not done.is_set():
            url = await pick(session)
            try:
                async with session.post(f"{url}/v1/chat/completions", json=body) as resp:
                    data: Any = await resp.json()
                    if resp.status != 200 or data["choices"][0]["message"]["content"] != "7":
                        errors.append(f"{url}: {resp.status} {data}")
                    else:
                        answers[url] += 1
            except aiohttp.ClientError as exc:
                errors.append(f"{url}: {exc!r}")

    timeout = aiohttp.ClientTimeout(total=120)
    async with aiohttp.ClientSession(timeout=timeout) as session:
        load = [asyncio.create_task(steady(session)) for _ in range(2)]
        body = {"model": MODEL_A, "messages": [{"role": "user", "content": "count"}],
                "stream": True, "max_tokens": STREAM_TOKENS, "ignore_eos": True}
        async with session.post(f"{first_url}/v1/chat/completions", json=body) as stream:
            assert stream.status == 200
            text = await stream.content.readany()

            async def flowing() -> bool:
                return answers[first_url] > 0

            await eventually_async(flowing, timeout=60, what="requests flowing")
            first.send_signal(signal.SIGTERM)
            async for chunk in stream.content.iter_any():
                text += chunk
        done.set()
        await asyncio.gather(*load)
    assert errors == [], errors[:5]
    tokens = sum(1 for line in text.decode().splitlines()
                 if line.startswith("data: {") and '"content":"' in line
                 and '"content":""' not in line)
    assert tokens == STREAM_TOKENS
    assert text.decode().rstrip().endswith("data: [DONE]")
    assert answers[first_url] > 0
    assert answers[second_url] > 0
    assert await asyncio.wait_for(first.wait(), 60) == 0, \
        _tail(tmp_path / "gateway-0.log")


def test_the_manifest_gives_the_longest_stream_time_to_finish() -> None:
    docs = list(yaml.safe_load_all((MANIFESTS / "gateway-deployment.yaml").read_text()))
    deployment = next(d for d in docs if d["kind"] == "Deployment")
    pod = deployment["spec"]["template"]["spec"]
    (container,) = pod["containers"]
    env = {e["name"]: e.get("value") for e in container["env"]}
    settings = load([], {k: v for k, v in env.items() if v is not None})
    pre_stop = container["lifecycle"]["preStop"]["sleep"]["seconds"]
    needed = pre_stop + settings.shutdown_delay_s + settings.shutdown_grace_s
    assert pod["terminationGracePeriodSeconds"] > needed
    assert settings.shutdown_grace_s >= 10 * 60  # ten-minute streams
    binding = next(d for d in docs if d["kind"] == "ConfigMap")
    assert parse_binding(binding["data"]["binding.yaml"]).empty  # fails closed until edited
