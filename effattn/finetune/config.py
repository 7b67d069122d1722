"""Fine-tuning recipes: typed, frozen, validated YAML.

A recipe is a YAML file whose sections map onto the models below (`extra="forbid"` everywhere but
in `student.convert`, whose options pass through to `effattn.convert.convert`). Problems are
reported as one EffattnError naming each bad key by its dotted path, with the value and the fix:

    train.max_step: unknown key (did you mean 'max_steps'?)
    train.max_steps = 'many': Input should be a valid integer

Command-line overrides (`train.max_steps=50`) are applied to the raw mapping before validation, so
they get exactly the same checks and type coercion as the file.
"""

from __future__ import annotations

import copy
import re
from pathlib import Path
from typing import Any, Literal, Union, get_args, get_origin

import yaml
from pydantic import BaseModel, ConfigDict, Field, PrivateAttr, ValidationError, field_validator, model_validator

from ..convert.options import StrictModel
from ..errors import EffattnError, did_you_mean


class _Section(StrictModel):
    """A recipe section (StrictModel's rules)."""

    def changed(self, keys) -> list[str]:
        """The `keys` set away from their defaults."""
        fields = type(self).model_fields
        return [k for k in keys if getattr(self, k) != fields[k].get_default(call_default_factory=True)]

    def _unread(self, prefix: str, keys, why: str):
        """Refuse the `keys` set away from their defaults, which the section's other choices never read (`why`):
        a run would ignore them without a word. Defaults pass, so a recipe that spells them out (the built-in
        ones) can still switch (e.g. optimizer.name=sgd)."""
        if changed := self.changed(keys):
            raise ValueError(", ".join(f"{prefix}.{k} = {getattr(self, k)}" for k in changed) + f": {why}")
        return self


class ConvertStep(BaseModel):
    """Run a conversion first; every key but `to` is one of the conversion's options (`kv_heads`,
    `method`, `calib`, `calib_tokens`, ...), checked against its options model in `validate_recipe`."""

    model_config = ConfigDict(extra="allow", frozen=True)
    to: str

    def options(self) -> dict[str, Any]:
        return {k: v for k, v in (self.model_extra or {}).items() if v is not None}


class Student(_Section):
    model: str = Field(description="a converted folder, or the model to convert when `convert` is set")
    convert: ConvertStep | None = None


class Teacher(_Section):
    model: str | None = Field(None, description="default: the model the student was converted from (effattn.json)")


class Data(_Section):
    sources: list[str] = Field(["mix"], description="built-in corpora, text files/folders, *.jsonl, or hf:ORG/NAME[/CONFIG][:SPLIT]")
    text_key: str = "text"  # the field holding the text in JSONL and hub datasets
    seq_len: int = Field(256, ge=2)
    bos: float = Field(0.0, ge=0, le=1, description="share of training blocks read after the tokenizer's BOS token "
                                                    "(EOS where it has none), spread evenly over the blocks: 0 (the "
                                                    "default) starts every block mid-text, 1 every block after BOS; a "
                                                    "block so marked keeps its length and loses its last token")
    positions: int = Field(0, ge=0, description="the context the blocks' positions spread over: each micro-batch "
                                                "reads its blocks from a start position drawn evenly from 0 to "
                                                "positions - seq_len (teacher and student alike), so that a model "
                                                "whose new parameters see rotated queries and keys (linear "
                                                "attention's maps) keeps every position it was converted for; 0 (the "
                                                "default): every block from position 0")

    @model_validator(mode="after")
    def _positions_hold_a_block(self):
        if 0 < self.positions < self.seq_len:
            raise ValueError(f"data.positions ({self.positions}) is shorter than a block (data.seq_len "
                             f"{self.seq_len}): use 0 (every block from position 0) or at least {self.seq_len}")
        return self

    @field_validator("sources", mode="before")
    @classmethod
    def _one_or_many(cls, v):
        return [v] if isinstance(v, str) else v

    @field_validator("sources")
    @classmethod
    def _not_empty(cls, v):
        if not v:
            raise ValueError("list at least one training source")
        if twice := sorted({s for s in v if v.count(s) > 1}):
            raise ValueError(f"lists {', '.join(map(repr, twice))} twice (each source is read once)")
        return v


