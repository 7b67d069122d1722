"""Text sampled from a model itself: `effattn sample MODEL -o FILE`, calibration text without a corpus.

A conversion calibrates on text, and each corpus pulls the converted model towards its own domain
(BENCHMARKS.md, the calibration-domain tables): calibrated on prose it reads prose better and code
worse. Where the text a model will read is not at hand, its own samples are a stand-in that holds what
it learned to write, in the shares it writes it: LLM-QAT (Liu et al., 2023) calibrated and trained
quantized models on such "data-free" text. Every sequence starts from the tokenizer's BOS token (EOS
where it has none) and is drawn by plain sampling (no top-k, no top-p) at `temperature`, `seq_len`
tokens long, the end-of-text token held back until then; the sequences are decoded and joined by blank
lines. The same model, settings and seed give the same text. Pass the file to a conversion, alone or
beside a corpus: `--calib calib,FILE`.
"""

from __future__ import annotations

import math
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import torch

from ..errors import EffattnError

# Seconds of one sampling step (every sequence of a batch one token further): a batch-1 decode step's price
# (`decode_seconds`: bound by reading the weights) times SAMPLE_DECODE_FACTOR (generate's own loop, the sampling over
# the vocabulary), plus every sequence's FLOPs at FORWARD_EFFICIENCY. Fitted on the built-in model in float32 on 2 idle
# cores (AMD EPYC, probe 233 GFLOP/s): `effattn sample llama -o FILE` took 55.3 s for 16 sequences of 512 tokens in
# one batch (a step 0.104 s) and 37.3 s for 2 in one batch (0.069 s), the load included.
SAMPLE_DECODE_FACTOR = 2.35


TEMPERATURES = (0.01, 100.0)  # the temperatures sampling takes


@dataclass(frozen=True)
class SampleSettings:
    tokens: int = 8192  # tokens in all, each sequence's start token included, rounded up to whole sequences
    seq_len: int = 512
    batch_size: int = 16  # sequences sampled side by side
    seed: int = 0
    temperature: float = 1.0

    @property
    def sequences(self) -> int:
        return math.ceil(self.tokens / self.seq_len)

    def validate(self) -> SampleSettings:
        for name, lowest in (("tokens", 1), ("seq_len", 2), ("batch_size", 1)):
            if getattr(self, name) < lowest:
                flag = "--" + name.replace("_", "-")
                raise EffattnError(f"{flag} must be at least {lowest}, got {getattr(self, name)}",
                                   f"use e.g. {flag} {getattr(SampleSettings, name)}")
        if not 0 <= self.seed < 2**63:
            raise EffattnError(f"--seed {self.seed} is outside torch's seeds (0 to 2**63 - 1)", "use e.g. --seed 0")
        if not (math.isfinite(self.temperature) and TEMPERATURES[0] <= self.temperature <= TEMPERATURES[1]):
            # beyond these the logits over the temperature overflow float32 (or flatten to nothing), and sampling fails
            raise EffattnError(f"--temperature must be from {TEMPERATURES[0]:g} to {TEMPERATURES[1]:g}, got "
                               f"{self.temperature:g}", "use e.g. --temperature 1.0 (the model's own distribution)")
        return self


@dataclass
class SamplePlan:
    model: str
    output: str
    dtype: str
    sequences: int
    seq_len: int
    tokens: int
    est_seconds: float
    est_peak_bytes: int
    notes: list[str] = field(default_factory=list)

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


@dataclass
class SampleReport:
    model: str
    output: str
    sequences: int
    tokens: int  # as --tokens counts them: each sequence's start token included
    sampled_tokens: int  # the start tokens left out: what the text holds
    characters: int
    seconds: float
    settings: dict[str, Any]
    notes: list[str] = field(default_factory=list)

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


def start_token(tokenizer) -> int:
    """The token every sample starts from: BOS, else EOS (a document's start for a model trained on text joined
    by EOS)."""
    for token in (tokenizer.bos_token_id, tokenizer.eos_token_id):
        if token is not None:
            return token
    raise EffattnError("the tokenizer has neither a BOS nor an EOS token to start samples from",
                       "use a model whose tokenizer names a bos_token or eos_token")


