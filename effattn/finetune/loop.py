"""The healing fine-tune: one loop for a CPU, a GPU, or many processes and nodes.

`finetune(recipe)` is what `effattn finetune RECIPE` runs. For several processes launch the same
command with `torchrun --nproc_per_node N -m effattn.cli finetune RECIPE` or `accelerate launch`;
accelerate supplies the process group (gloo on CPUs, NCCL on GPUs), DistributedDataParallel,
gradient accumulation without needless all-reduces, mixed precision and the checkpoint state. This
module supplies the data order, the loss and the bookkeeping:

  * every process reads all the text and takes its own slice of each global micro-batch (data.py),
    so processes see different data; DDP averages the gradients, so the weights stay identical;
  * the learning-rate schedule counts optimizer steps, whatever the number of processes;
  * conversion modules (those exposing `effattn_aux_loss`) may update buffers in their training
    forward, e.g. EMA codebooks. DDP's buffer broadcast (rank 0 overwriting everyone at each
    forward, discarding the other processes' updates) is off; instead their floating-point buffers
    are averaged over processes after every optimizer step. For an EMA of batch statistics that is
    the EMA of the statistics averaged over processes, and it keeps every process identical. Such a
    module should keep its EMA state (e.g. cluster sizes and sums, van den Oord et al. 2017,
    App. A.1) in buffers and derive the codebook from them;
  * only the main process evaluates, logs and writes; checkpoints hold every process's RNG state
    (on several nodes, OUT must be on a filesystem every node sees);
  * under `distributed.strategy: fsdp` (distributed.py) the student and the teacher are sharded
    instead: every process then takes part in each forward, evaluations included (they all compute
    the same numbers; the main process logs them), checkpoints are sharded, and the final model is
    gathered onto the main process to be written.
"""

from __future__ import annotations

import atexit
import datetime as _dt
import json
import math
import os
import shutil
import sys
import time
import warnings
from collections.abc import Callable
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from .. import __version__
from ..convert import convert, read_record
from ..errors import EffattnError
from ..io.checkpoint import Checkpoint
from ..io.load import as_ref, load_empty, load_model, load_tokenizer
from ..io.save import save_model
from ..models import export_code_for
from ..io.checkpoint import read_config
from ..io.verify import meta_model
from ..io.writer import finish_interrupted_swap, remove_path, write_json, write_text
from ..killpoints import kill_point
from ..resources import release_free_heap
from . import distributed
from .config import Optimizer, Recipe, Schedule, Student, recipe_diff
from .data import BlockStream, block_start, read_sources, training_blocks
from .heldout import evaluate_student, held_out_sets, score_teacher
from .losses import AttentionOutputs, FinalHidden, heal_loss
from .params import conversion_modules, count_params, native, select_trainable
from .preflight import in_finetune_terms
from .report import finetune_card, plot_curves
from .state import MetricsLog, RunFolder, decide_start, read_state, save_checkpoint

TEACHER_DTYPE = {"fp32": "float32", "bf16": "bfloat16", "fp16": "float16"}


@dataclass
class FinetuneResult:
    out: Path | None  # the written folder (main process; None elsewhere)
    model: torch.nn.Module | None  # the final native model: on every process under ddp, the main one's under fsdp
    steps: int
    tokens: int
    seconds: float  # training time, summed over resumed sessions
    final_loss: float  # mean training loss of the last 10 steps (main process; nan elsewhere)
    start_eval: dict[str, dict[str, float]] | None  # held-out metrics before / after (main process)
    final_eval: dict[str, dict[str, float]] | None
    resumed_from: int | None  # the checkpoint step this session started from
    record: dict[str, Any] | None  # the written effattn.json (main process)
    written: bool = True  # False: OUT already held this recipe's finished fine-tune, and nothing ran


def tokens_per_step(recipe: Recipe, processes: int) -> int:
    return recipe.data.seq_len * recipe.train.batch_size * recipe.train.grad_accum * processes


def total_steps(recipe: Recipe, processes: int) -> int:
    """train.max_steps, or train.max_tokens rounded up to whole optimizer steps."""
    if recipe.train.max_steps is not None:
        return recipe.train.max_steps
    return math.ceil(recipe.train.max_tokens / tokens_per_step(recipe, processes))


