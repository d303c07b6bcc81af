"""Write random weight files for a model directory that holds only a config and a tokenizer.

    python -m e2e.gpu.weights SRC DST

vLLM's dummy loader cannot reload weights, so a level-2 wake (``collective_rpc
reload_weights``) needs real files. This builds the model from ``SRC/config.json`` with
transformers (random initialisation from a fixed seed, bfloat16), saves it as
safetensors into ``DST`` and copies the tokenizer and generation config beside it.
Idempotent: a ``DST`` that already holds weights is left alone. Needs torch and
transformers only.

The seed is fixed because the benchmark's time to first token counts the first
non-empty content token: what random weights answer decides when that comes, so weights
drawn anew on each machine made one run's TTFT of this model incomparable with the next.
"""

from __future__ import annotations

import importlib
import json
import shutil
import sys
import time
from pathlib import Path
from typing import Any

__all__ = ["main", "write_weights"]

SEED = 1129
"""The random initialisation's seed: the same weights on every machine."""

_COPIED = ("config.json", "generation_config.json", "tokenizer.json", "tokenizer_config.json",
           "special_tokens_map.json", "vocab.json", "merges.txt")


def _has_weights(path: Path) -> bool:
    return any(path.glob("*.safetensors"))


def write_weights(src: Path, dst: Path) -> dict[str, Any]:
    """Build and save the weights; what was done and how long it took."""
    if _has_weights(dst):
        return {"dst": str(dst), "written": False, "reason": "weights already there"}
    began = time.perf_counter()
    torch: Any = importlib.import_module("torch")
    transformers: Any = importlib.import_module("transformers")
    tmp = dst.with_name(dst.name + ".partial")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    config = transformers.AutoConfig.from_pretrained(str(src))
    torch.manual_seed(SEED)
    model = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16)
    model.save_pretrained(str(tmp))  # safetensors by default
    for name in _COPIED:
        if (src / name).is_file():
            shutil.copy2(src / name, tmp / name)
    shutil.rmtree(dst, ignore_errors=True)
    tmp.rename(dst)
    size = sum(p.stat().st_size for p in dst.glob("*.safetensors"))
    return {"dst": str(dst), "written": True, "safetensors_bytes": size,
            "seconds": round(time.perf_counter() - began, 3)}


def main(argv: list[str] | None = None) -> int:
    args = sys.argv[1:] if argv is None else argv
    if len(args) != 2:
        print(__doc__, file=sys.stderr)
        return 2
    try:
        result = write_weights(Path(args[0]), Path(args[1]))
    except Exception as exc:  # reported as JSON: the stage script reads it
        result = {"error": f"{type(exc).__name__}: {exc}"}
    print(json.dumps(result), flush=True)
    return 0 if "error" not in result else 1


if __name__ == "__main__":
    sys.exit(main())
