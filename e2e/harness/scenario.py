"""Scenarios shared by the controller tests, the demo and the benchmarks: simulated engines
deployed as pods with claims, an activation client, and a checker of the one-awake rule (or,
for an awake set, of the rule that the GPU's memory is never overcommitted)."""

from __future__ import annotations

import array
import asyncio
import functools
import json
import multiprocessing
import threading
import time
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass, field
from multiprocessing.connection import Connection
from pathlib import Path
from typing import Any, NamedTuple

import aiohttp
from kubernetes import client

from controller.lease.device import DeviceError, DeviceReader
from driver.devices import device_name
from driver.inspection import process_environment
from driver.nvml.fake import FakeNvml
from e2e.harness.objects import claim, create_claim, engine_config, engine_pod
from e2e.harness.waiting import eventually
from rota.api.quantity import format_bytes, parse_quantity

PROC = Path("/proc")


@dataclass(frozen=True)
class EngineSpec:
    name: str
    model: str
    resident: str
    awake: str
    sleep_level: int = 1
    adapter: str = "vllm"
    args: tuple[str, ...] = ()
    gated: bool = False
    """Start through rota's start gate (start-up admission)."""
    config: tuple[tuple[str, Any], ...] = ()
    """More EngineConfig fields, e.g. ``(("omniStageIds", [0, 1]),)``."""


@dataclass
class Engine:
    spec: EngineSpec
    namespace: str
    claim_uid: str = ""
    pod_ip: str = ""

    @property
    def url(self) -> str:
        return f"http://{self.pod_ip}:8000"

    @property
    def resident_bytes(self) -> int:
        return parse_quantity(self.spec.resident)


def _ready_ip(core: client.CoreV1Api, namespace: str, name: str) -> str:
    pod = core.read_namespaced_pod(name, namespace)
    ready = any(c.type == "Ready" and c.status == "True" for c in pod.status.conditions or [])
    return str(pod.status.pod_ip) if pod.status.phase == "Running" and ready else ""


def deploy(api: client.ApiClient, namespace: str, node: str, specs: Sequence[EngineSpec],
           *, timeout: float = 90.0) -> list[Engine]:
    """Create a claim and an engine pod per spec; wait until every pod runs and is ready."""
    core = client.CoreV1Api(api)
    engines = []
    for spec in specs:
        config = engine_config(model=spec.model, awake=spec.awake, sleep_level=spec.sleep_level,
                               adapter=spec.adapter, extra=dict(spec.config))
        created = create_claim(api, namespace, claim(spec.name, memory=spec.resident,
                                                     config=config))
        core.create_namespaced_pod(namespace, engine_pod(spec.name, node=node,
                                                         claim_name=spec.name,
                                                         args=list(spec.args),
                                                         gated=spec.gated))
        engines.append(Engine(spec, namespace, claim_uid=created["metadata"]["uid"]))
    for engine in engines:
        engine.pod_ip = eventually(functools.partial(_ready_ip, core, namespace,
                                                     engine.spec.name),
                                   timeout=timeout, what=f"engine {engine.spec.name} ready")
    return engines


async def activate(session: aiohttp.ClientSession, url: str, model: str, *,
                   token: str | None = None, timeout_s: float = 120.0
                   ) -> tuple[int, dict[str, Any]]:
    """Ask the controller at ``url`` to wake ``model``. A 200's body gains ``endpoint``:
    the claimant's address as the controller's ``/v1/state`` lists it (the activation
    answer itself carries no address: gateways route to pod IPs they watch)."""
    headers = {"Authorization": f"Bearer {token}"} if token else {}
    async with session.post(f"{url}/v1/activate", json={"model": model}, headers=headers,
                            timeout=aiohttp.ClientTimeout(total=timeout_s)) as resp:
        status, body = resp.status, dict(await resp.json())
    if status == 200:
        async with session.get(f"{url}/v1/state", headers=headers,
                               timeout=aiohttp.ClientTimeout(total=timeout_s)) as resp:
            state = await resp.json()
        body["endpoint"] = next((c["endpoint"] for c in state.get("claimants", [])
                                 if c.get("claim") == body.get("claim")), None)
    return status, body


async def sim_state(session: aiohttp.ClientSession, engine: Engine) -> dict[str, Any]:
    async with session.get(f"{engine.url}/sim/state",
                           timeout=aiohttp.ClientTimeout(total=5)) as resp:
        return dict(await resp.json())


