"""Local refinement: a few optimizer steps on one converted layer, fitting the original model.

After a layer's closed-form initialisation (head merging, o_proj refit, ...), its new attention
parameters are trained on the calibration activations of that layer alone. Two targets:

  * `attention`: the converted attention's output matches the original attention's output on the
    same inputs x (the converted model's activations):
        min_θ  Σ ‖attn_θ(norm(x)) − attn_orig(norm(x))‖² / Σ ‖attn_orig(norm(x))‖²
    This is the attention-transfer stage of LoLCATs (Zhang et al. 2024, Sec. 3.1: "train the
    linear attention to match the softmax attention's outputs"), done one layer at a time.
  * `stream`: the whole converted layer on x matches the original layer on the original model's own
    activations x₀ at that depth (x₀ runs through the original layers alongside x):
        min_θ  Σ ‖layer_θ(x) − layer_orig(x₀)‖² / Σ ‖layer_orig(x₀) − x₀‖²
    so the attention parameters also absorb the error the layers below left in x.

Only the layer being converted is in memory, with its inputs x [N, T, D] (and x₀ for `stream`).
The loss is a relative squared error, so its value reads as the fraction of the fitted quantity's
energy that is wrong.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Annotated, Any, ClassVar, Literal

import torch
from pydantic import AfterValidator, Field

from ..resources import DEVICE_NAME, check_device
from .calibrate import batches, rows_of
from .options import ConversionOptions

Target = Literal["attention", "stream"]
Schedule = Literal["constant", "cosine"]


@dataclass(frozen=True)
class RefineSettings:
    steps: int = 0  # optimizer steps per layer; 0 = off
    lr: float = 1e-4  # Adam's learning rate
    target: Target = "attention"
    schedule: Schedule = "constant"  # the learning rate over the steps: constant, or a cosine decay to 0
    batch_size: int = 2  # calibration sequences per step
    seed: int = 0
    device: str = "cpu"  # where the steps run (cpu, cuda, cuda:N); the walk itself stays on the CPU

    @property
    def steps_words(self) -> str:
        """'30 Adam steps per layer at lr 0.0003' (+ ', cosine decay', + ' on cuda'), for a plan's summary."""
        return (f"{self.steps} Adam steps per layer at lr {self.lr:g}" + (", cosine decay" if self.schedule == "cosine" else "")
                + (f" on {self.device} (not in the time estimate)" if self.device != "cpu" else ""))

    def summary(self, trained: str, tail: str = " (--refine-steps 0: off)") -> str:
        """A plan's refinement row: the steps, what they train (`trained`), what they fit, and `tail`."""
        return f"{self.steps_words} on {trained}, fitting the {TARGET_WORDS[self.target]}{tail}"

    def record(self) -> dict:
        """The settings as a conversion's record states them (lr, target, schedule and device only when
        refinement runs; the device only when it is not the CPU)."""
        on = bool(self.steps)
        return {"refine_steps": self.steps, "refine_lr": self.lr if on else None, "refine_target": self.target if on else None,
                "refine_schedule": self.schedule if on else None,
                **({"refine_device": self.device} if on and self.device != "cpu" else {})}


# What each target fits, in a plan's summary.
TARGET_WORDS = {"attention": "original attention's output on the same inputs",
                "stream": "original model's activations after the layer"}


# The options' types carry their checks, so a conversion that redeclares a field (its own default or
# help) keeps them: `refine_steps: Steps = Field(30, description=...)`.
Steps = Annotated[int, Field(ge=0)]
LearningRate = Annotated[float, Field(gt=0)]


def _device(value: str) -> str:
    if value != "auto" and not DEVICE_NAME.fullmatch(value):
        raise ValueError(f"must be auto, cpu, cuda or cuda:N, got {value!r}")
    return value


Device = Annotated[str, AfterValidator(_device)]


