"""The conversion registry. Adding a conversion is one module and one line here."""

from __future__ import annotations

from ..errors import EffattnError, one_of
from .base import ConvertResult, Plan, convert, read_record
from .gqa import GQAConversion
from .vq import ReRoPEConversion, VQConversion

CONVERSIONS = {c.name: c for c in [GQAConversion(), ReRoPEConversion(), VQConversion()]}
ALIASES = {"mqa": ("gqa", {"kv_heads": 1}), "mha": ("gqa", {"kv_heads": "heads"})}


def get_conversion(name: str):
    if name not in CONVERSIONS:
        raise EffattnError(f"unknown conversion {name!r}", one_of(name, list(CONVERSIONS) + list(ALIASES)))
    return CONVERSIONS[name]


__all__ = ["CONVERSIONS", "ALIASES", "ConvertResult", "Plan", "convert", "get_conversion", "read_record"]
