"""Host-to-device copy floors of a level-1 wake, measured with PyTorch on this GPU.

    python -m e2e.gpu.h2d --model DIR [--model DIR ...] [--kv-bytes 8Gi] [--out FILE]

A level-1 wake copies every weight back from pinned host memory and maps the KV cache
again. This measures what such a wake can at best cost, in the pieces a wake is made of:

- ``bulk``: one pinned buffer copied to the device in one call (best and median of the
  repeats): the bandwidth of the link, the floor rota's reports divide by; the same from
  pageable memory (what a backup that is not pinned would give);
- per model, ``chunked_sync``: every weight tensor (as vLLM holds them, see
  :mod:`e2e.gpu.shapes`) copied on its own and synchronised after each, as vLLM's
  allocator copies one allocation at a time; ``chunked_async``: the same copies queued
  back to back;
- ``alloc``: device allocation of every weight tensor, and of a KV cache of
  ``--kv-bytes`` split into one tensor per layer (a wake maps fresh memory for both);
- ``pin``: allocating pinned host memory (a first level-1 sleep pins the whole model).

One JSON object on stdout (and in ``--out``). Needs only PyTorch with CUDA and the
standard library: it runs before rota's dependencies are installed.
"""

from __future__ import annotations

import argparse
import importlib
import json
import statistics
import sys
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from e2e.gpu.shapes import load_config, weight_bytes, weight_tensors

__all__ = ["main", "parse_bytes"]

_SUFFIXES = {"Ki": 2**10, "Mi": 2**20, "Gi": 2**30, "k": 10**3, "M": 10**6, "G": 10**9}


def parse_bytes(text: str) -> int:
    """``4Gi``, ``500M`` or a plain number of bytes."""
    for suffix in sorted(_SUFFIXES, key=len, reverse=True):
        if text.endswith(suffix) and text[: -len(suffix)].isdigit():
            return int(text[: -len(suffix)]) * _SUFFIXES[suffix]
    if not text.isdigit():
        raise argparse.ArgumentTypeError(f"not a byte count: {text!r}")
    return int(text)


def _timed(torch: Any, fn: Callable[[], object]) -> float:
    torch.cuda.synchronize()
    began = time.perf_counter()
    fn()
    torch.cuda.synchronize()
    return time.perf_counter() - began


def _bulk(torch: Any, nbytes: int, repeats: int) -> dict[str, Any]:
    began = time.perf_counter()
    host = torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)
    pin_s = time.perf_counter() - began
    device = torch.empty(nbytes, dtype=torch.uint8, device="cuda")
    device.copy_(host, non_blocking=True)  # warm-up: first touch, lazy mappings
    rates = [nbytes / _timed(torch, lambda: device.copy_(host, non_blocking=True))
             for _ in range(repeats)]
    back = [nbytes / _timed(torch, lambda: host.copy_(device, non_blocking=True))
            for _ in range(max(1, repeats // 2))]
    pageable = torch.empty(nbytes, dtype=torch.uint8)  # what an unpinned backup would give
    pageable.fill_(1)
    unpinned = [nbytes / _timed(torch, lambda: device.copy_(pageable))
                for _ in range(max(1, repeats // 2))]
    return {"bytes": nbytes, "repeats": repeats, "best_bytes_per_s": max(rates),
            "median_bytes_per_s": statistics.median(rates), "samples": rates,
            "d2h_best_bytes_per_s": max(back),
            "pageable_best_bytes_per_s": max(unpinned),
            "pin": {"bytes": nbytes, "seconds": pin_s,
                    "bytes_per_s": nbytes / pin_s if pin_s > 0 else None}}


def _chunked(torch: Any, sizes: Sequence[int], repeats: int) -> dict[str, Any]:
    """Copy tensors of ``sizes`` one by one from one pinned buffer into one device buffer
    (the destination is reused: only the sizes and the number of calls matter)."""
    largest = max(sizes)
    host = torch.empty(largest, dtype=torch.uint8, pin_memory=True)
    device = torch.empty(largest, dtype=torch.uint8, device="cuda")

    def each_synced() -> None:
        for n in sizes:
            device[:n].copy_(host[:n], non_blocking=True)
            torch.cuda.synchronize()

    def all_queued() -> None:
        for n in sizes:
            device[:n].copy_(host[:n], non_blocking=True)

    each_synced()  # warm-up
    synced = [_timed(torch, each_synced) for _ in range(repeats)]
    queued = [_timed(torch, all_queued) for _ in range(repeats)]
    total = sum(sizes)
    return {"tensors": len(sizes), "bytes": total,
            "sync_best_s": min(synced), "sync_median_s": statistics.median(synced),
            "async_best_s": min(queued), "async_median_s": statistics.median(queued),
            "sync_bytes_per_s": total / min(synced), "async_bytes_per_s": total / min(queued)}


def _alloc(torch: Any, sizes: Sequence[int]) -> float:
    """Seconds to allocate tensors of ``sizes`` on the device from an empty cache."""
    torch.cuda.empty_cache()
    held: list[Any] = []
    seconds = _timed(torch, lambda: held.extend(
        torch.empty(n, dtype=torch.uint8, device="cuda") for n in sizes))
    held.clear()
    torch.cuda.empty_cache()
    return seconds


def measure(models: Sequence[Path], *, nbytes: int, repeats: int, kv_bytes: int
            ) -> dict[str, Any]:
    try:
        torch: Any = importlib.import_module("torch")
    except ModuleNotFoundError:
        return {"error": "torch is not installed"}
    if not torch.cuda.is_available():
        return {"error": "torch sees no CUDA device"}
    result: dict[str, Any] = {"device": str(torch.cuda.get_device_name(0)),
                              "torch": str(torch.__version__)}
    result["bulk"] = _bulk(torch, nbytes, repeats)
    torch.cuda.empty_cache()
    result["models"] = {}
    for model in models:
        config = load_config(model)
        sizes = [n for _, n in weight_tensors(config)]
        layers = int(config["num_hidden_layers"])
        entry = _chunked(torch, sizes, max(1, repeats // 2))
        torch.cuda.empty_cache()
        entry["weights_bytes"] = weight_bytes(config)
        entry["alloc_weights_s"] = _alloc(torch, sizes)
        entry["alloc_kv_s"] = _alloc(torch, [kv_bytes // layers] * layers)
        entry["kv_bytes"] = kv_bytes
        result["models"][model.name] = entry
    return result


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m e2e.gpu.h2d", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", type=Path, action="append", default=[],
                        help="a model directory with config.json (repeatable)")
    parser.add_argument("--bytes", type=parse_bytes, default=4 * 2**30)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--kv-bytes", type=parse_bytes, default=8 * 2**30)
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args(argv)
    began = time.perf_counter()
    try:
        result = measure(args.model, nbytes=args.bytes, repeats=max(1, args.repeats),
                         kv_bytes=args.kv_bytes)
    except Exception as exc:  # reported, not raised: the caller reads one JSON line
        result = {"error": f"{type(exc).__name__}: {exc}"}
    result["wall_s"] = round(time.perf_counter() - began, 3)
    text = json.dumps(result)
    if args.out is not None:
        args.out.write_text(text + "\n", encoding="utf-8")
    print(text, flush=True)
    return 0 if "error" not in result else 1


if __name__ == "__main__":
    sys.exit(main())