def lr_multiplier(s: Schedule, steps: int) -> Callable[[int], float]:
    """Learning rate / peak at optimizer step `step`: linear warm-up, then cosine, linear or constant."""

    def multiplier(step: int) -> float:
        if step < s.warmup_steps:
            return (step + 1) / s.warmup_steps
        if s.name == "constant":
            return 1.0
        progress = min(1.0, (step - s.warmup_steps) / max(1, steps - s.warmup_steps))
        shape = 0.5 * (1 + math.cos(math.pi * progress)) if s.name == "cosine" else 1 - progress
        return s.min_lr_ratio + (1 - s.min_lr_ratio) * shape

    return multiplier


def build_optimizer(cfg: Optimizer, params) -> torch.optim.Optimizer:
    if cfg.name == "adamw":
        return torch.optim.AdamW(params, lr=cfg.lr, betas=cfg.betas, eps=cfg.eps, weight_decay=cfg.weight_decay)
    return torch.optim.SGD(params, lr=cfg.lr, momentum=cfg.momentum, weight_decay=cfg.weight_decay)


def apply_optimizer_settings(optimizer, scheduler, cfg: Optimizer) -> None:
    """After restoring a checkpoint, make the optimizer and the schedule follow the recipe (`--resume`
    with a changed optimizer section): the restored state carries the old learning rate (also in the
    scheduler's base_lrs), weight decay and betas. The moments and the step count stay restored."""
    for group in optimizer.param_groups:
        group["initial_lr"] = cfg.lr
        group["weight_decay"] = cfg.weight_decay
        if cfg.name == "adamw":
            group["betas"], group["eps"] = tuple(cfg.betas), cfg.eps
        else:
            group["momentum"] = cfg.momentum
    scheduler.base_lrs = [cfg.lr] * len(optimizer.param_groups)
    for group, factor in zip(optimizer.param_groups, scheduler.lr_lambdas):
        group["lr"] = cfg.lr * factor(scheduler.last_epoch)
    scheduler._last_lr = [group["lr"] for group in optimizer.param_groups]


def resolve_teacher(recipe: Recipe, student_record: dict[str, Any] | None, student_path: Path) -> str | None:
    """teacher.model, else the model the student was converted from; None when no term needs one."""
    if recipe.teacher.model:
        return recipe.teacher.model
    if recipe.loss.kl == 0 and recipe.loss.attn_out == 0:
        return None
    if recipe.student.convert is not None:
        return recipe.student.model
    source = (student_record or {}).get("source")
    if not source:
        raise EffattnError(f"no teacher: {student_path} has no effattn.json naming the model it was converted from",
                           "set teacher.model, or loss.kl=0 and loss.attn_out=0 to train on cross-entropy alone")
    if source.get("kind") == "gguf":
        return gguf_teacher(source, student_path)
    return source["model"] if source.get("kind") in ("builtin", "hub") else source["path"]


def gguf_teacher(source: dict[str, Any], student_path: Path) -> str:
    """The teacher of a student converted from a GGUF file: the file (dequantized again if its cached copy was
    pruned). Records before the file was kept name the cached copy, used while it is still there."""
    path = Path(source["path"])
    if path.is_file() or (path / "config.json").is_file():
        return str(path)
    gguf = source["path"] if path.suffix == ".gguf" else source.get("model", source["path"])
    raise EffattnError(f"no teacher: {student_path} was converted from the GGUF file {gguf}, which is no longer there",
                       "set teacher.model=... (that GGUF file or the model it came from), or loss.kl=0 and "
                       "loss.attn_out=0 to train on cross-entropy alone")


def prepare_student(student: Student, run: RunFolder, accelerator, say, command: str | None) -> Path:
    """The student's folder: as given, or converted once into OUT/student (reused by a resumed run).
    accelerator: accelerate's PartialState (or an Accelerator)."""
    if student.convert is None:
        with accelerator.main_process_first():
            return as_ref(student.model).path
    request = {"model": student.model, "convert": student.convert.model_dump()}
    if accelerator.is_main_process:
        done = (run.student_request.exists() and json.loads(run.student_request.read_text()) == request
                and (run.student / "effattn.json").exists())
        if not done:
            options = "".join(f", {k}={v}" for k, v in student.convert.options().items())
            say(f"converting {student.model} (to={student.convert.to}{options}) ...")
            convert(student.model, run.student, to=student.convert.to, options=student.convert.options(),
                    force=True, measure=False, command=command)
            write_json(run.student_request, request)
    accelerator.wait_for_everyone()
    return run.student


