"""Command line of the switch benchmark on engine simulators (``python -m e2e.bench.gpu``):
flags, the run's set-up and the one exit path that stops every simulator.

With ``--tensor-parallel N`` (N above 1) the run is the gang benchmark of
:mod:`e2e.gpu.gang_run` on N GPUs; otherwise the one-GPU protocol of
:mod:`e2e.gpu.switch_run`. ``--engine vllm`` hands the whole command line to
:mod:`e2e.gpu.bench`.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import logging
import os
import shutil
import signal
import sys
import tempfile
import time
import uuid
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import aiohttp

from controller.lease.switch import Fenced
from driver.devices import GpuDevice, discover
from driver.nvml import open_backend
from driver.nvml.api import NvmlBackend
from e2e.gpu.bandwidth import h2d_bandwidth, measure_child
from e2e.gpu.context import GIB, MIB, REPO_ROOT, BenchError, byte_count
from e2e.gpu.load import LoadError
from e2e.gpu.simulators import Sim, spawn, stop_sims
from e2e.gpu.switch_run import Run, remaining, run_protocol, say
from e2e.gpu.switch_summary import note, summary
from rota.kit.errors import ConfigError
from rota.kit.logs import configure

__all__ = ["main", "parser"]

log = logging.getLogger("e2e.gpu.switch_cli")


def _engine_of(argv: Sequence[str]) -> str:
    """The value of ``--engine`` (simulator when absent)."""
    for i, arg in enumerate(argv):
        if arg == "--engine" and i + 1 < len(argv):
            return argv[i + 1]
        if arg.startswith("--engine="):
            return arg.split("=", 1)[1]
    return "simulator"


def parser(description: str | None = None) -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m e2e.bench.gpu", description=description,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    add = p.add_argument
    add("--engine", choices=("simulator", "vllm"), default="simulator",
        help="simulator (default): engine simulators holding device memory; vllm: real vLLM "
             "servers and the failure scenarios (python -m e2e.bench.gpu --engine vllm --help)")
    add("--fake-nvml", metavar="FIXTURE", default=None,
        help="use the fake NVML with this fixture (a path, or a shipped name such as h200 or "
             "h200x8) instead of pynvml; implies --memory-backend fake")
    add("--memory-backend", choices=("cuda", "fake"), default=None,
        help="the simulators' memory (default: cuda, fake with --fake-nvml)")
    add("--gpu-index", type=int, default=0,
        help="NVML index of the GPU (with --tensor-parallel N: of the first of N GPUs)")
    add("--tensor-parallel", type=int, default=1, metavar="N",
        help="N above 1: a TP=N engine simulator (A) takes turns with N TP=1 engines (one "
             "per GPU) through gang switches; --a-* are A's per GPU, --b-* each TP=1 engine's")
    add("--handoffs", type=int, default=19)
    add("--a-awake", type=byte_count, default=60 * GIB, metavar="BYTES")
    add("--a-resident", type=byte_count, default=1 * GIB, metavar="BYTES")
    add("--a-weights", type=byte_count, default=48 * GIB, metavar="BYTES",
        help="part of A's awake-minus-resident that is weights (rest: KV)")
    add("--b-awake", type=byte_count, default=10 * GIB, metavar="BYTES")
    add("--b-resident", type=byte_count, default=1 * GIB, metavar="BYTES")
    add("--b-weights", type=byte_count, default=8 * GIB, metavar="BYTES")
    add("--context-allowance", type=byte_count, default=None, metavar="BYTES",
        help="added to each claimant's resident and awake budgets for the CUDA context the "
             "simulator's knobs do not count (default 1Gi with cuda memory, 0 with fake)")
    add("--resident-tolerance", type=byte_count, default=512 * MIB, metavar="BYTES",
        help="the controller's resident tolerance")
    add("--unknown-limit", type=byte_count, default=512 * MIB, metavar="BYTES",
        help="memory unknown processes may hold before wakes are refused")
    add("--tokens-per-second", type=float, default=500.0,
        help="the simulators' decode speed per request")
    add("--concurrency", type=int, default=8)
    add("--rounds", type=int, default=2)
    add("--max-tokens", type=int, default=128)
    add("--sample-interval-s", type=float, default=0.005,
        help="with --tensor-parallel: how often the one-awake invariant is read through the "
             "inspection service")
    add("--h2d-bandwidth", type=float, default=None, metavar="BYTES_PER_S",
        help="use this host-to-device bandwidth instead of measuring it")
    add("--skip-h2d", action="store_true", help="do not measure the bandwidth; assume 54e9 B/s")
    add("--h2d-bytes", type=byte_count, default=4 * GIB, metavar="BYTES")
    add("--h2d-repeats", type=int, default=5)
    add("--h2d-timeout-s", type=float, default=120.0)
    add("--start-timeout-s", type=float, default=180.0,
        help="bound on the simulators allocating and listening")
    add("--sleep-timeout-s", type=float, default=180.0,
        help="bound on one sleep call (the first allocates pinned memory)")
    add("--wake-timeout-s", type=float, default=120.0)
    add("--probe-timeout-s", type=float, default=30.0)
    add("--deadline-s", type=float, default=480.0,
        help="bound on the whole run, before the simulators are stopped")
    add("--stop-grace-s", type=float, default=20.0,
        help="how long stopped simulators get before SIGKILL")
    add("--log-level", default="warning",
        help="log level of the controller and driver code (stderr, JSON)")
    add("--measure-h2d-only", action="store_true", help=argparse.SUPPRESS)
    return p


def check(args: argparse.Namespace, p: argparse.ArgumentParser) -> None:
    if args.memory_backend is None:
        args.memory_backend = "fake" if args.fake_nvml else "cuda"
    if args.context_allowance is None:
        args.context_allowance = GIB if args.memory_backend == "cuda" else 0
    if args.handoffs < 1 or args.concurrency < 1 or args.rounds < 1 or args.max_tokens < 1:
        p.error("--handoffs, --concurrency, --rounds and --max-tokens must be >= 1")
    if args.tensor_parallel < 1:
        p.error("--tensor-parallel must be >= 1")
    if args.tensor_parallel > 1 and args.memory_backend != "fake":
        p.error("--tensor-parallel above 1 needs --memory-backend fake: the engine simulator "
                "holds a tensor-parallel engine's shards only as counted memory")
    if args.sample_interval_s <= 0:
        p.error("--sample-interval-s must be > 0")
    for key in ("a", "b"):
        awake, resident, weights = (getattr(args, f"{key}_{part}")
                                    for part in ("awake", "resident", "weights"))
        if weights <= 0 or resident + weights > awake:
            p.error(f"engine {key.upper()}: need 0 < weights and resident + weights <= awake")


def _sims(args: argparse.Namespace, workdir: Path) -> list[Sim]:
    """A and B; with ``--tensor-parallel N``: A on N GPUs and B0..B(N-1), one per GPU."""
    suffix = uuid.uuid4().hex[:8]
    tp = args.tensor_parallel
    keys = ["a", "b"] if tp == 1 else ["a", *(f"b{i}" for i in range(tp))]
    sims = []
    for key in keys:
        part = key[0]
        size = tp if part == "a" else 1
        sims.append(Sim(
            key=key, model=f"bench/model-{key}-{suffix}", tp=size,
            awake=getattr(args, f"{part}_awake") * size,
            resident=getattr(args, f"{part}_resident") * size,
            weights=getattr(args, f"{part}_weights") * size, claim_uid=str(uuid.uuid4()),
            port_file=workdir / f"{key}.port", log_file=workdir / f"{key}.log"))
    return sims


def _choose_gpus(backend: NvmlBackend, args: argparse.Namespace) -> list[GpuDevice]:
    """The GPUs of the run: ``--tensor-parallel`` of them from ``--gpu-index`` on."""
    gpus = {g.index: g for g in discover(backend)}
    wanted = range(args.gpu_index, args.gpu_index + args.tensor_parallel)
    missing = [i for i in wanted if i not in gpus]
    if missing:
        raise BenchError(f"no usable GPU with NVML index {missing}: {sorted(gpus)} (a run "
                         f"with --tensor-parallel {args.tensor_parallel} needs that many)")
    return [gpus[i] for i in wanted]


def _environment() -> dict[str, str]:
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(REPO_ROOT), env.get("PYTHONPATH"))
                                        if p)
    env.pop("ROTA_CLAIM_UID", None)
    env.pop("ROTA_POD_UID", None)
    return env


def _start(run: Run, args: argparse.Namespace, env: dict[str, str],
           fake_dir: Path | None) -> None:
    a = run.sims[0]
    for sim in run.sims:
        on = run.gpus if sim is a else [run.gpus[0 if len(run.gpus) == 1
                                                  else int(sim.key[1:])]]
        spawn(sim, args, env, on, fake_dir)
        say(f"started simulator {sim.label} (TP={sim.tp}, {', '.join(g.name for g in on)}): "
            f"{sim.awake // MIB} MiB awake ({sim.weights // MIB} MiB weights), "
            f"{sim.resident // MIB} MiB resident, pid {sim.proc.pid if sim.proc else '?'}")


def _execute(run: Run, args: argparse.Namespace, backend: NvmlBackend, workdir: Path,
             deadline: float) -> None:
    """The protocol under the run's deadline."""
    async def bounded() -> None:
        socket = workdir / "inspect.sock"
        try:
            async with asyncio.timeout(remaining(deadline, "the switch protocol")):
                if args.tensor_parallel > 1:
                    from e2e.gpu.gang_run import run_gang_protocol

                    await run_gang_protocol(run, args, backend, socket, deadline)
                else:
                    await run_protocol(run, args, backend, socket, deadline)
        except TimeoutError as exc:
            raise BenchError(f"timed out during {run.stage} (run deadline --deadline-s "
                             f"{args.deadline_s:g}; a step bound may have run out first)"
                             ) from exc

    asyncio.run(bounded())