class Lora(_Section):
    r: int = Field(16, ge=1)
    alpha: float = Field(32.0, gt=0)
    dropout: float = Field(0.0, ge=0, lt=1)
    target_modules: list[str] = ["q_proj", "k_proj", "v_proj", "o_proj"]


class Train(_Section):
    batch_size: int = Field(4, ge=1, description="sequences per process per micro-batch")
    grad_accum: int = Field(1, ge=1, description="micro-batches per optimizer step")
    max_steps: int | None = Field(None, ge=1, description="optimizer steps (or set max_tokens)")
    max_tokens: int | None = Field(None, ge=1, description="training tokens, rounded up to whole steps")
    params: Literal["all", "attention", "lora"] = "all"
    lora: Lora = Lora()
    precision: Literal["fp32", "bf16", "fp16"] = "fp32"
    seed: int = 0
    max_grad_norm: float | None = Field(1.0, gt=0)
    deterministic: bool = Field(False, description="torch's deterministic algorithms only: a resumed run equals an "
                                                   "uninterrupted one to the bit on GPUs too (CPU runs already do); slower")
    mla_latent: Literal["frozen", "scaled"] = Field(
        "frozen", description="MLA students: kv_a_proj_with_mqa (the latent rows, scaled ~1e-9 for the linear latent "
                              "norm) stays as converted (frozen: measured in BENCHMARKS.md) or trains through a "
                              "row-scale parametrization (scaled); params all/attention only")

    @model_validator(mode="after")
    def _steps_or_tokens(self):
        if (self.max_steps is None) == (self.max_tokens is None):
            raise ValueError("set exactly one of train.max_steps and train.max_tokens")
        if self.params != "lora":
            self.lora._unread("train.lora", Lora.model_fields, f"train.params is {self.params}, not lora")
        return self


class Optimizer(_Section):
    name: Literal["adamw", "sgd"] = "adamw"
    lr: float = Field(1e-4, gt=0)
    weight_decay: float = Field(0.0, ge=0)
    betas: tuple[float, float] = (0.9, 0.95)  # adamw
    eps: float = Field(1e-8, gt=0)  # adamw
    momentum: float = Field(0.9, ge=0)  # sgd

    @field_validator("betas")
    @classmethod
    def _betas_in_range(cls, v):
        if not all(0 <= b < 1 for b in v):
            raise ValueError("each beta must be in [0, 1), e.g. [0.9, 0.95]")
        return v

    @model_validator(mode="after")
    def _read_by_the_optimizer(self):
        unread = {"sgd": ("betas", "eps"), "adamw": ("momentum",)}[self.name]
        return self._unread("optimizer", unread, f"optimizer.name {self.name} does not read it")


class Schedule(_Section):
    name: Literal["cosine", "linear", "constant"] = "cosine"
    warmup_steps: int = Field(0, ge=0)
    min_lr_ratio: float = Field(0.1, ge=0, le=1, description="final lr / peak lr for cosine and linear")

    @model_validator(mode="after")
    def _read_by_the_schedule(self):
        return self._unread("schedule", ("min_lr_ratio",), "a constant schedule does not read it") \
            if self.name == "constant" else self


