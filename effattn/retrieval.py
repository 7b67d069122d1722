"""Long-context retrieval: can the model find one fact far back? `effattn eval MODEL --task passkey`.

Perplexity on short blocks says little about what efficient attention loses; windowed, quantized and
linear attention keep it close and lose retrieval first. Two tasks, each over a grid of context
lengths x depths (where in the text the fact sits, 0 = the start, 1 = just before the question):

  passkey  (Landmark Attention / LongLoRA's test) a 5-digit pass key hidden in filler text:
           "The pass key is 40231. Remember it. 40231 is the pass key." ... "What is the pass key?
           The pass key is" -> the model must continue with 40231.
  needle   (RULER's single needle-in-a-haystack) a key-value fact: "One of the special magic numbers
           for <word> is: 7281945." ... "What is the special magic number for <word> mentioned in the
           provided text? The special magic number for <word> mentioned in the provided text is"

The passkey's filler is, as in the papers, one repeated paragraph ("The grass is green. The sky is
blue. ..."); the needle's is natural text from a built-in corpus (default `britannica`, an evaluation
corpus: held out from calibration and training), taken at a random place for each sample. `--filler`
picks either for either task. The fact goes in at the
sentence boundary nearest its depth. Each prompt is exactly the cell's length in tokens. The answer is
greedy-decoded after a chunked prefill through the model's own cache (so long prompts never hold more
than one chunk's activations); it is correct when the first number it holds is the key (exact match).
Everything random comes from `seed`: the same seed gives the same prompts, hence the same answers.
"""

from __future__ import annotations

import random
import re
import warnings
from collections.abc import Callable
from dataclasses import asdict, dataclass, field, replace
from typing import Any

import torch

from .errors import EffattnError

TASKS = ("passkey", "needle")
REPEAT = "repeat"  # the passkey papers' filler
REPEAT_TEXT = "The grass is green. The sky is blue. The sun is yellow. Here we go. There and back again. "
DEFAULT_FILLER = {"passkey": REPEAT, "needle": "britannica"}
PREFILL_CHUNK = 2048  # tokens per prefill step: activations of one chunk, whatever the length
NEEDLE_WORDS = ("apple", "river", "orbit", "lantern", "meadow", "copper", "violet", "harbor", "falcon", "summit",
                "glacier", "ember", "quartz", "willow", "canyon", "saddle", "tundra", "comet", "marble", "pepper")


@dataclass(frozen=True)
class RetrievalSettings:
    task: str = "passkey"
    lengths: tuple[int, ...] = (2048, 4096, 8192)
    depths: tuple[float, ...] = (0.0, 0.25, 0.5, 0.75, 1.0)
    samples: int = 4  # prompts per (length, depth) cell
    seed: int = 0
    filler: str | None = None  # REPEAT or a corpus; None: the task's default (DEFAULT_FILLER)
    answer_tokens: int = 10
    prefill_chunk: int = PREFILL_CHUNK

    def validate(self) -> RetrievalSettings:
        if self.task not in TASKS:
            raise EffattnError(f"unknown task {self.task!r}", f"use --task {' or --task '.join(TASKS)}")
        if not self.lengths or min(self.lengths) < 128:
            raise EffattnError(f"--lengths {','.join(map(str, self.lengths))}: every length must be at least 128 tokens",
                               "e.g. --lengths 2048,4096,8192")
        if not self.depths or min(self.depths) < 0 or max(self.depths) > 1:
            raise EffattnError(f"--depths {','.join(map(str, self.depths))}: depths are fractions from 0 to 1",
                               "e.g. --depths 0,0.25,0.5,0.75,1")
        if self.samples < 1:
            raise EffattnError(f"--samples {self.samples} must be at least 1", "e.g. --samples 4")
        if self.filler is None:
            return replace(self, filler=DEFAULT_FILLER[self.task])
        if self.filler != REPEAT:
            from .data.corpora import load_text

            load_text(self.filler)  # a missing corpus or file is named now
        return self


@dataclass
class Prompt:
    ids: list[int]
    answer: str
    length: int
    depth: float  # asked for
    position: int  # token index where the fact starts