def sync_conversion_buffers(modules: list[torch.nn.Module], accelerator) -> None:
    """Average the floating-point buffers of conversion modules over processes (see the module docstring)."""
    if accelerator.num_processes == 1:
        return
    for module in modules:
        for buf in module.buffers():
            if buf.is_floating_point():
                buf.copy_(accelerator.reduce(buf, "mean"))


@torch.no_grad()
def teacher_forward(teacher, ids: torch.Tensor, *, logits: bool,
                    positions: torch.Tensor | None = None) -> torch.Tensor | None:
    """The teacher's logits [B, T, V], or (logits=False: only its attention outputs or final states are
    needed, which hooks collect) a pass through its decoder alone, skipping the vocabulary projection.
    A sharded (FSDP) teacher runs whole, projecting only the last position: its sharding hooks sit on
    the model, so its decoder cannot run alone."""
    if teacher is None:
        return None
    at = {} if positions is None else {"position_ids": positions}
    if logits:
        return teacher(input_ids=ids, use_cache=False, **at).logits
    if distributed.is_sharded(teacher):
        teacher(input_ids=ids, use_cache=False, logits_to_keep=1, **at)
    else:
        teacher.get_decoder()(input_ids=ids, use_cache=False, **at)
    return None


def optimizer_step(accelerator, model, teacher, optimizer, batches: list[torch.Tensor],
                   recipe: Recipe, hooks: tuple[AttentionOutputs, AttentionOutputs] | None = None,
                   finals: tuple[FinalHidden, FinalHidden | None] | None = None, starts: list[int] | None = None,
                   ) -> tuple[dict[str, torch.Tensor], float | None]:
    """One optimizer step over micro-batches [B, T] of this process: forward, loss, backward,
    (gradients all-reduced on the last one), clip, update. Returns the loss terms averaged over the
    micro-batches, and the gradient norm before clipping. hooks: (student, teacher) attention-output
    hooks, for loss.attn_out; finals: (student, teacher) final-norm hooks, for loss.chunk_tokens (the
    models then project only their last position, through the wrapper so DDP sees the forward).
    starts: each micro-batch's first position (`data.positions`; default 0)."""
    sums: dict[str, torch.Tensor] = {}
    grad_norm = None
    for i, ids in enumerate(batches):
        ids = ids.to(accelerator.device)
        positions = None if not starts or not starts[i] else \
            torch.arange(starts[i], starts[i] + ids.shape[1], device=ids.device)[None]  # (1, T): every row's
        at = {} if positions is None else {"position_ids": positions}
        with accelerator.accumulate(model):  # no all-reduce until the last micro-batch; loss / grad_accum
            with accelerator.autocast():
                chunked = None
                if finals is not None:
                    model(input_ids=ids, use_cache=False, logits_to_keep=1, **at)
                    logits = teacher_logits = None
                    # its decoder alone; the final-norm hook keeps its states
                    teacher_forward(teacher, ids, logits=False, positions=positions)
                    teacher_hidden = finals[1].take() if finals[1] is not None else None
                    chunked = (finals[0].take(), finals[0].head, teacher_hidden, finals[1] and finals[1].head)
                else:
                    logits = model(input_ids=ids, use_cache=False, **at).logits  # (B, T, V)
                    teacher_logits = teacher_forward(teacher, ids, logits=recipe.loss.kl > 0, positions=positions)
                attention = None if hooks is None else (hooks[0].take(), hooks[1].take())
                terms = heal_loss(recipe.loss, logits, teacher_logits, ids, model, attention, chunked)
                distributed.release(teacher)  # a sharded teacher's gathered root (embeddings, head): no backward frees it
            accelerator.backward(terms["loss"])
            if accelerator.sync_gradients and recipe.train.max_grad_norm:
                grad_norm = float(accelerator.clip_grad_norm_(model.parameters(), recipe.train.max_grad_norm))
            optimizer.step()  # a no-op until the last micro-batch
            optimizer.zero_grad(set_to_none=True)
        for k, v in terms.items():
            sums[k] = sums.get(k, 0.0) + v.detach().float() / len(batches)
    return sums, grad_norm