class RefineOptions(ConversionOptions):
    """The local-refinement options, declared once: a conversion that refines subclasses this and
    redeclares only what differs (a default, a description) with the types above.

    Pydantic lists a base's fields before the subclass's own; these are moved after them (and the
    validator rebuilt in that order, for `model_dump`), so every conversion's flags, `--help` and
    recorded command line read its own options first and refinement last."""

    refine_steps: Steps = Field(0, description="local refinement: optimizer steps per layer fitting the original "
                                               "attention output on the calibration activations (0: off)")
    refine_lr: LearningRate = Field(1e-4, description="learning rate of local refinement (Adam)")
    refine_target: Target = Field("attention", description="what refinement fits: attention (the original "
                                  "attention's output on the same inputs) or stream (the original model's "
                                  "activations after the layer)")
    refine_schedule: Schedule = Field("constant", description="learning rate of local refinement over the steps: "
                                      "constant, or cosine (decays to 0 by the last step)")
    refine_device: Device = Field("auto", description="where local refinement's steps run: cpu, cuda, cuda:N, or "
                                  "auto (cuda when torch sees a GPU, else cpu); the layer walk stays on the CPU")

    REFINE_FIELDS: ClassVar[tuple[str, ...]] = ("refine_steps", "refine_lr", "refine_target", "refine_schedule",
                                                "refine_device")

    @classmethod
    def __pydantic_init_subclass__(cls, **kwargs: Any) -> None:
        super().__pydantic_init_subclass__(**kwargs)
        fields = cls.__pydantic_fields__
        cls.__pydantic_fields__ = ({k: f for k, f in fields.items() if k not in cls.REFINE_FIELDS}
                                   | {k: fields[k] for k in cls.REFINE_FIELDS})
        cls.model_rebuild(force=True)

    def refine_settings(self) -> RefineSettings:
        """The settings, the device resolved (auto) and checked (a GPU torch sees) when refinement runs."""
        device = "cpu"
        if self.refine_steps:
            device = ("cuda" if torch.cuda.is_available() else "cpu") if self.refine_device == "auto" else \
                check_device(self.refine_device, flag="--refine-device")
        return RefineSettings(steps=self.refine_steps, lr=self.refine_lr, target=self.refine_target,
                              schedule=self.refine_schedule, device=device)


def refine_default(name: str, value: Any) -> Any:
    """A refinement field redeclared with another default only: `refine_lr: LearningRate =
    refine_default("refine_lr", 3e-4)` keeps RefineOptions' description (the annotation keeps its checks)."""
    return Field(value, description=RefineOptions.model_fields[name].description)


# A relative squared error this small is float32 rounding: the layer already matches what it would fit.
EXACT = 1e-9


def refine_flops(dims, settings: RefineSettings, tokens: int, seq_len: int, converted=None, hooks: bool = False) -> float:
    """Floating-point work the CPU does refining one layer (`dims`: resources.Dims) on `tokens`
    calibration tokens: none when the steps run on a GPU (`steps_words` says they are not estimated).
    `converted(tokens, seq_len)`: one forward of the converted attention block, for a conversion whose
    attention costs other than the original's (`dims.attention_flops`, the default)."""
    if not settings.steps or settings.device != "cpu":
        return 0.0
    stream = settings.target == "stream"
    mlp = dims.layer_flops(1, seq_len) - dims.attention_flops(1, seq_len)  # per token; only the stream target runs it
    attention = converted or dims.attention_flops

    def student(n: int) -> float:
        return attention(n, seq_len) + (n * mlp if stream else 0.0)

    def step(n: int) -> float:
        # the forward, then the backward: twice the attention's forward (the gradients of its inputs and of its
        # trained weights), once the frozen MLP's (its inputs' gradient only). SmolLM2's MQA: a step over its 30 layers
        # measured 4.3 s (36 steps took 69 s more than 20); this says 4.9 s, three forwards of the layer said 6.3 s.
        return 3 * attention(n, seq_len) + (2 * n * mlp if stream else 0.0)

    targets = (dims.layer_flops if stream else dims.attention_flops)(tokens, seq_len)
    # The error before and after, then the steps (forward + backward). With the stream target the targets are
    # the original model's activations after the layer and the error after the steps runs the converted layer
    # on x, so the layer walk carries both on (`outputs`) and runs neither again: the walk's own propagation,
    # which each conversion counts, is that error pass, unless the conversion propagates again (`hooks`).
    errors = 1 if stream and not hooks else 2
    return targets + errors * student(tokens) + settings.steps * step(settings.batch_size * seq_len)