@dataclass
class RetrievalReport:
    settings: dict[str, Any]
    model: str
    accuracy: dict[int, dict[float, float]]  # length -> depth -> share of exact matches
    mean: float
    baseline: str | None = None
    baseline_accuracy: dict[int, dict[float, float]] | None = None
    baseline_mean: float | None = None
    samples: list[dict[str, Any]] = field(default_factory=list)  # each prompt: length, depth, answer, outputs
    notes: list[str] = field(default_factory=list)
    dtype: str | None = None  # what the models ran in (--dtype auto resolved)

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


def _phrases(task: str, rng: random.Random) -> tuple[str, str, str, str]:
    """(instruction, fact, question, answer) of one sample."""
    if task == "passkey":
        key = str(rng.randint(10000, 99999))
        # the lines of LongLoRA's / Landmark Attention's prompt, joined by newlines as there
        return ("There is an important info hidden inside a lot of irrelevant text. Find it and memorize it. I will "
                "quiz you about the important information there.\n",
                f"\nThe pass key is {key}. Remember it. {key} is the pass key.\n",
                "\nWhat is the pass key? The pass key is", key)
    word, number = rng.choice(NEEDLE_WORDS), str(rng.randint(1000000, 9999999))
    return ("Some special magic numbers are hidden within the following text. Make sure to memorize them. I will "
            "quiz you about the numbers afterwards.\n\n",
            f" One of the special magic numbers for {word} is: {number}.",
            f"\n\nWhat is the special magic number for {word} mentioned in the provided text? The special magic "
            f"number for {word} mentioned in the provided text is", number)


class PromptBuilder:
    """Builds the grid's prompts with one tokenizer: filler tokens are computed once."""

    def __init__(self, tokenizer, settings: RetrievalSettings):
        from .data.corpora import load_text

        self.tok, self.settings = tokenizer, settings
        text = REPEAT_TEXT * 400 if settings.filler == REPEAT else load_text(settings.filler)
        self.filler = self.encode(text)
        if len(self.filler) < 64:
            raise EffattnError(f"filler {settings.filler!r} has {len(self.filler)} tokens", "use a longer --filler text")
        pieces = tokenizer.convert_ids_to_tokens(self.filler)
        # token i ends a sentence: the fact is inserted after it
        self.ends = [bool(re.search(r"[.!?][\"')\]]?$", tokenizer.convert_tokens_to_string([p]).rstrip()))
                     for p in pieces]
        probe = tokenizer("a")["input_ids"]
        self.bos = [probe[0]] if tokenizer.bos_token_id is not None and probe and probe[0] == tokenizer.bos_token_id else []

    def encode(self, text: str) -> list[int]:
        return self.tok(text, add_special_tokens=False, return_attention_mask=False)["input_ids"]

    def prompts(self) -> list[Prompt]:
        s = self.settings
        rng = random.Random(s.seed)
        out = []
        for length in s.lengths:
            for depth in s.depths:
                for _ in range(s.samples):
                    out.append(self.one(length, depth, rng))
        return out

    def one(self, length: int, depth: float, rng: random.Random) -> Prompt:
        instruction, fact, question, answer = _phrases(self.settings.task, rng)
        head, fact_ids, tail = self.bos + self.encode(instruction), self.encode(fact), self.encode(question)
        n = length - len(head) - len(fact_ids) - len(tail)
        if n < 16:
            need = length - n + 16
            raise EffattnError(f"--lengths {length} leaves no room for filler: the {self.settings.task} prompt's own "
                               f"text is {length - n:,} tokens with this tokenizer", f"use lengths of {need} tokens or more")
        start = rng.randrange(len(self.filler))
        idx = [(start + i) % len(self.filler) for i in range(n)]  # the filler wraps around
        filler = [self.filler[i] for i in idx]
        at = round(depth * n)
        if 0 < at:  # the nearest sentence end at or before the depth, within 200 tokens
            for j in range(at, max(0, at - 200), -1):
                if self.ends[idx[j - 1]]:
                    at = j
                    break
        ids = head + filler[:at] + fact_ids + filler[at:] + tail
        return Prompt(ids, answer, length, depth, len(head) + at)


