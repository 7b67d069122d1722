"""A conversion's options: one pydantic model per conversion, the single source of truth.

Each conversion declares `Options`, a subclass of `ConversionOptions` whose fields carry the name,
type, default, help (the field's description) and checks of every option. Everything else reads it:
the driver validates with it, the CLI builds `convert`'s and `vq-init`'s flags from the fields, a
recipe's `student.convert` is checked against it when the recipe is loaded, and
`effattn convert --to NAME --help` lists it.

Errors name the option the way the user wrote it: `--kv-heads` on the command line,
`student.convert.kv_heads` in a recipe.
"""

from __future__ import annotations

import re
import types
from collections.abc import Callable
from typing import Any, Literal, Union, get_args, get_origin

from pydantic import BaseModel, ConfigDict, ValidationError, field_validator

from ..errors import EffattnError, did_you_mean, one_of


def is_numeric(annotation) -> bool:
    """int or float, alone or in a union with None (not bool, which is an int subclass)."""
    args = get_args(annotation) if get_origin(annotation) in (Union, type(int | None)) else (annotation,)
    return any(a in (int, float) for a in args) and bool not in args


class StrictModel(BaseModel):
    """Settings read from a command line or a recipe: unknown keys refused, values frozen, no inf or NaN, and no
    boolean for a number (`train.max_steps: true` or `student.convert.kv_heads: true` is a typo, not 1: pydantic's
    lax mode would read a boolean as 1 or 0)."""

    model_config = ConfigDict(extra="forbid", frozen=True, allow_inf_nan=False)

    @field_validator("*", mode="before")
    @classmethod
    def _no_booleans_for_numbers(cls, value, info):
        if isinstance(value, bool) and is_numeric(cls.model_fields[info.field_name].annotation):
            raise ValueError("a number is expected, not a boolean")
        return value


class ConversionOptions(StrictModel):
    """Base of every conversion's options (StrictModel's rules)."""

    def given(self) -> set[str]:
        """The options the user set (as opposed to defaults)."""
        return set(self.model_fields_set)


def flag(key: str) -> str:
    return "--" + key.replace("_", "-")


def recipe_key(prefix: str) -> Callable[[str], str]:
    return lambda key: f"{prefix}{key}"


def in_recipe_terms(exc, prefix: str = "student.convert."):
    """The EffattnError `exc` of a conversion (which names command-line flags: `--kv-heads is required for --to
    gqa`) with each flag of a conversion option, and --to, named by its recipe key (`student.convert.kv_heads`)."""
    from . import CONVERSIONS
    from ..errors import EffattnError

    keys = {flag(k): f"{prefix}{k}" for c in CONVERSIONS.values() for k in c.Options.model_fields}
    keys["--to"] = f"{prefix}to"

    def swap(text: str | None) -> str | None:
        return None if text is None else re.sub(r"--[a-z][a-z0-9-]*", lambda m: keys.get(m.group(0), m.group(0)), text)

    return EffattnError(swap(exc.what), swap(exc.fix))


def resolve(to: str, values: dict[str, Any], *, name: Callable[[str], str] = flag, what: str = "--to"):
    """(conversion, its validated Options) for conversion name or alias `to` and the given values.

    `values` may hold None for options not given (the CLI passes every flag). An alias's presets
    (`mqa` = gqa with kv_heads 1) are applied; a given value that contradicts one is an error.
    """
    from . import ALIASES, CONVERSIONS, get_conversion

    values = {k: v for k, v in values.items() if v is not None}
    asked = to
    preset: dict[str, Any] = {}
    if to in ALIASES:
        to, preset = ALIASES[to]
        values = preset | values  # a given value is validated first, then held to the preset (below)
    conversion = get_conversion(to)
    fields = conversion.Options.model_fields
    for key in values:
        if key in fields:
            continue
        users = [c for c, conv in CONVERSIONS.items() if key in conv.Options.model_fields]
        if users:
            raise EffattnError(f"{name(key)} does not apply to {asked}", f"drop it ({name(key)} is for {', '.join(users)})")
        raise EffattnError(f"{name(key)}: unknown option of {asked}{did_you_mean(key, fields)}",
                           f"valid: {', '.join(name(k) for k in fields)}")
    try:
        opts = conversion.Options.model_validate(values)
    except ValidationError as exc:
        raise EffattnError("; ".join(_explain(e, name) for e in exc.errors()),
                           f"`effattn convert --to {asked} --help` lists the options of {asked}") from None
    for key, value in preset.items():
        if getattr(opts, key) != value:
            raise EffattnError(f"{what} {asked} fixes {name(key)} to {value}, but {getattr(opts, key)} was given",
                               f"drop {name(key)} or use {what} {to}")
    return conversion, opts


def _explain(error: dict[str, Any], name: Callable[[str], str]) -> str:
    key = str(error["loc"][0]) if error["loc"] else ""
    value, kind, ctx = error.get("input"), error["type"], error.get("ctx") or {}
    if kind in ("greater_than_equal", "greater_than", "less_than_equal", "less_than"):
        words = {"greater_than_equal": ">=", "greater_than": ">", "less_than_equal": "<=", "less_than": "<"}[kind]
        bound = next(iter(ctx.values()))
        noun = "an integer" if isinstance(bound, int) and not isinstance(bound, bool) else "a number"
        return f"{name(key)} must be {noun} {words} {bound}, got {value!r}"
    if kind == "literal_error":
        choices = re.findall(r"'([^']*)'", ctx.get("expected", ""))
        return f"unknown {name(key)} {value!r} ({one_of(str(value), choices)})"
    msg = error["msg"].removeprefix("Value error, ")
    return f"{name(key)} = {value!r}: {msg}" if key else msg


# -- describing options (CLI flags, help) -----------------------------------------------------

def cli_type(annotation) -> type:
    """The type a command-line flag parses for a field annotation (int | None -> int, Literal -> str)."""
    if get_origin(annotation) is Literal:
        return type(get_args(annotation)[0])
    if get_origin(annotation) in (Union, types.UnionType):
        args = [a for a in get_args(annotation) if a is not type(None)]
        for preferred in (bool, int, float):
            if preferred in args:
                return preferred
        return cli_type(args[0])
    return annotation if isinstance(annotation, type) else str


def choices_of(annotation) -> list[str]:
    if get_origin(annotation) is Literal:
        return [str(a) for a in get_args(annotation)]
    if get_origin(annotation) in (Union, types.UnionType):
        return [c for a in get_args(annotation) for c in choices_of(a)]
    return []


def describe(options: type[ConversionOptions]) -> list[dict[str, Any]]:
    """One row per option: name, flag, type, default, help."""
    rows = []
    for key, field in options.model_fields.items():
        choices = choices_of(field.annotation)
        rows.append({"name": key, "flag": flag(key), "type": " | ".join(choices) if choices else cli_type(field.annotation).__name__,
                     "default": field.default, "help": field.description or ""})
    return rows
