"""One layer-wise runner for every conversion: one decoder layer's weights in memory at a time.

`run_layers` walks the decoder layers in order. For layer i it reads the layer's tensors from the
checkpoint and hands them to the conversion's per-layer function, which returns the tensors to write
(new shapes, new buffers) and, on a calibrated run, the converted layer as a module. The runner then
  1. optionally refines that module (refine.py: a few optimizer steps fitting the original layer's
     attention output on the same inputs, or the original model's activations after the layer),
  2. writes the layer's tensors and releases the checkpoint's pages,
  3. propagates the calibration activations through the converted layer: they are layer i+1's inputs.
     Refinement towards the original model's activations has computed both already (the original layer's
     output on its own activations, its targets; the refined layer's output, its last error pass), and
     they are carried on rather than computed again.
A layer's tensors are exactly those its function returns (a conversion may rename or drop some);
tensors outside the layers (embeddings, final norm, head) are copied at the end.

On a calibrated run (calib given) the layer function also receives the layer's calibration inputs
x [N, T, D] (from the converted layers below: each layer is fitted to what the converted model
really feeds it), RoPE tables cos/sin [1, T, d] (or [N, T, d], one per sequence, where the calibration spreads
the sequences' positions: `CalibSettings.positions`; `calibrate.rows_of` picks a batch's) and the original
layer as a module. Without
calibration the walk streams weights only (x, original, cos and sin are None).

Peak memory: one layer's weights (a few copies) plus the calibration activations, whatever the
model's size.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch

from ..attention.layerwise import LayerFactory
from ..families import Family
from ..io.checkpoint import Checkpoint
from ..io.writer import SafetensorsWriter
from .base import layer_bytes, passthrough
from .calibrate import CalibSettings, batches, calibration_tokens, rows_of, starts
from .refine import RefineSettings, refine_layer


def streaming_bytes(ckpt: Checkpoint, family: Family) -> int:
    """Memory a weight-only layer-by-layer walk holds above the process's: one layer's tensors as read
    (mapped pages) and their working copies (float64 where the maths runs), and the largest single
    tensor's mapped pages."""
    largest = max(ckpt.meta(n)[1].itemsize * torch.Size(ckpt.meta(n)[0]).numel() for n in ckpt.names())
    per = layer_bytes(ckpt, family)
    return 2 * per + 4 * per * 8 // max(ckpt.dtype.itemsize, 1) // 2 + largest


def calibrated_bytes(ckpt: Checkpoint, family: Family, calib: CalibSettings, refine: RefineSettings | None = None) -> int:
    """Memory a calibrated walk holds above the process's: the streaming walk's, the embedding matrix
    in float32 (a copy unless stored so), the activations (the layer's inputs, their normed copy, the
    next layer's inputs being built, and the original model's for a `stream` refinement), one batch's
    attention scores, and tokenizing the calibration text."""
    config = ckpt.config
    hidden, heads = config["hidden_size"], config["num_attention_heads"]
    tokens, seq_len, batch = calib.tokens, calib.seq_len, calib.batch_size
    shape, dtype = ckpt.meta(family.embed)
    embed = torch.Size(shape).numel() * 4 if dtype != torch.float32 else 0  # float32: its mapped pages, counted above
    copies = 4 + (3 if refine is not None and refine.steps and refine.target == "stream" else 0)
    activations = copies * tokens * hidden * 4
    scores = batch * heads * seq_len * seq_len * 4
    walk = streaming_bytes(ckpt, family) + embed + activations + scores + 4 * layer_bytes(ckpt, family)
    return max(walk, calib.tokenize_bytes())


@dataclass
class LayerInput:
    index: int
    prefix: str  # the layer's tensor-name prefix, e.g. "model.layers.3."
    tensors: dict[str, torch.Tensor]  # the layer's checkpoint tensors by full name, as stored
    factory: LayerFactory  # builds decoder layers as modules, and RoPE tables
    calib: CalibSettings | None
    x: torch.Tensor | None = None  # (N, T, D) calibration inputs of this layer
    cos: torch.Tensor | None = None  # (1, T, d), or (N, T, d): one table per sequence (calibrate.rows_of)
    sin: torch.Tensor | None = None
    original: torch.nn.Module | None = None  # the original layer, float32 (calibrated runs)