@torch.no_grad()
def greedy_answer(model, ids: list[int], new_tokens: int, chunk: int = PREFILL_CHUNK) -> list[int]:
    """Greedy continuation of `ids` after a prefill in chunks of `chunk` tokens through the model's cache
    (in one forward for a dynamic-NTK model, whose chunks would rotate keys at different frequencies)."""
    from .evaluate import one_pass_only

    device = next(model.parameters()).device
    x = torch.tensor([ids], device=device)
    if one_pass_only(model):
        chunk = x.shape[1]
    cache, out = None, None
    for start in range(0, x.shape[1], chunk):
        out = model(input_ids=x[:, start : start + chunk], cache=cache, use_cache=True, logits_to_keep=1)
        cache = out.cache
    token = out.logits[:, -1:].argmax(-1)
    answer = [int(token)]
    for _ in range(new_tokens - 1):
        out = model(input_ids=token, cache=cache, use_cache=True)
        cache, token = out.cache, out.logits[:, -1:].argmax(-1)
        answer.append(int(token))
    return answer


def is_correct(text: str, answer: str) -> bool:
    """Exact match: the first number in the model's continuation is the key."""
    found = re.search(r"\d+", text)
    return found is not None and found.group(0) == answer


def grid(results: list[tuple[Prompt, bool]], settings: RetrievalSettings) -> dict[int, dict[float, float]]:
    acc: dict[int, dict[float, float]] = {}
    for length in settings.lengths:
        acc[length] = {}
        for depth in settings.depths:
            cell = [ok for p, ok in results if p.length == length and p.depth == depth]
            acc[length][depth] = sum(cell) / len(cell)
    return acc


def run_model(model, tokenizer, prompts: list[Prompt], settings: RetrievalSettings,
              progress: Callable[[int], None] | None = None) -> list[tuple[Prompt, bool, str]]:
    out = []
    for i, prompt in enumerate(prompts):
        tokens = greedy_answer(model, prompt.ids, settings.answer_tokens, settings.prefill_chunk)
        text = tokenizer.decode(tokens, skip_special_tokens=True)
        out.append((prompt, is_correct(text, prompt.answer), text))
        if progress is not None:
            progress(i + 1)
    return out


def estimate(config: dict[str, Any], params: int, settings: RetrievalSettings, *, models: int = 1,
             dtype: torch.dtype = torch.float32, cast_bytes: int = 0) -> tuple[float, int]:
    """(seconds, peak bytes above the process's) of the grid on this machine with the weights in `dtype`: every
    prompt's prefill and answer, per model; memory: the weights, the cache at the longest length, one chunk's
    activations (the cache and activations counted in float32, an upper bound), or loading a model stored in
    another dtype (`cast_bytes`, evaluate.load_cast_bytes) if that is more.
    Time: the prefill passes every prompt token through the decoder layers (the embedding is a lookup; priced at
    PREFILL_EFFICIENCY), their attention reads the cache (ATTENTION_EFFICIENCY, at the float32 probe in any dtype),
    and logits come at the last position only; each further answer token is a decode step (DECODE_EFFICIENCY).
    Pricing all of it as an evaluation forward (FORWARD_EFFICIENCY, the output layer at every position), as this
    did until 2026-12-07, priced the built-in model's float32 grids 1.3-1.7x above their measured time."""
    from .convert.base import kv_bytes_per_token
    from .resources import (ATTENTION_EFFICIENCY, MODEL_LOAD_SECONDS, PREFILL_EFFICIENCY, TOKENIZE_BYTES_PER_CHAR,
                            Dims, compute_seconds, decode_seconds, input_embedding_params)

    dims = Dims.of(config)
    output = dims.vocab * dims.hidden  # the output layer: the prefill runs it at the last position only
    layers = max(params - input_embedding_params(config) - output, 0)
    seconds = MODEL_LOAD_SECONDS
    per_cell = settings.samples * len(settings.depths)
    for length in settings.lengths:
        matmuls = 2 * layers * length + 2 * output
        attention = dims.layers * dims.scores_flops(length, length)
        seconds += per_cell * (compute_seconds(matmuls, PREFILL_EFFICIENCY, dtype)
                               + compute_seconds(attention, ATTENTION_EFFICIENCY)
                               + decode_seconds(config, params, length, settings.answer_tokens - 1))
    longest, chunk = max(settings.lengths), min(settings.prefill_chunk, max(settings.lengths))
    layer = chunk * (12 * dims.hidden + 4 * dims.intermediate) * 4
    scores = dims.heads * chunk * (longest + settings.answer_tokens) * 4  # a chunk's queries against the cache
    cache = (longest + settings.answer_tokens) * kv_bytes_per_token(config, torch.float32)
    from .data.corpora import load_text

    tokenize = (len(REPEAT_TEXT) * 400 if settings.filler == REPEAT else len(load_text(settings.filler))) * TOKENIZE_BYTES_PER_CHAR
    return models * seconds, models * params * dtype.itemsize + max(layer + scores + cache, tokenize, cast_bytes)


