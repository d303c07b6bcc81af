"""Engine processes of the GPU benchmark: real vLLM servers, or the engine simulator
standing in for one where there is no GPU.

Each engine runs in its own session (``setsid``), writes its output to a log file, and is
recorded in the benchmark's state directory (:class:`EngineRecord`): a later command on the
same machine attaches to the running engines instead of paying their cold start again
(89-100 s for a small model on the H200). Every wait is bounded; an engine that exits while
starting is reported with the tail of its log. Stopping signals the engine's whole process
group (vLLM runs its engine core as a child process), then kills what is left.

Both launchers take an :class:`EngineSpec`; vLLM gets the flags and environment that ran
on the H200 (sleep mode, fixed KV cache, bfloat16, eager unless CUDA graphs are asked
for), the simulator gets the memory a vLLM engine of that spec holds (weights from the
model's config, the KV cache, the resident part), registered with the fake NVML.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import signal
import socket
import subprocess
import threading
import time
import uuid
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Literal, Protocol

import aiohttp
from pydantic import BaseModel, ConfigDict, Field

from e2e.gpu.shapes import load_config, weight_bytes
from e2e.gpu.vllm_log import tail

__all__ = [
    "EngineProcess",
    "EngineRecord",
    "EngineSpec",
    "EngineStartError",
    "Launcher",
    "SimulatorLauncher",
    "VllmLauncher",
    "free_port",
    "process_group",
]

MIB = 2**20
GIB = 2**30

VLLM_ENVIRONMENT = {
    "VLLM_SERVER_DEV_MODE": "1",        # the sleep, wake and is_sleeping routes
    "VLLM_USE_FLASHINFER_SAMPLER": "0",  # flashinfer is not in the offline bundle
    "HF_HUB_OFFLINE": "1",
    "TRANSFORMERS_OFFLINE": "1",
    "VLLM_NO_USAGE_STATS": "1",
    "PYTHONUNBUFFERED": "1",
}
"""What a vLLM 0.26 server needs on the GPU machine (no network there)."""


def bench_identity(claim_uid: str) -> dict[str, str]:
    """The environment that makes an engine of the bench its claim's: the bench's engines
    run in no pod, so each names a simulated pod (uid: its claim uid) through
    ``ROTA_POD_UID``, which the bench's inspection service is told to take
    (``pods_from_environment``), as the driver does only with the fake NVML backend."""
    return {"ROTA_CLAIM_UID": claim_uid, "ROTA_POD_UID": claim_uid}


class EngineStartError(RuntimeError):
    """An engine did not come up; the message carries the tail of its log."""


class EngineSpec(BaseModel):
    """One engine of the benchmark: the model, its fixed KV cache and vLLM's options."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    key: str = Field(pattern=r"^[a-z][a-z0-9]{0,15}$")
    """Short name in reports and state (``a``, ``b``, ``g``, ``x``)."""
    model_dir: Path
    served_name: str = Field(min_length=1)
    kv_cache_bytes: int = Field(gt=0)
    load_format: Literal["dummy", "auto"] = "dummy"
    enforce_eager: bool = True
    max_model_len: int = Field(default=4096, gt=0)
    max_num_seqs: int = Field(default=32, gt=0)
    gpu_memory_utilization: float = Field(default=0.30, gt=0, le=1)
    extra_args: tuple[str, ...] = ()

    def weights_bytes(self) -> int:
        """Bytes of the model's weights (from its config), what a level-1 wake copies."""
        return weight_bytes(load_config(self.model_dir))

    def estimated_awake_bytes(self, overhead_bytes: int = 3 * GIB) -> int:
        """Weights + KV cache + context and activations: what admission must find free."""
        return self.weights_bytes() + self.kv_cache_bytes + overhead_bytes


