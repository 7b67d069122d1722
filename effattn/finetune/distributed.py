"""How a fine-tune of several processes divides the work: DDP, or FSDP2 through accelerate's FSDP plugin.

The recipe's `distributed` section picks the strategy (`auto` by default):

  ddp   every process holds the whole student (fp32), its gradients, the AdamW state and the teacher;
        DistributedDataParallel all-reduces the gradients. Right for models that fit one device.
  fsdp  PyTorch FSDP2 (`fully_shard`), set up by accelerate's `FullyShardedDataParallelPlugin`: each
        decoder layer is one unit whose parameters, gradients and optimizer state are split across the
        P processes; a unit's parameters are gathered for its forward and backward and freed after
        (ZeRO-3). The frozen teacher is sharded the same way. Checkpoints are sharded
        (torch.distributed.checkpoint, one file per process) and the final model is gathered onto the
        main process and written as one native folder. Only the main process reads the checkpoints; the
        others build empty models (io.load.load_empty) and receive their shards from it, so host memory
        holds one copy of the weights, not one per process.
  auto  fsdp when more than one process runs and the student has at least `fsdp_min_params`
        parameters (1B by default: a 1B student in fp32 with AdamW needs ~16 GB before activations,
        the teacher ~2 GB more in bf16), else ddp.

Memory per process, from the dry run (plan.py): ddp ~ 16 bytes per student parameter + the teacher;
fsdp ~ (16 bytes per student parameter + the teacher) / P + two gathered units + the embeddings.

With train.precision bf16 under fsdp, parameters are gathered and computed in bf16 and gradients
reduced in fp32 (MixedPrecisionPolicy(param_dtype=bf16, reduce_dtype=fp32)); the sharded master
weights and the optimizer stay fp32. Under gradient accumulation every micro-batch's gradients are
reduce-scattered at once (accelerate's `sync_each_batch`): holding them unsharded until the last
micro-batch would cost a whole model's gradients per process, which is what sharding avoids.

Activation checkpointing (`distributed.activation_checkpointing`, any strategy) is transformers'
gradient checkpointing of each decoder layer, which restores the RNG state for the recompute, so
dropout (LoRA's) draws the same mask twice and the gradients are exact; the FSDP plugin's own
wrapper does not restore it.

accelerate (1.16) enables its FSDP plugin on accelerators only and runs plain DDP on CPUs, although
FSDP2 itself runs there over gloo. `make_accelerator` switches the state to FSDP on CPUs too, the
one place effattn reaches into accelerate, so the same code is tested on this machine as runs on GPUs.
"""

from __future__ import annotations

from typing import Any

import torch

from ..errors import EffattnError
from .config import FSDP_ONLY, Distributed, Recipe

PRECISION = {"fp32": "no", "bf16": "bf16", "fp16": "fp16"}  # recipe -> accelerate mixed_precision
COMPUTE_DTYPE = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}


def resolve_strategy(cfg: Distributed, student_params: int, processes: int) -> str:
    """'ddp' or 'fsdp' (one process is 'ddp': there is nothing to shard or to all-reduce)."""
    if processes <= 1:
        return "ddp"
    if cfg.strategy == "auto":
        return "fsdp" if student_params >= cfg.fsdp_min_params else "ddp"
    return cfg.strategy


def describe(cfg: Distributed, strategy: str, processes: int, student_params: int) -> str:
    """One line for the dry run and the log: what runs, and why when `auto` chose it."""
    if processes <= 1:
        what = "one process (nothing to shard)"
    elif strategy == "fsdp":
        what = f"fsdp across {processes} processes (FSDP2: parameters, gradients, optimizer state" + \
               (" and the teacher" if cfg.shard_teacher else "") + " sharded)"
    else:
        what = f"ddp across {processes} processes (each holds the whole model)"
    if cfg.strategy == "auto" and processes > 1:
        side = "≥" if strategy == "fsdp" else "<"
        what += f"; auto: student {student_params / 1e9:,.2f}B {side} fsdp_min_params {cfg.fsdp_min_params / 1e9:,.2f}B"
    if cfg.activation_checkpointing:
        what += "; activation checkpointing"
    unread = cfg.changed(FSDP_ONLY) if strategy != "fsdp" else []  # auto chose ddp: set, and not read
    if unread:
        what += f"; {', '.join(f'distributed.{k}' for k in unread)} not read (fsdp only)"
    return what


def check(recipe: Recipe, strategy: str) -> None:
    """Refuse combinations that cannot run, before anything is loaded."""
    cfg = recipe.distributed
    if strategy != "fsdp":
        return
    if cfg.cpu_offload and not torch.accelerator.is_available():
        raise EffattnError("distributed.cpu_offload=true offloads from an accelerator, and this machine has none "
                           "(the run is on the CPU already)", "set distributed.cpu_offload=false")
    if recipe.train.mla_latent == "scaled":
        raise EffattnError("train.mla_latent=scaled trains through a parametrization, which FSDP's sharded "
                           "parameters do not carry", "keep train.mla_latent=frozen, or run with distributed.strategy=ddp")