class Loss(_Section):
    kl: float = Field(1.0, ge=0, description="weight of KL(teacher || student) on the logits")
    temperature: float = Field(1.0, gt=0)
    ce: float = Field(0.0, ge=0, description="weight of next-token cross-entropy")
    attn_out: float = Field(0.0, ge=0, description="weight of the per-layer attention-output error against the teacher")
    aux_weight: float = Field(1.0, ge=0, description="weight of conversion-specific terms (effattn_aux_loss)")
    chunk_tokens: int = Field(0, ge=0, description="compute the logits, KL and CE this many tokens at a time from "
                                                   "the final hidden states, recomputing each chunk in the backward "
                                                   "pass, so memory does not grow with batch x seq_len x vocab (0: "
                                                   "the whole micro-batch at once)")

    @model_validator(mode="after")
    def _something_to_learn(self):
        if self.kl == 0 and self.ce == 0 and self.attn_out == 0:
            raise ValueError("loss.kl, loss.ce and loss.attn_out are all 0; give at least one a positive weight")
        if self.kl == 0:
            self._unread("loss", ("temperature",), "it scales the KL term, whose weight loss.kl is 0")
        return self


class Eval(_Section):
    every: int = Field(0, ge=0, description="evaluate every N steps (0: only before and after training)")
    corpora: list[str] = ["shakespeare", "britannica"]
    tokens: int = Field(4096, ge=2, description="tokens per corpus")
    seq_len: int = Field(512, ge=2)
    batch_size: int = Field(2, ge=1)
    bos: bool = Field(False, description="read every block after the tokenizer's BOS token (EOS where it has none), "
                                         "as `effattn eval --bos` does; the same next tokens are scored")

    @field_validator("corpora", mode="before")
    @classmethod
    def _one_or_many(cls, v):
        return [v] if isinstance(v, str) else v


class Checkpoint(_Section):
    every: int = Field(0, ge=0, description="save a resumable checkpoint every N steps (0: only at the end)")
    keep: int = Field(2, ge=1, description="checkpoints kept; older ones are deleted")


class Distributed(_Section):
    """How a run of several processes divides the work (torchrun / accelerate launch; finetune/distributed.py)."""

    strategy: Literal["auto", "ddp", "fsdp"] = Field(
        "auto", description="ddp: every process holds the whole student, teacher and optimizer state; fsdp: FSDP2 "
                            "(accelerate's FSDP plugin) shards the student's parameters, gradients and optimizer state "
                            "and the frozen teacher across processes; auto: fsdp when more than one process runs and "
                            "the student has at least fsdp_min_params parameters, else ddp")
    fsdp_min_params: int = Field(1_000_000_000, ge=0, description="auto: the student size from which fsdp runs")
    activation_checkpointing: bool = Field(False, description="recompute each decoder layer's activations in the backward "
                                                              "pass instead of keeping them (any strategy)")
    reshard_after_forward: bool = Field(True, description="fsdp: free each layer's gathered parameters after its forward "
                                                          "and gather them again for the backward (false: keep them, "
                                                          "more memory, fewer all-gathers)")
    cpu_offload: bool = Field(False, description="fsdp: keep the sharded parameters, gradients and optimizer state in "
                                                 "host memory, the optimizer step on the CPU (GPUs only)")
    shard_teacher: bool = Field(True, description="fsdp: shard the frozen teacher too (false: every process holds all of it)")
    wrap: list[str] | None = Field(None, description="fsdp: module classes sharded as one unit each (default: the "
                                                      "model's decoder layers, its _no_split_modules)")

    @model_validator(mode="after")
    def _read_by_the_strategy(self):
        if self.strategy == "ddp":
            self._unread("distributed", FSDP_ONLY, "distributed.strategy is ddp, and only fsdp reads it")
        if self.strategy != "auto":
            self._unread("distributed", ("fsdp_min_params",), f"only strategy auto reads it (it is {self.strategy})")
        return self


FSDP_ONLY = ("reshard_after_forward", "cpu_offload", "shard_teacher", "wrap")