async def set_faults(session: aiohttp.ClientSession, engine: Engine, **faults: bool) -> None:
    async with session.post(f"{engine.url}/sim/faults", json=faults,
                            timeout=aiohttp.ClientTimeout(total=5)) as resp:
        resp.raise_for_status()


@dataclass(frozen=True)
class StreamedAnswer:
    content: str
    ttft_s: float
    """From sending the request to its first content token (0 when none came)."""
    total_s: float


async def stream_chat(session: aiohttp.ClientSession, base_url: str, model: str, *,
                      prompt: str = "What is 3 + 4?", max_tokens: int = 4,
                      ignore_eos: bool = False, timeout_s: float = 30.0) -> StreamedAnswer:
    """One streamed chat completion, with its content and timing."""
    body = {"model": model, "stream": True, "stream_options": {"include_usage": True},
            "max_tokens": max_tokens, "ignore_eos": ignore_eos,
            "messages": [{"role": "user", "content": prompt}]}
    start = time.perf_counter()
    first = 0.0
    parts: list[str] = []
    async with session.post(f"{base_url}/v1/chat/completions", json=body,
                            timeout=aiohttp.ClientTimeout(total=timeout_s)) as resp:
        resp.raise_for_status()
        async for raw in resp.content:
            line = raw.decode().strip()
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            for choice in json.loads(line[6:]).get("choices") or []:
                piece = choice.get("delta", {}).get("content") or ""
                if piece and not first:
                    first = time.perf_counter() - start
                parts.append(piece)
    return StreamedAnswer("".join(parts), first, time.perf_counter() - start)


async def ask_seven(session: aiohttp.ClientSession, base_url: str, model: str) -> str:
    """The correctness question, streamed; returns the content."""
    return (await stream_chat(session, base_url, model)).content


class GpuView(NamedTuple):
    """One GPU in a sample."""

    device: str
    total_bytes: int
    used_bytes: int
    """What NVML says is in use: every process's memory and what the driver holds itself."""
    processes: list[tuple[str, int]]
    """(claim uid, bytes held) per process."""


def awake_set_capacity(engines: Sequence[Engine], total_bytes: int) -> int:
    """The most of ``engines`` (the engines of one GPU) that their budgets let be awake
    together on a GPU of ``total_bytes``: the awake budgets of those awake and the resident
    budgets of the rest fit it. Reached by waking those whose awake budget exceeds their
    resident one the least."""
    growth = sorted(parse_quantity(e.spec.awake) - e.resident_bytes for e in engines)
    needed = sum(e.resident_bytes for e in engines)
    fitting = 0
    for extra in growth:
        needed += extra
        if needed > total_bytes:
            break
        fitting += 1
    return fitting


def _registry_reader(registry: Path, fixture: Path) -> Callable[[], list[GpuView]]:
    """A blocking read of every GPU of a fake NVML registry, one moment each."""
    backend = FakeNvml.from_path(fixture, registry)
    backend.init()
    names = [device_name(index) for index in range(backend.device_count())]
    claims: dict[int, str] = {}  # an engine's pid keeps its claim for its life

    def claim_of(pid: int) -> str:
        if pid not in claims:
            claims[pid] = process_environment(pid, PROC).get("ROTA_CLAIM_UID", "")
        return claims[pid]

    def read() -> list[GpuView]:
        views: list[GpuView] = []
        for index, name in enumerate(names):
            memory, processes = backend.memory_and_processes(index)
            views.append(GpuView(name, memory.total, memory.used,
                                 [(claim_of(p.pid), p.used_bytes or 0) for p in processes]))
        return views

    return read


