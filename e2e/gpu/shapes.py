"""The weight tensors of a dense decoder model, from its Hugging Face ``config.json``.

The copy floor of a level-1 wake is the bytes of the weights over the host-to-device
bandwidth. vLLM keeps each weight as its own allocation (fused: ``qkv_proj`` and
``gate_up_proj`` are one tensor each), so the bench also times the copy tensor by tensor,
which is what a wake can at best do. Standard library only: it runs on the GPU machine
before rota's dependencies are there.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from pathlib import Path
from typing import Any

__all__ = ["DTYPE_BYTES", "load_config", "weight_bytes", "weight_tensors"]

DTYPE_BYTES = {"bfloat16": 2, "float16": 2, "float32": 4}


def load_config(model_dir: Path) -> dict[str, Any]:
    """The model's ``config.json``."""
    data: dict[str, Any] = json.loads((model_dir / "config.json").read_text(encoding="utf-8"))
    return data


def _int(config: Mapping[str, Any], key: str) -> int:
    value = config.get(key)
    if type(value) is not int or value <= 0:
        raise ValueError(f"config.json: {key} must be a positive integer, not {value!r}")
    return value


def weight_tensors(config: Mapping[str, Any]) -> list[tuple[str, int]]:
    """(name, bytes) of every weight tensor as vLLM holds it, for Llama/Qwen-style models
    (fused QKV and gate/up projections, per-head q/k norms where the model has them)."""
    hidden = _int(config, "hidden_size")
    layers = _int(config, "num_hidden_layers")
    heads = _int(config, "num_attention_heads")
    kv_heads = int(config.get("num_key_value_heads") or heads)
    head_dim = int(config.get("head_dim") or hidden // heads)
    inter = _int(config, "intermediate_size")
    vocab = _int(config, "vocab_size")
    size = DTYPE_BYTES.get(str(config.get("torch_dtype") or "bfloat16"), 2)
    qk_norm = str(config.get("model_type", "")).startswith("qwen3")
    tensors = [("embed_tokens", vocab * hidden * size)]
    for i in range(layers):
        tensors += [
            (f"layers.{i}.qkv_proj", (heads + 2 * kv_heads) * head_dim * hidden * size),
            (f"layers.{i}.o_proj", heads * head_dim * hidden * size),
            (f"layers.{i}.gate_up_proj", 2 * inter * hidden * size),
            (f"layers.{i}.down_proj", inter * hidden * size),
            (f"layers.{i}.input_layernorm", hidden * size),
            (f"layers.{i}.post_attention_layernorm", hidden * size),
        ]
        if qk_norm:
            tensors += [(f"layers.{i}.q_norm", head_dim * size),
                        (f"layers.{i}.k_norm", head_dim * size)]
    tensors.append(("norm", hidden * size))
    if not config.get("tie_word_embeddings", False):
        tensors.append(("lm_head", vocab * hidden * size))
    return tensors


def weight_bytes(config: Mapping[str, Any]) -> int:
    """Bytes of all weights (what a level-1 sleep offloads and a wake copies back)."""
    return sum(n for _, n in weight_tensors(config))
