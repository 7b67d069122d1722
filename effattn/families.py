"""Model families described as data.

A family says where a decoder's attention tensors live and how its attention is built (biases,
per-head norms, RoPE layout). Conversions read these templates instead of branching on
`model_type`; adding a family is adding one entry here.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from .errors import EffattnError


@dataclass(frozen=True)
class Family:
    name: str
    model_types: tuple[str, ...]
    layer: str = "model.layers.{layer}."  # prefix of every tensor of decoder layer `layer`
    q_proj: str = "self_attn.q_proj"
    k_proj: str = "self_attn.k_proj"
    v_proj: str = "self_attn.v_proj"
    o_proj: str = "self_attn.o_proj"
    # Per-head RMSNorms applied to q and k after the projection and before RoPE (Qwen3).
    q_norm: str | None = None
    k_norm: str | None = None
    input_norm: str = "input_layernorm"  # the RMSNorm in front of attention
    qkv_bias: str = "config"  # "always" (Qwen2), "config" (`attention_bias`), or "never"
    rope_layout: str = "rotate_half"  # HF layout: frequency j pairs dims j and j + head_dim/2
    embed: str = "model.embed_tokens.weight"
    lm_head: str = "lm_head.weight"
    notes: str = ""

    def prefix(self, layer: int) -> str:
        return self.layer.format(layer=layer)

    def attn(self, layer: int, part: str, kind: str = "weight") -> str:
        """Full tensor name, e.g. attn(3, "k_proj") -> "model.layers.3.self_attn.k_proj.weight"."""
        return f"{self.prefix(layer)}{getattr(self, part)}.{kind}"

    @property
    def has_qk_norm(self) -> bool:
        return self.k_norm is not None


FAMILIES: dict[str, Family] = {
    f.name: f
    for f in [
        Family("llama", ("llama",), notes="Llama 1-3, SmolLM, TinyLlama; optional q/k/v/o biases"),
        Family("mistral", ("mistral", "ministral"), qkv_bias="never",
               notes="optional sliding window; Ministral: per-layer window or full attention (layer_types)"),
        Family("qwen2", ("qwen2",), qkv_bias="always", notes="q/k/v biases"),
        Family("qwen3", ("qwen3",), q_norm="self_attn.q_norm", k_norm="self_attn.k_norm",
               notes="per-head q/k RMSNorm before RoPE"),
    ]
}

_BY_MODEL_TYPE = {mt: f for f in FAMILIES.values() for mt in f.model_types}


def family_for(config: dict[str, Any]) -> Family:
    """The family of a config.json dict; a one-line error for anything else."""
    from .models import model_spec

    model_type = config.get("model_type")
    if model_spec(model_type):  # effattn's own models keep their base family's layout
        model_type = config.get("base_model_type")
    if model_type in _BY_MODEL_TYPE:
        return _BY_MODEL_TYPE[model_type]
    remote = " (its modeling code is remote: auto_map in config.json)" if config.get("auto_map") else ""
    raise EffattnError(f"model_type {model_type!r} is not a supported family{remote}",
                       f"effattn converts these model types only: {supported_types()}")


def supported_types() -> str:
    """The model types effattn converts, as one list."""
    return ", ".join(sorted(_BY_MODEL_TYPE))


@dataclass(frozen=True)
class AttentionShape:
    """The attention geometry of a config: what every conversion validates against."""

    layers: int
    hidden: int
    heads: int
    kv_heads: int
    head_dim: int

    @property
    def group(self) -> int:
        return self.heads // self.kv_heads

    @classmethod
    def of(cls, config: dict[str, Any]) -> AttentionShape:
        heads = config["num_attention_heads"]
        return cls(
            layers=config["num_hidden_layers"],
            hidden=config["hidden_size"],
            heads=heads,
            kv_heads=config.get("num_key_value_heads") or heads,
            head_dim=config.get("head_dim") or config["hidden_size"] // heads,
        )


def trained_length(config: dict[str, Any]) -> int:
    """The context a model was trained to: a RoPE-scaled model's original length (linear scaling: its
    max_position_embeddings over the factor; dynamic NTK keeps the trained one), else its
    max_position_embeddings."""
    params = rope_settings(config)
    original = params.get("original_max_position_embeddings") or config.get("original_max_position_embeddings")
    if original:
        return int(original)
    longest = int(config.get("max_position_embeddings") or 2048)
    if params.get("rope_type") == "linear" and params.get("factor"):  # linear keeps no original length: its
        return max(1, round(longest / float(params["factor"])))  # max_position_embeddings is the extended one
    return longest


def beyond_positions(config: dict[str, Any], lengths, name: str, what: str) -> str | None:
    """A one-line note when any of `lengths` is beyond the model's max_position_embeddings (positions
    past it are extrapolated), or None. `what` names the lengths, e.g. "--context 16,384"."""
    limit = config.get("max_position_embeddings") or trained_length(config)
    if all(n <= limit for n in lengths):
        return None
    return (f"{what} is beyond {name}'s max_position_embeddings ({limit:,}; trained to {trained_length(config):,}): "
            "positions past it are extrapolated")


def context_length(config: dict[str, Any]) -> str:
    """The context a model is meant for, in words: its trained length, or the extension its RoPE
    scaling declares."""
    params, trained = rope_settings(config), trained_length(config)
    kind, factor = params.get("rope_type", "default"), params.get("factor")
    if kind in (None, "default") or not factor:
        return f"{trained:,} tokens (trained)"
    return f"{context_positions(config):,} tokens (RoPE {kind} x{float(factor):g} of the trained {trained:,})"


def rope_settings(config: dict[str, Any]) -> dict[str, Any]:
    """RoPE parameters from a transformers 5 (`rope_parameters`) or 4 (`rope_theta`/`rope_scaling`) config."""
    params = dict(config.get("rope_parameters") or {})
    if not params:
        params["rope_theta"] = config.get("rope_theta", 10000.0)
        params["rope_type"] = (config.get("rope_scaling") or {}).get("rope_type", "default")
        if config.get("rope_scaling"):
            params.update(config["rope_scaling"])
    params.setdefault("partial_rotary_factor", config.get("partial_rotary_factor", 1.0))
    return params


def context_positions(config: dict[str, Any]) -> int:
    """The longest context the model is meant for (positions): max_position_embeddings, or the trained
    length times a RoPE scaling factor where that is longer."""
    params = rope_settings(config)
    longest = int(config.get("max_position_embeddings") or 2048)
    if params.get("factor") and params.get("rope_type") not in (None, "default"):
        longest = max(longest, round(trained_length(config) * float(params["factor"])))
    return longest