@dataclass
class AwakeMonitor:
    """Samples the node's GPU in a thread and counts every snapshot in which more than
    one claimant holds more than its resident memory.

    With ``awake_set`` (a controller that may keep several engines awake where their
    budgets fit) the rule checked is the set's: a violation is a snapshot in which the
    GPU's memory in use exceeds its total, and a snapshot in which more engines hold more
    than their resident memory than any set of them fits by their budgets
    (:func:`awake_set_capacity`) is counted in ``crowded``.

    It reads through the driver's inspection API, or, given ``registry`` and ``fixture``,
    the fake GPU's process registry directly (claims told apart by the ``ROTA_CLAIM_UID``
    each engine process carries, as the driver does for simulated nodes): the chaos
    campaign samples several nodes every 5 ms, and their drivers answering that cost more
    CPU than a 2-core machine has to spare.

    A sample starts every ``interval_s`` on a fixed schedule (a slow read delays the next
    one, never the schedule); ``gaps`` holds the time between the starts of consecutive
    samples, so that what the sampling really achieved can be reported."""

    socket: Path
    engines: Sequence[Engine]
    tolerance_bytes: int = 256 * 1024**2
    interval_s: float = 0.005
    registry: Path | None = None
    fixture: Path | None = None
    separate_process: bool = False
    """Sample in a child process, with its own interpreter and GIL: in the chaos campaign
    the clients, the API relays and the Lease observer share the parent's, and a monitor
    thread among them slowed them down and was slowed down by them."""
    awake_set: bool = False
    """Check the awake set's rule (memory in use never over the GPU's total) instead of
    one awake."""
    samples: int = field(default=0, init=False)
    violations: list[str] = field(default_factory=list, init=False)
    """Snapshots that broke the rule: two engines above resident (one awake), the GPU's
    memory over its total (``awake_set``); when, and what each engine held."""
    crowded: list[str] = field(default_factory=list, init=False)
    """``awake_set``: snapshots with more engines above resident than their budgets let be
    awake together."""
    above_resident: dict[int, int] = field(default_factory=dict, init=False)
    """Snapshots of a GPU by how many engines held more than their resident memory."""
    peak_used_bytes: int = field(default=0, init=False)
    """The most memory in use any snapshot of a GPU showed, and that GPU's total."""
    peak_total_bytes: int = field(default=0, init=False)
    gaps: array.array[float] = field(default_factory=lambda: array.array("d"), init=False)
    _stop: threading.Event = field(default_factory=threading.Event, init=False)
    _sampled: threading.Condition = field(default_factory=threading.Condition, init=False)
    _thread: threading.Thread | None = field(default=None, init=False)
    _child: Any = field(default=None, init=False)
    """The child process (``separate_process``), and its end of the pipe and its count of
    samples, shared with this process."""
    _pipe: Connection | None = field(default=None, init=False)
    _shared_samples: Any = field(default=None, init=False)
    _capacity: dict[int, int] = field(default_factory=dict, init=False)
    """:func:`awake_set_capacity` by the GPU's total."""

    def _run(self) -> None:
        asyncio.run(self._loop())

    async def _loop(self) -> None:
        if self.registry is not None and self.fixture is not None:
            read_registry = _registry_reader(self.registry, self.fixture)

            async def read() -> list[GpuView]:
                return read_registry()

            await self._sample(read)
            return
        reader = DeviceReader(self.socket)

        async def inspect() -> list[GpuView]:
            return [GpuView(gpu.device, gpu.total_bytes, gpu.used_bytes,
                            [(p.claim_uid, p.used_bytes) for p in gpu.processes])
                    for gpu in (await reader.read()).values()]

        try:
            await self._sample(inspect)
        finally:
            await reader.close()

    async def _sample(self, read: Callable[[], Awaitable[list[GpuView]]]) -> None:
        resident = {e.claim_uid: e.resident_bytes for e in self.engines}
        loop = asyncio.get_running_loop()
        due = loop.time()
        last: float | None = None
        while not self._stop.is_set():
            now = loop.time()
            if last is not None:
                self.gaps.append(now - last)
            last = now
            due = max(due + self.interval_s, now)  # late: start again from now
            try:
                gpus = await read()
            except DeviceError:  # the driver restarting: sample again shortly
                await asyncio.sleep(0.01)
                last = None
                continue
            for gpu in gpus:
                self._check(gpu, resident)
            with self._sampled:
                self.samples += 1
                self._sampled.notify_all()
            if self._shared_samples is not None:
                self._shared_samples.value = self.samples
            await asyncio.sleep(max(0.0, due - loop.time()))

    def _check(self, gpu: GpuView, resident: dict[str, int]) -> None:
        held = {claim: used for claim, used in gpu.processes if claim in resident
                and used > resident[claim] + self.tolerance_bytes}
        self.above_resident[len(held)] = self.above_resident.get(len(held), 0) + 1
        if gpu.used_bytes > self.peak_used_bytes:
            self.peak_used_bytes, self.peak_total_bytes = gpu.used_bytes, gpu.total_bytes
        # Each one kept says when, and how much each engine held: to find it in logs.
        if not self.awake_set:
            if len(held) > 1:
                self.violations.append(f"{time.time():.3f} {gpu.device}: {held}")
            return
        if gpu.used_bytes > gpu.total_bytes:
            self.violations.append(
                f"{time.time():.3f} {gpu.device}: {format_bytes(gpu.used_bytes)} in use of "
                f"{format_bytes(gpu.total_bytes)}: {dict(gpu.processes)}")
        if gpu.total_bytes not in self._capacity:
            self._capacity[gpu.total_bytes] = awake_set_capacity(self.engines, gpu.total_bytes)
        if len(held) > self._capacity[gpu.total_bytes]:
            self.crowded.append(f"{time.time():.3f} {gpu.device}: {held}")

    def wait_next(self, timeout: float = 10.0) -> None:
        """Block until the monitor has taken a sample that started after this call."""
        if self._child is not None:
            self._wait_for_child(timeout)
            return
        with self._sampled:
            target = self.samples + 2  # the sample in progress may predate the call
            if not self._sampled.wait_for(lambda: self.samples >= target, timeout):
                raise TimeoutError(f"the awake monitor took no sample in {timeout} s")

    def _wait_for_child(self, timeout: float) -> None:
        target = self._shared_samples.value + 2
        deadline = time.monotonic() + timeout
        while self._shared_samples.value < target:
            if time.monotonic() > deadline or not self._child.is_alive():
                raise TimeoutError(f"the awake monitor took no sample in {timeout} s")
            time.sleep(self.interval_s)

    def __enter__(self) -> AwakeMonitor:
        if self.separate_process:
            self._start_child()
            return self
        self._thread = threading.Thread(target=self._run, name="awake-monitor", daemon=True)
        self._thread.start()
        return self

    def _start_child(self) -> None:
        context = multiprocessing.get_context("spawn")
        self._pipe, child_end = context.Pipe()
        self._shared_samples = context.Value("q", 0, lock=False)
        settings = (self.socket, list(self.engines), self.tolerance_bytes, self.interval_s,
                    self.registry, self.fixture, self.awake_set)
        self._child = context.Process(target=_sample_in_child, name="awake-monitor",
                                      args=(settings, child_end, self._shared_samples),
                                      daemon=True)
        self._child.start()
        child_end.close()
        self._wait_for_child(60.0)  # an interpreter's start and imports: seconds

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(10)
        if self._child is not None:
            self._stop_child()

    def _stop_child(self) -> None:
        """Tell the child to stop and take over what it counted; a child that died or
        does not answer is an error, never a monitor that silently saw nothing."""
        child, pipe = self._child, self._pipe
        self._child = self._pipe = None
        assert pipe is not None
        try:
            pipe.send("stop")
            if not pipe.poll(30):
                raise RuntimeError("the awake monitor's process did not answer its stop")
            (samples, violations, gaps, self.crowded, self.above_resident,
             self.peak_used_bytes, self.peak_total_bytes) = pipe.recv()
        except (EOFError, BrokenPipeError) as exc:
            raise RuntimeError(f"the awake monitor's process died (exit code "
                               f"{child.exitcode})") from exc
        finally:
            pipe.close()
            child.join(10)
            if child.is_alive():
                child.kill()
        self.samples, self.violations = samples, violations
        self.gaps = array.array("d")
        self.gaps.frombytes(gaps)


def _sample_in_child(settings: tuple[Any, ...], pipe: Connection, shared_samples: Any
                     ) -> None:
    """A separate-process monitor's child: sample until the parent says stop (or goes
    away), then send back the samples' count, the violations, the gaps and the rest it
    counted."""
    socket, engines, tolerance, interval, registry, fixture, awake_set = settings
    monitor = AwakeMonitor(socket, engines, tolerance, interval, registry, fixture,
                           awake_set=awake_set)
    monitor._shared_samples = shared_samples
    with monitor:
        try:
            pipe.recv()
        except EOFError:
            return
    pipe.send((monitor.samples, monitor.violations, monitor.gaps.tobytes(), monitor.crowded,
               monitor.above_resident, monitor.peak_used_bytes, monitor.peak_total_bytes))
