"""Model folders for the GPU benchmark's tests: the configs of the two models the GPU runs
serve (Qwen3 layer sizes: a 14B and a 0.5B model, 4096-token vocabulary), no tokenizer,
no weights: enough for the engine simulator standing in for vLLM."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

_COMMON: dict[str, Any] = {
    "architectures": ["Qwen3ForCausalLM"], "model_type": "qwen3", "head_dim": 128,
    "num_key_value_heads": 8, "torch_dtype": "bfloat16", "vocab_size": 4096,
    "max_position_embeddings": 40960}
CONFIGS: dict[str, dict[str, Any]] = {
    "model-14b": _COMMON | {"hidden_size": 5120, "intermediate_size": 17408,
                            "num_attention_heads": 40, "num_hidden_layers": 40,
                            "tie_word_embeddings": False},
    "model-small": _COMMON | {"hidden_size": 1024, "intermediate_size": 3072,
                              "num_attention_heads": 16, "num_hidden_layers": 32,
                              "tie_word_embeddings": True},
}


def write_models(root: Path) -> Path:
    """``root/model-14b`` and ``root/model-small`` with their config.json; ``root``."""
    for name, config in CONFIGS.items():
        (root / name).mkdir(parents=True, exist_ok=True)
        (root / name / "config.json").write_text(json.dumps(config), encoding="utf-8")
    return root


def write_fake_weights(folder: Path) -> Path:
    """A model-small folder that looks as if it held weight files (the simulator reads
    none; vLLM would)."""
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "config.json").write_text(json.dumps(CONFIGS["model-small"]), encoding="utf-8")
    (folder / "model.safetensors").write_bytes(b"")
    return folder


def stop_recorded_engines(state_dir: Path) -> None:
    """Stop every engine a benchmark state records (a test that failed halfway leaves its
    engines running: they have their own sessions)."""
    from e2e.gpu.engines import main as engines

    if (state_dir / "state.json").is_file():
        engines(["stop", str(state_dir)])
