"""A soak of rota on a real node: clients of three models through the gateway replicas,
while the lease controllers and the gateways are rolled and restarted under them.

    python -m e2e.campaigns.soak [--minutes 30] [--clients 12] [--disrupt-every 90]

Three engine simulators share the node's (fake) GPU, started through rota's start gate.
Each client sends chat completions (streamed, with usage, and not), and completions, for a
model drawn at random (its own model more often than the others, so that switches keep
coming), over a connection of its own to a gateway replica that is Ready and not being
deleted (as an EndpointSlice would name it), and reads every byte with the strict parser
of :mod:`e2e.harness.wire`. Like the OpenAI SDK, a client tries again after a 429 or a 503, as
long as ``Retry-After`` says. Meanwhile, one after another, every ``--disrupt-every``
seconds: a rollout of the controller DaemonSet, a rollout of the gateway Deployment, and
the deletion of the node's controller pod (SIGTERM, then the DaemonSet's new pod).

The promise: every request answered with its model's answer (none lost, none refused in
the end), no malformed answer or stream, and the GPU never seen with two engines awake.
The report prints what each disruption took and how requests fared during it.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import random
import sys
import time
import uuid
from collections import Counter
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any
from urllib.parse import urlsplit

from kubernetes import client

from e2e.harness.deploy import CONTROLLER, GATEWAY, is_ready, restarted
from e2e.harness.objects import create_namespace
from e2e.harness.rota_node import RotaOnNodes, gated_engine_docs, watched_engines
from e2e.harness.scenario import AwakeMonitor, Engine, EngineSpec
from e2e.harness.waiting import eventually
from e2e.harness.wire import Exchange, Malformed, parse_answer, parse_sse

MODELS = {"soak-a": "org/soak-a", "soak-b": "org/soak-b", "soak-c": "org/soak-c"}
RESIDENT, AWAKE = "1Gi", "40Gi"
KINDS = ("chat-stream", "chat", "completion")
OWN_MODEL_SHARE = 0.6
"""How often a client asks for its own model (the rest is split between the others)."""
ATTEMPTS = 6
"""Tries per request, as far as ``Retry-After`` allows (the OpenAI SDK makes 3)."""
RETRY_AFTER_CAP_S = 5.0
REQUEST_DEADLINE_S = 240.0
"""How long one try may take, the switch it waits for included (the gateway holds a
request for a switch up to its own bound, which is shorter)."""
DISRUPTIONS = ("controller-rollout", "gateway-rollout", "controller-restart")


@dataclass
class Outcome:
    """One request, after all its tries."""

    model: str
    kind: str
    started: float
    ended: float
    status: int = 0
    """The last try's HTTP status; 0 when no answer came."""
    tries: int = 0
    problem: str = ""
    """Why it is not a good answer ("" when it is)."""
    malformed: bool = False


@dataclass
class Window:
    name: str
    began: float
    ended: float = 0.0


@dataclass
class SoakReport:
    outcomes: list[Outcome] = field(default_factory=list)
    windows: list[Window] = field(default_factory=list)
    violations: list[str] = field(default_factory=list)
    samples: int = 0

    @property
    def failed(self) -> list[Outcome]:
        return [o for o in self.outcomes if o.problem]

    @property
    def malformed(self) -> list[Outcome]:
        return [o for o in self.outcomes if o.malformed]

    def during(self, window: Window) -> list[Outcome]:
        return [o for o in self.outcomes
                if o.started < (window.ended or float("inf")) and o.ended > window.began]

    def lines(self) -> list[str]:
        statuses = Counter(o.status for o in self.outcomes)
        retried = sum(1 for o in self.outcomes if o.tries > 1)
        out = [f"requests {len(self.outcomes)}: answered {len(self.outcomes) - len(self.failed)}"
               f", failed {len(self.failed)}, malformed {len(self.malformed)}, tried again "
               f"{retried}; final statuses {dict(sorted(statuses.items()))}",
               f"GPU samples {self.samples}, two awake in {len(self.violations)}"]
        for window in self.windows:
            seen = self.during(window)
            took = (window.ended or time.monotonic()) - window.began
            out.append(f"{window.name}: {took:.1f} s, {len(seen)} requests across it, "
                       f"{sum(1 for o in seen if o.problem)} failed, longest "
                       f"{max((o.ended - o.started for o in seen), default=0.0):.1f} s")
        out.extend(f"failed: {o.kind} {o.model}: {o.problem}" for o in self.failed[:10])
        return out

    def passed(self) -> bool:
        return bool(self.outcomes) and not self.failed and not self.violations


