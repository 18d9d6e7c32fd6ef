"""Models with seeded random weights, written at test time (no download, no tokenizer): a Llama and a hybrid.

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

__all__ = ["BENCH", "TINY", "TINY_HYBRID", "HybridSpec", "ModelSpec", "make_tiny_hybrid", "make_tiny_llama"]


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


@dataclass(frozen=True)
class HybridSpec:
    """Shape of the Mamba2 + attention model written by :func:`make_tiny_hybrid` (fp32)."""

    hidden: int = 256
    layer_types: tuple[str, ...] = ("mamba", "attention", "mamba", "attention")
    heads: int = 4
    kv_heads: int = 2
    intermediate: int = 512
    vocab: int = 1024
    mamba_heads: int = 8
    mamba_head_dim: int = 64
    mamba_state: int = 64
    max_position_embeddings: int = 2048


TINY_HYBRID = HybridSpec()
"""Tests: two Mamba2 and two attention layers, dense MLPs (no experts)."""


def _hybrid_config(spec: HybridSpec) -> dict[str, Any]:
    return {
        "architectures": ["GraniteMoeHybridForCausalLM"],
        "model_type": "granitemoehybrid",
        "hidden_size": spec.hidden,
        "intermediate_size": spec.intermediate,
        "shared_intermediate_size": spec.intermediate,
        "num_local_experts": 0,
        "num_hidden_layers": len(spec.layer_types),
        "layer_types": list(spec.layer_types),
        "num_attention_heads": spec.heads,
        "num_key_value_heads": spec.kv_heads,
        "mamba_n_heads": spec.mamba_heads,
        "mamba_d_head": spec.mamba_head_dim,
        "mamba_d_state": spec.mamba_state,
        "mamba_n_groups": 1,
        "mamba_d_conv": 4,
        "mamba_expand": spec.mamba_heads * spec.mamba_head_dim // spec.hidden,
        "mamba_chunk_size": 256,
        "position_embedding_type": "rope",
        "max_position_embeddings": spec.max_position_embeddings,
        "vocab_size": spec.vocab,
        "rms_norm_eps": 1e-5,
        "bos_token_id": 1,
        "eos_token_id": 2,
        "tie_word_embeddings": False,
        "torch_dtype": "float32",
    }


def make_tiny_hybrid(path: str, seed: int = 0, spec: HybridSpec = TINY_HYBRID, scale: float = 0.05) -> str:
    """Write a GraniteMoeHybrid checkpoint (Mamba2 and attention layers) with seeded random weights.

    The shapes and names come from transformers' own model class, built under ``torch.manual_seed(seed)``;
    every matrix is then redrawn as ``randn * scale`` from a seeded generator (norms = 1; Mamba's ``A_log`` and
    ``dt_bias`` = 0, ``D`` = 1), so the next token depends on the context.
    """
    torch: Any = importlib.import_module("torch")
    transformers: Any = importlib.import_module("transformers")
    save_file = importlib.import_module("safetensors.torch").save_file
    os.makedirs(path, exist_ok=True)
    config = transformers.GraniteMoeHybridConfig(**{k: v for k, v in _hybrid_config(spec).items()
                                                    if k not in ("architectures", "model_type", "torch_dtype")})
    torch.manual_seed(seed)
    model = transformers.GraniteMoeHybridForCausalLM(config)
    gen = torch.Generator().manual_seed(seed)
    tensors = {}
    for name, value in sorted(model.state_dict().items()):
        if name.endswith("norm.weight"):
            tensors[name] = torch.ones(value.shape, dtype=torch.float32)
        elif name.endswith(("A_log", "D", "dt_bias")):
            tensors[name] = torch.zeros(value.shape, dtype=torch.float32) + (1.0 if name.endswith("D") else 0.0)
        else:
            tensors[name] = torch.randn(value.shape, generator=gen, dtype=torch.float32) * scale
    save_file(tensors, os.path.join(path, "model.safetensors"), metadata={"format": "pt"})
    with open(os.path.join(path, "config.json"), "w") as f:
        json.dump(_hybrid_config(spec), f, indent=2)
    with open(os.path.join(path, "aiotransfer-model.json"), "w") as f:
        json.dump({"seed": seed, "scale": scale, **asdict(spec)}, f)
    return path