def relative_error(out: torch.Tensor, targets: torch.Tensor, scale: torch.Tensor | None = None) -> float:
    """||out - targets||^2 / scale, by default / ||targets||^2: the error refinement reports."""
    scale = targets.pow(2).sum() if scale is None else scale
    return ((out - targets).pow(2).sum() / scale.clamp_min(1e-30)).item()


def attention_out(layer: torch.nn.Module, x: torch.Tensor, cos, sin, **kwargs) -> torch.Tensor:
    """A transformers decoder layer's attention output (before the residual) on layer inputs x [B, T, D];
    kwargs go to the attention's forward."""
    h = layer.input_layernorm(x)
    return layer.self_attn(hidden_states=h, position_embeddings=(cos, sin), attention_mask=None, **kwargs)[0]  # (B, T, D)


def layer_out(layer: torch.nn.Module, x: torch.Tensor, cos, sin, **kwargs) -> torch.Tensor:
    return layer(x, position_embeddings=(cos, sin), **kwargs)  # (B, T, D); the layer hands kwargs to its attention


def _map(fn, x: torch.Tensor, batch: int) -> torch.Tensor:
    """fn(x[rows], rows) over slices of `batch` rows, concatenated."""
    return torch.cat([fn(x[sl], sl) for sl in batches(x, batch)])