def evaluate_retrieval(model, baseline=None, settings: RetrievalSettings | None = None, *, dtype: str = "float32",
                       trust_remote_code: bool = False, allow_pickle: bool = False, tokenizer=None,
                       memory_check: bool = True,
                       progress: Callable[[str, int, int], None] | None = None,
                       warn: Callable[[str], None] | None = None,
                       say: Callable[[str], None] | None = None,
                       attn_implementation: str | None = None, device: str = "cpu",
                       dry_run: bool = False) -> RetrievalReport | EvalPlan:
    """Run the retrieval grid on MODEL (and BASELINE, with MODEL's tokenizer and the same prompts).
    `progress(name, done, total)` is called after each prompt; before the work, `warn` gets one-line notes
    (lengths beyond the trained context) and `say` the time and memory estimate. Everything is checked before
    any weights load (the checkpoints, the memory, every prompt built); `dry_run=True` returns that plan
    (EvalPlan) and loads no weights."""
    from .evaluate import TOKENIZER_FIX, EvalPlan, check_same_tokenizer, check_vocabularies, load_cast_bytes
    from .families import beyond_positions
    from .io.load import as_ref, check_loadable, check_tokenizer_fits, load_model, load_tokenizer, parse_dtype
    from .resources import check_device, check_memory, rss

    settings = (settings or RetrievalSettings()).validate()
    cuda = check_device(device).startswith("cuda")
    # a dry run plans a .gguf from its metadata: it dequantizes nothing (convert --dry-run does the same)
    refs = [as_ref(m, trust_remote_code=trust_remote_code, plan_only=dry_run) for m in (model, baseline)
            if m is not None]
    ckpts = [check_loadable(r, trust_remote_code=trust_remote_code, allow_pickle=allow_pickle,
                            attn_implementation=attn_implementation if i == 0 else None, dtype=dtype,
                            plan_only=dry_run)
             for i, r in enumerate(refs)]
    if len(ckpts) == 2:  # the baseline reads MODEL's prompts
        check_vocabularies(ckpts[0].config.get("vocab_size"), ckpts[1].config.get("vocab_size"))
    notes = []
    for ref, ckpt in zip(refs, ckpts):
        note = beyond_positions(ckpt.config, settings.lengths, ref.display, f"--lengths up to {max(settings.lengths):,}")
        if note:
            notes.append(note)
    runs_in = parse_dtype(dtype) or ckpts[0].dtype
    cast = 0 if cuda else load_cast_bytes(ckpts, parse_dtype(dtype))  # in host memory, before a GPU gets the weights
    seconds, work = estimate(ckpts[0].config, max(c.num_params for c in ckpts), settings, models=len(ckpts),
                             dtype=runs_in, cast_bytes=cast)
    now = 0 if cuda else rss()  # on a GPU: the device's memory, weights, cache and activations

    def peak_at(longest: int) -> int:
        # every length capped at `longest` (dropping the longer ones left a grid that fit, and the refusal named a
        # length that did not)
        fewer = RetrievalSettings(**(asdict(settings) | {"lengths": tuple(dict.fromkeys(min(n, longest)
                                                                                          for n in settings.lengths))}))
        return now + estimate(ckpts[0].config, max(c.num_params for c in ckpts), fewer, models=len(ckpts),
                              dtype=runs_in, cast_bytes=cast)[1]

    check_memory(now + work, what=f"the {settings.task} grid up to {max(settings.lengths):,} tokens",
                 options=[("--lengths values of", max(settings.lengths), peak_at, 128, 1)], check=memory_check,
                 device=device if cuda else None)

    tok = load_tokenizer(tokenizer or refs[0], trust_remote_code=trust_remote_code, plan_only=dry_run)
    check_same_tokenizer(tok, refs[1] if len(refs) == 2 else None, trust_remote_code=trust_remote_code,
                         plan_only=dry_run)
    check_tokenizer_fits(tok, zip([r.display for r in refs], [c.config for c in ckpts]), TOKENIZER_FIX)
    prompts = PromptBuilder(tok, settings).prompts()  # a bad length or filler is refused before the model loads
    plan = EvalPlan(task=settings.task, model=refs[0].display, baseline=refs[1].display if baseline else None,
                    dtype=str(runs_in).removeprefix("torch."), device=device, est_peak_bytes=now + work,
                    est_seconds=None if cuda else seconds,  # CPU timings only
                    work={"prompts": len(prompts) * len(ckpts), "lengths": list(settings.lengths)}, notes=notes)
    if dry_run:
        return plan
    for note in notes:
        if warn is not None:
            warn(note)
    if say is not None:
        say(f"{plan.work['prompts']} prompts: {plan.estimates()}")
    lm, _, ref = load_model(refs[0], dtype=dtype, trust_remote_code=trust_remote_code, allow_pickle=allow_pickle,
                            tokenizer=False, attn_implementation=attn_implementation, device=device)
    total = len(prompts)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        mine = run_model(lm, tok, prompts, settings, progress and (lambda i: progress(ref.display, i, total)))
    del lm
    report = RetrievalReport(settings=asdict(settings), model=ref.display,
                             accuracy=grid([(p, ok) for p, ok, _ in mine], settings),
                             mean=sum(ok for _, ok, _ in mine) / total, notes=notes, dtype=plan.dtype)
    theirs = None
    if baseline is not None:
        base, _, base_ref = load_model(refs[1], dtype=dtype, trust_remote_code=trust_remote_code,
                                       allow_pickle=allow_pickle, tokenizer=False, device=device)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            theirs = run_model(base, tok, prompts, settings, progress and (lambda i: progress(base_ref.display, i, total)))
        report.baseline = base_ref.display
        report.baseline_accuracy = grid([(p, ok) for p, ok, _ in theirs], settings)
        report.baseline_mean = sum(ok for _, ok, _ in theirs) / total
    for i, (prompt, ok, text) in enumerate(mine):
        row = {"length": prompt.length, "depth": prompt.depth, "position": prompt.position, "answer": prompt.answer,
               "output": text, "correct": ok}
        if theirs is not None:
            row |= {"baseline_output": theirs[i][2], "baseline_correct": theirs[i][1]}
        report.samples.append(row)
    return report