def _body(kind: str, model: str) -> tuple[str, dict[str, Any]]:
    if kind == "completion":
        return "/v1/completions", {"model": model, "prompt": "What is 3 + 4?",
                                   "max_tokens": 8}
    body: dict[str, Any] = {"model": model, "max_tokens": 8,
                            "messages": [{"role": "user", "content": "What is 3 + 4?"}]}
    if kind == "chat-stream":
        body |= {"stream": True, "stream_options": {"include_usage": True}}
    return "/v1/chat/completions", body


def check_answer(kind: str, model: str, body: bytes) -> str:
    """What is wrong with a 200 answer of ``kind`` for ``model`` ("" when nothing);
    raises :class:`Malformed` for a stream that breaks the SSE format."""
    if kind != "chat-stream":
        answer = json.loads(body)
        if answer.get("model") != model or not answer.get("choices"):
            return f"an answer without choices of {model}: {body[:200]!r}"
        return ""
    events = [e.data for e in parse_sse(body) if e.data is not None]
    if events[-1:] != ["[DONE]"]:
        return f"a stream without [DONE]: {body[-200:]!r}"
    chunks = [e for e in events[:-1] if isinstance(e, dict)]
    errors = [e["error"] for e in chunks if "error" in e]
    if errors:
        return f"a stream that ended in an error: {errors[0]}"
    if not any(c.get("choices") and c["choices"][0].get("delta", {}).get("content")
               for c in chunks):
        return f"a stream without content: {body[:200]!r}"
    if not any(c.get("usage") for c in chunks):
        return "a stream without its usage chunk"
    if any(c.get("model") != model for c in chunks):
        return f"a stream with chunks of another model: {body[:200]!r}"
    return ""


class Gateways:
    """The host URLs of the gateway replicas an EndpointSlice would name, read again
    every ``every_s``."""

    def __init__(self, rota: RotaOnNodes, every_s: float = 0.5) -> None:
        self.rota = rota
        self.every_s = every_s
        self.urls: list[str] = []

    def read(self) -> list[str]:
        try:
            return self.rota.gateway_urls()
        except LookupError:
            return []

    async def follow(self, stop: asyncio.Event) -> None:
        while not stop.is_set():
            with contextlib.suppress(client.ApiException, OSError):
                self.urls = await asyncio.to_thread(self.read)
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(stop.wait(), self.every_s)


async def one_try(url: str, path: str, body: dict[str, Any]) -> tuple[int, dict[str, str],
                                                                     bytes]:
    """One request over a connection of its own; the parsed answer (status 0: the
    connection ended without a byte)."""
    place = urlsplit(url)
    exchange = await Exchange.post(int(place.port or 80), path, body,
                                   host=place.hostname or "127.0.0.1",
                                   deadline_s=REQUEST_DEADLINE_S)
    try:
        raw = await exchange.read_all()
    finally:
        await exchange.close()
    if not raw:
        return 0, {}, b""
    answer = parse_answer(raw)
    return answer.status, answer.headers, answer.body


