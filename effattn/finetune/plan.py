"""`effattn finetune --dry-run`: what a recipe would do, without loading weights or training.

The student is built on the meta device from its config (or from the conversion's plan when the
recipe converts first), so parameter counts are exact and cost nothing. Memory and time are
estimates:

  memory per process = student fp32 weights + gradients and optimizer state of the trainable
                       parameters + teacher weights + activations of one micro-batch
                       (per layer ~(12*hidden + 4*intermediate) values per token, the attention
                       probabilities, and ~6 copies of the [B, T, vocab] logits for the KL, or
                       of [loss.chunk_tokens, vocab] when the logits are formed in chunks)
  under fsdp           the weights, gradients and optimizer state are 1/P of those (and the teacher's,
                       when it is sharded), plus what is gathered at once: two decoder-layer units
                       (the one running and the one prefetched; all of them with
                       reshard_after_forward false) and the embeddings / head unit, in the compute dtype
  with activation      per layer only its input [B, T, hidden] is kept, plus one layer's activations
  checkpointing        while it is recomputed
  time               = matmul FLOPs per step (student forward 2N, backward 2N + 2N_trainable per
                       token; teacher forward 2N) / (this device's measured matmul FLOP/s x an
                       efficiency calibrated on SmolLM2-135M here), plus the evaluations
"""

from __future__ import annotations

import os
from typing import Any

import torch

from ..convert import convert, read_record
from ..convert.options import in_recipe_terms
from ..errors import EffattnError
from ..io.checkpoint import Checkpoint, read_config
from ..evaluate import check_same_tokenizer, prefix_token
from ..io.load import DTYPES, as_ref, load_tokenizer, tokenizer_missing
from .config import Recipe
from .data import check_disjoint, check_source
from . import distributed
from .loop import TEACHER_DTYPE, resolve_teacher, tokens_per_step, total_steps
from .params import count_params, select_trainable
from ..io.verify import meta_model
from ..models import MODEL_SPECS
from ..resources import MEMORY_MARGIN, check_memory, cpu_efficiency, cpu_flops, device_flops, memory_budget

# Achieved / best-measured-matmul FLOP/s of the CPU recipes on SmolLM2-135M, 2 idle cores (AMD EPYC, best probe 203
# GFLOP/s): at 0.45 the plan said 20.9 min of training for heal-gqa (100 steps of 4 x 256 tokens; measured 14.7 min)
# and 18.5 min for heal-linear (36 of 2,048; measured 11.6-17.4 min), 0.70 and 0.63-0.94 of it; 0.6 makes them 15.7
# and 13.9 min. (0.45 was fitted against live probes under load, 41-68 GFLOP/s.) A rough, machine-dependent factor.
EFFICIENCY = 0.6
# bf16 on the CPU (autocast) is priced at the bfloat16 probe (resources.cpu_flops), of which it reaches a smaller
# share (resources.HALF_EFFICIENCY): extend-context-gpu's shape (1 x 16,384 tokens, activation checkpointing) on the
# built-in model, 8 steps, measured 36.9 min (2 cores, AMD EPYC, bf16 probe 1,008 GFLOP/s, fp32 238); priced at 60% of
# the fp32 probe the plan said 95 min, at 31% of the bf16 probe it says 37 (BENCHMARKS.md, "A heal at 16K on the CPU").
RUNTIME_BYTES = 2**29  # Python, torch, tokenizer, tokenized text: ~0.5 GiB measured
LOGIT_COPIES = 6  # student logits, their log-softmax and gradient, teacher logits and log-softmax, the KL terms


