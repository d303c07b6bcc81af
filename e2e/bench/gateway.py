"""Benchmark of the gateway's cost on the streaming path, on the local cluster.

    python -m e2e.bench.gateway [--requests 20] [--streams 64] [--rounds 6]
                                [--max-tokens 64] [--tokens-per-second 50] [--ttft 0.05]
                                [--gateway-arg=--FLAG=VALUE ...]

A GPU node with the driver, the node agent, one lease controller and a gateway process;
one simulated engine, made awake through the activation API before anything is measured,
so no switch is involved. The same streamed chat request (``max_tokens`` tokens with
``ignore_eos``) goes to the engine directly and through the gateway, in the same run,
the two sides alternating phase by phase:

- 1 stream: ``--requests`` requests one after another;
- ``--streams`` concurrent streams, started together: ``--rounds`` rounds, each starting
  them all at once (a burst: the last of them waits behind the others' starts);
- ``--streams`` concurrent streams, steady: as many clients, each starting its next stream
  as soon as its last one ended, their first starts spread over one stream's length, so
  that ``--streams`` streams are always in flight and starts are spread out; ``--rounds``
  streams per client, twice per side, the sides taking turns.

Time to first token is measured from sending the request to the first chunk that carries
content; chunks per second counts content chunks over the phase's wall time. Each side
has one ``aiohttp.ClientSession`` with room for every stream. Prints one line per
measurement and a JSON object last. Targets at ``--streams`` streams (issue 19: 64), burst
and steady alike: through the gateway, time to first token p50 <= 1.10 x direct, added
latency (the p99 time to first token through the gateway less the p99 directly) <= 5 ms,
chunks per second >= 0.7 x direct; with 1 stream, time to first token p50 <= 1.10 x
direct. The two sides'
requests are not paired, so the added latency is a difference of percentiles, not a
percentile of differences.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import re
import statistics
import time
import urllib.request
from dataclasses import dataclass, field
from typing import Any

import aiohttp
from kubernetes import client

from e2e.bench.stats import percentile
from e2e.cluster import LocalCluster
from e2e.harness.local_node import engine_node
from e2e.harness.scenario import EngineSpec, activate, deploy
from e2e.harness.waiting import eventually_async

TTFT_RATIO_TARGET = 1.10
ADDED_P99_TARGET_MS = 5.0
CHUNK_RATIO_TARGET = 0.7
REQUEST_TIMEOUT_S = 60.0
ACTIVATION_TOKEN = "bench-activation-token"
STEADY_TURNS = 2
"""Steady phases per side, the sides taking turns (the machine's load drifts)."""


@dataclass(frozen=True)
class Load:
    """What is asked of each side, and how the simulator paces its answers."""

    requests: int = 20
    streams: int = 64
    rounds: int = 6
    max_tokens: int = 64
    tokens_per_second: float = 50.0
    ttft_s: float = 0.05

    def sim_args(self) -> tuple[str, ...]:
        return (f"--tokens-per-second={self.tokens_per_second}",
                f"--ttft-seconds={self.ttft_s}")


@dataclass
class Phase:
    ttfts_s: list[float] = field(default_factory=list)
    chunks: int = 0
    wall_s: float = 0.0

    def summary(self) -> dict[str, float]:
        ms = sorted(t * 1e3 for t in self.ttfts_s)
        return {"n": len(ms), "ttft_p50_ms": round(statistics.median(ms), 2),
                "ttft_p99_ms": round(percentile(ms, 0.99), 2),
                "chunks_per_s": round(self.chunks / self.wall_s, 1) if self.wall_s else 0.0}


def _body(model: str, max_tokens: int) -> dict[str, Any]:
    return {"model": model, "stream": True, "max_tokens": max_tokens, "ignore_eos": True,
            "messages": [{"role": "user", "content": "Write something long."}]}


async def stream_once(session: aiohttp.ClientSession, base_url: str, body: dict[str, Any]
                      ) -> tuple[float, int]:
    """One streamed chat request: (time to first content chunk, content chunks)."""
    start = time.perf_counter()
    ttft: float | None = None
    chunks = 0
    done = False
    async with session.post(f"{base_url}/v1/chat/completions", json=body,
                            timeout=aiohttp.ClientTimeout(total=REQUEST_TIMEOUT_S)) as resp:
        if resp.status != 200:
            raise RuntimeError(f"{base_url} answered {resp.status}: {await resp.text()}")
        async for raw in resp.content:
            line = raw.strip()
            if not line.startswith(b"data: "):
                continue
            payload = line[6:]
            if payload == b"[DONE]":
                done = True
                break
            event = json.loads(payload)
            if event.get("error") is not None:
                raise RuntimeError(f"{base_url} sent an error mid-stream: {event['error']}")
            if any((c.get("delta") or {}).get("content") for c in event.get("choices") or []):
                chunks += 1
                if ttft is None:
                    ttft = time.perf_counter() - start
    if ttft is None or not done:
        raise RuntimeError(f"{base_url}: stream without content or [DONE]")
    return ttft, chunks


async def _sequential(session: aiohttp.ClientSession, url: str, body: dict[str, Any],
                      count: int) -> Phase:
    phase = Phase()
    start = time.perf_counter()
    for _ in range(count):
        ttft, chunks = await stream_once(session, url, body)
        phase.ttfts_s.append(ttft)
        phase.chunks += chunks
    phase.wall_s = time.perf_counter() - start
    return phase


async def _concurrent(session: aiohttp.ClientSession, url: str, body: dict[str, Any],
                      streams: int, phase: Phase) -> None:
    start = time.perf_counter()
    results = await asyncio.gather(*(stream_once(session, url, body) for _ in range(streams)))
    phase.wall_s += time.perf_counter() - start
    for ttft, chunks in results:
        phase.ttfts_s.append(ttft)
        phase.chunks += chunks


async def _steady(session: aiohttp.ClientSession, url: str, body: dict[str, Any],
                  load: Load, phase: Phase) -> None:
    """``load.streams`` clients, each running ``load.rounds`` streams back to back, the
    first starts spread evenly over one stream's expected length."""
    length_s = load.ttft_s + load.max_tokens / load.tokens_per_second

    async def client(index: int) -> None:
        await asyncio.sleep(index * length_s / load.streams)
        for _ in range(load.rounds):
            ttft, chunks = await stream_once(session, url, body)
            phase.ttfts_s.append(ttft)
            phase.chunks += chunks

    start = time.perf_counter()
    await asyncio.gather(*(client(i) for i in range(load.streams)))
    phase.wall_s += time.perf_counter() - start


async def _warm_up(session: aiohttp.ClientSession, url: str, model: str, streams: int
                   ) -> None:
    """Short streams, not measured, that leave ``streams`` connections open (client to
    gateway and gateway to engine alike)."""
    body = _body(model, 2)
    await asyncio.gather(*(stream_once(session, url, body) for _ in range(streams)))


async def measure(direct_url: str, gateway_url: str, model: str, load: Load
                  ) -> dict[str, dict[str, Phase]]:
    """Both sides, alternating, each phase after a warm-up that opens the connections it
    needs (idle pooled connections close after 15 s)."""
    body = _body(model, load.max_tokens)
    sides = {"direct": direct_url, "gateway": gateway_url}
    phases: dict[str, dict[str, Phase]] = {"1": {}}
    limit = max(2 * load.streams, 16)
    sessions = {side: aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=limit))
                for side in sides}
    try:
        for side, url in sides.items():
            await _warm_up(sessions[side], url, model, 1)
            phases["1"][side] = await _sequential(sessions[side], url, body, load.requests)
            print(f"1 stream, {side}: {phases['1'][side].summary()}", flush=True)
        for side, url in sides.items():
            await _warm_up(sessions[side], url, model, load.streams)
        many = {side: Phase() for side in sides}
        for _ in range(load.rounds):
            for side, url in sides.items():
                await _concurrent(sessions[side], url, body, load.streams, many[side])
        phases[str(load.streams)] = many
        for side in sides:
            print(f"{load.streams} streams, {side}: {many[side].summary()}", flush=True)
        steady = phases[f"{load.streams}_steady"] = {side: Phase() for side in sides}
        for _ in range(STEADY_TURNS):
            for side, url in sides.items():
                await _warm_up(sessions[side], url, model, load.streams)
                await _steady(sessions[side], url, body, load, steady[side])
        for side in sides:
            print(f"{load.streams} streams steady, {side}: {steady[side].summary()}",
                  flush=True)
    finally:
        for session in sessions.values():
            await session.close()
    return phases


