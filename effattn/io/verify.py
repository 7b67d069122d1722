"""A checkpoint checked against its own config.json before any work: every tensor the config implies is
there, with the shape it implies. transformers would otherwise fill a missing tensor with random values
(and evaluate a broken model without a word), and conversions would fail deep inside with a shape error
that names no tensor.

The expected names and shapes come from the model class built on the meta device (no memory, no
weights), so they are exact for every family transformers (or effattn) registers; a model type only
remote code defines is not checked.
"""

from __future__ import annotations

import re
from typing import Any

import torch

from ..errors import EffattnError, clip


def meta_model(config: dict[str, Any]):
    """The causal-LM model `config` describes, on the meta device (shapes only)."""
    from transformers import CONFIG_MAPPING, AutoModelForCausalLM

    import effattn.attention  # noqa: F401 - effattn's own model classes

    cfg = CONFIG_MAPPING[config["model_type"]].from_dict(config)
    with torch.device("meta"):
        return AutoModelForCausalLM.from_config(cfg)


def expected_tensors(config: dict[str, Any], model=None) -> dict[str, tuple[int, ...]] | None:
    """Name -> shape of every tensor a checkpoint of `config` holds (tied output weights excluded), or
    None where the model type is not registered here. `model`: config's meta model, where the caller built it."""
    from transformers import CONFIG_MAPPING

    if config.get("model_type") not in CONFIG_MAPPING:
        return None
    try:
        model = model if model is not None else meta_model(config)
    except Exception as exc:  # noqa: BLE001 - transformers' own checks of the config, said in one line
        reason = " ".join(str(exc).split())
        reason = reason.split("validate_architecture'")[-1].strip(" :.'") or type(exc).__name__
        raise EffattnError(f"transformers rejects this config.json ({clip(reason)})", "fix or re-download it") from None
    tied = {k for k in getattr(model, "_tied_weights_keys", None) or {}} if config.get("tie_word_embeddings", True) else set()
    return {name: tuple(t.shape) for name, t in model.state_dict().items() if name not in tied}


def stored_under_other_names(model_type: str | None) -> list[re.Pattern]:
    """Patterns of the model's tensor names that its checkpoints store otherwise: transformers renames or fuses
    them while loading (its checkpoint conversion mapping: a Mixtral's block_sparse_moe.experts.N.w1 become
    mlp.experts.gate_up_proj). Such names cannot be looked up in the checkpoint, so they go unchecked here."""
    try:
        from transformers.conversion_mapping import get_checkpoint_conversion_mapping
    except ImportError:  # a transformers without conversion mappings loads names as stored
        return []
    patterns = []
    for rule in get_checkpoint_conversion_mapping(model_type) or []:
        targets = getattr(rule, "target_patterns", None) or []
        for target in [targets] if isinstance(targets, str) else targets:
            try:
                patterns.append(re.compile(target))
            except (re.error, TypeError):
                patterns.append(re.compile(re.escape(str(target))))
    return patterns


def verify_checkpoint(ckpt, model=None) -> None:
    """Refuse a checkpoint that lacks a tensor its config.json implies or holds one of another shape,
    naming the tensor. A checkpoint whose names follow another scheme altogether (fewer than half the
    expected names present) is left to transformers' own key mapping. `model`: the config's meta model, where the
    caller built it already."""
    expected = expected_tensors(ckpt.config, model)
    if not expected:
        return
    renamed = stored_under_other_names(ckpt.config.get("model_type"))
    expected = {name: shape for name, shape in expected.items() if not any(p.search(name) for p in renamed)}
    present = set(ckpt.names())
    missing = [name for name in expected if name not in present]
    if len(missing) > len(expected) / 2:
        return
    where = ckpt.folder
    if missing:
        more = f" (and {len(missing) - 1} more)" if len(missing) > 1 else ""
        raise EffattnError(f"{where} lacks tensor {missing[0]}{more}, which its config.json implies",
                           "export the checkpoint again completely, or fix its config.json")
    for name, shape in expected.items():
        actual = tuple(ckpt.meta(name)[0])
        if actual != shape:
            raise EffattnError(f"tensor {name} in {where} has shape {list(actual)}, but config.json implies {list(shape)}",
                               "export the checkpoint again, or fix config.json to match it")