@contextmanager
def deterministic_algorithms(on: bool):
    """torch.use_deterministic_algorithms for the run (and cuBLAS's fixed workspace it needs), restored after.

    On the CPU the same run is bit-for-bit the same without it (tests/test_resume_kill.py); on GPUs some
    kernels (atomic adds in backward passes, split-K matmuls) are not, so a resumed run would drift
    from an uninterrupted one by rounding unless this is on."""
    if not on:
        yield
        return
    before = torch.are_deterministic_algorithms_enabled()
    os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
    torch.use_deterministic_algorithms(True)
    try:
        yield
    finally:
        torch.use_deterministic_algorithms(before)


def finetune(recipe: Recipe, *, resume: bool = False, force: bool = False, progress=None,
             log: Callable[[str], None] | None = None, command: str | None = None,
             memory_check: bool = True) -> FinetuneResult:
    """Run `recipe` and write the fine-tuned model to `recipe.output`; resumes from its checkpoints.

    resume:   continue from OUT's last checkpoint even if the recipe changed (without it, a
              checkpoint of the same recipe is resumed automatically and a changed recipe is an error).
    force:    start over, replacing OUT.
    progress: a rich Progress; the task it gets carries the fields `loss` and `tok_s`.
    log:      receives one-line messages (resuming, evaluations, ...). Main process only.
    memory_check: refuse a run whose estimated memory per process exceeds the device's (plan_finetune).
    """
    aside: dict[str, Path] = {}  # the folder --force moved aside in this call (main process)
    try:
        with deterministic_algorithms(recipe.train.deterministic), in_finetune_terms():
            result = _finetune(recipe, resume=resume, force=force, progress=progress, log=log, command=command,
                               memory_check=memory_check, aside=aside)
    except Exception:  # an error, not an interrupt (which keeps the new run to resume): the old folder comes back
        if (moved := aside.get("replaced")) is not None and moved.is_dir():
            shutil.rmtree(aside["out"], ignore_errors=True)
            moved.rename(aside["out"])
            if log is not None:
                log(f"the run failed: {aside['out']} holds the folder --force was replacing again")
        raise
    if result.out is not None:  # the main process, the model written: the replaced folder goes
        run = RunFolder(recipe.output)
        remove_path(run.replaced)
        if run.link_replaced is not None and run.link_replaced.is_symlink():  # an earlier version's leftover
            run.link_replaced.unlink()
    release_process_group_at_exit()
    return result


def release_process_group_at_exit() -> None:
    """Destroy the process group (if any) when the interpreter exits, while it is still whole.

    A process that exits with a gloo group alive tears the group's worker threads down during
    interpreter finalization, and that can abort the process ("terminate called without an active
    exception", SIGABRT: pytorch/pytorch#190489) after every byte was written, so torchrun reports a
    finished run as failed. Destroying the group first makes that rarer, not impossible: entry points
    also skip finalization (`exit_without_finalizing`). Registered after a successful run only: every
    process has passed the run's last barrier, so nothing is in flight (destroying a group while another
    process is inside a collective can hang, as torchtitan found). At exit rather than now, so that a
    program may call `finetune` again in the same process group. Registered once however often it is called."""
    global _group_released_at_exit
    if torch.distributed.is_available() and torch.distributed.is_initialized():
        atexit.unregister(_destroy_process_group)
        atexit.register(_destroy_process_group)
        _group_released_at_exit = True


_group_released_at_exit = False


def _destroy_process_group() -> None:
    if torch.distributed.is_initialized():
        torch.distributed.destroy_process_group()