async def _wait_routed(gateway_url: str, model: str) -> None:
    """Until the gateway forwards to the awake engine (it learns routes from watches)."""
    async with aiohttp.ClientSession() as session:
        body = _body(model, 2)

        async def answers() -> bool:
            await stream_once(session, gateway_url, body)
            return True

        await eventually_async(answers, timeout=60, what="gateway routes the model")


async def _activate(controller_url: str, model: str) -> dict[str, Any]:
    async with aiohttp.ClientSession() as session:
        async def awake() -> dict[str, Any] | None:
            status, body = await activate(session, controller_url, model,
                                          token=ACTIVATION_TOKEN, timeout_s=60)
            return body if status == 200 else None

        answer = await eventually_async(awake, timeout=90, what=f"{model} awake")
    assert answer is not None
    return answer


GATEWAY_HISTOGRAMS = ("first_token", "queue_wait")
"""The gateway's own histograms read before and after (``rota_gateway_<name>_duration_
seconds``): its time to first token, and the wait for a place among the engine's
``--max-concurrency-per-engine``."""


def _gateway_histograms(gateway_url: str) -> dict[str, float]:
    """``<name>_count`` and ``<name>_sum`` of :data:`GATEWAY_HISTOGRAMS`, summed over
    their labels."""
    with urllib.request.urlopen(f"{gateway_url}/metrics", timeout=5) as resp:
        text = resp.read().decode()
    found: dict[str, float] = {}
    names = "|".join(GATEWAY_HISTOGRAMS)
    for m in re.finditer(rf"^rota_gateway_({names})_duration_seconds_(count|sum)"
                         r"(?:\{[^}]*\})? (\S+)$", text, re.M):
        key = f"{m.group(1)}_{m.group(2)}"
        found[key] = found.get(key, 0.0) + float(m.group(3))
    return found