class Recipe(_Section):
    description: str = ""
    student: Student
    teacher: Teacher = Teacher()
    data: Data = Data()
    train: Train
    optimizer: Optimizer = Optimizer()
    schedule: Schedule = Schedule()
    loss: Loss = Loss()
    eval: Eval = Eval()
    checkpoint: Checkpoint = Checkpoint()
    distributed: Distributed = Distributed()
    output: str | None = Field(None, description="output folder (-o overrides)")
    _source: Path | None = PrivateAttr(None)  # the recipe file it was read from, if any (load_recipe)

    @field_validator("output")
    @classmethod
    def _output_named(cls, v):
        if v is not None and not v.strip():
            raise ValueError("the output folder is empty: name a folder (an empty path would mean the current one)")
        return v

    def to_dict(self) -> dict[str, Any]:
        return self.model_dump(mode="json")

    def to_yaml(self) -> str:
        return yaml.safe_dump(self.to_dict(), sort_keys=False, default_flow_style=None, width=100)


# Sections that change what the run writes or when, not the weights it trains: a checkpoint can be
# resumed with different values here.
NOT_TRAINING = ("description", "output", "checkpoint", "eval")


def recipe_diff(old: dict[str, Any], new: dict[str, Any], prefix: str = "") -> list[str]:
    """'key.path: old -> new' for every training-relevant leaf that differs."""
    diffs = []
    for key in sorted(set(old) | set(new)):
        if not prefix and key in NOT_TRAINING:
            continue
        a, b = old.get(key), new.get(key)
        if isinstance(a, dict) and isinstance(b, dict):
            diffs += recipe_diff(a, b, f"{prefix}{key}.")
        elif a != b:
            diffs.append(f"{prefix}{key}: {a!r} -> {b!r}")
    return diffs


# -- reading and overriding ----------------------------------------------------------------------

class DuplicateKey(Exception):
    def __init__(self, key: str, line: int):
        super().__init__(key)
        self.key, self.line = key, line


class _UniqueKeyLoader(yaml.SafeLoader):
    """yaml.safe_load, but a key given twice in one mapping is an error (PyYAML keeps the last)."""

    def construct_mapping(self, node, deep=False):
        seen = set()
        for key_node, _ in node.value:
            key = self.construct_object(key_node, deep=deep)
            if key in seen:
                raise DuplicateKey(str(key), key_node.start_mark.line + 1)
            seen.add(key)
        return super().construct_mapping(node, deep=deep)


def read_yaml(path: str | Path) -> dict[str, Any]:
    path = Path(path).expanduser()
    if not path.is_file():
        raise EffattnError(f"recipe file {path} not found",
                           "pass a YAML file or a built-in recipe name (`effattn recipes ls`)")
    try:
        data = yaml.load(path.read_text(encoding="utf-8"), Loader=_UniqueKeyLoader)
    except DuplicateKey as exc:
        raise EffattnError(f"{path} line {exc.line}: key {exc.key!r} appears twice in one section (the second "
                           "would silently replace the first)", "merge the two into one") from None
    except yaml.YAMLError as exc:
        where = getattr(exc, "problem_mark", None)
        line = f" at line {where.line + 1}" if where else ""
        raise EffattnError(f"{path} is not valid YAML{line} ({getattr(exc, 'problem', exc)})",
                           "fix the syntax; `effattn recipes cp heal-gqa FILE` writes a valid example") from None
    except UnicodeDecodeError as exc:
        raise EffattnError(f"recipe file {path} is not UTF-8 text ({exc.reason} at byte {exc.start})",
                           "pass a YAML recipe saved as UTF-8") from None
    if not isinstance(data, dict):
        raise EffattnError(f"{path} does not hold a mapping of recipe sections (got {type(data).__name__})",
                           "start from `effattn recipes cp heal-gqa FILE`")
    return data