def sample_peak_bytes(config: dict, params: int, settings: SampleSettings, *, weight_bytes: int, cast_bytes: int = 0,
                      batch_size: int | None = None) -> int:
    """Memory sampling holds above the process's: the weights, then a batch's cache at full length (float32 on the
    CPU, as transformers' cache holds the keys and values of a float32 model) and its logits (a few copies through
    the logits processors), or the cast of a checkpoint loaded in another dtype, whichever is larger."""
    from ..convert.base import kv_bytes_per_token
    from ..resources import Dims

    batch = settings.batch_size if batch_size is None else batch_size
    dims = Dims.of(config)
    cache = batch * settings.seq_len * kv_bytes_per_token(config, torch.float32)
    step = batch * (4 * dims.vocab * 4 + (12 * dims.hidden + 4 * dims.intermediate) * 4)
    return params * weight_bytes + max(cache + step, cast_bytes)


def sample_seconds(config: dict, params: int, settings: SampleSettings) -> float:
    """Seconds of sampling on this CPU (idle): every batch takes seq_len - 1 steps, each priced as SAMPLE_DECODE_FACTOR
    says (the attention over the cache at the full length: an upper bound)."""
    from ..resources import (FORWARD_EFFICIENCY, MODEL_LOAD_SECONDS, Dims, compute_seconds, decode_seconds,
                             input_embedding_params)

    dims = Dims.of(config)
    steps = (settings.seq_len - 1) * math.ceil(settings.sequences / settings.batch_size)  # every batch's steps
    per_sequence = (2 * max(params - input_embedding_params(config), 0)
                    + dims.layers * dims.scores_flops(1, settings.seq_len))
    flops = (settings.seq_len - 1) * settings.sequences * per_sequence
    step = SAMPLE_DECODE_FACTOR * decode_seconds(config, params, settings.seq_len // 2)
    return MODEL_LOAD_SECONDS + steps * step + compute_seconds(flops, FORWARD_EFFICIENCY)


def check_output_file(output: Path, force: bool, model: Path | None = None) -> Path:
    """The file the text goes to (where a symbolic link leads), refused before any work: a folder, an existing file
    without --force, one of the model's own files, a name too long for the temporary file beside it, a path under a
    file, a folder nothing can be written in."""
    from ..io.writer import check_writable, temporary_file

    given = Path(output).expanduser()
    if given.is_symlink() and not force:  # a dangling link too: replacing it is replacing something
        raise EffattnError(f"{given} exists (a symbolic link)",
                           "pass --force to write where it leads, or name another file")
    output = given.resolve() if given.is_symlink() else given.absolute()
    if output.is_dir():
        raise EffattnError(f"{given} is a folder; sample writes one text file",
                           f"name a file, e.g. {given / 'samples.txt'}")
    if output.exists() and not force:
        raise EffattnError(f"{given} exists", "pass --force to replace it, or name another file")
    if model is not None and output.exists() and output.resolve().is_relative_to(Path(model).resolve()):
        raise EffattnError(f"{given} is one of the model's own files: writing it would destroy the input",
                           "name a file outside the model's folder")
    longer = len(temporary_file(output).name) - len(output.name)  # the name it is written under first
    if len(output.name) + longer > 255:
        raise EffattnError(f"the file name {output.name[:40]}... is too long ({len(output.name)} characters)",
                           f"use a name of at most {255 - longer} characters")
    for parent in output.parents:  # missing folders are made when the text is written
        if parent.exists():
            if not parent.is_dir():
                raise EffattnError(f"{parent} is a file, so {given} cannot be written", "name a file in a folder")
            check_writable(parent, given)
            break
    return output


def plan_sample(model, output: Path, settings: SampleSettings, *, dtype: str = "float32",
                trust_remote_code: bool = False, allow_pickle: bool = False, memory_check: bool = True,
                force: bool = False) -> SamplePlan:
    """Check everything a sampling run needs before any weights load (the output file, the model, its tokenizer
    and start token, the memory) and price it."""
    from ..evaluate import load_cast_bytes
    from ..families import beyond_positions
    from ..io.load import as_ref, check_loadable, check_tokenizer_fits, load_tokenizer, parse_dtype, tokenizer_missing
    from ..resources import check_memory, rss

    settings = settings.validate()
    ref = as_ref(model, trust_remote_code=trust_remote_code, plan_only=True)
    output = check_output_file(output, force, ref.source)  # the .gguf file, or the model's folder
    ckpt = check_loadable(ref, trust_remote_code=trust_remote_code, allow_pickle=allow_pickle, dtype=dtype,
                          plan_only=True)
    why = tokenizer_missing(ref.path)
    if why:
        raise EffattnError(why, "copy the tokenizer files of the model it came from into it")
    tokenizer = load_tokenizer(ref, trust_remote_code=trust_remote_code, plan_only=True)
    check_tokenizer_fits(tokenizer, [(ref.display, ckpt.config)])
    start_token(tokenizer)
    notes = [n for n in [beyond_positions(ckpt.config, [settings.seq_len], ref.display,
                                          f"--seq-len {settings.seq_len:,}")] if n]
    runs_in = parse_dtype(dtype) or ckpt.dtype
    cast = load_cast_bytes([ckpt], parse_dtype(dtype))
    now = rss()

    def peak(batch_size: int) -> int:
        return now + sample_peak_bytes(ckpt.config, ckpt.num_params, settings, weight_bytes=runs_in.itemsize,
                                       cast_bytes=cast, batch_size=batch_size)

    check_memory(peak(settings.batch_size), what=f"sampling {settings.batch_size} sequences of {settings.seq_len:,} "
                 "tokens at once", options=[("--batch-size", settings.batch_size, peak, 1, 1)], check=memory_check)
    return SamplePlan(model=ref.display, output=str(output), dtype=str(runs_in).removeprefix("torch."),
                      sequences=settings.sequences, seq_len=settings.seq_len,
                      tokens=settings.sequences * settings.seq_len,
                      est_seconds=sample_seconds(ckpt.config, ckpt.num_params, settings),
                      est_peak_bytes=peak(settings.batch_size), notes=notes)


@torch.no_grad()
def sample_texts(model: torch.nn.Module, tokenizer, settings: SampleSettings, progress=None) -> list[str]:
    """`settings.sequences` texts sampled from `model` (see the module docstring), in batches."""
    start = start_token(tokenizer)
    caller_rng = torch.random.get_rng_state()
    torch.manual_seed(settings.seed)
    texts: list[str] = []
    try:
        left = settings.sequences
        while left > 0:
            batch = min(settings.batch_size, left)
            ids = torch.full((batch, 1), start, dtype=torch.long, device=model.device)
            new = settings.seq_len - 1
            out = model.generate(ids, attention_mask=torch.ones_like(ids), do_sample=True,
                                 temperature=settings.temperature, top_k=0, top_p=1.0, max_new_tokens=new,
                                 min_new_tokens=new, pad_token_id=tokenizer.eos_token_id if
                                 tokenizer.eos_token_id is not None else start)
            texts += [tokenizer.decode(row[1:], skip_special_tokens=True).strip() for row in out]
            left -= batch
            if progress is not None:
                progress(batch)
    finally:
        torch.random.set_rng_state(caller_rng)
    return texts


def sample(model, output: Path, settings: SampleSettings | None = None, *, dtype: str = "float32",
           trust_remote_code: bool = False, allow_pickle: bool = False, memory_check: bool = True,
           force: bool = False, dry_run: bool = False, progress=None) -> SamplePlan | SampleReport:
    """Sample text from MODEL into the UTF-8 file `output` (the library entry point of `effattn sample`). The
    file appears whole or not at all: the text goes to a temporary file beside it, renamed when complete.
    `dry_run=True` returns the plan and loads no weights."""
    from ..io.load import load_model
    from ..io.writer import disk_error, write_text

    settings = settings or SampleSettings()
    plan = plan_sample(model, output, settings, dtype=dtype, trust_remote_code=trust_remote_code,
                       allow_pickle=allow_pickle, memory_check=memory_check, force=force)
    if dry_run:
        return plan
    began = time.perf_counter()
    # the model itself (a .gguf was planned from its metadata: it is dequantized now)
    lm, tokenizer, ref = load_model(model, dtype=dtype, trust_remote_code=trust_remote_code, allow_pickle=allow_pickle)
    texts = sample_texts(lm, tokenizer, settings, progress=progress)
    text = "\n\n".join(texts) + "\n"
    output = Path(plan.output)
    made = [p for p in [output.parent, *output.parent.parents] if not p.exists()]  # removed again on a failure
    try:
        output.parent.mkdir(parents=True, exist_ok=True)
        write_text(output, text)
    except OSError as exc:
        for folder in made:  # deepest first
            try:
                folder.rmdir()
            except OSError:
                break
        raise (disk_error(exc, output) or EffattnError(f"could not write {output}: {exc.strerror or exc}",
                                                       "choose another -o")) from None
    return SampleReport(model=ref.display, output=str(output), sequences=len(texts),
                        tokens=len(texts) * settings.seq_len, sampled_tokens=len(texts) * (settings.seq_len - 1),
                        characters=len(text), seconds=round(time.perf_counter() - began, 1),
                        settings=asdict(settings), notes=plan.notes)