def run(cluster: LocalCluster, api: client.ApiClient, *, load: Load | None = None,
        namespace: str | None = None, gateway_args: tuple[str, ...] = ()) -> dict[str, Any]:
    """Run the benchmark on ``cluster`` with a node of its own; returns the result object
    (``targets_met`` included). ``gateway_args``: more flags for the gateway process. The
    node and its processes are stopped before returning."""
    load = load or Load()
    with engine_node(cluster, api, prefix="bench", namespace=namespace) as (node, ns):
        spec = EngineSpec("engine-a", "bench/model-a", resident="1Gi", awake="20Gi",
                          args=load.sim_args())
        (engine,) = deploy(api, ns, node.name, [spec])
        token = node.dirs.root / "activation-token"
        token.write_text(ACTIVATION_TOKEN + "\n")
        node.start_controller(extra=[f"--token-file={token}"])
        asyncio.run(_activate(node.controller_url(), spec.model))
        gateway_url = node.start_gateway(
            token_file=token, extra=[f"--serving-namespaces={ns}", *gateway_args])
        asyncio.run(_wait_routed(gateway_url, spec.model))
        before = _gateway_histograms(gateway_url)
        phases = asyncio.run(measure(engine.url, gateway_url, spec.model, load))
        after = _gateway_histograms(gateway_url)
    return summarise(phases, load, before, after)