class EngineRecord(BaseModel):
    """A started engine, as the state directory keeps it between commands."""

    model_config = ConfigDict(extra="forbid")

    spec: EngineSpec
    launcher: Literal["vllm", "simulator"]
    pid: int
    port: int
    claim_uid: str
    log: Path
    started_at: float
    """Wall-clock time (epoch seconds) of the start."""
    boot_id: str
    """The machine's boot id: a record from another boot names no live process."""
    ready_s: float | None = None
    """Start to ``/health`` 200 with the model listed (the cold start)."""
    first_probe_s: float | None = None
    """Start to the first probe that passed."""
    start_phases: dict[str, float] = Field(default_factory=dict)
    """vLLM's own start-up numbers from its log (model loading, init engine, compile)."""
    awake_bytes: int | None = None
    """What NVML showed the engine holding awake (its processes summed)."""
    resident_bytes: int | None = None
    """What NVML showed it holding asleep, after its first sleep."""
    first_sleep_s: float | None = None
    first_wake_s: float | None = None
    asleep_level: int | None = None
    """The level it sleeps at now (None: awake); a level-2 sleeper needs the level-2 wake."""
    dead: bool = False
    """Killed or crashed on purpose by a scenario; never used again."""

    @property
    def base_url(self) -> str:
        return f"http://127.0.0.1:{self.port}"


def boot_id() -> str:
    try:
        return Path("/proc/sys/kernel/random/boot_id").read_text(encoding="ascii").strip()
    except OSError:
        return "unknown"


def free_port() -> int:
    """A TCP port nothing listens on now (vLLM needs a concrete port)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as probe:
        probe.bind(("127.0.0.1", 0))
        return int(probe.getsockname()[1])


def process_group(pgid: int, proc_root: Path = Path("/proc")) -> list[int]:
    """Pids of the live (non-zombie) processes of process group ``pgid``."""
    found: list[int] = []
    for entry in proc_root.iterdir():
        if not entry.name.isdigit():
            continue
        try:
            stat = (entry / "stat").read_text(encoding="ascii", errors="replace")
        except OSError:
            continue
        fields = stat[stat.rfind(")") + 2:].split()
        if len(fields) > 2 and fields[0] != "Z" and fields[2] == str(pgid):
            found.append(int(entry.name))
    return found


class Launcher(Protocol):
    """Builds the command line and environment of one engine."""

    @property
    def name(self) -> Literal["vllm", "simulator"]: ...

    def command(self, spec: EngineSpec, port: int) -> list[str]: ...

    def environment(self, spec: EngineSpec, claim_uid: str, cache_root: Path
                    ) -> dict[str, str]: ...


@dataclass(frozen=True)
class VllmLauncher:
    """vLLM 0.26's OpenAI server (``vllm serve``) with the flags that ran on the H200."""

    python: str
    pythonpath: str = ""
    """``PYTHONPATH`` of the engine (where the offline bundle was installed)."""
    base_env: Mapping[str, str] = field(default_factory=dict)
    name: Literal["vllm", "simulator"] = "vllm"

    def command(self, spec: EngineSpec, port: int) -> list[str]:
        command = [self.python, "-m", "vllm.entrypoints.cli.main", "serve", str(spec.model_dir),
                   "--served-model-name", spec.served_name, "--host", "127.0.0.1",
                   "--port", str(port), "--enable-sleep-mode", "--dtype", "bfloat16",
                   "--max-model-len", str(spec.max_model_len),
                   "--max-num-seqs", str(spec.max_num_seqs),
                   "--gpu-memory-utilization", str(spec.gpu_memory_utilization),
                   "--kv-cache-memory-bytes", str(spec.kv_cache_bytes)]
        if spec.enforce_eager:
            command.append("--enforce-eager")
        if spec.load_format == "dummy":
            command += ["--load-format", "dummy"]
        return command + list(spec.extra_args)

    def environment(self, spec: EngineSpec, claim_uid: str, cache_root: Path
                    ) -> dict[str, str]:
        env = dict(self.base_env)
        env.pop("ROTA_CLAIM_UID", None)
        env |= VLLM_ENVIRONMENT
        env["VLLM_CACHE_ROOT"] = str(cache_root)
        env |= bench_identity(claim_uid)
        if self.pythonpath:
            env["PYTHONPATH"] = self.pythonpath
        else:
            env.pop("PYTHONPATH", None)
        return env