def plan_finetune(recipe: Recipe, processes: int | None = None, *, memory_check: bool = True,
                  estimate_time: bool = True, device_memory: int | None = None) -> dict[str, Any]:
    """The resolved run: models, parameter counts, strategy, tokens per step, memory and time estimates. A
    run whose estimated memory per process exceeds the device's (or `device_memory` bytes, to plan for
    other machines) is refused (`memory_check=False` plans it anyway). `processes`: the number of
    processes to plan for (default: this launch's WORLD_SIZE). Models may be config.json folders without
    weights: their sizes come from the config."""
    processes = processes or int(os.environ.get("WORLD_SIZE", "1"))
    for source in recipe.data.sources:
        check_source(source)
    check_disjoint(recipe.data.sources, recipe.eval.corpora)
    student = recipe.student
    student_ref = as_ref(student.model, plan_only=True)  # the model, or the one it is converted from
    # its tokenizer reads the data (a config-only folder, planned for another machine, has none to ask)
    tokenizer = load_tokenizer(student_ref) if tokenizer_missing(student_ref.path) is None else None
    if tokenizer is not None and ((recipe.eval.bos and recipe.eval.corpora) or recipe.data.bos):
        prefix_token(tokenizer)  # the prefix token exists
    if student.convert is not None:
        try:
            plan = convert(student.model, None, to=student.convert.to, options=student.convert.options(), dry_run=True,
                           measure=False, memory_check=memory_check).plan  # prepare_student converts without measuring
        except EffattnError as exc:
            raise in_recipe_terms(exc) from None
        config, conversion, record, path = plan.config, dict(plan.summary), None, None
    else:
        path = student_ref.path
        config, conversion, record = read_config(path), None, read_record(path)
    teacher_spec = resolve_teacher(recipe, record, path)
    # sizes and configs only: a .gguf teacher is planned from its metadata, not dequantized
    teacher_ref = as_ref(teacher_spec, plan_only=True) if teacher_spec else None
    teacher_path = teacher_ref.path if teacher_ref else None
    teacher_config = read_config(teacher_path) if teacher_path else None
    teacher_meta = meta_model(teacher_config) if teacher_config else None
    teacher_params = _num_params(teacher_path) if teacher_path else 0
    check_configs(recipe, config, teacher_config, teacher_spec)
    if tokenizer is not None:  # the teacher is scored on the student's token ids: its tokenizer must give the same
        check_same_tokenizer(tokenizer, teacher_ref, role="teacher.model",
                             fix="distil from the model the student was converted from (teacher.model)")

    base = meta_model(config)
    student_params = count_params(base)[1]
    strategy = distributed.resolve_strategy(recipe.distributed, student_params, processes)
    distributed.check(recipe, strategy)
    if strategy == "fsdp" and recipe.distributed.wrap:  # what shard_teacher and accelerate would refuse, loaded
        check_wrap(base, recipe.distributed.wrap, "the student")
        if teacher_spec and recipe.distributed.shard_teacher:
            check_wrap(teacher_meta, recipe.distributed.wrap, "the teacher")
    unit_params, tail_params = _units(base, recipe.distributed.wrap)
    teacher_units = _units(teacher_meta, recipe.distributed.wrap) if teacher_meta is not None else (0, 0)
    model = select_trainable(base, recipe.train)
    trainable, total = count_params(model)
    embed = model.get_input_embeddings().weight.numel()
    vocab, hidden = config["vocab_size"], config["hidden_size"]
    # matmul parameters per token: everything but the embedding lookup; a tied lm_head still multiplies
    compute = total - embed + (vocab * hidden if config.get("tie_word_embeddings") else 0)
    if recipe.train.params == "all":
        trainable_compute = compute
    else:
        trainable_compute = trainable
    teacher_compute = teacher_params - embed + (vocab * hidden if config.get("tie_word_embeddings") else 0) if teacher_spec else 0

    steps = total_steps(recipe, processes)
    per_step = tokens_per_step(recipe, processes)
    B, T, accum = recipe.train.batch_size, recipe.data.seq_len, recipe.train.grad_accum
    layers, heads = config["num_hidden_layers"], config["num_attention_heads"]

    cfg = recipe.distributed
    sharded = strategy == "fsdp"
    shards = processes if sharded else 1
    act_bytes = 2 if recipe.train.precision != "fp32" else 4
    teacher_bytes = DTYPES[TEACHER_DTYPE[recipe.train.precision]].itemsize

    # an effattn model's attention may keep more per layer for the backward pass (ModelSpec.layer_activation_bytes)
    extra_per_layer = getattr(MODEL_SPECS.get(config.get("model_type")), "layer_activation_bytes", None)

    def memory_at(B: int, T: int, shards: int = shards, checkpointing: bool = cfg.activation_checkpointing) -> dict[str, int]:
        teacher_shards = shards if cfg.shard_teacher else 1
        inter = config.get("intermediate_size", 4 * hidden)
        optimizer_bytes = {"adamw": 8, "sgd": 4}[recipe.optimizer.name]
        per_layer = B * T * (12 * hidden + 4 * inter) * act_bytes + (extra_per_layer(config, B, T) if extra_per_layer else 0)
        kept_layers = B * T * hidden * act_bytes * layers + per_layer if checkpointing else per_layer * layers
        memory = {
            "student_weights": total * 4 // shards,
            "gradients_and_optimizer": trainable * (4 + optimizer_bytes) // shards,
            "teacher_weights": teacher_params * teacher_bytes // teacher_shards,
            "activations": kept_layers + B * heads * T * T * act_bytes * 2
                           + min(B * T, recipe.loss.chunk_tokens or B * T) * vocab * 4 * LOGIT_COPIES
                           + (B * T * hidden * 4 * 2 if recipe.loss.chunk_tokens else 0),  # the kept final states
        }
        if sharded:  # the units gathered at once (student in the compute dtype, its gradients reduced in fp32)
            gathered = (layers if not cfg.reshard_after_forward else 2) * unit_params
            memory["gathered_units"] = ((gathered + tail_params) * act_bytes + unit_params * trainable // total * 4
                                        + ((2 * teacher_units[0] + teacher_units[1]) * teacher_bytes
                                           if cfg.shard_teacher and teacher_spec else 0))
        memory["runtime"] = RUNTIME_BYTES
        memory["total"] = sum(memory.values())
        return memory

    memory = memory_at(B, T)
    if memory_check:
        options = [("train.batch_size={} or less (a larger train.grad_accum keeps the tokens per step)", B,
                    lambda b: memory_at(b, T)["total"], 1, 1),
                   ("train.batch_size=1 and data.seq_len={} or less", T, lambda t: memory_at(1, t)["total"], 16, 1)]
        also = f"set distributed.strategy=fsdp to shard it across the {processes} processes" \
            if not sharded and processes > 1 else ""
        budget = device_memory or memory_budget("cuda" if torch.cuda.is_available() else None)
        if sharded and budget:  # more processes shard it thinner
            more = next((p for p in (processes * 2**k for k in range(1, 12))
                         if memory_at(B, T, p)["total"] <= budget * MEMORY_MARGIN), None)
            if more:
                also = f"run it on {more} processes" + (" or train.params=lora" if recipe.train.params != "lora" else "")
        if (budget and not cfg.activation_checkpointing
                and memory_at(B, T, checkpointing=True)["total"] <= budget * MEMORY_MARGIN):
            also = "set distributed.activation_checkpointing=true (each layer's activations recomputed in the backward)" \
                + (f", or {also}" if also else "")
        check_memory(memory["total"], what=f"the fine-tune (per process, micro-batches of {B} x {T} tokens, "
                                           f"{strategy if processes > 1 else 'one process'})",
                     options=options, device="cuda" if torch.cuda.is_available() else None, budget=device_memory,
                     also=also)
    attention = 4 * layers * T * hidden  # scores and weighted sum per token, causal half of 2 x 2 x T x d x heads
    flops_token = (4 * compute + 2 * trainable_compute + 3 * attention) + (2 * teacher_compute + attention)
    # an effattn model's attention may cost more to train than that count (ModelSpec.layer_train_flops)
    extra_flops = getattr(MODEL_SPECS.get(config.get("model_type")), "layer_train_flops", None)
    flops_token += layers * extra_flops(config, T) if extra_flops else 0.0
    step_flops = flops_token * B * T * accum
    evals = (steps // recipe.eval.every if recipe.eval.every else 0) + 1
    eval_flops = (evals + (1 if teacher_spec else 0)) * len(recipe.eval.corpora) * recipe.eval.tokens * 2 * compute
    dtype = torch.bfloat16 if recipe.train.precision == "bf16" else torch.float32
    if not estimate_time:  # the run checks memory only: no speed probe
        return {"memory_bytes_per_process": memory, "strategy": strategy}
    # a GPU's probe as it runs; the CPU's best probe on this machine (resources.matmul_flops), as the conversions'
    # estimates use: a probe that shares the cores with another job measured 69 GFLOP/s where the cores give 203, and
    # the heal-linear estimate said 55 min for 11.6-17.4 measured
    cuda = torch.cuda.is_available()
    efficiency = EFFICIENCY if cuda else cpu_efficiency(EFFICIENCY, dtype)
    flops = device_flops(dtype) * efficiency if cuda else cpu_flops(EFFICIENCY, dtype)
    return {
        "recipe": recipe.to_dict(),
        "student": {"model": student.model, "conversion": conversion, "params": total, "trainable": trainable,
                    "trains": recipe.train.params},
        "teacher": {"model": teacher_spec, "params": teacher_params},
        "processes": processes,
        "strategy": strategy,
        "distributed": distributed.describe(cfg, strategy, processes, student_params),
        "steps": steps,
        "tokens_per_step": per_step,
        "tokens": steps * per_step,
        "memory_bytes_per_process": memory,
        "est_seconds": {"training": steps * step_flops / flops, "evaluation": eval_flops / flops},
        "est_basis": f"{flops / 1e9:,.0f} GFLOP/s effective ({efficiency:.0%} of measured "
                     f"{'bf16 ' if dtype == torch.bfloat16 else ''}matmul speed)",
    }


def check_configs(recipe: Recipe, student: dict[str, Any], teacher: dict[str, Any] | None,
                  teacher_spec: str | None) -> None:
    """What the student's and the teacher's configs rule out: another vocabulary, blocks past the student's
    positions."""
    if teacher is not None and teacher.get("vocab_size") != student.get("vocab_size"):
        raise EffattnError(f"teacher {teacher_spec} and the student have different vocabularies "
                           f"({teacher.get('vocab_size')} vs {student.get('vocab_size')})",
                           "distil from the model the student was converted from (teacher.model)")
    limit = student.get("max_position_embeddings")
    reach = max(recipe.data.positions, recipe.data.seq_len)
    if limit and reach > limit:
        key = "data.positions" if recipe.data.positions >= recipe.data.seq_len else "data.seq_len"
        raise EffattnError(f"{key} ({reach:,}) is past the student's {limit:,} positions (max_position_embeddings)",
                           f"set {key}={limit} or less, or convert with RoPE scaling first "
                           "(student.convert.to: rope-scaling)")


def _num_params(folder) -> int:
    """Parameters of a checkpoint: from its weight files, or (a config.json alone) from its config."""
    return Checkpoint(folder, shapes_only=True).num_params


def check_wrap(model: torch.nn.Module, wrap: list[str], role: str) -> None:
    """Every class in distributed.wrap names modules of `model` (a meta model): a name that matches nothing
    shards nothing, and one misspelt among right ones would leave its layers whole in the root unit."""
    present = {type(m).__name__ for m in model.modules()}
    missing = [name for name in wrap if name not in present]
    if missing:
        layers = getattr(model, "_no_split_modules", None) or sorted(present)
        raise EffattnError(f"distributed.wrap: {role} ({type(model).__name__}) has no modules of the class(es) "
                           f"{', '.join(missing)}", f"name its decoder layer class ({', '.join(layers)}), or drop "
                           "distributed.wrap (the default is the decoder layers)")


def _units(model: torch.nn.Module, wrap: list[str] | None) -> tuple[int, int]:
    """(parameters of the largest FSDP unit, parameters outside every unit) of a (meta) model: the units are
    the modules of the classes in `wrap`, by default its decoder layers (`_no_split_modules`)."""
    names = set(wrap or getattr(model, "_no_split_modules", None) or ())
    units = [sum(p.numel() for p in m.parameters()) for m in model.modules() if type(m).__name__ in names]
    total = count_params(model)[1]
    return (max(units), total - sum(units)) if units else (total, 0)
