"""What trains (recipe `train.params`): everything, the attention only, or LoRA adapters.

  all        every parameter (an MLA model's latent projection, latent norm and low-rank query path
             excepted; `train.mla_latent: scaled` trains the latent projection through a row-scale
             parametrization: attention/mla.py)
  attention  each layer's attention module (the family's q/k/v/o projections, norms, and whatever a
             conversion put there), plus every module that exposes `effattn_aux_loss`
  lora       peft LoRA adapters on `train.lora.target_modules` (+ the conversion modules as above, and
             the parameters a conversion's modules name in `effattn_trainable`, e.g. a linear-attention
             layer's feature maps and mix); merged into the weights before saving, so the output stays a
             native checkpoint
"""

from __future__ import annotations

import re
import warnings

import torch

from ..errors import EffattnError
from ..families import family_for
from .config import Train


def conversion_modules(model: torch.nn.Module) -> list[torch.nn.Module]:
    """Modules that declare conversion-specific state (an `effattn_aux_loss` attribute)."""
    return [m for m in model.modules() if hasattr(m, "effattn_aux_loss")]


def conversion_parameters(model: torch.nn.Module) -> list[torch.nn.Parameter]:
    """The parameters a conversion added and always trains (alongside LoRA adapters too): those each module
    names in its `effattn_trainable` attribute (submodules or parameters of it)."""
    found = []
    for module in model.modules():
        for name in getattr(module, "effattn_trainable", ()):
            part = getattr(module, name)
            found += list(part.parameters()) if isinstance(part, torch.nn.Module) else [part]
    return found


def _attention_pattern(model: torch.nn.Module) -> re.Pattern:
    """Matches parameter names inside any layer's attention module, e.g. model.layers.3.self_attn."""
    try:
        family = family_for(model.config.to_dict())
    except EffattnError:  # a native output of a conversion (e.g. MLA's DeepseekV3) keeps the Llama-style layout
        from ..families import Family

        family = Family("native", ())
    attn_module = family.q_proj.rsplit(".", 1)[0]  # "self_attn.q_proj" -> "self_attn"
    layer = re.escape(family.layer).replace(r"\{layer\}", r"\d+")
    return re.compile(rf"(^|\.){layer}{re.escape(attn_module)}\.")


def select_trainable(model: torch.nn.Module, train: Train) -> torch.nn.Module:
    """Set requires_grad per `train.params`; returns the model to train (peft-wrapped for lora)."""
    from ..attention.mla import SCALED_MODULES, is_mla

    mla = is_mla(model)
    if mla and train.precision == "fp16":
        raise EffattnError("train.precision=fp16 on an MLA student: its latent projection holds values near 1e-9, "
                           "below float16's range", "use train.precision=bf16 (float32's range) or fp32")
    if train.mla_latent == "scaled" and not mla:
        raise EffattnError("train.mla_latent=scaled applies to MLA students only, and this one is not",
                           "drop train.mla_latent (or convert the student --to mla)")
    if train.params == "all":
        model.requires_grad_(True)
        _freeze_mla(model, mla, scale_latent=train.mla_latent == "scaled")
        return model
    if train.params == "lora":
        if mla and set(train.lora.target_modules) & set(SCALED_MODULES):
            raise EffattnError(f"train.lora.target_modules includes {sorted(set(train.lora.target_modules) & set(SCALED_MODULES))}, "
                               "which an MLA model keeps at the scale that holds its latent norm linear (an adapter "
                               "would not be)", "target q_proj, kv_b_proj, o_proj and the MLP instead")
        if tied := _tied_targets(model, train.lora.target_modules):
            raise EffattnError(f"train.lora.target_modules includes {', '.join(tied)}, whose weight the model ties to "
                               "its other embedding (tie_word_embeddings): merging the adapter would change both, and "
                               "the model written would not be the one trained", f"leave {', '.join(tied)} out, or "
                               "train the embeddings with train.params=all")
        _check_lora_targets(model, train.lora)
        model = _with_lora(model, train)
    else:
        pattern = _attention_pattern(model)
        for name, p in model.named_parameters():
            p.requires_grad_(bool(pattern.search(name)))
    for module in conversion_modules(model):
        module.requires_grad_(True)
    for param in conversion_parameters(model):
        param.requires_grad_(True)
    _freeze_mla(model, mla, scale_latent=train.params == "attention" and train.mla_latent == "scaled")
    if not any(p.requires_grad for p in model.parameters()):
        raise EffattnError(f"train.params={train.params} selects no parameters of this model",
                           "use train.params=all, or check train.lora.target_modules")
    return model