def _summary(run: Run, args: argparse.Namespace, started: float, error: str | None
             ) -> dict[str, Any]:
    if args.tensor_parallel > 1:
        from e2e.gpu.gang_run import gang_summary

        return gang_summary(run, args, started, error)
    return summary(run, args, started, error)


def main(argv: Sequence[str] | None = None, description: str | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if _engine_of(argv) == "vllm":
        from e2e.gpu.bench import main as vllm_main

        return vllm_main(argv)
    p = parser(description)
    args = p.parse_args(argv)
    if args.measure_h2d_only:
        return measure_child(args.h2d_bytes, args.h2d_repeats)
    check(args, p)
    configure(args.log_level)
    started = time.monotonic()
    deadline = started + args.deadline_s
    workdir = Path(tempfile.mkdtemp(prefix="rota-bench-gpu-"))
    fake_dir = workdir / "nvml" if args.fake_nvml else None
    run = Run(sims=_sims(args, workdir))
    env = _environment()
    say(f"rota GPU switch benchmark -- {note(bool(args.fake_nvml), gang=args.tensor_parallel > 1)}")
    error: str | None = None
    backend: NvmlBackend | None = None
    previous = signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    try:
        backend = open_backend(args.fake_nvml, fake_dir)
        backend.init()
        run.gpus = _choose_gpus(backend, args)
        run.gpu = run.gpus[0]
        for gpu in run.gpus:
            say(f"GPU {gpu.index}: {gpu.product_name} {gpu.uuid}, "
                f"{gpu.memory_bytes // MIB} MiB (NVML {'fake' if args.fake_nvml else 'real'}, "
                f"memory backend {args.memory_backend})")
        if args.memory_backend == "cuda":
            env["CUDA_DEVICE_ORDER"] = "PCI_BUS_ID"
            env["CUDA_VISIBLE_DEVICES"] = ",".join(g.uuid for g in run.gpus)
        run.h2d = h2d_bandwidth(args, env)
        say(f"host-to-device bandwidth {run.h2d['bytes_per_s'] / 1e9:.1f} GB/s "
            f"({run.h2d['source']})")
        _start(run, args, env, fake_dir)
        _execute(run, args, backend, workdir, deadline)
    except (BenchError, ConfigError, TimeoutError, OSError, aiohttp.ClientError, LoadError,
            Fenced) as exc:
        error = f"{type(exc).__name__}: {exc}" if str(exc) else type(exc).__name__
    except (KeyboardInterrupt, SystemExit):
        error = "interrupted (signal); simulators stopped"
    except Exception as exc:
        error = f"{type(exc).__name__}: {exc}"
        log.exception("benchmark failed")
    finally:
        stop_sims(run.sims, args.stop_grace_s)
        if backend is not None:
            with contextlib.suppress(Exception):
                backend.shutdown()
        signal.signal(signal.SIGTERM, previous)
        if error is not None:
            say(f"ERROR: {error}")
            for sim in run.sims:
                if sim.proc is not None:
                    print(f"--- simulator {sim.label} log (tail) ---\n{sim.log_tail()}",
                          file=sys.stderr, flush=True)
        shutil.rmtree(workdir, ignore_errors=True)
    result = _summary(run, args, started, error)
    print(json.dumps(result), flush=True)
    return 0 if result["ok"] else 1
