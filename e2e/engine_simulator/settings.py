"""Settings of the engine simulator: one typed model, parsed once from flags and environment.

Precedence is flag, then environment, then default. Every knob has a flag and an
environment variable. Most variables are ``ROTA_SIM_<KNOB>``; the ones a DRA CDI spec
injects into an engine container keep their own names, so the simulator started in such a
container picks up its model, port, memory budgets and GPU without extra flags:

=================================  ===========================================
``ROTA_MODEL``                     served model name
``ROTA_ENGINE_PORT``               HTTP port
``ROTA_AWAKE_MEMORY_BYTES``        GPU memory held while awake
``ROTA_RESIDENT_MEMORY_BYTES``     GPU memory held while asleep
``ROTA_GPU_UUID``                  GPU uuids, comma-separated (else the
                                   uuids in ``NVIDIA_VISIBLE_DEVICES``)
``ROTA_FAKE_NVML_PROC_DIR``        fake NVML process directory
=================================  ===========================================

Nothing else in the package reads the environment.
"""

from __future__ import annotations

import argparse
import os
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Annotated, Any, Literal

from pydantic import (
    BaseModel,
    BeforeValidator,
    ConfigDict,
    Field,
    SecretStr,
    ValidationError,
    model_validator,
)

from controller.lease.engines.surfaces import supported, surface_for

__all__ = [
    "DEFAULT_GPU_UUID",
    "Faults",
    "FaultsPatch",
    "KeepFault",
    "Settings",
    "build_parser",
    "settings_from_args",
]

DEFAULT_GPU_UUID = "GPU-00000000-0000-0000-0000-000000000000"
"""The uuid a simulator reports when neither flag nor environment names a GPU."""


_BYTE_SUFFIXES = {"Ki": 2**10, "Mi": 2**20, "Gi": 2**30, "Ti": 2**40,
                  "k": 10**3, "M": 10**6, "G": 10**9, "T": 10**12}


def _bytes(value: object) -> object:
    """Accept byte counts as ints, digit strings or whole quantities (``"8Gi"``, ``"500M"``)."""
    if not isinstance(value, str):
        return value
    text = value.strip()
    for suffix in sorted(_BYTE_SUFFIXES, key=len, reverse=True):
        number = text.removesuffix(suffix)
        if number != text:
            if not number.isdigit():
                raise ValueError(f"not a byte count: {value!r}")
            return int(number) * _BYTE_SUFFIXES[suffix]
    if not text.isdigit():
        raise ValueError(f"not a byte count: {value!r}")
    return int(text)


ByteCount = Annotated[int, BeforeValidator(_bytes), Field(ge=0)]
Seconds = Annotated[float, Field(ge=0.0)]
KeepFault = Literal["lose-token", "duplicate-token", "abort"]
"""What the ``keep_fault`` test knob does to a request kept across a sleep."""


