"""The engine arguments that the single-run GPU tools (``e2e.gpu.keep_probe``,
``e2e.gpu.policy_run``) share: which launcher starts the engines (real vLLM or the engine
simulator on the fake NVML), which GPU, which model, and the engine's shape. One
definition, so that a run of either tool takes the same flags for the same engine."""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

from e2e.gpu.context import GIB, REPO_ROOT, byte_count


def add_engine_arguments(p: argparse.ArgumentParser, *, model_help: str,
                         kv_help: str | None = None) -> None:
    """``--launcher``, ``--fake-nvml``, ``--gpu-index``, ``--models``, ``--model``, the
    engine's shape (``--kv``, ``--max-seqs``, ``--max-model-len``,
    ``--gpu-memory-utilization``), vLLM's interpreter and the simulator's decode rate."""
    add = p.add_argument
    add("--launcher", choices=("vllm", "simulator"), default="vllm")
    add("--fake-nvml", metavar="FIXTURE", default=None,
        help="the fake NVML with this fixture (with --launcher simulator)")
    add("--gpu-index", type=int, default=0)
    add("--models", type=Path, default=REPO_ROOT / ".vllm" / "models",
        help="folder holding model-small (config + tokenizer)")
    add("--model", default="model-small", help=model_help)
    add("--kv", type=byte_count, default=2 * GIB, metavar="BYTES", help=kv_help)
    add("--max-seqs", type=int, default=32)
    add("--max-model-len", type=int, default=4096)
    add("--gpu-memory-utilization", type=float, default=0.2)
    add("--vllm-python", default=sys.executable)
    add("--vllm-pythonpath", default=os.environ.get("ROTA_VLLM_PYTHONPATH", ""))
    add("--tokens-per-second", type=float, default=100.0,
        help="the simulator's decode rate per request (with --launcher simulator)")