def exit_without_finalizing(code: int) -> None:
    """End a process that ran a process group (a torchrun worker) with `code`: the exit hooks run (they
    destroy the group and flush), the interpreter's finalization does not. Returns, doing nothing, in a
    process that ran none. Non-daemon threads are waited for first, as at a normal exit. For entry points
    only (the CLI, a worker script): a library call must not end its caller's process.

    Destroying the group is not enough. Its gloo worker threads live on, and one of them can still hold the
    last reference to a finished collective (the final barrier keeps the all-gathers queued before it)
    when the interpreter finalizes. Releasing that work's tensors needs the GIL; a thread asking for the
    GIL during finalization is ended by pthread_exit, whose unwinding through a noexcept destructor calls
    std::terminate. The process aborts (SIGABRT, "terminate called without an active exception") after
    every byte was written, and torchrun reports the finished run as failed. A core dump of one such
    abort shows ~AsyncBarrierWork -> ~AsyncAllgatherCoalescedWork -> decref_pyobject -> take_gil ->
    PyThread_exit_thread -> std::terminate on a ProcessGroupGloo thread, the main thread in Py_FinalizeEx.
    Measured on 2 loaded cores: 2 aborts in 64 resumed FSDP runs of tests/test_distributed.py's recipe
    (pytorch/pytorch#179291 is the same race)."""
    if not _group_released_at_exit:
        return
    import threading

    # what the interpreter does at exit before finalizing: wait for non-daemon threads (an executor's work), run the
    # hooks; private CPython functions (3.11 checked), so a runtime without them exits through finalization
    shutdown_threads, run_hooks = getattr(threading, "_shutdown", None), getattr(atexit, "_run_exitfuncs", None)
    if shutdown_threads is None or run_hooks is None:
        return
    shutdown_threads()
    run_hooks()
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except (OSError, ValueError):  # closed or gone: nothing left to lose
            pass
    os._exit(code)