class Faults(BaseModel):
    """Injected misbehaviour. Settable at start (flags) and at runtime (``POST /sim/faults``).

    The simulator behaves like vLLM 0.26 by default; the faults marked *kinder* bring back
    behaviours friendlier than vLLM's (what rota once assumed), for tests that must not
    depend on a fix that has not landed yet.
    """

    model_config = ConfigDict(extra="forbid", frozen=True, use_attribute_docstrings=True)

    wake_fails: bool = False
    """``/wake_up`` answers vLLM's HTTP 500 out-of-memory body; memory stays at resident."""
    wake_hangs: bool = False
    """``/wake_up`` does not return until this fault is cleared; then the wake goes on,
    even when its caller went away meanwhile (as vLLM's does). Only a server that cancels
    the handlers of departed clients (aiohttp's in-process test server) ends it sooner."""
    sleep_lies: bool = False
    """``/sleep`` answers 200 and ``/is_sleeping`` says true, but no memory is released."""
    sleep_ignored: bool = False
    """``/sleep`` answers 200 but nothing happens: ``/is_sleeping`` stays false."""
    wake_ignored: bool = False
    """``/wake_up`` answers 200 but nothing happens: ``/is_sleeping`` stays true."""
    crash_on_sleep: bool = False
    """``/sleep`` answers 200, then the process exits hard (like vllm#45520)."""
    crash_now: bool = False
    """Exit hard at once (at start: right after binding the port)."""
    stall_generation: bool = False
    """Running generations stop before their next token until cleared (a test hook)."""
    fail_mid_stream: bool = False
    """Generations fail before their last token (after the first when there are several);
    a stream then ends with ``data: {"error": ...}`` and ``[DONE]``, without a finish reason."""
    drop_reused_connections: bool = False
    """A request arriving on a kept-alive connection finds it closed by the server, as when
    a client reuses a pooled connection just as uvicorn's keep-alive closes it."""
    refuse_while_asleep: bool = False
    """Kinder than vLLM 0.26: generation requests while the engine sleeps or drains for a
    sleep get HTTP 503 at once (vLLM holds them until a wake)."""
    sleep_cancelled_with_client: bool = False
    """Kinder than vLLM 0.26: a ``/sleep`` whose client gives up is dropped and the
    scheduler resumes (vLLM keeps it registered and sleeps when the engine next idles)."""
    wake_each_tag: bool = False
    """Kinder than vLLM 0.26: ``/wake_up?tags=`` wakes each named tag that is asleep instead
    of skipping the whole call when one of them is awake."""
    sleep_undoes_partial_wake: bool = False
    """Kinder than vLLM 0.26: ``/sleep`` on an engine whose wake stopped halfway frees the
    memory mapped again (vLLM: "Executor is already sleeping", the memory stays)."""
    empty_rpc_answers: bool = False
    """Kinder than vLLM 0.26: ``/reset_prefix_cache`` and ``/collective_rpc`` answer 200
    with an empty body (vLLM: ``{"success": bool}`` and ``{"results": [...]}``)."""
    omni_level2_wake: bool = False
    """Kinder than vLLM-Omni 0.26/0.30: a wakeup after a level-2 sleep reloads the weights
    and works (vLLM-Omni: 501 NotImplementedError, and the engine cannot be woken again)."""
    omni_sleep_aborts: bool = False
    """Kinder than vLLM-Omni: its sleep aborts running generations first (vLLM-Omni does
    not pause or drain: the memory is unmapped under a running request)."""
    omni_gib_numbers: bool = False
    """Kinder than vLLM-Omni: ACK metadata ``total_freed_gib``/``rank_residual_gib`` are
    numbers (vLLM-Omni sends strings such as ``"12.34"``)."""


class FaultsPatch(BaseModel):
    """Body of ``POST /sim/faults``: only the faults named change."""

    model_config = ConfigDict(extra="forbid")

    wake_fails: bool | None = None
    wake_hangs: bool | None = None
    sleep_lies: bool | None = None
    sleep_ignored: bool | None = None
    wake_ignored: bool | None = None
    crash_on_sleep: bool | None = None
    crash_now: bool | None = None
    stall_generation: bool | None = None
    fail_mid_stream: bool | None = None
    drop_reused_connections: bool | None = None
    refuse_while_asleep: bool | None = None
    sleep_cancelled_with_client: bool | None = None
    wake_each_tag: bool | None = None
    sleep_undoes_partial_wake: bool | None = None
    empty_rpc_answers: bool | None = None
    omni_level2_wake: bool | None = None
    omni_sleep_aborts: bool | None = None
    omni_gib_numbers: bool | None = None

    def apply(self, faults: Faults) -> Faults:
        return faults.model_copy(update=self.model_dump(exclude_none=True))