@dataclass(frozen=True)
class SimulatorLauncher:
    """The engine simulator in place of vLLM: same HTTP API, the memory a vLLM engine of
    the spec would hold, counted and registered with the fake NVML."""

    python: str
    repo_root: Path
    fake_nvml_dir: Path
    gpu_uuid: str
    base_env: Mapping[str, str] = field(default_factory=dict)
    resident_bytes: int = 800 * MIB
    overhead_bytes: int = 1200 * MIB
    """Activations and allocator slack on top of weights and KV cache."""
    tokens_per_second: float = 2000.0
    first_sleep_seconds: float = 0.0
    name: Literal["vllm", "simulator"] = "simulator"

    def awake_bytes(self, spec: EngineSpec) -> int:
        return self.resident_bytes + spec.weights_bytes() + spec.kv_cache_bytes + \
            self.overhead_bytes

    def command(self, spec: EngineSpec, port: int) -> list[str]:
        return [self.python, "-m", "e2e.engine_simulator", "--model", spec.served_name,
                "--host", "127.0.0.1", "--port", str(port),
                "--awake-memory-bytes", str(self.awake_bytes(spec)),
                "--resident-memory-bytes", str(self.resident_bytes),
                "--weights-bytes", str(spec.weights_bytes()), "--memory-backend", "fake",
                "--gpu-uuid", self.gpu_uuid, "--fake-nvml-dir", str(self.fake_nvml_dir),
                "--tokens-per-second", str(self.tokens_per_second),
                "--first-sleep-seconds", str(self.first_sleep_seconds),
                "--shutdown-grace-seconds", "0", "--log-level", "info"]

    def environment(self, spec: EngineSpec, claim_uid: str, cache_root: Path
                    ) -> dict[str, str]:
        env = dict(self.base_env)
        env |= bench_identity(claim_uid)
        env["VLLM_SERVER_DEV_MODE"] = "1"  # the sleep routes, as vLLM serves them only so
        env["PYTHONPATH"] = os.pathsep.join(
            p for p in (str(self.repo_root), env.get("PYTHONPATH", "")) if p)
        return env