async def request(gateways: Gateways, model: str, kind: str, rng: random.Random
                  ) -> Outcome:
    """One request of ``kind`` for ``model``, tried again after a 429 or 503."""
    path, body = _body(kind, model)
    outcome = Outcome(model, kind, time.monotonic(), 0.0)
    for attempt in range(1, ATTEMPTS + 1):
        outcome.tries = attempt
        if not gateways.urls:
            outcome.problem = "no gateway replica Ready"
            await asyncio.sleep(1.0)
            continue
        try:
            status, headers, answer = await one_try(rng.choice(gateways.urls), path, body)
            outcome.status = status
            if status == 200:
                outcome.problem = check_answer(kind, model, answer)
                break
        except Malformed as exc:
            outcome.problem, outcome.malformed = f"malformed: {str(exc)[:300]}", True
            break
        except (OSError, TimeoutError) as exc:
            outcome.problem = f"no answer: {type(exc).__name__} {exc}"
            break
        if status == 0:
            outcome.problem = "the connection closed without an answer"
            break
        outcome.problem = f"{status}: {answer[:200]!r}"
        if status not in (429, 503) or "retry-after" not in headers:
            break
        await asyncio.sleep(min(float(headers["retry-after"]), RETRY_AFTER_CAP_S))
    outcome.ended = time.monotonic()
    return outcome


async def client_loop(number: int, gateways: Gateways, report: SoakReport,
                      stop: asyncio.Event, seed: int) -> None:
    rng = random.Random(seed * 1000 + number)
    names = list(MODELS.values())
    own = names[number % len(names)]
    while not stop.is_set():
        model = own if rng.random() < OWN_MODEL_SHARE else rng.choice(
            [m for m in names if m != own])
        report.outcomes.append(await request(gateways, model, rng.choice(KINDS), rng))


def _rolled(current: Callable[[], list[client.V1Pod]], old: set[str], want: int
            ) -> bool:
    pods = current()
    return (len(pods) == want and all(is_ready(p) for p in pods)
            and not {p.metadata.uid for p in pods} & old)


def disrupt(rota: RotaOnNodes, name: str, timeout_s: float = 600.0) -> None:
    """One disruption, waited for until the node is whole again (blocking)."""
    deployment, node = rota.deployment, rota.node().name

    def controllers() -> list[client.V1Pod]:
        return deployment.controller_pods(node)

    if name == "gateway-rollout":
        doc = next(d for d in deployment.docs
                   if d["kind"] == "Deployment" and d["metadata"]["name"] == GATEWAY)
        old = {p.metadata.uid for p in deployment.gateway_pods()}
        deployment.applier.apply([restarted(doc)])
        eventually(lambda: _rolled(deployment.gateway_pods, old, len(old)),
                   timeout=timeout_s, max_interval=1.0, what="the gateway rolled over")
        return
    old = {p.metadata.uid for p in controllers()}
    if name == "controller-rollout":
        deployment.applier.apply([restarted(deployment.daemonset(CONTROLLER))])
    elif name == "controller-restart":
        for pod in controllers():
            client.CoreV1Api(rota.api).delete_namespaced_pod(
                pod.metadata.name, pod.metadata.namespace, _request_timeout=10)
    else:
        raise ValueError(f"no disruption named {name!r}: {', '.join(DISRUPTIONS)}")
    eventually(lambda: _rolled(controllers, old, 1), timeout=timeout_s, max_interval=1.0,
               what=f"the controller on {node} replaced ({name})")


async def disruptions(rota: RotaOnNodes, report: SoakReport, every_s: float,
                      names: Sequence[str], stop: asyncio.Event,
                      progress: Callable[[str], None]) -> None:
    for i in range(len(names)):
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(stop.wait(), every_s)
        if stop.is_set():
            return
        window = Window(names[i], time.monotonic())
        report.windows.append(window)
        await asyncio.to_thread(disrupt, rota, names[i])
        window.ended = time.monotonic()
        progress(f"{window.name} done in {window.ended - window.began:.1f} s; requests so "
                 f"far {len(report.outcomes)}, failed {len(report.failed)}")


@dataclass
class SoakStage:
    """The soak's engines, deployed and Ready, and the GPU's monitor."""

    rota: RotaOnNodes
    namespace: str
    engines: dict[str, Engine]
    monitor: AwakeMonitor
    urls: dict[str, str]


