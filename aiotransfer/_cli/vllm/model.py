"""A Llama checkpoint with seeded random weights, written at test time (no download, no tokenizer).

The weights are ``randn * 0.05`` from a fixed ``torch.Generator`` (norms = 1), so every process that loads
the directory computes the same function and the next token depends on the whole context: decoding over
another request's KV gives different tokens. vLLM's ``load_format="dummy"`` does not (its weights are so
small that the context barely matters), which is why it is never used here.
"""

from __future__ import annotations

import importlib
import json
import os
from dataclasses import asdict, dataclass
from typing import Any

__all__ = ["BENCH", "TINY", "ModelSpec", "make_tiny_llama"]


@dataclass(frozen=True)
class ModelSpec:
    """Shape of the Llama written by :func:`make_tiny_llama` (fp32)."""

    hidden: int = 256
    layers: int = 4
    heads: int = 4
    kv_heads: int = 2
    head_dim: int = 64
    intermediate: int = 512
    vocab: int = 1024
    max_position_embeddings: int = 2048

    def kv_bytes_per_token(self, dtype_bytes: int = 4) -> int:
        """K and V of one token over all layers."""
        return self.layers * 2 * self.kv_heads * self.head_dim * dtype_bytes

    def block_bytes(self, block_size: int, dtype_bytes: int = 4) -> int:
        """One vLLM KV block over all layers."""
        return self.kv_bytes_per_token(dtype_bytes) * block_size


TINY = ModelSpec()
"""Tests: 4 KiB of KV per token (fp32), 12 MB of weights."""
BENCH = ModelSpec(hidden=512, layers=8, heads=8, kv_heads=8, head_dim=64, intermediate=1024)
"""Benchmark: 32 KiB of KV per token (fp32; 1k tokens = 32 MiB), 84 MB of weights."""


def _config(spec: ModelSpec) -> dict[str, Any]:
    return {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "hidden_size": spec.hidden,
        "intermediate_size": spec.intermediate,
        "num_hidden_layers": spec.layers,
        "num_attention_heads": spec.heads,
        "num_key_value_heads": spec.kv_heads,
        "head_dim": spec.head_dim,
        "hidden_act": "silu",
        "max_position_embeddings": spec.max_position_embeddings,
        "rms_norm_eps": 1e-5,
        "rope_theta": 10000.0,
        "vocab_size": spec.vocab,
        "bos_token_id": 1,
        "eos_token_id": 2,
        "tie_word_embeddings": False,
        "torch_dtype": "float32",
    }


def _shapes(spec: ModelSpec) -> dict[str, tuple[int, ...]]:
    """Every tensor of the checkpoint, in a fixed order (the generator's draws follow it)."""
    h, i, v = spec.hidden, spec.intermediate, spec.vocab
    q, kv = spec.heads * spec.head_dim, spec.kv_heads * spec.head_dim
    shapes: dict[str, tuple[int, ...]] = {"model.embed_tokens.weight": (v, h)}
    for n in range(spec.layers):
        p = f"model.layers.{n}."
        shapes.update({
            p + "input_layernorm.weight": (h,),
            p + "self_attn.q_proj.weight": (q, h),
            p + "self_attn.k_proj.weight": (kv, h),
            p + "self_attn.v_proj.weight": (kv, h),
            p + "self_attn.o_proj.weight": (h, q),
            p + "post_attention_layernorm.weight": (h,),
            p + "mlp.gate_proj.weight": (i, h),
            p + "mlp.up_proj.weight": (i, h),
            p + "mlp.down_proj.weight": (h, i),
        })
    shapes["model.norm.weight"] = (h,)
    shapes["lm_head.weight"] = (v, h)
    return shapes


def make_tiny_llama(path: str, seed: int = 0, spec: ModelSpec = TINY, scale: float = 0.05) -> str:
    """Write ``config.json`` and ``model.safetensors`` of a Llama with seeded random weights into ``path``.

    Needs torch and safetensors (the vLLM venv has both). Returns ``path``. The same ``seed`` and ``spec``
    give the same bytes in every process.
    """
    torch: Any = importlib.import_module("torch")
    save_file = importlib.import_module("safetensors.torch").save_file
    os.makedirs(path, exist_ok=True)
    gen = torch.Generator().manual_seed(seed)
    tensors = {}
    for name, shape in _shapes(spec).items():
        if name.endswith("norm.weight"):
            tensors[name] = torch.ones(shape, dtype=torch.float32)
        else:
            tensors[name] = torch.randn(shape, generator=gen, dtype=torch.float32) * scale
    save_file(tensors, os.path.join(path, "model.safetensors"), metadata={"format": "pt"})
    with open(os.path.join(path, "config.json"), "w") as f:
        json.dump(_config(spec), f, indent=2)
    with open(os.path.join(path, "aiotransfer-model.json"), "w") as f:
        json.dump({"seed": seed, "scale": scale, **asdict(spec)}, f)
    return path