def _finetune(recipe: Recipe, *, resume: bool, force: bool, progress, log: Callable[[str], None] | None,
              command: str | None, memory_check: bool = True, aside: dict[str, Path] | None = None) -> FinetuneResult:
    from .plan import plan_finetune
    from .preflight import check_run

    texts = read_sources(recipe.data.sources, recipe.data.text_key)
    # what --dry-run checks, before any output is touched or the student converted: OUT, the text, the configs,
    # the conversion's options and (memory_check) the memory
    check_run(recipe, resume=resume, force=force, texts=texts)
    plan_finetune(recipe, estimate_time=False, memory_check=memory_check)

    from accelerate import PartialState
    from accelerate.utils import set_seed

    procs = PartialState(cpu=not torch.accelerator.is_available())  # the process group; the Accelerator comes
    main, world, rank = procs.is_main_process, procs.num_processes, procs.process_index  # with the strategy
    say = log if (log and main) else (lambda _: None)
    run = RunFolder(recipe.output)
    recipe_dict = recipe.to_dict()
    if main and (repaired := finish_interrupted_swap(run.out)):
        say(repaired)
    procs.wait_for_everyone()
    start = decide_start(run, recipe_dict, resume=resume, force=force)
    procs.wait_for_everyone()
    if main:
        if start.wipe and force and not run.started():  # the folder --force replaces: kept aside until the end
            remove_path(run.replaced)
            run.out.rename(run.replaced)
            if aside is not None:
                aside.update(out=run.out, replaced=run.replaced)
        elif start.wipe:  # a run of ours that never reached a checkpoint (or a --force restart of one)
            shutil.rmtree(run.out)
        run.out.mkdir(parents=True, exist_ok=True)
        run.clean_partial()
        if not start.done:
            run.marker.touch()  # first: a folder with it is a run of ours, which a later run may replace
            write_text(run.recipe, recipe.to_yaml())
    for note in start.notes:
        say(note)
    procs.wait_for_everyone()
    if start.done:
        return finished_result(run, main)

    # -- models -----------------------------------------------------------------------------------
    set_seed(recipe.train.seed)
    student_path = prepare_student(recipe.student, run, procs, say, command)
    student_record = read_record(student_path)
    teacher_spec = resolve_teacher(recipe, student_record, student_path)
    student_params = count_params(meta_model(read_config(student_path)))[1]
    strategy = distributed.resolve_strategy(recipe.distributed, student_params, world)
    distributed.check(recipe, strategy)
    if start.checkpoint is not None and (before := read_state(start.checkpoint).get("strategy", "ddp")) != strategy:
        raise EffattnError(f"{start.checkpoint} was written under distributed strategy {before}, this run is {strategy} "
                           f"({distributed.describe(recipe.distributed, strategy, world, student_params)})",
                           f"resume with distributed.strategy={before}, or pass --force to start over")
    sharded = strategy == "fsdp"
    say(f"running {distributed.describe(recipe.distributed, strategy, world, student_params)}")
    accelerator = distributed.make_accelerator(recipe, strategy)
    evaluates = main or sharded  # a sharded model's forward needs every process
    whole = distributed.loads_everything(strategy, main)  # under fsdp the others get their shards from the first
    with accelerator.main_process_first():
        if whole:
            model, tokenizer, _ = load_model(student_path, dtype="float32")
        else:
            model, tokenizer = load_empty(student_path, dtype="float32"), load_tokenizer(student_path)
        teacher = None
        if teacher_spec is not None:
            teacher_dtype = TEACHER_DTYPE[recipe.train.precision]
            teacher = load_model(teacher_spec, dtype=teacher_dtype, tokenizer=False)[0] if whole or not \
                recipe.distributed.shard_teacher else load_empty(teacher_spec, dtype=teacher_dtype)
    if teacher is not None:
        if teacher.config.vocab_size != model.config.vocab_size:
            raise EffattnError(f"teacher {teacher_spec} and student have different vocabularies "
                               f"({teacher.config.vocab_size} vs {model.config.vocab_size})",
                               "distil from the model the student was converted from (teacher.model)")
        teacher.eval().requires_grad_(False)
        if sharded and recipe.distributed.shard_teacher:
            teacher = distributed.shard_teacher(accelerator, teacher, recipe.distributed)  # placed as it is sharded
        else:
            teacher.to(accelerator.device)
    save_dtype = Checkpoint(student_path).dtype

    # -- data -------------------------------------------------------------------------------------
    say(f"tokenizing {', '.join(recipe.data.sources)} ...")
    stream = BlockStream(training_blocks(tokenizer, texts, recipe.data.seq_len, recipe.data.bos), recipe.train.seed)
    room = recipe.data.positions - recipe.data.seq_len  # data.positions: where the micro-batches may start
    del texts
    release_free_heap()  # the tokenizer's freed pieces, which the training steps' tensors would not reuse
    held_out = held_out_sets(tokenizer, recipe.eval) if evaluates else []
    if evaluates and teacher is not None:
        score_teacher(teacher, held_out, recipe.eval.batch_size, accelerator.autocast)
        distributed.release(teacher)
    teacher_eval = {s.corpus: s.teacher_perplexity for s in held_out if s.teacher_perplexity is not None}

    # -- optimisation -----------------------------------------------------------------------------
    model.train()
    model = select_trainable(model, recipe.train)
    if recipe.distributed.activation_checkpointing:
        distributed.enable_activation_checkpointing(model)
    trainable, total = count_params(model)
    conv_modules = conversion_modules(model)
    steps = total_steps(recipe, world)
    optimizer = build_optimizer(recipe.optimizer, [p for p in model.parameters() if p.requires_grad])
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lr_multiplier(recipe.schedule, steps))
    with warnings.catch_warnings():  # torch >= 2.13 renames DDP's broadcast_buffers; accelerate passes the old name
        warnings.filterwarnings("ignore", message=".*broadcast_buffers.*", category=FutureWarning)
        model, optimizer = accelerator.prepare(model, optimizer)
    accelerator.register_for_checkpointing(scheduler)  # stepped by us once per optimizer step

    def evaluate_now() -> dict[str, dict[str, float]]:  # the processes that evaluate
        result = evaluate_student(accelerator.unwrap_model(model), held_out, recipe.eval.batch_size,
                                  accelerator.autocast)
        kill_point("eval", step)
        if result:  # eval.corpora: [] evaluates nothing
            say(_eval_line(step, result))
        return result

    metrics = MetricsLog(run.metrics)
    step = 0
    if start.checkpoint is not None:
        accelerator.load_state(str(start.checkpoint))
        apply_optimizer_settings(optimizer, scheduler, recipe.optimizer)  # --resume with a changed recipe: its values
        state = read_state(start.checkpoint)
        step, samples, tokens, seconds = state["step"], state["samples"], state["tokens"], state["seconds"]
        start_eval = state["start_eval"]
        resumes = state.get("resumes", [])
        if changes := recipe_diff(state["recipe"], recipe_dict):
            resumes = resumes + [{"step": step, "changes": changes}]
        if main:
            metrics.keep_until(step)
    else:
        samples = tokens = 0
        seconds = 0.0
        start_eval = None
        resumes = []
        if evaluates:
            start_eval = evaluate_now()
        if main:
            metrics.path.write_text("")
            metrics.append({"kind": "eval", "step": 0, "eval": start_eval})
        accelerator.wait_for_everyone()
    resumed_from = step if start.checkpoint is not None else None
    say(f"training {trainable:,} of {total:,} parameters for {steps} steps of "
        f"{tokens_per_step(recipe, world):,} tokens on {world} process(es)"
        + (f", blocks at positions spread over {recipe.data.positions:,}" if room > 0 else ""))

    def state_now() -> dict[str, Any]:
        return {"step": step, "samples": samples, "tokens": tokens, "seconds": seconds, "processes": world,
                "strategy": strategy, "recipe": recipe_dict, "start_eval": start_eval, "resumes": resumes}

    # -- the loop ---------------------------------------------------------------------------------
    B, accum = recipe.train.batch_size, recipe.train.grad_accum
    step_tokens = tokens_per_step(recipe, world)
    use_teacher = teacher is not None and (recipe.loss.kl > 0 or recipe.loss.attn_out > 0)
    hooks = None
    if recipe.loss.attn_out > 0:  # resolve_teacher gave a teacher
        hooks = (AttentionOutputs(accelerator.unwrap_model(model), "student"), AttentionOutputs(teacher, "teacher"))
    finals = None
    if recipe.loss.chunk_tokens and (recipe.loss.kl > 0 or recipe.loss.ce > 0):
        finals = (FinalHidden(accelerator.unwrap_model(model), "student"),
                  FinalHidden(teacher, "teacher") if use_teacher and recipe.loss.kl > 0 else None)
    task = progress.add_task("healing", total=steps, completed=step, loss=float("nan"), tok_s=0.0) if (progress and main) else None
    last_saved = step if start.checkpoint is not None else None
    session_t0, session_tokens = time.perf_counter(), 0
    while step < steps:
        t0 = time.perf_counter()
        firsts = [samples + (micro * world + rank) * B for micro in range(accum)]  # each micro-batch's first sample
        batches = [stream.take(k, B) for k in firsts]  # accum x (B, T)
        starts = [block_start(k, room, recipe.train.seed) for k in firsts]
        sums, grad_norm = optimizer_step(accelerator, model, teacher if use_teacher else None, optimizer, batches,
                                         recipe, hooks, finals, starts)
        lr = scheduler.get_last_lr()[0]
        scheduler.step()
        sync_conversion_buffers(conv_modules, accelerator)
        step += 1
        samples += accum * world * B
        tokens += step_tokens
        keys = sorted(sums)
        values = accelerator.reduce(torch.stack([sums[k] for k in keys]), "mean").tolist()
        if not math.isfinite(loss := values[keys.index("loss")]):  # every process has the same mean: all stop
            raise EffattnError(f"the training loss is {loss} at step {step}: the training diverged",
                               f"lower optimizer.lr (now {recipe.optimizer.lr:g})"
                               + (" or set train.max_grad_norm" if recipe.train.max_grad_norm is None else "")
                               + " and start over with --force (the checkpoints may hold weights already diverging)")
        dt = time.perf_counter() - t0
        seconds += dt
        session_tokens += step_tokens
        kill_point("train.step", step)
        if main:
            record = {"kind": "train", "step": step, **dict(zip(keys, values)), "lr": lr, "grad_norm": grad_norm,
                      "tokens": tokens, "tokens_per_s": step_tokens / dt}
            metrics.append(record)
            kill_point("train.logged", step)
            if task is not None:
                progress.update(task, completed=step, loss=record["loss"],
                                tok_s=session_tokens / (time.perf_counter() - session_t0))
        if recipe.eval.every and step % recipe.eval.every == 0 and step < steps:
            result = evaluate_now() if evaluates else None
            if main:
                metrics.append({"kind": "eval", "step": step, "eval": result})
            accelerator.wait_for_everyone()
        if recipe.checkpoint.every and step % recipe.checkpoint.every == 0 and step < steps:
            save_checkpoint(accelerator, run, state_now(), recipe.checkpoint.keep)
            last_saved = step

    # -- the end: evaluate, checkpoint, write the model -------------------------------------------
    for hook in (*(hooks or ()), *(f for f in finals or () if f is not None)):
        hook.remove()
    final_eval = evaluate_now() if evaluates else None
    if main:
        if not any(r.get("kind") == "eval" and r["step"] == steps for r in metrics.records()):
            metrics.append({"kind": "eval", "step": steps, "eval": final_eval})
    if last_saved != steps:  # a kill while writing the model below resumes here, with nothing left to train
        save_checkpoint(accelerator, run, state_now(), recipe.checkpoint.keep)
    final = gathered_model(accelerator, model, student_path, recipe, main) if sharded else \
        native(accelerator.unwrap_model(model))
    out = record = None
    final_loss = float("nan")
    if main:
        train_records = [r for r in metrics.records() if r.get("kind") == "train"]
        final_loss = sum(r["loss"] for r in train_records[-10:]) / len(train_records[-10:])
        plot_curves(metrics.records(), run.curves, teacher_eval, title=f"effattn finetune · {run.out.name}")
        record = extend_record(student_record, recipe.student.model, {
            "command": command,
            "recipe": recipe_dict,
            "student": recipe.student.model,
            "teacher": teacher_spec,
            "params": recipe.train.params,
            "trainable_params": trainable,
            "total_params": total,
            "steps": steps,
            "tokens": tokens,
            "processes": world,
            "strategy": strategy,
            "seconds": round(seconds, 1),
            "final_loss": final_loss,  # mean training loss of the last 10 steps
            "eval_tokens": {s.corpus: s.blocks.shape[0] * (s.blocks.shape[1] - s.skip) for s in held_out},
            "resumes": resumes,  # each --resume with a changed recipe: the step and what changed
            "final_terms": {k: train_records[-1][k] for k in ("kl", "ce", "attn_out", "aux") if k in train_records[-1]},
            "start_eval": start_eval,
            "final_eval": final_eval,
            "teacher_eval": teacher_eval,
        })
        out = save_model(final, tokenizer, run.out, record, card=finetune_card(run.out.name, record, final.config.model_type), dtype=save_dtype,
                         force=True, side_files=Checkpoint(student_path).side_files(),
                         extra_files={"recipe.yaml": run.recipe, "metrics.jsonl": run.metrics, "curves.png": run.curves},
                         export_code=export_code_for(final))
    accelerator.wait_for_everyone()
    return FinetuneResult(out, final, steps, tokens, seconds, final_loss, start_eval, final_eval, resumed_from, record)


