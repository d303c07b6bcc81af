"""The host-to-device bandwidth the switch benchmark's wake floor divides by.

A level-1 wake copies the weights back from pinned host memory, so its floor is weight
bytes over this bandwidth. :func:`h2d_bandwidth` measures it in a short-lived child process
(``python -m e2e.bench.gpu --measure-h2d-only``, which runs :func:`measure_child`: a pinned
host tensor copied to the device with PyTorch, best of the repeats) when torch and CUDA
are present; otherwise, or when asked, it takes 54e9 B/s, the rate measured on the H200.
A child keeps the CUDA context (and its memory) out of the benchmark's own process.
"""

from __future__ import annotations

import argparse
import importlib
import importlib.util
import json
import statistics
import subprocess
import sys
import time
from typing import Any

from e2e.gpu.context import ASSUMED_H2D_BYTES_PER_S, REPO_ROOT

__all__ = ["h2d_bandwidth", "measure_child"]


def measure_child(nbytes: int, repeats: int) -> int:
    """Child-process mode: time pinned host -> device copies with torch; print JSON."""
    try:
        torch: Any = importlib.import_module("torch")
    except ModuleNotFoundError:
        print(json.dumps({"error": "torch is not installed"}))
        return 0
    if not torch.cuda.is_available():
        print(json.dumps({"error": "torch sees no CUDA device"}))
        return 0
    host = torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)
    device = torch.empty(nbytes, dtype=torch.uint8, device="cuda")
    device.copy_(host, non_blocking=True)  # warm-up: first touch, lazy mappings
    torch.cuda.synchronize()
    samples = []
    for _ in range(repeats):
        began = time.perf_counter()
        device.copy_(host, non_blocking=True)
        torch.cuda.synchronize()
        samples.append(nbytes / (time.perf_counter() - began))
    print(json.dumps({"bytes": nbytes, "samples": samples, "best": max(samples),
                      "median": statistics.median(samples),
                      "device": str(torch.cuda.get_device_name(0))}))
    return 0


def h2d_bandwidth(args: argparse.Namespace, env: dict[str, str]) -> dict[str, Any]:
    """The bandwidth the wake floor uses, and where it came from."""
    if args.h2d_bandwidth is not None:
        return {"bytes_per_s": float(args.h2d_bandwidth), "measured": False,
                "source": "given with --h2d-bandwidth"}
    assumed = {"bytes_per_s": ASSUMED_H2D_BYTES_PER_S, "measured": False}
    if args.skip_h2d:
        return assumed | {"source": "assumed 54e9 B/s (--skip-h2d)"}
    if importlib.util.find_spec("torch") is None:
        return assumed | {"source": "assumed 54e9 B/s: torch is not installed"}
    command = [sys.executable, "-m", "e2e.bench.gpu", "--measure-h2d-only",
               "--h2d-bytes", str(args.h2d_bytes), "--h2d-repeats", str(args.h2d_repeats)]
    try:
        done = subprocess.run(command, cwd=REPO_ROOT, env=env, capture_output=True, text=True,
                              timeout=args.h2d_timeout_s, check=False)
    except subprocess.TimeoutExpired:
        return assumed | {"source": f"assumed 54e9 B/s: the measurement took over "
                                    f"{args.h2d_timeout_s} s"}
    lines = done.stdout.strip().splitlines()
    try:
        answer: dict[str, Any] = json.loads(lines[-1]) if lines else {}
    except json.JSONDecodeError:
        answer = {}
    if done.returncode != 0 or "best" not in answer:
        why = answer.get("error") or (done.stderr.strip().splitlines() or ["no answer"])[-1]
        return assumed | {"source": f"assumed 54e9 B/s: {why}"}
    return {"bytes_per_s": float(answer["best"]), "measured": True,
            "median_bytes_per_s": float(answer["median"]), "copy_bytes": int(answer["bytes"]),
            "repeats": len(answer["samples"]),
            "source": "measured: pinned host tensor -> device, torch, best of the repeats"}