def make_accelerator(recipe: Recipe, strategy: str):
    from accelerate import Accelerator
    from accelerate.utils import DistributedDataParallelKwargs, GradientAccumulationPlugin

    train = recipe.train
    common = dict(mixed_precision=PRECISION[train.precision],
                  # accelerate only forms a CPU process group (gloo) under torchrun when told it is on CPUs
                  cpu=not torch.accelerator.is_available())
    if strategy != "fsdp":
        return Accelerator(gradient_accumulation_steps=train.grad_accum,
                           kwargs_handlers=[DistributedDataParallelKwargs(broadcast_buffers=False)], **common)
    from accelerate.utils import DistributedType, FullyShardedDataParallelPlugin

    cfg = recipe.distributed
    mp = None
    if train.precision != "fp32":
        mp = {"param_dtype": COMPUTE_DTYPE[train.precision], "reduce_dtype": torch.float32}
    plugin = FullyShardedDataParallelPlugin(
        fsdp_version=2, auto_wrap_policy="transformer_based_wrap", transformer_cls_names_to_wrap=cfg.wrap,
        reshard_after_forward=cfg.reshard_after_forward, cpu_offload=cfg.cpu_offload,
        state_dict_type="SHARDED_STATE_DICT", mixed_precision_policy=mp, activation_checkpointing=False,
        cpu_ram_efficient_loading=True)  # the first process's weights are sent out shard by shard
    accelerator = Accelerator(fsdp_plugin=plugin, **common, gradient_accumulation_plugin=GradientAccumulationPlugin(
        num_steps=train.grad_accum, sync_each_batch=True))
    if accelerator.distributed_type == DistributedType.MULTI_CPU:  # accelerate dropped the plugin: see the docstring
        from accelerate.state import PartialState

        accelerator.state.distributed_type = DistributedType.FSDP
        PartialState._shared_state["distributed_type"] = DistributedType.FSDP
        accelerator.state.fsdp_plugin = plugin
    if not accelerator.is_fsdp2:
        raise EffattnError(f"accelerate did not set up FSDP2 (distributed type {accelerator.distributed_type})",
                           "run with distributed.strategy=ddp, or launch with torchrun / accelerate launch")
    return accelerator


def enable_activation_checkpointing(model: torch.nn.Module) -> None:
    """Recompute each decoder layer in the backward pass (transformers' gradient checkpointing)."""
    from peft import PeftModel

    base = model.get_base_model() if isinstance(model, PeftModel) else model
    if not getattr(base, "supports_gradient_checkpointing", False):
        raise EffattnError(f"{type(base).__name__} does not support gradient checkpointing",
                           "set distributed.activation_checkpointing=false")
    # non-reentrant torch.utils.checkpoint restores the RNG state; transformers also makes the embeddings'
    # output ask for gradients, so checkpointed layers behind frozen embeddings (LoRA) still backpropagate
    base.activation_checkpointing_enable({"use_reentrant": False})


def shard_teacher(accelerator, teacher: torch.nn.Module, cfg: Distributed) -> torch.nn.Module:
    """The frozen teacher under FSDP2: one unit per decoder layer, the rest (embeddings, final norm, head) in
    the root unit, which stays gathered after a forward until `release(teacher)` frees it (the chunked KL
    projects the teacher's final states through its head after the forward). The first process holds the
    weights (the others an empty model, `load_empty`): each tensor is sent to all and each keeps its shard,
    as accelerate does for the student."""
    from accelerate.utils.fsdp_utils import fsdp2_load_full_state_dict
    from torch.distributed.fsdp import fully_shard

    names = set(cfg.wrap or getattr(teacher, "_no_split_modules", None) or ())
    units = [m for m in teacher.modules() if type(m).__name__ in names]
    if not units:
        raise EffattnError(f"the teacher ({type(teacher).__name__}) has no modules of the classes {sorted(names)} "
                           "to shard as units", "name its decoder layer class in distributed.wrap, "
                           "or set distributed.shard_teacher=false")
    full = teacher.state_dict() if accelerator.is_main_process else {}
    for unit in units:
        fully_shard(unit, reshard_after_forward=True)
    fully_shard(teacher, reshard_after_forward=False)
    fsdp2_load_full_state_dict(accelerator, teacher, full)
    del full
    if hasattr(teacher, "tie_weights"):  # loading assigned the tied tensors one by one
        teacher.tie_weights()
    return teacher


def release(module: torch.nn.Module | None) -> None:
    """Free what an FSDP2 module keeps gathered after a forward without backward (no-op otherwise)."""
    from torch.distributed.fsdp import FSDPModule

    if isinstance(module, FSDPModule):
        module.reshard()


def loads_everything(strategy: str, main: bool) -> bool:
    """Whether this process reads the checkpoints whole: all of them under ddp, the first one under fsdp."""
    return strategy != "fsdp" or main


def is_sharded(module: torch.nn.Module | None) -> bool:
    from torch.distributed.fsdp import FSDPModule

    return isinstance(module, FSDPModule)


def full_state_dict(model: torch.nn.Module) -> dict[str, Any]:
    """The whole state dict of an FSDP2 model on the main process (CPU tensors), {} on the others;
    every process must call it (it all-gathers one tensor at a time)."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

    return get_model_state_dict(model, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