def gathered_model(accelerator, model, student_path: Path, recipe: Recipe, main: bool) -> torch.nn.Module | None:
    """The trained FSDP model, whole, as a native model on the main process (None on the others): every
    process takes part in gathering the state dict one tensor at a time; the main process loads it into
    an unsharded copy of the student (LoRA adapters in place, to be merged as without FSDP)."""
    state = distributed.full_state_dict(model)
    if not main:
        return None
    whole, _, _ = load_model(student_path, dtype="float32", tokenizer=False)
    whole = select_trainable(whole, recipe.train)
    whole.load_state_dict(state)
    del state
    return native(whole)


def finished_result(run: RunFolder, main: bool) -> FinetuneResult:
    """The result of the fine-tune already finished in OUT, read back from its folder (under fsdp by the
    main process only)."""
    ft = json.loads((run.out / "effattn.json").read_text())["finetune"]
    model = None
    if main or ft.get("strategy", "ddp") != "fsdp":
        model, _, _ = load_model(run.out, dtype="float32", tokenizer=False)
    record = json.loads((run.out / "effattn.json").read_text()) if main else None
    return FinetuneResult(run.out if main else None, model, ft["steps"], ft["tokens"], ft["seconds"],
                          ft["final_loss"] if main else float("nan"), ft["start_eval"] if main else None,
                          ft["final_eval"] if main else None, ft["steps"], record, written=False)


def _eval_line(step: int, result: dict[str, dict[str, float]]) -> str:
    parts = [f"{c} ppl {m['perplexity']:,.2f}" + (f", agreement {m['agreement']:.1%}" if "agreement" in m else "")
             for c, m in result.items()]
    return f"eval @ step {step}: " + "; ".join(parts)


def extend_record(student_record: dict[str, Any] | None, student: str, finetune: dict[str, Any]) -> dict[str, Any]:
    """The student's effattn.json with a `finetune` section added (an earlier one kept as its `previous`)."""
    record = dict(student_record or {"source": {"model": student}})
    previous = record.pop("finetune", None)
    record["effattn_version"] = __version__
    record["created"] = _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds")
    record["finetune"] = finetune | ({"previous": previous} if previous else {})
    return record