def refine_layer(converted: torch.nn.Module, original: torch.nn.Module, x: torch.Tensor, cos: torch.Tensor,
                 sin: torch.Tensor, settings: RefineSettings, x0: torch.Tensor | None = None,
                 trainable: list[str] | None = None,
                 converted_rope: tuple[torch.Tensor, torch.Tensor] | None = None,
                 forward_kwargs: dict[str, Any] | None = None, prepare=None,
                 outputs: dict[str, torch.Tensor] | None = None) -> dict[str, float | bool]:
    """Train `converted`'s attention parameters in place (see the module docstring); x [N, T, D] are its
    inputs, x0 the original model's activations at this depth (target `stream`). Returns the relative
    squared error over all of x before and after, and whether the steps ran: a layer that already matches
    (error at most EXACT) is left as it is.

    trainable: names of `converted.self_attn`'s parameters to train (default: the q/k/v/o
    projections' weights and biases; norms stay as they are).
    converted_rope: the converted layer's own (cos, sin) where its rotary dims differ from the original's.
    forward_kwargs: extra arguments of the converted layer's forward (e.g. VQ's `vq_far`); the original
    layer runs without them.
    prepare: for the `attention` target, `prepare(converted, x, cos, sin)` returns `predict(rows)`, the
    converted attention's output on x[rows] with autograd to the trainable parameters, where the conversion
    can compute it faster than a forward (linear attention with only its mix to fit precomputes what does
    not depend on it); the steps, picks, errors and optimizer are the same.

    outputs: with the stream target, filled with what the layer walk would compute next: "x0", the original
    layer's output on x0 (the targets), and "x", the converted layer's output on x after the steps (the last
    error pass), so that neither runs twice.

    Modules stay in the mode they come in (eval for every conversion here: a VQ layer in training mode
    would move its codebook by EMA at every forward). On a GPU (`settings.device`) both layers and the
    activations are moved there for the steps and the layers moved back after: the caller's tensors stay
    on the CPU.
    """
    if settings.device != "cpu":
        return _refine_on(settings.device, converted, original, x, cos, sin, settings, x0, trainable, converted_rope,
                          forward_kwargs, prepare, outputs)
    ccos, csin = converted_rope or (cos, sin)
    kwargs = forward_kwargs or {}
    batch = settings.batch_size
    with torch.no_grad():
        if settings.target == "stream":
            targets = _map(lambda xb, sl: layer_out(original, xb, *rows_of((cos, sin), sl)), x0, batch)  # (N, T, D)
            scale = (targets - x0).pow(2).sum()
        else:
            targets = _map(lambda xb, sl: attention_out(original, xb, *rows_of((cos, sin), sl)), x, batch)  # (N, T, D)
            scale = targets.pow(2).sum()
    forward = layer_out if settings.target == "stream" else attention_out
    fast = prepare(converted, x, ccos, csin) if prepare is not None and settings.target == "attention" else None

    def predict(rows: torch.Tensor) -> torch.Tensor:  # the converted layer's output on x[rows]
        return fast(rows) if fast is not None else forward(converted, x[rows], *rows_of((ccos, csin), rows), **kwargs)

    energy = scale / targets[..., 0].numel()  # per position: the loss below is a mean over positions

    keep = outputs is not None and settings.target == "stream"
    if keep:
        outputs["x0"] = targets

    def error() -> float:
        with torch.no_grad():
            out = torch.cat([predict(torch.arange(i, min(i + batch, len(x)))) for i in range(0, len(x), batch)])
            if keep:
                outputs["x"] = out
            return relative_error(out, targets, scale)

    before = error()
    if before <= EXACT:
        # Already exact (a merge of KV heads that were copies): nothing to fit, and Adam would scale the
        # rounding noise of a zero gradient up to full-size steps.
        return {"before": before, "after": before, "ran": False}
    attn = converted.self_attn
    params = dict(attn.named_parameters())
    names = trainable or [n for n in params if n.split(".")[0] in ("q_proj", "k_proj", "v_proj", "o_proj")]
    converted.requires_grad_(False)
    for n in names:
        params[n].requires_grad_(True)
    optimizer = torch.optim.Adam([params[n] for n in names], lr=settings.lr)
    schedule = (torch.optim.lr_scheduler.CosineAnnealingLR(optimizer, T_max=settings.steps)
                if settings.schedule == "cosine" else None)
    gen = torch.Generator().manual_seed(settings.seed)
    for _ in range(settings.steps):
        pick = torch.randint(len(x), (batch,), generator=gen)
        with torch.enable_grad():
            residual = predict(pick) - targets[pick]
            loss = residual.pow(2).sum(-1).mean() / energy
            loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        if schedule is not None:
            schedule.step()
    converted.requires_grad_(False)
    return {"before": before, "after": error(), "ran": True}


def _refine_on(device: str, converted, original, x, cos, sin, settings: RefineSettings, x0, trainable, converted_rope,
               forward_kwargs, prepare=None, outputs=None) -> dict[str, float | bool]:
    """refine_layer with its steps on `device`; the modules (and `outputs`) come back to the CPU whatever happens."""
    from dataclasses import replace

    def to(t):
        return t.to(device) if torch.is_tensor(t) else t

    try:
        converted.to(device)
        original.to(device)
        return refine_layer(converted, original, to(x), to(cos), to(sin), replace(settings, device="cpu"),
                            x0=to(x0), trainable=trainable,
                            converted_rope=tuple(to(t) for t in converted_rope) if converted_rope else None,
                            forward_kwargs={k: to(v) for k, v in (forward_kwargs or {}).items()}, prepare=prepare,
                            outputs=outputs)
    finally:
        for k, v in (outputs or {}).items():
            outputs[k] = v.cpu()
        converted.to("cpu")
        original.to("cpu")
