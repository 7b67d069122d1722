"""`effattn inspect`: what a model is, what its KV cache costs, and which conversions apply."""

from __future__ import annotations

from typing import Any

from .convert import CONVERSIONS
from .convert.base import kv_bytes_per_token
from .families import AttentionShape, context_length, family_for, rope_settings, trained_length
from .io.checkpoint import Checkpoint
from .io.verify import verify_checkpoint
from .io.load import as_ref


def inspect_model(model: str, *, context: int | None = None, trust_remote_code: bool = False,
                  allow_pickle: bool = False) -> dict[str, Any]:
    ref = as_ref(model, trust_remote_code=trust_remote_code)
    ckpt = Checkpoint(ref.path, allow_pickle=allow_pickle)
    verify_checkpoint(ckpt)
    family = family_for(ckpt.config)
    shape = AttentionShape.of(ckpt.config)
    dtype = ckpt.dtype
    per_token = kv_bytes_per_token(ckpt.config, dtype)
    info = {
        "model": ref.display,
        "path": str(ref.path),
        "family": family.name,
        "architecture": (ckpt.config.get("architectures") or ["?"])[0],
        "layers": shape.layers,
        "hidden_size": shape.hidden,
        "query_heads": shape.heads,
        "kv_heads": shape.kv_heads,
        "head_dim": shape.head_dim,
        "attention": "MHA" if shape.kv_heads == shape.heads else ("MQA" if shape.kv_heads == 1 else f"GQA (group {shape.group})"),
        "qk_norm": family.has_qk_norm,
        "rope": rope_settings(ckpt.config),
        "max_position_embeddings": ckpt.config.get("max_position_embeddings"),
        "trained_length": trained_length(ckpt.config),
        "context_length": context_length(ckpt.config),
        "tie_word_embeddings": bool(ckpt.config.get("tie_word_embeddings", False)),
        "parameters": ckpt.num_params,
        "dtype": str(dtype).replace("torch.", ""),
        "weights_bytes": ckpt.nbytes,
        "kv_bytes_per_token": per_token,
        "conversions": {name: c.targets(ckpt.config) if hasattr(c, "targets") else c.description
                        for name, c in CONVERSIONS.items()},
    }
    if context:
        info["context"] = context
        info["kv_bytes_at_context"] = per_token * context
    return info