@contextlib.contextmanager
def soak_stage(rota: RotaOnNodes, *, namespace: str | None = None,
               args: dict[str, Sequence[str]] | None = None) -> Iterator[SoakStage]:
    """Deploy the three engines (``args``: more simulator arguments by engine name) in a
    namespace of their own, sample the GPU from before their start; delete it all after."""
    namespace = namespace or f"soak-{uuid.uuid4().hex[:6]}"
    create_namespace(rota.api, namespace)
    docs = {name: gated_engine_docs(name, model=model, resident=RESIDENT, awake=AWAKE,
                                    args=(args or {}).get(name, ()))
            for name, model in MODELS.items()}
    specs = {name: EngineSpec(name, model, RESIDENT, AWAKE) for name, model in MODELS.items()}
    try:
        with watched_engines(rota, namespace, docs, specs) as watched:
            yield SoakStage(rota, namespace, watched.engines, watched.monitor, watched.urls)
    finally:
        with contextlib.suppress(client.ApiException):
            client.CoreV1Api(rota.api).delete_namespace(namespace, _request_timeout=10)


async def soak(stage: SoakStage, *, seconds: float, clients: int, disrupt_every_s: float,
               names: Sequence[str] = DISRUPTIONS, seed: int = 0,
               progress: Callable[[str], None] = lambda line: None) -> SoakReport:
    """Run the clients for ``seconds``, or until the last disruption is over when that
    comes later."""
    report = SoakReport()
    stop, clients_stop = asyncio.Event(), asyncio.Event()
    gateways = Gateways(stage.rota)
    gateways.urls = await asyncio.to_thread(gateways.read)
    following = asyncio.create_task(gateways.follow(stop))
    loops = [asyncio.create_task(client_loop(i, gateways, report, clients_stop, seed))
             for i in range(clients)]
    disrupting = asyncio.create_task(disruptions(stage.rota, report, disrupt_every_s, names,
                                                 stop, progress))
    ends = time.monotonic() + seconds
    try:
        await disrupting
        await asyncio.sleep(max(0.0, ends - time.monotonic()))
        clients_stop.set()
        await asyncio.gather(*loops)
    finally:
        stop.set()
        clients_stop.set()
        for task in (*loops, following, disrupting):
            task.cancel()
        await asyncio.gather(*loops, following, disrupting, return_exceptions=True)
    report.samples = stage.monitor.samples
    report.violations = list(stage.monitor.violations)
    return report


def main(argv: list[str] | None = None) -> int:
    from e2e.cluster import LocalCluster, binaries
    from e2e.cluster.realnode import RealNode
    from e2e.harness.deploy import deploy
    from e2e.harness.rota_node import build_rota_images
    from rota.kit.logs import configure

    parser = argparse.ArgumentParser(prog="python -m e2e.campaigns.soak", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--minutes", type=float, default=30.0, help="how long clients run")
    parser.add_argument("--clients", type=int, default=12, help="concurrent clients")
    parser.add_argument("--disrupt-every", type=float, default=90.0, metavar="SECONDS",
                        help="seconds between the end of one disruption and the next")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--log-level", default="warning")
    args = parser.parse_args(argv)
    configure(args.log_level)

    def say(line: str) -> None:
        print(line, flush=True)

    rounds = max(1, int(args.minutes * 60 / (args.disrupt_every + 60)))
    names = [DISRUPTIONS[i % len(DISRUPTIONS)] for i in range(rounds)]
    images = build_rota_images()
    with LocalCluster() as cluster:
        api = cluster.api_client()
        node = RealNode(cluster, "soak-node-1", images, bin_dir=binaries.locate())
        node.start()
        try:
            rota = RotaOnNodes(cluster, [node], deploy(api, nodes=[node.name],
                                                       gateway_nodes=[node.name]))
            rota.wait_ready()
            say(f"rota Ready on {node.name}; {args.clients} clients for {args.minutes:g} min, "
                f"disruptions: {', '.join(names)}")
            with soak_stage(rota) as stage:
                report = asyncio.run(soak(stage, seconds=args.minutes * 60,
                                          clients=args.clients,
                                          disrupt_every_s=args.disrupt_every, names=names,
                                          seed=args.seed, progress=say))
        finally:
            node.stop()
            api.close()
    print("\n".join(report.lines()))
    return 0 if report.passed() else 1


if __name__ == "__main__":
    sys.exit(main())