class Settings(BaseModel):
    """Everything the simulator can be told. Timing knobs default to 0 (instant)."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    model: str = "simulated-model"
    """Served model name (``/v1/models``; requests naming another model get 404)."""
    host: str = "127.0.0.1"
    port: int = Field(default=8000, ge=0, le=65535)
    """0 picks a free port; the bound port is logged and written to ``port_file``."""
    port_file: Path | None = None

    first_sleep_seconds: Seconds = 0.0
    """Extra time taken by the first level-1 sleep (pinned host buffers are allocated)."""
    later_sleep_seconds: Seconds = 0.0
    """Extra time taken by every other sleep of level 1 or 2."""
    wake_level1_seconds: Seconds = 0.0
    """Extra time taken by a wake that brings weights back after a level-1 sleep."""
    wake_level2_seconds: Seconds = 0.0
    """Extra time taken by a wake that re-maps weights after a level-2 sleep."""
    reload_seconds: Seconds = 0.0
    """Time taken by ``collective_rpc reload_weights``."""
    start_seconds: Seconds = 0.0
    """Time the process spends at start before it touches the GPU or listens (a real
    vLLM's imports and model load: seconds to minutes in which it shows no GPU process
    and answers nothing)."""
    ttft_seconds: Seconds = 0.0
    """Time to first token of every generation."""
    tokens_per_second: Seconds = 0.0
    """Decode speed, one token per chunk; 0 means instant."""
    prefill_tokens_per_second: Seconds = 0.0
    """Speed of the recompute a request kept across a sleep or pause (``mode=keep``) needs
    at its wake: vLLM preempted it (KV cache freed) and prefills its prompt plus the tokens
    it had generated before it samples the next, so the delay is (prompt + generated) /
    this rate. 0 means instant."""
    resume_merge_tokens: int = Field(default=4, ge=1)
    """Tokens the first chunk after a kept request's recompute carries: vLLM's output
    collector merges the deltas the engine produced while the API server was catching up
    at the wake (on an H100, 248 of 248 frozen streams came back in fewer chunks than
    tokens, none lost). 1: one token per chunk, as before a freeze."""
    keep_fault: KeepFault | None = None
    """A test fault, off by default: every request kept across a sleep or pause, at its
    first output after the wake, loses one token (``lose-token``), repeats the last one it
    sent (``duplicate-token``) or is aborted (``abort``), so that a correctness check can be
    shown to catch it. Usage counts stay the engine's (tokens generated), as a bug between
    the engine and its client would leave them."""
    leak_per_cycle_mib: int = Field(default=0, ge=0)
    """A test fault, off by default: each sleep/wake cycle (a level-1 or level-2 sleep, then
    the wake that maps everything again) leaves this many MiB more resident on the GPU,
    awake and asleep, as users report of some engines (the footprint creeps)."""

    awake_memory_bytes: ByteCount = 8 * 2**30
    resident_memory_bytes: ByteCount = 1 * 2**30
    weights_bytes: ByteCount | None = None
    """Part of (awake - resident) that is weights; the rest is KV cache. Default: half."""
    memory_backend: Literal["fake", "cuda"] = "fake"
    gpu_uuid: str = DEFAULT_GPU_UUID
    """The engine's (first) GPU: the one a single-GPU engine uses, rank 0's."""
    gpu_uuids: tuple[str, ...] = ()
    """Every GPU the engine was given, in order (``NVIDIA_VISIBLE_DEVICES``, as rota's CDI
    spec sets it for a claim on several GPUs); empty: ``gpu_uuid`` alone. The first is
    ``gpu_uuid``."""
    tensor_parallel_size: int = Field(default=1, ge=1, le=64)
    """vLLM's ``--tensor-parallel-size``: the engine runs one worker per GPU on the first
    ``tensor_parallel_size`` of :attr:`gpus`, each holding its shard (1/N) of the memory
    knobs, which are then the engine's totals over its GPUs. With a fake NVML registry,
    rank 0's record is this process's and each other rank's is a worker process of its own
    (pid, pod and environment as this one's), as NVML shows a vLLM worker per GPU; one
    server, one sleep and one wake for all of them."""
    fake_nvml_dir: Path | None = None
    """Where to register this process's GPU memory for rota's fake NVML; None: don't."""
    gpu_memory_bytes: ByteCount | None = None
    """The GPU's total memory for the capacity check of the fake backend. None: what the
    fake NVML registry publishes for ``gpu_uuid`` (the driver's fixture); a GPU nobody
    describes has no limit."""
    nvml_pid: int | None = Field(default=None, gt=0)
    """The pid to register under; None: this process's pid."""

    omni: bool = False
    """Behave like vLLM-Omni: serve its stage-aware ``/v1/omni/sleep`` and
    ``/v1/omni/wakeup`` (vLLM's own ``/sleep`` and ``/wake_up`` then fail with 500)."""
    omni_stages: int = Field(default=3, ge=1, le=64)
    """Stages of the Omni pipeline (Qwen2.5-Omni and Qwen3-Omni have three)."""

    vllm_version: str = "0.26.0"
    """The vLLM release whose surface the simulator speaks (``/version``, the route table at
    ``/openapi.json``, the answers of ``/sleep`` and ``/wake_up``): one rota has a surface
    for (``controller/lease/engines/vllm_surfaces``)."""
    sleep_ignores_requests: bool = False
    """vLLM RFC #51476: ``/sleep`` is a pure memory step; it takes no ``mode`` (its route
    table says so), does not wait for running requests and sleeps under them (they are
    frozen). Each sleep records how many requests ran under it (``running``)."""

    dev_mode: bool = False
    """``VLLM_SERVER_DEV_MODE=1``: serve vLLM's development routes (``/sleep``,
    ``/wake_up``, ``/is_sleeping``, ``/collective_rpc``, ``/reset_prefix_cache``,
    ``/pause``, ``/resume``, ``/is_paused``); without it they answer 404, as in vLLM."""
    api_key: SecretStr | None = Field(default=None, min_length=1)
    """vLLM's ``--api-key`` (``VLLM_API_KEY``): paths starting ``/v1``, ``/v2`` or
    ``/inference`` need ``Authorization: Bearer <key>`` (401 ``{"error": "Unauthorized"}``
    without it); the development routes, ``/health`` and ``/metrics`` are never guarded."""
    keep_alive_on_engine_death: bool = False
    """``VLLM_KEEP_ALIVE_ON_ENGINE_DEATH=1``: once the engine core died the server stays up
    (``/health`` 503, every other call 500) instead of exiting."""
    keep_alive_seconds: Seconds = 5.0
    """uvicorn's keep-alive (``VLLM_HTTP_TIMEOUT_KEEP_ALIVE``): idle connections close then."""
    load_format: Literal["auto", "dummy"] = "auto"
    """vLLM's ``--load-format``: ``reload_weights`` fails (500) under ``dummy``."""
    disable_log_stats: bool = False
    """vLLM's ``--disable-log-stats``: ``/metrics`` then carries no ``vllm:`` gauges."""

    shutdown_grace_seconds: Seconds = 5.0
    """On SIGTERM/SIGINT, how long running generations may finish before they are aborted."""
    log_level: Literal["debug", "info", "warning", "error"] = "info"

    faults: Faults = Faults()

    @model_validator(mode="before")
    @classmethod
    def _first_gpu(cls, data: Any) -> Any:
        """``gpu_uuids`` alone names ``gpu_uuid`` too (its first)."""
        if isinstance(data, dict) and data.get("gpu_uuids") and "gpu_uuid" not in data:
            data = {**data, "gpu_uuid": next(iter(data["gpu_uuids"]))}
        return data

    @model_validator(mode="after")
    def _gpus_fit(self) -> Settings:
        if self.gpu_uuids and self.gpu_uuids[0] != self.gpu_uuid:
            raise ValueError(f"gpu_uuid {self.gpu_uuid!r} is not the first of gpu_uuids "
                             f"{list(self.gpu_uuids)}")
        if len(set(self.gpus)) != len(self.gpus):
            raise ValueError(f"a GPU is named twice: {list(self.gpus)}")
        if self.tensor_parallel_size > len(self.gpus):
            # vLLM fails the same way when it is given fewer GPUs than its world size.
            raise ValueError(
                f"tensor_parallel_size {self.tensor_parallel_size} needs as many GPUs; "
                f"the engine was given {len(self.gpus)}: {list(self.gpus)}")
        if self.tensor_parallel_size > 1 and self.memory_backend != "fake":
            raise ValueError("tensor_parallel_size above 1 needs the fake memory backend")
        if self.leak_per_cycle_mib and self.memory_backend != "fake":
            raise ValueError("leak_per_cycle_mib needs the fake memory backend")
        return self

    @property
    def gpus(self) -> tuple[str, ...]:
        """Every GPU the engine was given, in order."""
        return self.gpu_uuids or (self.gpu_uuid,)

    @property
    def worker_gpus(self) -> tuple[str, ...]:
        """The GPU of each tensor-parallel rank (rank 0 first)."""
        return self.gpus[:self.tensor_parallel_size]

    @model_validator(mode="after")
    def _known_release(self) -> Settings:
        if surface_for(self.vllm_version) is None:
            raise ValueError(f"vllm_version {self.vllm_version!r}: the simulator speaks "
                             f"{', '.join(supported())}")
        return self

    @model_validator(mode="after")
    def _memory_fits(self) -> Settings:
        if self.resident_memory_bytes > self.awake_memory_bytes:
            raise ValueError(
                f"resident memory ({self.resident_memory_bytes} bytes) exceeds awake memory "
                f"({self.awake_memory_bytes} bytes)"
            )
        if self.weights_bytes is not None and self.weights_bytes > self.releasable_bytes:
            raise ValueError(
                f"weights ({self.weights_bytes} bytes) exceed awake minus resident memory "
                f"({self.releasable_bytes} bytes)"
            )
        return self

    @property
    def releasable_bytes(self) -> int:
        """What a level-2 sleep hands back: awake minus resident."""
        return self.awake_memory_bytes - self.resident_memory_bytes

    @property
    def effective_weights_bytes(self) -> int:
        if self.weights_bytes is not None:
            return self.weights_bytes
        return self.releasable_bytes // 2

    @property
    def kv_cache_bytes(self) -> int:
        return self.releasable_bytes - self.effective_weights_bytes


# (field, flag, environment variable, help). Fault flags are generated from ``Faults``.
_KNOBS: tuple[tuple[str, str, str, str], ...] = (
    ("model", "--model", "ROTA_MODEL", "served model name"),
    ("host", "--host", "ROTA_SIM_HOST", "address to bind"),
    ("port", "--port", "ROTA_ENGINE_PORT", "port to bind; 0 picks a free one"),
    ("port_file", "--port-file", "ROTA_SIM_PORT_FILE",
     "write the bound port to this file (atomically) once listening"),
    ("first_sleep_seconds", "--first-sleep-seconds", "ROTA_SIM_FIRST_SLEEP_SECONDS",
     "extra duration of the first level-1 sleep"),
    ("later_sleep_seconds", "--later-sleep-seconds", "ROTA_SIM_LATER_SLEEP_SECONDS",
     "extra duration of every later sleep"),
    ("wake_level1_seconds", "--wake-level1-seconds", "ROTA_SIM_WAKE_LEVEL1_SECONDS",
     "extra duration of a wake after a level-1 sleep"),
    ("wake_level2_seconds", "--wake-level2-seconds", "ROTA_SIM_WAKE_LEVEL2_SECONDS",
     "extra duration of a weights wake after a level-2 sleep"),
    ("reload_seconds", "--reload-seconds", "ROTA_SIM_RELOAD_SECONDS",
     "duration of collective_rpc reload_weights"),
    ("start_seconds", "--start-seconds", "ROTA_SIM_START_SECONDS",
     "time at start before the GPU is touched or the port bound (imports, model load)"),
    ("ttft_seconds", "--ttft-seconds", "ROTA_SIM_TTFT_SECONDS", "time to first token"),
    ("tokens_per_second", "--tokens-per-second", "ROTA_SIM_TOKENS_PER_SECOND",
     "decode speed; 0 = instant"),
    ("prefill_tokens_per_second", "--prefill-tokens-per-second",
     "ROTA_SIM_PREFILL_TOKENS_PER_SECOND",
     "recompute speed of a request kept across a sleep: its wake costs (prompt + generated "
     "tokens) / rate; 0 = instant"),
    ("resume_merge_tokens", "--resume-merge-tokens", "ROTA_SIM_RESUME_MERGE_TOKENS",
     "tokens merged into the first chunk a kept request sends after its recompute (vLLM's "
     "output collector); 1 = one per chunk"),
    ("keep_fault", "--keep-fault", "ROTA_SIM_KEEP_FAULT",
     "test fault: a kept request loses a token (lose-token), repeats one "
     "(duplicate-token) or is aborted (abort) at its first output after the wake"),
    ("leak_per_cycle_mib", "--leak-per-cycle-mib", "ROTA_SIM_LEAK_PER_CYCLE_MIB",
     "test fault: each sleep/wake cycle leaves this many MiB more resident"),
    ("awake_memory_bytes", "--awake-memory-bytes", "ROTA_AWAKE_MEMORY_BYTES",
     "GPU memory held awake (bytes or quantity such as 8Gi)"),
    ("resident_memory_bytes", "--resident-memory-bytes", "ROTA_RESIDENT_MEMORY_BYTES",
     "GPU memory still held asleep (bytes or quantity)"),
    ("weights_bytes", "--weights-bytes", "ROTA_SIM_WEIGHTS_BYTES",
     "part of awake-minus-resident that is weights; default half, the rest is KV cache"),
    ("memory_backend", "--memory-backend", "ROTA_SIM_MEMORY_BACKEND",
     "fake: count bytes (and register them with the fake NVML); "
     "cuda: hold real GPU memory with PyTorch"),
    ("gpu_uuid", "--gpu-uuid", "ROTA_GPU_UUID",
     "GPU uuids, comma-separated: the first is the engine's GPU, a tensor-parallel engine "
     "takes one per rank (else the uuids in NVIDIA_VISIBLE_DEVICES)"),
    ("tensor_parallel_size", "--tensor-parallel-size", "ROTA_SIM_TENSOR_PARALLEL_SIZE",
     "vLLM's tensor parallelism: one worker per GPU, each holding 1/N of the memory "
     "knobs (then the engine's totals); one sleep and one wake for all"),
    ("fake_nvml_dir", "--fake-nvml-dir", "ROTA_FAKE_NVML_PROC_DIR",
     "fake NVML process directory to register GPU memory in"),
    ("nvml_pid", "--nvml-pid", "ROTA_SIM_NVML_PID",
     "pid to register with the fake NVML (default: this process)"),
    ("gpu_memory_bytes", "--gpu-memory-bytes", "ROTA_SIM_GPU_MEMORY_BYTES",
     "the GPU's total memory for the fake backend's capacity check (default: what the "
     "fake NVML registry publishes for the GPU; none published: no limit)"),
    ("omni", "--omni", "ROTA_SIM_OMNI",
     "behave like vLLM-Omni (stage-aware /v1/omni/sleep and /v1/omni/wakeup)"),
    ("omni_stages", "--omni-stages", "ROTA_SIM_OMNI_STAGES", "number of Omni stages"),
    ("vllm_version", "--vllm-version", "ROTA_SIM_VLLM_VERSION",
     "the vLLM release whose surface to speak (routes, /version, /openapi.json, the "
     "answers of /sleep and /wake_up); default 0.26.0"),
    ("sleep_ignores_requests", "--sleep-ignores-requests", "ROTA_SIM_SLEEP_IGNORES_REQUESTS",
     "vLLM RFC #51476: /sleep takes no mode and sleeps under running requests"),
    ("dev_mode", "--dev-mode", "VLLM_SERVER_DEV_MODE",
     "serve vLLM's development routes (sleep, wake_up, is_sleeping, collective_rpc, "
     "reset_prefix_cache, pause, resume, is_paused); without it they answer 404"),
    ("api_key", "--api-key", "VLLM_API_KEY",
     "require 'Authorization: Bearer KEY' on /v1*, /v2*, /inference* (never on the "
     "development routes, /health or /metrics), as vLLM's --api-key"),
    ("keep_alive_on_engine_death", "--keep-alive-on-engine-death",
     "VLLM_KEEP_ALIVE_ON_ENGINE_DEATH",
     "once the engine core died, stay up (/health 503) instead of exiting as vLLM does"),
    ("keep_alive_seconds", "--keep-alive-seconds", "VLLM_HTTP_TIMEOUT_KEEP_ALIVE",
     "close idle HTTP connections after this long, as uvicorn does"),
    ("load_format", "--load-format", "ROTA_SIM_LOAD_FORMAT",
     "auto or dummy (dummy weights cannot be reloaded: reload_weights answers 500)"),
    ("disable_log_stats", "--disable-log-stats", "ROTA_SIM_DISABLE_LOG_STATS",
     "no vllm: gauges on /metrics (as vLLM's --disable-log-stats)"),
    ("shutdown_grace_seconds", "--shutdown-grace-seconds", "ROTA_SIM_SHUTDOWN_GRACE_SECONDS",
     "on SIGTERM, how long running generations may finish before they are aborted"),
    ("log_level", "--log-level", "ROTA_SIM_LOG_LEVEL", "debug, info, warning or error"),
)

_BOOLEAN_KNOBS = frozenset({"omni", "dev_mode", "disable_log_stats",
                            "keep_alive_on_engine_death", "sleep_ignores_requests"})
_METAVARS = {
    "model": "NAME", "host": "HOST", "port": "PORT", "port_file": "FILE",
    "tokens_per_second": "RATE", "awake_memory_bytes": "BYTES",
    "resident_memory_bytes": "BYTES", "weights_bytes": "BYTES", "memory_backend": "{fake,cuda}",
    "gpu_memory_bytes": "BYTES",
    "gpu_uuid": "UUID[,UUID...]", "tensor_parallel_size": "N", "fake_nvml_dir": "DIR",
    "nvml_pid": "PID", "omni_stages": "N",
    "log_level": "LEVEL", "vllm_version": "VERSION", "api_key": "KEY",
    "load_format": "{auto,dummy}", "prefill_tokens_per_second": "RATE",
    "resume_merge_tokens": "N", "keep_fault": "{lose-token,duplicate-token,abort}",
    "leak_per_cycle_mib": "MIB",
}

_DESCRIPTION = """\
rota engine simulator -- NOT a real inference engine.

Behaves like vLLM 0.26's OpenAI server started with --enable-sleep-mode:
/health, /metrics, /v1/models, /v1/chat/completions and /v1/completions
(streamed and not), and with VLLM_SERVER_DEV_MODE=1 (or --dev-mode) /sleep,
/wake_up, /is_sleeping, /collective_rpc, /reset_prefix_cache, /pause, /resume,
/is_paused, with vLLM's quirks: requests to a sleeping engine are held, an
abandoned sleep still fires, the fake GPU runs out. Its answers are canned: a
prompt asking "3 + 4" gets "7", others get filler text. Simulator-only endpoints
live under /sim/ (state, faults).
"""

_EPILOG = """\
Every flag can also be given in the environment variable named in its help;
a flag wins over the environment. Byte counts accept Kubernetes quantities
(8Gi, 512Mi, 500M).
"""


def build_parser() -> argparse.ArgumentParser:
    """The simulator's command line. Every default is None: unset means "not given"."""
    parser = argparse.ArgumentParser(
        prog="python -m e2e.engine_simulator",
        description=_DESCRIPTION,
        epilog=_EPILOG,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    defaults = Settings()
    for name, flag, env, text in _KNOBS:
        default = getattr(defaults, name)
        shown = f"env {env}; default {default}"
        if name == "gpu_uuid":
            shown = f"env {env} or NVIDIA_VISIBLE_DEVICES; default {default}"
        if name in _BOOLEAN_KNOBS:
            parser.add_argument(
                flag, dest=name, default=None, action=argparse.BooleanOptionalAction,
                help=f"{text} ({shown})",
            )
        else:
            parser.add_argument(flag, dest=name, default=None,
                                metavar=_METAVARS.get(name, "SECONDS"), help=f"{text} ({shown})")
    faults = parser.add_argument_group(
        "faults", "also settable at runtime: POST /sim/faults with a JSON object of booleans"
    )
    for name, field in Faults.model_fields.items():
        env = f"ROTA_SIM_{name.upper()}"
        flag = "--" + name.replace("_", "-")
        faults.add_argument(
            flag, dest=f"fault_{name}", default=None, action=argparse.BooleanOptionalAction,
            help=f"{(field.description or '').replace('``', '').rstrip('.')} "
                 f"(env {env}; default {field.default})",
        )
    return parser


def _uuids(text: str) -> list[str]:
    return [entry.strip() for entry in text.split(",") if entry.strip()]


def _gpu_uuids_from(environ: Mapping[str, str]) -> list[str]:
    explicit = _uuids(environ.get("ROTA_GPU_UUID", ""))
    if explicit:
        return explicit
    return [entry for entry in _uuids(environ.get("NVIDIA_VISIBLE_DEVICES", ""))
            if entry.startswith(("GPU-", "MIG-"))]


def _raw_values(args: argparse.Namespace, environ: Mapping[str, str]) -> dict[str, Any]:
    raw: dict[str, Any] = {}
    for name, _flag, env, _help in _KNOBS:
        given = getattr(args, name)
        if name == "gpu_uuid":
            found = _uuids(given) if given is not None else _gpu_uuids_from(environ)
            if found:
                raw["gpu_uuid"], raw["gpu_uuids"] = found[0], found
        elif given is not None:
            raw[name] = given
        elif environ.get(env, "").strip():
            raw[name] = environ[env].strip()
    faults: dict[str, Any] = {}
    for name in Faults.model_fields:
        given = getattr(args, f"fault_{name}")
        env = f"ROTA_SIM_{name.upper()}"
        if given is not None:
            faults[name] = given
        elif environ.get(env, "").strip():
            faults[name] = environ[env].strip()
    raw["faults"] = faults
    return raw


def settings_from_args(
    argv: Sequence[str] | None = None, environ: Mapping[str, str] | None = None
) -> Settings:
    """Parse flags and environment into :class:`Settings`; exits with usage on bad input."""
    parser = build_parser()
    args = parser.parse_args(argv)
    raw = _raw_values(args, os.environ if environ is None else environ)
    try:
        return Settings.model_validate(raw)
    except (ValidationError, ValueError) as exc:
        parser.error(str(exc))