def apply_overrides(data: dict[str, Any], overrides: list[str]) -> dict[str, Any]:
    """A copy of `data` with `a.b.c=VALUE` overrides applied; VALUE is parsed as YAML (50, 1e-4, [a, b], null)."""
    data = copy.deepcopy(data)
    for item in overrides:
        key, sep, raw = item.partition("=")
        if not sep or not key or not re.fullmatch(r"[A-Za-z_][\w-]*(\.[A-Za-z_][\w-]*)*", key):
            raise EffattnError(f"override {item!r} is not KEY=VALUE with a dotted key",
                               "write e.g. train.max_steps=50 or data.sources=[mix,notes.txt]")
        try:
            value = yaml.safe_load(raw) if raw.strip() else ""
        except yaml.YAMLError:
            value = raw
        node = data
        parts = key.split(".")
        for i, part in enumerate(parts[:-1]):
            child = node.get(part)
            if child is None:
                child = node[part] = {}
            if not isinstance(child, dict):
                raise EffattnError(f"override {item!r}: {'.'.join(parts[: i + 1])} is a value ({child!r}), not a section",
                                   f"set {'.'.join(parts[: i + 1])}=VALUE instead")
            node = child
        node[parts[-1]] = value
    return data


def validate_recipe(data: dict[str, Any], source: str = "recipe") -> Recipe:
    try:
        recipe = Recipe.model_validate(data)
    except ValidationError as exc:
        problems = [_explain(e) for e in exc.errors()]
        raise EffattnError(f"{source} is invalid: " + "; ".join(problems),
                           "fix these keys (`effattn recipes cp heal-gqa FILE` shows every section)") from None
    step = recipe.student.convert
    if step is not None:  # the conversion's own options model checks its options, as on the command line
        from ..convert.options import recipe_key, resolve

        try:
            resolve(step.to, step.options(), name=recipe_key("student.convert."), what="student.convert.to")
        except EffattnError as exc:
            raise EffattnError(f"{source} is invalid: {exc.what}", exc.fix) from None
    return recipe


def load_recipe(recipe: str | Path, overrides: list[str] | None = None, *, output: str | Path | None = None) -> Recipe:
    """Read a recipe file or built-in recipe name, apply overrides and `output`, validate."""
    from .recipes import recipe_path

    path = recipe_path(str(recipe))
    data = apply_overrides(read_yaml(path), list(overrides or []))
    if output is not None:
        data["output"] = str(output)
    resolved = validate_recipe(data, source=str(recipe))
    resolved._source = path.expanduser().absolute()
    return resolved


# -- error messages ------------------------------------------------------------------------------

def _explain(error: dict[str, Any]) -> str:
    loc = [str(p) for p in error["loc"]]
    path = ".".join(loc) or "recipe"
    kind = error["type"]
    if kind == "extra_forbidden":
        valid = _fields_at(loc[:-1])
        hint = did_you_mean(loc[-1], valid) or (f" (valid: {', '.join(valid)})" if valid else "")
        return f"{path}: unknown key{hint}"
    if kind == "missing":
        return f"{path}: required key is missing"
    msg = error["msg"].removeprefix("Value error, ")
    if kind == "literal_error":
        choices = re.findall(r"'([^']*)'", error.get("ctx", {}).get("expected", ""))
        msg += did_you_mean(str(error.get("input")), choices)
    if kind in ("value_error", "assertion_error") and not loc:
        return msg
    return f"{path} = {error.get('input')!r}: {msg}" if "input" in error and not isinstance(error["input"], dict) else f"{path}: {msg}"


def _fields_at(loc: list[str]) -> list[str]:
    """The valid keys of the section at `loc` (e.g. ['train'] -> Train's fields)."""
    model: Any = Recipe
    for part in loc:
        field = getattr(model, "model_fields", {}).get(part)
        if field is None:
            return []
        model = _model_in(field.annotation)
        if model is None:
            return []
    return list(getattr(model, "model_fields", {}))


def _model_in(annotation) -> type[BaseModel] | None:
    if isinstance(annotation, type) and issubclass(annotation, BaseModel):
        return annotation
    if get_origin(annotation) in (Union, type(int | None)):
        for arg in get_args(annotation):
            found = _model_in(arg)
            if found:
                return found
    return None