def summarise(phases: dict[str, dict[str, Phase]], load: Load, before: dict[str, float],
              after: dict[str, float]) -> dict[str, Any]:
    result: dict[str, Any] = {
        "load": {"requests_1_stream": load.requests, "streams": load.streams,
                 "rounds": load.rounds, "max_tokens": load.max_tokens,
                 "sim_tokens_per_second": load.tokens_per_second, "sim_ttft_s": load.ttft_s},
    }
    for streams, sides in phases.items():
        direct, gateway = sides["direct"].summary(), sides["gateway"].summary()
        result[f"streams_{streams}"] = {
            "direct": direct, "gateway": gateway,
            "ttft_p50_ratio": round(gateway["ttft_p50_ms"] / direct["ttft_p50_ms"], 3),
            "ttft_p50_added_ms": round(gateway["ttft_p50_ms"] - direct["ttft_p50_ms"], 2),
            "ttft_p99_ratio": round(gateway["ttft_p99_ms"] / direct["ttft_p99_ms"], 3),
            "ttft_p99_added_ms": round(gateway["ttft_p99_ms"] - direct["ttft_p99_ms"], 2),
            "chunks_ratio": round(gateway["chunks_per_s"] / direct["chunks_per_s"], 3)}
    for name, key in (("first_token", "gateway_metric_ttft_mean_ms"),
                      ("queue_wait", "gateway_metric_queue_wait_mean_ms")):
        count = after.get(f"{name}_count", 0.0) - before.get(f"{name}_count", 0.0)
        if count > 0:
            result[key] = round((after.get(f"{name}_sum", 0.0)
                                 - before.get(f"{name}_sum", 0.0)) / count * 1e3, 2)
    targets = {"ttft_p50_1_stream": result["streams_1"]["ttft_p50_ratio"] <= TTFT_RATIO_TARGET}
    for name in (f"{load.streams}_streams", f"{load.streams}_steady"):
        many = result[f"streams_{name.removesuffix('_streams')}"]
        targets[f"ttft_p50_{name}"] = many["ttft_p50_ratio"] <= TTFT_RATIO_TARGET
        targets[f"added_p99_{name}"] = many["ttft_p99_added_ms"] <= ADDED_P99_TARGET_MS
        targets[f"chunks_per_s_{name}"] = many["chunks_ratio"] >= CHUNK_RATIO_TARGET
    result["targets"] = targets
    result["targets_met"] = all(result["targets"].values())
    return result


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m e2e.bench.gateway", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--requests", type=int, default=20,
                        help="sequential requests per side with 1 stream (20)")
    parser.add_argument("--streams", type=int, default=64, help="concurrent streams (64)")
    parser.add_argument("--rounds", type=int, default=6,
                        help="rounds of concurrent streams per side, and streams per "
                        "steady client (6)")
    parser.add_argument("--max-tokens", type=int, default=64,
                        help="tokens per answer, with ignore_eos (64)")
    parser.add_argument("--tokens-per-second", type=float, default=50.0,
                        help="the simulator's decode speed per stream (50)")
    parser.add_argument("--ttft", type=float, default=0.05,
                        help="the simulator's time to first token in seconds (0.05)")
    parser.add_argument("--gateway-arg", action="append", default=[], metavar="FLAG",
                        help="a flag for the gateway process, e.g. "
                        "--gateway-arg=--max-concurrency-per-engine=256 (repeatable)")
    args = parser.parse_args(argv)
    load = Load(requests=args.requests, streams=args.streams, rounds=args.rounds,
                max_tokens=args.max_tokens, tokens_per_second=args.tokens_per_second,
                ttft_s=args.ttft)
    cluster = LocalCluster()
    try:
        with cluster:
            api = cluster.api_client()
            try:
                result = run(cluster, api, load=load, gateway_args=tuple(args.gateway_arg))
            finally:
                api.close()
    finally:
        cluster.cleanup()
    for key in (f"streams_{load.streams}", f"streams_{load.streams}_steady", "streams_1"):
        phase = result[key]
        print(f"{key}: ttft p50 ratio {phase['ttft_p50_ratio']} "
              f"(+{phase['ttft_p50_added_ms']} ms), p99 ratio {phase['ttft_p99_ratio']} "
              f"(+{phase['ttft_p99_added_ms']} ms), chunks/s ratio {phase['chunks_ratio']}")
    print(f"targets: {result['targets']}")
    print(json.dumps(result))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
