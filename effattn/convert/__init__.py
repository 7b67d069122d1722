"""The conversion registry. Adding a conversion is one module and one line here.

A conversion declares everything the rest of effattn needs (base.py's `Conversion`): its name,
aliases (other names with preset options, e.g. mqa = gqa with kv_heads 1), `Options` (options.py),
`plan`, `run`, optionally `targets` (the line `effattn inspect` shows; else its description), and
`model`, the ModelSpec of its own model class where no native architecture fits (models.py), and
optionally `measure_contexts`, the block lengths its card is measured at (default 512; a conversion
whose cache pays off only at long context, like VQ, declares longer ones).
`register_conversion` adds one at run time (a plugin, or a test).
"""

from __future__ import annotations

from ..errors import EffattnError, one_of
from .base import ConvertResult, Plan, convert, read_record
from .gqa import GQAConversion
from .linear import LinearConversion
from .mla import MLAConversion
from .rope_scaling import RopeScalingConversion
from .sparse import SparseConversion
from .swa import SWAConversion
from .vq import ReRoPEConversion, VQConversion

CONVERSIONS: dict = {}
ALIASES: dict[str, tuple[str, dict]] = {}  # alias -> (conversion, preset options)


def register_conversion(conversion) -> None:
    """Add `conversion` (and its aliases) to the registry, and its model class if it declares one."""
    CONVERSIONS[conversion.name] = conversion
    for alias, preset in getattr(conversion, "aliases", {}).items():
        ALIASES[alias] = (conversion.name, preset)
    if getattr(conversion, "model", None) is not None:
        from ..models import MODEL_SPECS, register_model

        if conversion.model.model_type not in MODEL_SPECS:
            register_model(conversion.model)


# Conversions users ask for that effattn refuses, with the measured reason (BENCHMARKS.md)
REFUSED = {
    "alibi": ("--to alibi is refused: ALiBi replaces RoPE, which every layer of a RoPE model was trained with. "
              "Measured on the built-in model at 512 tokens: perplexity 32.1 -> 417 on shakespeare and 48.8 -> 444 "
              "on britannica with ALiBi in place of RoPE (217 and 277 with RoPE simply removed), so recovering "
              "is pretraining, not a heal",
              "to extend a RoPE model's context use --to rope-scaling (e.g. --rope-type yarn) or --to rerope"),
}


def get_conversion(name: str):
    if name in REFUSED:
        raise EffattnError(*REFUSED[name])
    if name not in CONVERSIONS:
        raise EffattnError(f"unknown conversion {name!r}", one_of(name, list(CONVERSIONS) + list(ALIASES)))
    return CONVERSIONS[name]


for _conversion in (GQAConversion(), ReRoPEConversion(), VQConversion(), RopeScalingConversion(), SWAConversion(),
                    SparseConversion(), MLAConversion(), LinearConversion()):
    register_conversion(_conversion)

__all__ = ["CONVERSIONS", "ALIASES", "ConvertResult", "Plan", "convert", "get_conversion", "read_record",
           "register_conversion"]
