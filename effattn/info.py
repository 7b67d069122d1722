"""`effattn inspect`: what a model is, what its KV cache costs, and which conversions apply."""

from __future__ import annotations

from typing import Any

from .convert import CONVERSIONS
from .convert.base import kv_bytes_per_token
from .errors import EffattnError
from .families import AttentionShape, context_length, family_for, rope_settings, trained_length
from .io.checkpoint import Checkpoint
from .io.verify import verify_checkpoint
from .io.load import as_ref


def inspect_model(model: str, *, context: int | None = None, trust_remote_code: bool = False,
                  allow_pickle: bool = False) -> dict[str, Any]:
    ref = as_ref(model, trust_remote_code=trust_remote_code)
    ckpt = Checkpoint(ref.path, allow_pickle=allow_pickle)
    mla = bool(ckpt.config.get("kv_lora_rank"))
    family = family_for(ckpt.config) if not mla else None  # first: an unsupported family is refused as such
    meta = _meta_model(ckpt.config)  # built once: for the checkpoint's verification and the parameter count
    verify_checkpoint(ckpt, meta)
    shape = AttentionShape.of(ckpt.config)
    dtype = ckpt.dtype
    per_token = kv_bytes_per_token(ckpt.config, dtype)
    info = {
        "model": ref.display,
        "path": str(ref.path),
        "family": family.name if family else ckpt.config.get("model_type"),
        "architecture": (ckpt.config.get("architectures") or ["?"])[0],
        "layers": shape.layers,
        "hidden_size": shape.hidden,
        "query_heads": shape.heads,
        "kv_heads": shape.kv_heads,
        "head_dim": shape.head_dim,
        "attention": "MHA" if shape.kv_heads == shape.heads else ("MQA" if shape.kv_heads == 1 else f"GQA (group {shape.group})"),
        "qk_norm": family.has_qk_norm if family else False,
        "rope": rope_settings(ckpt.config),
        "max_position_embeddings": ckpt.config.get("max_position_embeddings"),
        "trained_length": trained_length(ckpt.config),
        "context_length": context_length(ckpt.config),
        "tie_word_embeddings": bool(ckpt.config.get("tie_word_embeddings", False)),
        "parameters": _parameters(ckpt, meta),
        "dtype": str(dtype).replace("torch.", ""),
        "weights_bytes": ckpt.nbytes,
        "kv_bytes_per_token": per_token,
        # an MLA model has no family here: its line below says what to convert instead
        "conversions": {name: _applies(c, ckpt.config, family) for name, c in CONVERSIONS.items()} if family else {},
    }
    window = window_of(ckpt.config)
    if window is not None:
        size, layers, sinks = window
        info["attention_window"] = (f"{size:,} keys" + (f" + {sinks} sinks" if sinks else "") + f" on {layers} of "
                                    f"{shape.layers} layers: those layers' cache stops growing there")
    from .models import model_spec

    if mla:
        c = ckpt.config
        info["attention"] = (f"MLA: latent {c['kv_lora_rank']} + shared rotary key {c['qk_rope_head_dim']} per token and "
                             f"layer; per-head keys {c.get('qk_nope_head_dim', 0)} + {c['qk_rope_head_dim']}, values "
                             f"{c.get('v_head_dim')}")
        info["kv_heads"] = "latent"
        info["conversions"] = {"-": "an MLA model: effattn converts from GQA/MHA families; convert the model it came "
                                    "from (see its effattn.json)"}
    elif model_spec(ckpt.config.get("model_type")):
        info["conversions"] = {"-": "an effattn model: convert the model it came from (see its effattn.json)"}
        if window is None:  # VQ, linear attention: a cache that is not keys and values per token
            info["kv_bytes_per_token"] = None
            info["kv_cache"] = (f"not keys and values per token ({ckpt.config['model_type']}): its size is in the "
                                "conversion's summary and model card; `effattn eval MODEL` measures it")
    if context:
        info["context"] = context
        info["kv_bytes_at_context"] = None if info["kv_bytes_per_token"] is None else \
            cache_bytes_at(ckpt.config, dtype, context)
    return info


def _meta_model(config: dict[str, Any]):
    """The meta model `config` builds, or None where transformers cannot build it (an unregistered type, a config it
    refuses: verify_checkpoint then says why, or leaves the checkpoint to transformers)."""
    from .io.verify import meta_model

    try:
        return meta_model(config)
    except Exception:  # noqa: BLE001 - see the docstring
        return None


def _parameters(ckpt, meta) -> int:
    """The model's parameters: counted on the model its config builds (`meta`, on the meta device), so that stored
    buffers (VQ's codebooks and key means) are not counted; the checkpoint's tensors where transformers cannot
    build it."""
    return sum(p.numel() for p in meta.parameters()) if meta is not None else ckpt.num_params


def _applies(conversion, config: dict[str, Any], family) -> str:
    """What the conversion does to this model, or why `convert` refuses it (checks on the config alone)."""
    from .convert.base import check_applies

    try:
        check_applies(conversion, config, family, "this model")
    except EffattnError as exc:
        return f"refused: {exc.what}"
    return conversion.targets(config) if hasattr(conversion, "targets") else conversion.description


def window_of(config: dict[str, Any]) -> tuple[int, int, int] | None:
    """(window, windowed layers, sinks) of a model whose attention reads a sliding window, else None:
    Mistral's `sliding_window`, Ministral/Qwen `layer_types`, effattn_sinks."""
    layers = config["num_hidden_layers"]
    if config.get("model_type") == "effattn_sinks":
        return int(config["attention_window"]), layers - len(config.get("sink_full_layers") or []), int(config["sink_tokens"])
    size = config.get("sliding_window")
    if not size or (config.get("model_type") in ("qwen2", "qwen3") and not config.get("use_sliding_window")):
        return None
    if config.get("model_type") == "llama":  # Llama's attention ignores it (only its cache would truncate)
        return None
    types = config.get("layer_types") or ["sliding_attention"] * layers
    return int(size), sum(t == "sliding_attention" for t in types), 0


def cache_bytes_at(config: dict[str, Any], dtype, context: int) -> float:
    """KV-cache bytes after `context` tokens: windowed layers hold at most their window (and sinks)."""
    per_layer = kv_bytes_per_token(config, dtype) / config["num_hidden_layers"]
    window = window_of(config)
    if window is None:
        return per_layer * config["num_hidden_layers"] * context
    size, windowed, sinks = window
    full = config["num_hidden_layers"] - windowed
    return per_layer * (full * context + windowed * min(context, size - 1 + sinks))  # W - 1 keys cached, + sinks