def _freeze_mla(model: torch.nn.Module, mla: bool, scale_latent: bool) -> None:
    """An MLA model's latent norm and low-rank query path stay as converted; its latent projection trains
    (`scale_latent`: scaled latent rows through a row-scale parametrization) or stays too (attention/mla.py)."""
    if not mla:
        return
    from ..attention.mla import frozen_in_training, scale_latent_rows, scaled_module

    if scale_latent:
        scale_latent_rows(model)
    for name, p in model.named_parameters():
        if frozen_in_training(name) or (scaled_module(name) and not scale_latent):
            p.requires_grad_(False)


def _tied_targets(model: torch.nn.Module, targets: list[str]) -> list[str]:
    """The LoRA targets (peft's rule: a module whose name is the target or ends in .target) that are a tied
    input or output embedding."""
    if not getattr(model.config, "tie_word_embeddings", False):
        return []
    embeddings = (model.get_input_embeddings(), model.get_output_embeddings())
    tied = [name for name, m in model.named_modules() if any(m is e for e in embeddings if e is not None)]
    return [t for t in targets if any(n == t or n.endswith("." + t) for n in tied)]


def _check_lora_targets(model: torch.nn.Module, lora) -> None:
    """Every target names modules of the model (peft's rule: the name, or a name ending in .target): peft
    refuses a list none of whose entries match, and silently skips a misspelt one beside right ones. A rank past
    every adapted layer's own is refused: each adapter would hold more than its layer and add nothing."""
    import difflib

    names = [n for n, _ in model.named_modules() if n]
    linear = sorted({n.rsplit(".", 1)[-1] for n, m in model.named_modules() if isinstance(m, torch.nn.Linear)})
    for target in lora.target_modules:
        if not any(n == target or n.endswith("." + target) for n in names):
            close = difflib.get_close_matches(target, linear, n=1)
            raise EffattnError(f"train.lora.target_modules: {target!r} names no module of this model",
                               (f"did you mean {close[0]!r}? " if close else "") +
                               f"its linear layers are named {', '.join(linear)}")
    widths = [min(m.in_features, m.out_features) for n, m in model.named_modules() if isinstance(m, torch.nn.Linear)
              and any(n == t or n.endswith("." + t) for t in lora.target_modules)]
    if widths and lora.r > max(widths):
        raise EffattnError(f"train.lora.r={lora.r} is more than the rank of every layer it adapts (at most "
                           f"{max(widths)}): each adapter would hold more than its layer",
                           f"use train.lora.r={max(widths)} or less, or train.params=all")


def _with_lora(model: torch.nn.Module, train: Train) -> torch.nn.Module:
    from peft import LoraConfig, get_peft_model

    lora = train.lora
    config = LoraConfig(r=lora.r, lora_alpha=lora.alpha, lora_dropout=lora.dropout,
                        target_modules=list(lora.target_modules), bias="none")
    try:
        with warnings.catch_warnings():  # peft calls a transformers API deprecated in 5.x
            warnings.simplefilter("ignore", FutureWarning)
            return get_peft_model(model, config)
    except ValueError as exc:
        linear = sorted({n.rsplit(".", 1)[-1] for n, m in model.named_modules() if isinstance(m, torch.nn.Linear)})
        raise EffattnError(f"train.lora.target_modules={list(lora.target_modules)} do not match this model ({exc})",
                           f"its linear layers are named {', '.join(linear)}") from None


def native(model: torch.nn.Module) -> torch.nn.Module:
    """The plain transformers model to save: LoRA adapters merged into the weights, an MLA model's
    row-scale parametrizations folded back into its weights."""
    from peft import PeftModel

    from ..attention.mla import unscale_latent_rows

    model = model.merge_and_unload() if isinstance(model, PeftModel) else model
    unscale_latent_rows(model)
    return model


def count_params(model: torch.nn.Module) -> tuple[int, int]:
    """(trainable, total) parameters; `parameters()` counts tied tensors once."""
    params = list(model.parameters())
    return sum(p.numel() for p in params if p.requires_grad), sum(p.numel() for p in params)