@dataclass
class LayerOutput:
    tensors: dict[str, torch.Tensor]  # everything to write for this layer, by full name (the writer casts)
    module: torch.nn.Module | None = None  # the converted layer (calibrated runs: propagation, refinement)
    forward_kwargs: dict[str, Any] = field(default_factory=dict)  # extra arguments of module's forward
    refinable: bool = True  # whether local refinement may train this module's attention
    note: str = ""  # shown in the progress line
    # called after refinement, just before the activations go through `module` (hooks that must see the
    # final layer, and only its propagation: refinement runs `module` too)
    before: Callable[[], None] | None = None
    after: Callable[[], None] | None = None  # called once the activations went through `module`
    # The converted layer's own RoPE tables (cos, sin) where they differ from the original's (a conversion
    # that changes the rotary dims, e.g. MLA's shared rotary key): propagation and refinement use them.
    rope: tuple[torch.Tensor, torch.Tensor] | None = None
    trainable: list[str] | None = None  # parameters of module.self_attn that refinement trains (default q/k/v/o)
    # a faster forward for refinement's `attention` target: prepare(module, x, cos, sin) -> predict(rows)
    # (refine.refine_layer); None: module's own forward
    prepare: Callable | None = None


@torch.no_grad()
def run_layers(ckpt: Checkpoint, family: Family, writer: SafetensorsWriter, convert_layer: Callable[[LayerInput], LayerOutput],
               *, layers: int, target: torch.dtype | None, calib: CalibSettings | None = None,
               refine: RefineSettings | None = None, original_kv_heads: int | None = None, progress=None,
               description: str = "converting layers") -> dict[str, Any]:
    """Walk every decoder layer through `convert_layer` (see the module docstring); returns what was
    measured on the way (`refine`: per-layer losses), for the record."""
    factory = LayerFactory(ckpt.config, family)
    x = cos = sin = None
    if calib is not None:
        ids = calibration_tokens(ckpt.folder, calib)  # (N, T)
        cos, sin = factory.rope(ids.shape[1], starts(calib, len(ids)))  # [1 or N, T, d] (CalibSettings.positions)
        x = ckpt.get(family.embed).float()[ids]  # (N, T, D): the converted model's hidden states
        description += f" ({ids.numel():,} calibration tokens)"
    kv_heads = original_kv_heads or ckpt.config.get("num_key_value_heads") or ckpt.config["num_attention_heads"]
    refine = refine if (refine is not None and refine.steps and calib is not None) else None
    x0 = x if (refine is not None and refine.target == "stream") else None  # the original model's activations
    losses: list[dict[str, float]] = []
    written: set[str] = set()
    task = progress.add_task(description, total=layers) if progress else None
    for layer in range(layers):
        prefix = family.prefix(layer)
        tensors = {n: ckpt.get(n) for n in ckpt.names() if n.startswith(prefix)}
        original = factory.layer(layer, tensors, kv_heads) if calib is not None else None
        out = convert_layer(LayerInput(layer, prefix, tensors, factory, calib, x, cos, sin, original))
        new_rope = out.rope or (cos, sin)
        carried: dict[str, torch.Tensor] = {}  # the stream target's passes, which are the propagation's (refine_layer)
        if refine is not None and out.refinable and out.module is not None:
            losses.append(refine_layer(out.module, original, x, cos, sin, refine, x0=x0, trainable=out.trainable,
                                       converted_rope=out.rope, forward_kwargs=out.forward_kwargs,
                                       prepare=out.prepare, outputs=carried) | {"layer": layer})
            state = out.module.state_dict()
            for name in out.tensors:
                if name[len(prefix):] in state:
                    out.tensors[name] = state[name[len(prefix):]].detach().clone()
        for name, tensor in out.tensors.items():
            writer.write(name, tensor)
            written.add(name)
        written |= set(tensors)  # the layer's tensors not returned are dropped, not copied
        ckpt.release()
        if out.before is not None:
            out.before()
        if x is not None and "x" in carried and out.before is None:
            x = carried["x"]  # the converted layer's output on x, after its steps: the last error pass of refine_layer
        elif x is not None:  # (a conversion whose hooks score heads while the activations pass propagates again)
            x = torch.cat([out.module(x[sl], position_embeddings=rows_of(new_rope, sl), **out.forward_kwargs)
                           for sl in batches(x, calib.batch_size)])
        if x0 is not None:
            x0 = carried["x0"] if "x0" in carried else torch.cat(
                [original(x0[sl], position_embeddings=rows_of((cos, sin), sl)) for sl in batches(x0, calib.batch_size)])
        if out.after is not None:
            out.after()
        if progress:
            progress.update(task, advance=1, description=description + (f": layer {layer}, {out.note}" if out.note else ""))
    passthrough(ckpt, writer, [n for n in ckpt.names() if n not in written], target)
    if not losses:
        return {}
    what = ("the layer's output against the original model's at that depth" if refine.target == "stream"
            else "the attention output against the original attention's on the same inputs")
    return {"refine": {"loss": f"relative squared error of {what}, per layer",
                       "before": [round(r["before"], 6) for r in losses],
                       "after": [round(r["after"], 6) for r in losses],
                       "skipped": [r["layer"] for r in losses if not r["ran"]]}}  # layers that already matched
