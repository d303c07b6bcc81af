"""Engine simulator processes of the switch benchmark (``python -m e2e.bench.gpu``).

Each :class:`Sim` is one ``python -m e2e.engine_simulator`` process standing for one claim:
started with ``ROTA_CLAIM_UID`` (and the same value as ``ROTA_POD_UID``) so the driver's
inspection service attributes its GPU memory to that claim, with real device memory
(``--memory-backend cuda``) or counted memory registered with the fake NVML. A simulator
of ``tp`` above 1 is a tensor-parallel engine: one worker process per GPU, each holding its
shard, as vLLM's ``--tensor-parallel-size`` runs (the simulator's own ``--tensor-parallel-size``).

Every wait here is bounded; :func:`stop_sims` ends every process (SIGTERM, then SIGKILL),
and a simulator gets SIGKILL if the benchmark itself dies (parent-death signal).
"""

from __future__ import annotations

import argparse
import contextlib
import shutil
import signal
import subprocess
import sys
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import aiohttp

from driver.devices import GpuDevice
from e2e.gpu.context import REPO_ROOT, BenchError
from e2e.gpu.vllm_log import tail
from e2e.harness.waiting import WaitTimeout, eventually_async

__all__ = ["Sim", "sim_state", "spawn", "stop_sims", "wait_listening"]

LOG_LINES = 15
"""Lines of a simulator's log quoted in an error."""


@dataclass
class Sim:
    """One engine simulator process and the claim it stands for.

    ``awake``, ``resident`` and ``weights`` are the engine's totals: a tensor-parallel
    engine (``tp`` above 1) holds 1/``tp`` of each on every one of its GPUs."""

    key: str
    model: str
    awake: int
    resident: int
    weights: int
    claim_uid: str
    port_file: Path
    log_file: Path
    tp: int = 1
    proc: subprocess.Popen[bytes] | None = None
    port: int = 0

    @property
    def label(self) -> str:
        return self.key.upper()

    def shard(self, total: int) -> int:
        """The part of ``total`` bytes one GPU of the engine holds."""
        return total // self.tp

    def log_tail(self) -> str:
        return tail(self.log_file, LOG_LINES)


def spawn(sim: Sim, args: argparse.Namespace, env: dict[str, str],
          gpus: Sequence[GpuDevice], fake_dir: Path | None) -> None:
    """Start ``sim``'s simulator on ``gpus`` (one for a one-GPU engine, ``sim.tp`` for a
    tensor-parallel one); its output goes to ``sim.log_file``."""
    if len(gpus) != sim.tp:
        raise BenchError(f"simulator {sim.label} is TP={sim.tp} but was given "
                         f"{len(gpus)} GPUs")
    command = [sys.executable, "-m", "e2e.engine_simulator", "--model", sim.model,
               "--host", "127.0.0.1", "--port", "0", "--port-file", str(sim.port_file),
               "--awake-memory-bytes", str(sim.awake),
               "--resident-memory-bytes", str(sim.resident),
               "--weights-bytes", str(sim.weights), "--memory-backend", args.memory_backend,
               "--tokens-per-second", str(args.tokens_per_second),
               "--gpu-uuid", ",".join(g.uuid for g in gpus),
               "--shutdown-grace-seconds", "0", "--dev-mode", "--log-level", "warning"]
    if sim.tp > 1:
        command += ["--tensor-parallel-size", str(sim.tp)]
    if fake_dir is not None:
        command += ["--fake-nvml-dir", str(fake_dir)]
    child_env = dict(env, ROTA_CLAIM_UID=sim.claim_uid, ROTA_POD_UID=sim.claim_uid)
    if args.memory_backend == "cuda":  # each engine sees its own GPUs, as its claim's would
        child_env |= {"CUDA_DEVICE_ORDER": "PCI_BUS_ID",
                      "CUDA_VISIBLE_DEVICES": ",".join(g.uuid for g in gpus)}
    setpriv = shutil.which("setpriv")
    if setpriv:  # the simulator gets SIGKILL if this process dies: no GPU memory left held
        command = [setpriv, "--pdeathsig", "KILL", "--", *command]
    with sim.log_file.open("wb") as out:
        sim.proc = subprocess.Popen(
            command, cwd=REPO_ROOT, env=child_env, stdin=subprocess.DEVNULL, stdout=out,
            stderr=subprocess.STDOUT)


def stop_sims(sims: Sequence[Sim], grace_s: float) -> None:
    """SIGTERM every simulator still running, wait (bounded), then SIGKILL. A
    tensor-parallel simulator's workers end with it (they hold its pipe)."""
    running = [s.proc for s in sims if s.proc is not None and s.proc.poll() is None]
    for proc in running:
        with contextlib.suppress(ProcessLookupError):
            proc.send_signal(signal.SIGTERM)
    deadline = time.monotonic() + grace_s
    for proc in running:
        try:
            proc.wait(timeout=max(0.1, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            with contextlib.suppress(ProcessLookupError):
                proc.kill()
            with contextlib.suppress(subprocess.TimeoutExpired):
                proc.wait(timeout=10)


async def wait_listening(sim: Sim, session: aiohttp.ClientSession, deadline: float) -> None:
    """Until the simulator wrote its port file (memory is allocated by then) and answers;
    raises :class:`BenchError` when it exits first or the deadline passes."""
    proc = sim.proc
    if proc is None:
        raise BenchError(f"simulator {sim.label} was never started")

    async def listening() -> str:
        if proc.poll() is not None:
            return "exited"
        text = ""
        with contextlib.suppress(OSError):
            text = sim.port_file.read_text(encoding="ascii").strip()
        return text if text.isdigit() else ""

    try:
        found = await eventually_async(listening, timeout=max(0.0, deadline - time.monotonic()),
                                       interval=0.05, max_interval=0.2,
                                       what=f"simulator {sim.label} listening")
    except WaitTimeout:
        raise BenchError(f"simulator {sim.label} did not listen within the start "
                         f"deadline:\n{sim.log_tail()}") from None
    if found == "exited":
        raise BenchError(f"simulator {sim.label} exited with status {proc.poll()} while "
                         f"starting:\n{sim.log_tail()}")
    sim.port = int(found)
    timeout = aiohttp.ClientTimeout(total=max(1.0, deadline - time.monotonic()))
    async with session.get(f"http://127.0.0.1:{sim.port}/health", timeout=timeout) as resp:
        if resp.status != 200:
            raise BenchError(f"simulator {sim.label} /health answered {resp.status}")


async def sim_state(sim: Sim, session: aiohttp.ClientSession) -> dict[str, Any]:
    """The simulator's own account (``/sim/state``): its memory, sleeps and wakes."""
    timeout = aiohttp.ClientTimeout(total=10)
    async with session.get(f"http://127.0.0.1:{sim.port}/sim/state", timeout=timeout) as resp:
        resp.raise_for_status()
        state: dict[str, Any] = await resp.json()
        return state
