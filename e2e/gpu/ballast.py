"""Hold GPU memory on purpose: the "other process" of the failure scenarios.

    python -m e2e.gpu.ballast --bytes 60Gi [--fake-nvml-dir DIR --gpu-uuid UUID]

With PyTorch and CUDA it allocates ``--bytes`` on the device (plain ``cudaMalloc``
through PyTorch's allocator, which NVML shows at once); with ``--fake-nvml-dir`` it
registers the bytes with rota's fake NVML instead (a machine without a GPU). It prints one
JSON line (``{"ready": true, "pid": ..., "bytes": ...}``) once the memory is held, then
holds it until SIGTERM/SIGINT or ``--max-seconds`` (bounded: it never outlives a run).
Standard library (and torch) only.
"""

from __future__ import annotations

import argparse
import importlib
import json
import os
import signal
import sys
import threading
import time
from pathlib import Path
from typing import Any

from e2e.gpu.h2d import parse_bytes

__all__ = ["main"]


def _register(directory: Path, gpu_uuid: str, nbytes: int) -> Path:
    """The fake NVML's registry format (see driver/nvml/fake.py), written atomically."""
    directory.mkdir(parents=True, exist_ok=True)
    target = directory / f"{os.getpid()}.json"
    tmp = directory / f".{os.getpid()}.ballast.tmp"
    tmp.write_text(json.dumps({"pid": os.getpid(), "gpu_uuid": gpu_uuid,
                               "used_bytes": nbytes}), encoding="utf-8")
    tmp.rename(target)
    return target


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m e2e.gpu.ballast", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--bytes", type=parse_bytes, required=True)
    parser.add_argument("--fake-nvml-dir", type=Path, default=None)
    parser.add_argument("--gpu-uuid", default="")
    parser.add_argument("--max-seconds", type=float, default=600.0)
    args = parser.parse_args(argv)
    stop = threading.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda *_: stop.set())
    held: Any = None
    registered: Path | None = None
    began = time.perf_counter()
    try:
        if args.fake_nvml_dir is not None:
            registered = _register(args.fake_nvml_dir, args.gpu_uuid, args.bytes)
        else:
            torch: Any = importlib.import_module("torch")
            held = torch.empty(args.bytes, dtype=torch.uint8, device="cuda")
            torch.cuda.synchronize()
    except Exception as exc:
        print(json.dumps({"ready": False, "error": f"{type(exc).__name__}: {exc}"}), flush=True)
        return 1
    print(json.dumps({"ready": True, "pid": os.getpid(), "bytes": args.bytes,
                      "seconds": round(time.perf_counter() - began, 3)}), flush=True)
    stop.wait(args.max_seconds)
    del held
    if registered is not None:
        registered.unlink(missing_ok=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