class EngineProcess:
    """One engine: started here (``proc`` set) or attached from its record."""

    def __init__(self, record: EngineRecord,
                 proc: subprocess.Popen[bytes] | None = None) -> None:
        self.record = record
        self.proc = proc

    @property
    def key(self) -> str:
        return self.record.spec.key

    @classmethod
    def start(cls, spec: EngineSpec, launcher: Launcher, state_dir: Path, *,
              claim_uid: str | None = None) -> EngineProcess:
        """Start the engine in its own session; it outlives this process."""
        port = free_port()
        log_path = state_dir / f"engine-{spec.key}.log"
        cache_root = state_dir / f"cache-{spec.key}"
        cache_root.mkdir(parents=True, exist_ok=True)
        uid = claim_uid or str(uuid.uuid4())
        command = launcher.command(spec, port)
        with log_path.open("ab") as out:
            out.write(f"### rota bench: starting {' '.join(command)}\n".encode())
            out.flush()
            proc = subprocess.Popen(
                command, cwd=state_dir, env=launcher.environment(spec, uid, cache_root),
                stdin=subprocess.DEVNULL, stdout=out, stderr=subprocess.STDOUT,
                start_new_session=True)
        record = EngineRecord(spec=spec, launcher=launcher.name, pid=proc.pid, port=port,
                              claim_uid=uid, log=log_path, started_at=time.time(),
                              boot_id=boot_id())
        return cls(record, proc)

    def alive(self) -> bool:
        """The engine's first process still runs (a zombie does not count)."""
        if self.record.dead:
            return False
        if self.proc is not None:
            return self.proc.poll() is None
        if self.record.boot_id != boot_id():
            return False
        try:
            stat = Path(f"/proc/{self.record.pid}/stat").read_text(encoding="ascii",
                                                                   errors="replace")
        except OSError:
            return False
        return stat[stat.rfind(")") + 2:].split()[:1] != ["Z"]

    def group(self) -> list[int]:
        return process_group(self.record.pid)

    async def wait_ready(self, session: aiohttp.ClientSession, *, deadline: float,
                         poll_s: float = 0.5) -> float:
        """Until ``/health`` answers 200 and ``/v1/models`` lists the served name; the
        seconds since the start. Raises EngineStartError (with the log's tail) when the
        process exits or the (monotonic) deadline passes."""
        began_wall = self.record.started_at
        timeout = aiohttp.ClientTimeout(total=3.0, sock_connect=1.0)
        last = "no answer yet"
        while True:
            if not self.alive():
                code = self.proc.poll() if self.proc is not None else None
                raise EngineStartError(
                    f"engine {self.key} exited while starting (status {code}); log tail:\n"
                    f"{tail(self.record.log)}")
            try:
                async with session.get(self.record.base_url + "/health",
                                       timeout=timeout) as resp:
                    last = f"/health {resp.status}"
                    if resp.status == 200:
                        async with session.get(self.record.base_url + "/v1/models",
                                               timeout=timeout) as models:
                            body = await models.text()
                            last = f"/v1/models {models.status}"
                            if models.status == 200 and self._lists_model(body):
                                return time.time() - began_wall
            except (aiohttp.ClientError, TimeoutError, OSError) as exc:
                last = f"{type(exc).__name__}"
            if time.monotonic() >= deadline:
                raise EngineStartError(
                    f"engine {self.key} not ready before the deadline ({last}); log tail:\n"
                    f"{tail(self.record.log)}")
            await asyncio.sleep(poll_s)

    def _lists_model(self, body: str) -> bool:
        try:
            data = json.loads(body).get("data") or []
        except (ValueError, AttributeError):
            return False
        return any(isinstance(m, dict) and m.get("id") == self.record.spec.served_name
                   for m in data)

    def kill(self) -> list[int]:
        """SIGKILL the whole process group at once (a crash, as the scenarios need it);
        the pids it had. A child of this process is reaped in the background."""
        pids = self.group()
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(self.record.pid, signal.SIGKILL)
        self.record.dead = True
        if self.proc is not None:
            threading.Thread(target=self.proc.wait, name=f"reap-{self.key}",
                             daemon=True).start()
        return pids

    def stop(self, grace_s: float = 20.0) -> list[int]:
        """SIGTERM the process group, wait (bounded), SIGKILL what is left; the pids that
        had to be killed."""
        if not self.group() and not self.alive():
            return []
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(self.record.pid, signal.SIGTERM)
        deadline = time.monotonic() + grace_s
        while time.monotonic() < deadline:
            if self.proc is not None:
                self.proc.poll()
            if not self.group():
                return []
            time.sleep(0.1)
        left = self.group()
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(self.record.pid, signal.SIGKILL)
        if self.proc is not None:
            with contextlib.suppress(subprocess.TimeoutExpired):
                self.proc.wait(timeout=10)
        return left


def stop_all(engines: Sequence[EngineProcess], grace_s: float = 20.0) -> dict[str, list[int]]:
    """Stop every engine; the pids that needed SIGKILL, by engine."""
    return {e.key: e.stop(grace_s) for e in engines}


def main(argv: Sequence[str] | None = None) -> int:
    """``python -m e2e.gpu.engines status|stop STATE_DIR``: the engines a benchmark state
    records, alive or not; ``stop`` ends them (SIGTERM to each process group, then
    SIGKILL). Needs no GPU library: it works when nothing else does."""
    import sys

    args = list(sys.argv[1:] if argv is None else argv)
    if len(args) != 2 or args[0] not in ("status", "stop"):
        print("usage: python -m e2e.gpu.engines status|stop STATE_DIR", file=sys.stderr)
        return 2
    path = Path(args[1]) / "state.json"
    try:
        raw = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError) as exc:
        print(f"no readable state in {path}: {exc}", file=sys.stderr)
        return 1
    for key, data in (raw.get("engines") or {}).items():
        engine = EngineProcess(EngineRecord.model_validate(data))
        group = engine.group() if engine.record.boot_id == boot_id() else []
        line = f"{key}: pid {engine.record.pid} port {engine.record.port} " \
               f"{'alive' if engine.alive() else 'not running'}, {len(group)} processes"
        if args[0] == "stop" and group:
            killed = engine.stop(20.0)
            line += f"; stopped{' (SIGKILL: ' + str(killed) + ')' if killed else ''}"
        print(line, flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