def plot_heatmap(report: RetrievalReport, path) -> None:
    """Accuracy per (depth, length) cell, one panel per model, as a PNG."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    panels = [(report.model, report.accuracy)]
    if report.baseline_accuracy is not None:
        panels.append((report.baseline, report.baseline_accuracy))
    lengths = list(report.accuracy)
    depths = list(next(iter(report.accuracy.values())))
    fig, axes = plt.subplots(1, len(panels), figsize=(1.2 + 1.1 * len(lengths) * len(panels), 1.2 + 0.5 * len(depths)),
                             squeeze=False)
    for ax, (name, acc) in zip(axes[0], panels):
        data = [[acc[n][d] for n in lengths] for d in depths]
        ax.imshow(data, vmin=0, vmax=1, cmap="RdYlGn", aspect="auto")
        ax.set_xticks(range(len(lengths)), [f"{n:,}" for n in lengths])
        ax.set_yticks(range(len(depths)), [f"{d:g}" for d in depths])
        ax.set_xlabel("context length (tokens)")
        ax.set_ylabel("depth of the fact")
        ax.set_title(f"{name}: {report.settings['task']}", fontsize=9)
        for i, row in enumerate(data):
            for j, v in enumerate(row):
                ax.text(j, i, f"{v:.0%}", ha="center", va="center", fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
