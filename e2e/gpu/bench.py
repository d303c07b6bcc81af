"""The GPU benchmark with real vLLM engines: ``python -m e2e.bench.gpu --engine vllm``.

No Kubernetes: the driver's NVML backend behind its inspection service (a unix socket),
the controller's real :class:`~controller.lease.switch.Switcher` and vLLM adapter, claimants
built as the claims' opaque config would give them, an in-memory Lease. The engines are
real vLLM 0.26 servers on the GPU (or, with ``--launcher simulator --fake-nvml h200``, the
engine simulator standing in for them, for a run anywhere).

A run is a list of scenarios (see :mod:`e2e.gpu.scenarios`) executed in order while time is
left; engines are started once, in their own sessions, and recorded in ``--state-dir``
with what the run found out about them, so that a following command on the same machine
goes on with the next scenarios on the same engines (``--keep-engines``). Results are
written to ``--out``/``<stage>.json`` after every step, a human summary is printed at
the end, and the JSON object is the last line of stdout. Every wait is bounded; the whole
run stops (engines kept or stopped as asked) before ``--deadline-s``.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import logging
import os
import signal
import sys
import time
import uuid
from collections.abc import Coroutine, Sequence
from pathlib import Path
from typing import Any

import aiohttp

from controller.lease.device import DeviceReader
from driver.devices import GpuDevice, discover
from driver.inspection import InspectionService
from driver.nvml import open_backend
from driver.nvml.api import NvmlBackend
from e2e.gpu import report
from e2e.gpu.context import (
    ASSUMED_H2D_BYTES_PER_S,
    GIB,
    MIB,
    REPO_ROOT,
    Bench,
    BenchError,
    BenchState,
    byte_count,
    note,
    write_atomic,
)
from e2e.gpu.engines import (
    Launcher,
    SimulatorLauncher,
    VllmLauncher,
    boot_id,
)
from e2e.gpu.instrument import HttpTrace
from e2e.gpu.sampler import NvmlSampler
from e2e.harness.ports import ReaderDevice
from rota.kit.engine_connections import engine_connector
from rota.kit.logs import configure
from rota.kit.sockets import UnixServer

log = logging.getLogger("e2e.gpu.bench")

# -- command line ---------------------------------------------------------------------------


def parser() -> argparse.ArgumentParser:
    from e2e.gpu.scenarios import EXTRA, SCENARIOS

    p = argparse.ArgumentParser(prog="python -m e2e.bench.gpu --engine vllm",
                                description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--engine", choices=("vllm",), default="vllm", help=argparse.SUPPRESS)
    p.add_argument("--launcher", choices=("vllm", "simulator"), default="vllm",
                   help="vllm: real servers on the GPU; simulator: the engine simulator in "
                        "their place (needs --fake-nvml)")
    p.add_argument("--fake-nvml", metavar="FIXTURE", default=None,
                   help="the fake NVML with this fixture (a path or a name such as h200)")
    p.add_argument("--gpu-index", type=int, default=0)
    p.add_argument("--stage", default="bench", help="name of this command's result file")
    p.add_argument("--out", type=Path, default=Path("."),
                   help="folder of <stage>.json and <stage>-nvml.json")
    p.add_argument("--state-dir", type=Path, default=None,
                   help="engines' logs and the state a later command continues from "
                        "(default: a temporary folder)")
    p.add_argument("--scenarios", default="all",
                   help=f"comma-separated, in order; 'all' or 'next' (those this state has "
                        f"not run yet). Known: {', '.join(SCENARIOS)}; only when named: "
                        f"{', '.join(EXTRA)}")
    p.add_argument("--models", type=Path, default=REPO_ROOT / ".vllm" / "models",
                   help="folder holding model-14b and model-small (config + tokenizer)")
    p.add_argument("--small-weights", type=Path, default=None,
                   help="model-small with real weight files (python -m e2e.gpu.weights); "
                        "engine B loads them, so that level 2 can reload; default "
                        "<state-dir>/weights/model-small when it holds weights")
    p.add_argument("--a-model", default="model-14b",
                   help="the model of engine A, a folder under --models (model-small fits a "
                        "smaller GPU)")
    p.add_argument("--handoffs", type=int, default=19)
    p.add_argument("--a-kv", type=byte_count, default=8 * GIB, metavar="BYTES")
    p.add_argument("--b-kv", type=byte_count, default=4 * GIB, metavar="BYTES")
    p.add_argument("--g-kv", type=byte_count, default=4 * GIB, metavar="BYTES")
    p.add_argument("--vllm-python", default=sys.executable)
    p.add_argument("--vllm-pythonpath", default=os.environ.get("ROTA_VLLM_PYTHONPATH", ""),
                   help="PYTHONPATH of the vLLM servers (env ROTA_VLLM_PYTHONPATH)")
    p.add_argument("--h2d-json", type=Path, default=None,
                   help="a result of python -m e2e.gpu.h2d from this machine to reuse")
    p.add_argument("--skip-h2d", action="store_true", help="assume 54e9 B/s")
    p.add_argument("--deadline-s", type=float, default=560.0)
    p.add_argument("--keep-engines", action="store_true",
                   help="leave the engines running at the end (a later command reuses them)")
    p.add_argument("--stop-engines", action="store_true",
                   help="stop every engine of the state at the end (and no scenario first, "
                        "with --scenarios none)")
    p.add_argument("--probe-mode", choices=("structure", "answer"), default="structure",
                   help="structure: any content, [DONE] and usage (random weights answer "
                        "noise); answer: the controller's own probe (expects 7)")
    p.add_argument("--probe-max-tokens", type=int, default=16)
    p.add_argument("--sample-interval-ms", type=float, default=5.0)
    p.add_argument("--resident-budget", type=byte_count, default=GIB, metavar="BYTES",
                   help="resident budget of each claimant (vLLM asleep keeps ~0.78 GiB)")
    p.add_argument("--resident-tolerance", type=byte_count, default=512 * MIB, metavar="BYTES")
    p.add_argument("--unknown-limit", type=byte_count, default=512 * MIB, metavar="BYTES")
    p.add_argument("--start-timeout-s", type=float, default=300.0)
    p.add_argument("--sleep-timeout-s", type=float, default=180.0)
    p.add_argument("--wake-timeout-s", type=float, default=120.0)
    p.add_argument("--probe-timeout-s", type=float, default=60.0)
    p.add_argument("--concurrency", type=int, default=8)
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--max-tokens", type=int, default=128)
    p.add_argument("--wake-cycles", type=int, default=6,
                   help="wake_detail: sleep/wake cycles of A timed call by call")
    p.add_argument("--level2-cycles", type=int, default=3)
    p.add_argument("--graph-handoffs", type=int, default=4)
    p.add_argument("--abandon-after-s", type=float, default=1.0,
                   help="abandoned_sleep: the adapter's sleep bound while a long stream runs")
    p.add_argument("--long-tokens", type=int, default=1500,
                   help="abandoned_sleep: length of the stream the sleep waits for")
    p.add_argument("--kill-delay-s", type=float, default=-1.0,
                   help="killed_mid_switch: SIGKILL the target this long into its wake "
                        "(negative: 40%% of its last wake, else 20 ms)")
    p.add_argument("--estimate-scale", type=float, default=None,
                   help="scale of the scenarios' time estimates (default 1 for vllm, 0.05 "
                        "for the simulator)")
    p.add_argument("--log-level", default="warning")
    return p


def check_args(args: argparse.Namespace, p: argparse.ArgumentParser) -> None:
    if args.launcher == "simulator" and not args.fake_nvml:
        p.error("--launcher simulator needs --fake-nvml (its memory is counted, not real)")
    if args.estimate_scale is None:
        args.estimate_scale = 1.0 if args.launcher == "vllm" else 0.05
    if args.handoffs < 2:
        p.error("--handoffs must be >= 2 (both directions)")
    for name in (args.a_model, "model-small"):
        if not (args.models / name / "config.json").is_file():
            p.error(f"{args.models / name} holds no config.json (copy the model folders "
                    f"into {args.models})")


def load_h2d(args: argparse.Namespace, state: BenchState) -> dict[str, Any]:
    """The copy floor's bandwidth: a measurement of this machine (``--h2d-json``, or one
    an earlier command kept), or the assumed 54e9 B/s."""
    if state.h2d is not None and state.h2d.get("measured"):
        return state.h2d
    if args.h2d_json is not None and not args.skip_h2d:
        try:
            measured = json.loads(args.h2d_json.read_text(encoding="utf-8"))
        except (OSError, ValueError) as exc:
            return {"bytes_per_s": ASSUMED_H2D_BYTES_PER_S, "measured": False,
                    "source": f"assumed: {args.h2d_json} unreadable ({exc})"}
        bulk = measured.get("bulk") or {}
        if "best_bytes_per_s" in bulk:
            return {"bytes_per_s": float(bulk["best_bytes_per_s"]), "measured": True,
                    "source": f"measured on this machine ({args.h2d_json.name}): pinned host "
                              "buffer to device, best of the repeats",
                    "detail": measured}
        return {"bytes_per_s": ASSUMED_H2D_BYTES_PER_S, "measured": False,
                "source": f"assumed: {measured.get('error', 'no bulk result')}"}
    return {"bytes_per_s": ASSUMED_H2D_BYTES_PER_S, "measured": False,
            "source": "assumed 54e9 B/s (no measurement given)"}


async def _run(args: argparse.Namespace, state: BenchState, state_file: Path,
               backend: NvmlBackend, gpu: GpuDevice, launcher: Launcher, deadline: float,
               holder: dict[str, Bench]) -> None:
    from e2e.gpu.scenarios import run_scenarios

    socket = state_file.parent / f"inspect-{os.getpid()}.sock"
    # The engines run in no pod: each names its simulated pod (engines.bench_identity).
    service = InspectionService(backend=backend, gpus=[gpu], proc_root=Path("/proc"),
                                pods_from_environment=True)
    server = UnixServer(socket, [service.handler()])
    await server.start()
    reader = DeviceReader(socket, timeout_s=10.0)
    sampler = NvmlSampler(backend, gpu.index, interval_s=args.sample_interval_ms / 1e3)
    trace = HttpTrace()
    try:
        async with aiohttp.ClientSession(connector=engine_connector(),
                                         trace_configs=[trace.config()]) as session:
            bench = Bench(args=args, state=state, state_file=state_file,
                          out_file=args.out / f"{args.stage}.json", backend=backend, gpu=gpu,
                          launcher=launcher, session=session, device=ReaderDevice(reader),
                          sampler=sampler, trace=trace, deadline=deadline)
            holder["bench"] = bench
            for key in bench.live():
                bench.watch(key)
            sampler.start()
            await run_scenarios(bench)
    finally:
        sampler.stop()
        await reader.close()
        await server.stop(1.0)


async def _signalled(work: Coroutine[Any, Any, None]) -> None:
    """``work``, cancelled by SIGTERM or SIGINT (results so far are written all the same)."""
    loop = asyncio.get_running_loop()
    task = asyncio.current_task()
    assert task is not None
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, task.cancel)
    await work


def main(argv: Sequence[str] | None = None) -> int:
    p = parser()
    args = p.parse_args(argv)
    check_args(args, p)
    configure(args.log_level)
    started = time.monotonic()
    deadline = started + args.deadline_s
    state_dir = args.state_dir or Path(os.environ.get("TMPDIR", "/tmp")) / \
        f"rota-bench-gpu-{uuid.uuid4().hex[:8]}"
    state_dir.mkdir(parents=True, exist_ok=True)
    args.state_dir = state_dir
    args.out.mkdir(parents=True, exist_ok=True)
    state_file = state_dir / "state.json"
    fake_dir = state_dir / "nvml"
    print(f"rota GPU benchmark ({args.stage}) -- {note(args)}", flush=True)
    holder: dict[str, Bench] = {}
    error: str | None = None
    backend: NvmlBackend | None = None
    stopped: dict[str, list[int]] = {}
    try:
        backend = open_backend(args.fake_nvml, fake_dir)
        backend.init()
        gpu = next((g for g in discover(backend) if g.index == args.gpu_index), None)
        if gpu is None:
            raise BenchError(f"no usable GPU with NVML index {args.gpu_index}")
        previous = BenchState.load(state_file)
        if previous is not None and (previous.boot_id != boot_id()
                                     or previous.gpu_uuid != gpu.uuid):
            raise BenchError(f"{state_file} was written on another boot or GPU: its engines "
                             "are gone (the machine was restarted); start again with the "
                             "first stage")
        state = previous or BenchState(boot_id=boot_id(), gpu_uuid=gpu.uuid)
        state.stages.append(args.stage)
        state.h2d = load_h2d(args, state)
        env = dict(os.environ)
        env.pop("ROTA_CLAIM_UID", None)
        env.pop("ROTA_POD_UID", None)
        launcher: Launcher
        if args.launcher == "vllm":
            # By index, in NVML's (PCI bus) order: parts of vLLM read the variable as numbers.
            env["CUDA_DEVICE_ORDER"] = "PCI_BUS_ID"
            env["CUDA_VISIBLE_DEVICES"] = str(gpu.index)
            launcher = VllmLauncher(python=args.vllm_python, pythonpath=args.vllm_pythonpath,
                                    base_env=env)
        else:
            launcher = SimulatorLauncher(python=sys.executable, repo_root=REPO_ROOT,
                                         fake_nvml_dir=fake_dir, gpu_uuid=gpu.uuid,
                                         base_env=env)
        print(f"GPU {gpu.index}: {gpu.product_name} {gpu.uuid}, {gpu.memory_bytes // MIB} MiB; "
              f"copy floor bandwidth {state.h2d['bytes_per_s'] / 1e9:.1f} GB/s "
              f"({state.h2d['source']}); state in {state_dir}", flush=True)

        asyncio.run(_signalled(_run(args, state, state_file, backend, gpu, launcher, deadline,
                                    holder)))
    except asyncio.CancelledError:
        error = "stopped by a signal; results so far are kept"
    except Exception as exc:
        error = f"{type(exc).__name__}: {exc}"
        if not isinstance(exc, BenchError):
            log.exception("benchmark failed")
    finally:
        bench = holder.get("bench")
        if bench is not None and (args.stop_engines or not args.keep_engines):
            for key in bench.live():
                stopped[key] = bench.engine(key).stop(10.0)
                bench.record(key).dead = True
        if backend is not None:
            with contextlib.suppress(Exception):
                backend.shutdown()
    if bench is None:
        summary: dict[str, Any] = {"benchmark": "gpu_switch_vllm", "stage": args.stage,
                                   "ok": False, "error": error, "note": note(args)}
        write_atomic(args.out / f"{args.stage}.json", json.dumps(summary))
    else:
        bench.state.save(state_file)
        summary = bench.summary(error)
        if stopped:
            summary["engines_stopped"] = stopped
        write_atomic(args.out / f"{args.stage}.json", json.dumps(summary, default=str))
        timeline = bench.sampler.report()
        write_atomic(args.out / f"{args.stage}-nvml.json",
                      json.dumps({k: timeline[k] for k in ("timeline_columns", "timeline")}))
        print(report.text(summary), flush=True)
    if error:
        print(f"ERROR: {error}", flush=True)
    print(json.dumps(headline(summary, args.out / f"{args.stage}.json")), flush=True)
    return 0 if summary.get("ok") else 1


def headline(summary: dict[str, Any], path: Path) -> dict[str, Any]:
    """The last line of stdout: the verdicts and a few numbers; the whole result is in
    ``path`` (printing it would bury the report in a call's output tail)."""
    scenarios = summary.get("scenarios") or {}
    main = (scenarios.get("main") or {}).get("summary") or {}
    overall = main.get("all") or {}
    return {
        "benchmark": summary.get("benchmark"), "stage": summary.get("stage"),
        "ok": summary.get("ok"), "error": summary.get("error"), "results": str(path),
        "scenarios": {name: ("skipped" if r.get("skipped") else "error" if r.get("error")
                             else "ok" if r.get("ok") else "not ok")
                      for name, r in scenarios.items()},
        "handoffs_ok": main.get("ok"), "handoffs": main.get("handoffs"),
        "p50_s": {k: (overall.get(k) or {}).get("p50") for k in (
            "handoff_to_first_token", "recovery_to_first_token", "wake_call",
            "controller_overhead")},
        "nvml_violations": (summary.get("sampler") or {}).get("violations"),
    }


if __name__ == "__main__":
    raise SystemExit(main())
