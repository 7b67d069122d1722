"""Measure a model, alone or against a baseline: quality, KV-cache memory and speed.

Quality: perplexity on held-out text; against a baseline also top-1 agreement (how often both
models predict the same next token) and KL(baseline || model) per token. Memory: KV-cache bytes per
token, measured by summing the tensors of a real cache after a forward pass (not computed from the
config). Speed: prefill and decode tokens/s, median of a few timed runs.
"""

from __future__ import annotations

from contextlib import nullcontext

import math
import statistics
import time
from dataclasses import asdict, dataclass, field
from typing import Any

import torch
import torch.nn.functional as F

from .data import corpora
from .data.corpora import load_text, token_blocks
from .errors import EffattnError
from .kernels import gemv


@dataclass
class EvalSettings:
    corpora: tuple[str, ...] = corpora.DEFAULT_EVAL
    context: int = 512
    max_tokens: int = 8192  # per corpus
    batch_size: int = 2
    speed: bool = True
    decode_tokens: int = 32
    speed_repeats: int = 3
    speed_context: int | None = None  # also time prefill and decode after this many tokens (None: not)
    bos: bool = False  # score every block with the tokenizer's BOS (or EOS) token in front: prefix_token


@dataclass
class ModelMeasure:
    name: str
    params: int
    perplexity: dict[str, float] = field(default_factory=dict)
    kv_bytes_per_token: float | None = None
    kv_context: int | None = None
    prefill_tokens_per_s: float | None = None  # at the evaluation context (`kv_context` tokens)
    decode_tokens_per_s: float | None = None
    # every context speed was measured at: {"context", "prefill_tokens_per_s", "decode_tokens_per_s"}
    speed: list[dict[str, float]] = field(default_factory=list)


@dataclass
class EvalReport:
    settings: dict[str, Any]
    model: ModelMeasure
    baseline: ModelMeasure | None = None
    agreement: dict[str, float] = field(default_factory=dict)  # top-1 agreement with the baseline
    kl: dict[str, float] = field(default_factory=dict)  # mean KL(baseline || model) per token, nats
    tokens: dict[str, int] = field(default_factory=dict)
    # the context beyond which the model decodes faster than the baseline (decode_break_even)
    decode_break_even: dict[str, Any] | None = None
    # what ran the linear layers of the timed decode steps, the same for both models (kernels/gemv)
    decode_linears: str | None = None
    dtype: str | None = None  # what the models ran in (float32, bfloat16, ...; --dtype auto resolved)

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


@dataclass
class EvalPlan:
    """What `effattn eval` will do, from the checks it makes before any weights load (`--dry-run` prints it)."""
    task: str
    model: str
    baseline: str | None
    dtype: str
    device: str
    est_peak_bytes: int  # the process's resident set at the peak (on a GPU: the device's memory)
    est_seconds: float | None  # on this machine's CPU, idle (None on a GPU: no estimate)
    work: dict[str, Any] = field(default_factory=dict)  # perplexity: tokens read per corpus; retrieval: prompts
    notes: list[str] = field(default_factory=list)  # warnings the run gives (lengths beyond the trained context)

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    def estimates(self) -> str:
        """The estimates in one phrase, as a run states them when it starts."""
        cuda = self.device.startswith("cuda")
        seconds = self.est_seconds
        when = "" if seconds is None else "estimated " + (f"~{seconds:,.0f} s" if seconds < 120 else
                                                          f"~{seconds / 60:,.1f} min") + " on this machine (idle), "
        return when + f"~{self.est_peak_bytes / 2**30:,.1f} GiB {f'of {self.device} ' if cuda else ''}at the peak"


def log_probs(model, ids: torch.Tensor, autocast=nullcontext,
              positions: torch.Tensor | None = None) -> torch.Tensor:
    """Next-token log-probabilities [B, T, V] (float32) of `model` on ids [B, T] (moved to its device), read at
    `positions` [1, T] (default 0..T-1)."""
    device = next(model.parameters()).device
    at = {} if positions is None else {"position_ids": positions.to(device)}
    with autocast():
        logits = model(input_ids=ids.to(device), use_cache=False, **at).logits
    return F.log_softmax(logits.float(), dim=-1)


def target_nll(logp: torch.Tensor, ids: torch.Tensor) -> float:
    """Σ −log p(next token) over every position that has a next token; logp [B, T, V], ids [B, T]."""
    return -logp[:, :-1].gather(-1, ids[:, 1:, None].to(logp.device)).sum().item()


LOGIT_CHUNK = 128  # positions whose [B, chunk, vocab] log-probabilities exist at once


def logp_chunks(model, ids: torch.Tensor, chunk: int = LOGIT_CHUNK):
    """Yield (start, log-probabilities [B, n, V]) over the positions of ids [B, T], `chunk` positions at a
    time: the decoder runs once, the LM head per chunk, so a long block never holds its whole [B, T, V]
    logits (at 8K tokens and a 49K vocabulary that is 1.6 GB a copy). The model's own forward runs, with
    its LM head swapped for the identity so that it returns the final hidden states; models without a
    linear `lm_head`, or with a logit soft-cap after it, get one chunk of full logits."""
    head = getattr(model, "lm_head", None)
    if not isinstance(head, torch.nn.Linear) or getattr(model.config, "final_logit_softcapping", None) or ids.shape[1] <= chunk:
        yield 0, log_probs(model, ids)
        return
    model.lm_head = torch.nn.Identity()
    try:
        hidden = final_hidden(model, ids.to(head.weight.device))  # (B, T, D)
    finally:
        model.lm_head = head
    for start in range(0, ids.shape[1], chunk):
        yield start, F.log_softmax(head(hidden[:, start : start + chunk]).float(), dim=-1)


PREFILL_CHUNK = 32768  # longer blocks run in chunks of this many positions through the model's cache


def perplexity(mean_nll: float) -> float:
    """exp(mean NLL); infinite beyond float64's range (a broken model's mean loss above ~709 nats raised an
    OverflowError after the whole evaluation), NaN where the loss is."""
    try:
        return math.exp(mean_nll)
    except OverflowError:
        return math.inf


def one_pass_only(model) -> bool:
    """Whether the model must see a sequence in one forward: dynamic NTK RoPE rescales its frequencies
    to the longest position of each forward, so keys cached by an earlier chunk were rotated at other
    frequencies than the later ones (a chunked prefill is then not the model's own computation)."""
    from .families import rope_settings

    config = getattr(model, "config", None)
    return config is not None and rope_settings(config.to_dict()).get("rope_type") == "dynamic"


def final_hidden(model, ids: torch.Tensor, chunk: int = PREFILL_CHUNK) -> torch.Tensor:
    """The model's output over ids [B, T] in one forward, or, for blocks longer than `chunk`, in chunks
    through its own cache (as generation prefills): a 32K block then holds one chunk's activations and
    the cache, not 32K positions' activations in every layer. Dynamic-NTK models: one forward."""
    if ids.shape[1] <= chunk or one_pass_only(model):
        return model(input_ids=ids, use_cache=False).logits
    cache, parts = None, []
    for start in range(0, ids.shape[1], chunk):
        out = model(input_ids=ids[:, start : start + chunk], cache=cache, use_cache=True)
        cache = out.cache
        parts.append(out.logits)
    return torch.cat(parts, dim=1)


def prefix_token(tokenizer) -> int:
    """The token `--bos` puts in front of every block: the tokenizer's BOS token, or its EOS token where it
    has no BOS (Qwen2's tokenizers), as lm-evaluation-harness picks the prefix of its rolling perplexity."""
    for token in (tokenizer.bos_token_id, tokenizer.eos_token_id):
        if token is not None:
            return int(token)
    raise EffattnError("the tokenizer has neither a BOS nor an EOS token, so --bos has nothing to put in front of "
                       "a block", "drop --bos, or pass --tokenizer with a tokenizer that has one")


def with_prefix(blocks: torch.Tensor, token: int) -> torch.Tensor:
    """blocks [N, T] with `token` in front of each: [N, 1 + T]."""
    return torch.cat([torch.full((len(blocks), 1), token, dtype=blocks.dtype), blocks], dim=1)


@torch.no_grad()
def corpus_scores(model, blocks: torch.Tensor, baseline=None, batch_size: int = 2,
                  prefix: int | None = None) -> dict[str, float]:
    """Perplexity of `model` on blocks [N, T]; with a baseline also agreement and KL (and its ppl). With a
    `prefix` token, every block is read after it and the prefix's own prediction is left out: the same T - 1
    next tokens are scored, agreement and KL over the same T positions, each with one token more before it."""
    nll = base_nll = kl = agree = 0.0
    n_pred = n_pos = 0
    skip = 0 if prefix is None else 1  # leading positions not scored
    for i in range(0, len(blocks), batch_size):
        ids = blocks[i : i + batch_size]
        if prefix is not None:
            ids = with_prefix(ids, prefix)
        base_chunks = logp_chunks(baseline, ids) if baseline is not None else None
        for start, logp in logp_chunks(model, ids):  # (B, n, V)
            base_logp = next(base_chunks)[1] if base_chunks is not None else None
            lo = max(skip - start, 0)  # this chunk's first scored position
            logp, start = logp[:, lo:], start + lo
            n = logp.shape[1]
            nxt = ids[:, start + 1 : start + n + 1, None].to(logp.device)  # next tokens, where there is one
            m = nxt.shape[1]
            nll -= logp[:, :m].gather(-1, nxt).sum().item()
            if base_logp is not None:
                base_logp = base_logp[:, lo:]
                base_nll -= base_logp[:, :m].gather(-1, nxt).sum().item()
                kl += (base_logp.exp() * (base_logp - logp)).sum().item()
                agree += (base_logp.argmax(-1) == logp.argmax(-1)).sum().item()
        n_pred += ids[:, skip + 1 :].numel()
        n_pos += ids[:, skip:].numel() if baseline is not None else 0
    out = {"perplexity": perplexity(nll / n_pred), "tokens": n_pred}
    if baseline is not None:
        out |= {"baseline_perplexity": perplexity(base_nll / n_pred), "agreement": agree / n_pos, "kl": kl / n_pos}
    return out


def tensor_bytes(obj: Any, _seen: set[int] | None = None, _depth: int = 0) -> int:
    """Bytes of every distinct tensor reachable from `obj` (a cache object, list, dict, dataclass)."""
    seen = set() if _seen is None else _seen
    if _depth > 6 or id(obj) in seen:
        return 0
    seen.add(id(obj))
    if isinstance(obj, torch.Tensor):
        key = obj.untyped_storage().data_ptr() if obj.numel() else id(obj)
        if key in seen:
            return 0
        seen.add(key)
        return obj.numel() * obj.element_size()
    if isinstance(obj, (list, tuple, set)):
        return sum(tensor_bytes(x, seen, _depth + 1) for x in obj)
    if isinstance(obj, dict):
        return sum(tensor_bytes(x, seen, _depth + 1) for x in obj.values())
    if hasattr(obj, "__dict__") and not isinstance(obj, (torch.nn.Module, type)):
        return sum(tensor_bytes(x, seen, _depth + 1) for x in vars(obj).values())
    return 0


@torch.no_grad()
def kv_cache_bytes(model, ids: torch.Tensor) -> int:
    """Total bytes held by the cache a forward pass over `ids` [1, T] returns (only the last position's
    logits are computed: at 8K tokens the whole [T, vocab] would be the largest tensor of the run)."""
    out = model(input_ids=ids.to(next(model.parameters()).device), use_cache=True, logits_to_keep=1)
    if out.cache is None:
        raise EffattnError("the model returned no KV cache", "evaluate a model whose forward supports use_cache=True")
    return tensor_bytes(out.cache)


SPEED_CHUNK = 4096  # a long speed prompt is prefilled in chunks of this many tokens through the cache


WARM_DECODE_STEPS = 4  # untimed decode steps before `speed` times any


@torch.no_grad()
def speed(model, ids: torch.Tensor, decode_tokens: int = 32, repeats: int = 3) -> tuple[float, float]:
    """(prefill tokens/s over `ids` [1, T], decode tokens/s for greedy steps after it); medians. Prompts
    longer than SPEED_CHUNK are prefilled in chunks through the cache, as generation would (bounded
    activations), except for models that must see a sequence in one forward (`one_pass_only`)."""
    device = next(model.parameters()).device
    ids = ids.to(device)

    def now() -> float:  # a GPU's queued work counted in the time it took
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        return time.perf_counter()

    # warm-up, untimed: a short prefill and decode steps. With the prefill alone, the model timed first in a process
    # (the converted one) decoded up to 40% slower than the same model timed again (a tiny model, idle machine, one
    # run of three); with the decode steps, within 10%. (On a loaded machine the speeds swung 90x either way.)
    out = model(input_ids=ids[:, :16], use_cache=True, logits_to_keep=1)
    cache, token = out.cache, out.logits[:, -1:].argmax(-1)
    for _ in range(WARM_DECODE_STEPS):
        out = model(input_ids=token, cache=cache, use_cache=True)
        cache, token = out.cache, out.logits[:, -1:].argmax(-1)
    chunk = ids.shape[1] if one_pass_only(model) else SPEED_CHUNK
    prefill, decode = [], []
    for _ in range(repeats):
        t0 = now()
        cache = None
        for start in range(0, ids.shape[1], chunk):
            out = model(input_ids=ids[:, start : start + chunk], cache=cache, use_cache=True, logits_to_keep=1)
            cache = out.cache
        prefill.append(ids.shape[1] / (now() - t0))
        cache, token = out.cache, out.logits[:, -1:].argmax(-1)
        t0 = now()
        for _ in range(decode_tokens):
            out = model(input_ids=token, cache=cache, use_cache=True)
            cache, token = out.cache, out.logits[:, -1:].argmax(-1)
        decode.append(decode_tokens / (now() - t0))
    return statistics.median(prefill), statistics.median(decode)


def decode_break_even(mine: list[dict[str, float]], base: list[dict[str, float]]) -> dict[str, Any] | None:
    """Where the model decodes faster than the baseline, from decode speeds both measured at the same two or more
    contexts. A decode step's time is taken as linear in the context (the original reads every cached key; a
    constant-size cache makes the slope ~0) through the shortest and longest measurement of each model. Returns
    {"tokens": N, "below": bool, "measured": [contexts]}: faster beyond N tokens (0: at every length; None: at no
    length), or, with below, faster only below N tokens (a step that grows faster than the baseline's, from a shorter
    one at the shortest context measured). None for fewer than two shared contexts. The lines are read from the
    shortest measured context on: a model slower there whose step grows at least as fast is slower at every length,
    whatever the lines' extrapolated intercepts say."""
    times = [{p["context"]: 1.0 / p["decode_tokens_per_s"] for p in points if p.get("decode_tokens_per_s")}
             for points in (mine, base)]
    shared = sorted(set(times[0]) & set(times[1]))
    if len(shared) < 2:
        return None
    lo, hi = shared[0], shared[-1]
    (t_m, b_m), (t_b, b_b) = ((t[lo], (t[hi] - t[lo]) / (hi - lo)) for t in times)  # time at lo, growth per token
    ahead = t_b - t_m  # how much shorter the model's step is at the shortest context (> 0: faster there)
    below = False
    if b_m < b_b:  # the model's step grows more slowly: faster beyond the crossing
        tokens = max(0.0, lo - ahead / (b_b - b_m))
    elif ahead <= 0:  # slower at the shortest context, and not growing more slowly
        tokens = None
    elif b_m == b_b:
        tokens = 0.0
    else:  # faster at the shortest context, growing faster: faster only below the crossing
        tokens, below = lo + ahead / (b_m - b_b), True
    return {"tokens": tokens, "below": below, "measured": shared}


def speed_prompt(tokenizer, text: str, length: int) -> torch.Tensor:
    """[1, length] token ids of `text`, repeated as often as needed to reach `length`."""
    ids = tokenizer(text[: length * 8], return_tensors="pt")["input_ids"][:, :length]
    while ids.shape[1] < length:
        ids = torch.cat([ids, ids], dim=1)
    return ids[:, :length]


def _params(model) -> int:
    return sum(p.numel() for p in model.parameters())


def check_vocabularies(mine: int | None, theirs: int | None) -> None:
    """Refuse a baseline whose vocabulary differs from the model's (agreement and KL compare next-token
    distributions); sizes a config does not give are not compared."""
    if mine is not None and theirs is not None and mine != theirs:
        raise EffattnError(f"model and baseline have different vocabularies ({mine} vs {theirs})",
                           "compare a converted model with the model it came from")


TOKENIZER_FIX = "tokenize with the tokenizer of the model it came from (--tokenizer)"


def check_same_tokenizer(tok, base_ref, *, trust_remote_code: bool = False, plan_only: bool = False,
                         role: str = "the baseline",
                         fix: str = "compare a converted model with the model it came from (or give --tokenizer the "
                                    "tokenizer both share)") -> None:
    """Refuse a baseline (or a fine-tune's teacher: `role`) whose own tokenizer gives other ids than `tok`, which reads
    the text for both models: a baseline of the same vocabulary size with another tokenizer was scored on ids its
    tokenizer never makes (100% agreement and KL 0 against a model that tokenizes differently). The base vocabularies
    are compared (added tokens such as a pad token do not turn up in text); one without tokenizer files is not."""
    from .io.load import load_tokenizer, tokenizer_missing

    if base_ref is None or tokenizer_missing(base_ref.path):
        return
    theirs = load_tokenizer(base_ref, trust_remote_code=trust_remote_code, plan_only=plan_only)
    mine = {t: i for t, i in tok.get_vocab().items() if i < tok.vocab_size}
    other = {t: i for t, i in theirs.get_vocab().items() if i < theirs.vocab_size}
    differ = sum(other.get(t) != i for t, i in mine.items()) + len(other.keys() - mine.keys())
    if differ:
        raise EffattnError(f"{role} {base_ref.display} has another tokenizer than the one that reads the text "
                           f"({differ:,} tokens differ): both models are scored on the same token ids", fix)


def measure(model, tokenizer, *, name: str, settings: EvalSettings, baseline=None, baseline_name: str = "baseline") -> EvalReport:
    """Evaluate loaded models. The tokenizer is the model's (the baseline must share the vocabulary)."""
    if baseline is not None:
        check_vocabularies(model.config.vocab_size, baseline.config.vocab_size)
    mine = ModelMeasure(name, _params(model))
    base = ModelMeasure(baseline_name, _params(baseline)) if baseline is not None else None
    report = EvalReport(settings=asdict(settings), model=mine, baseline=base)
    speed_ids = None
    prefix = prefix_token(tokenizer) if settings.bos else None
    for corpus in settings.corpora:
        blocks = token_blocks(tokenizer, load_text(corpus), settings.context, settings.max_tokens, spread=True)
        speed_ids = blocks[:1] if speed_ids is None else speed_ids
        scores = corpus_scores(model, blocks, baseline, settings.batch_size, prefix)
        mine.perplexity[corpus] = scores["perplexity"]
        report.tokens[corpus] = scores["tokens"]
        if base is not None:
            base.perplexity[corpus] = scores["baseline_perplexity"]
            report.agreement[corpus] = scores["agreement"]
            report.kl[corpus] = scores["kl"]
    long_ids = None
    if settings.speed and settings.speed_context:
        long_ids = speed_prompt(tokenizer, load_text(settings.corpora[0]), settings.speed_context)
    for measure_, lm in ((mine, model), (base, baseline)):
        if measure_ is None:
            continue
        measure_.kv_context = speed_ids.shape[1]
        measure_.kv_bytes_per_token = kv_cache_bytes(lm, speed_ids) / speed_ids.shape[1]
        if not settings.speed:
            continue
        # both models decode with the same linear layers: effattn's matrix-vector product on the CPU
        with gemv.decoding(lm) as switched:
            measure_.prefill_tokens_per_s, measure_.decode_tokens_per_s = speed(
                lm, speed_ids, settings.decode_tokens, settings.speed_repeats)
            measure_.speed.append({"context": speed_ids.shape[1], "prefill_tokens_per_s": measure_.prefill_tokens_per_s,
                                   "decode_tokens_per_s": measure_.decode_tokens_per_s})
            if long_ids is not None and long_ids.shape[1] != speed_ids.shape[1]:
                # one prefill at a long context takes long and varies little: timed once
                prefill, decode = speed(lm, long_ids, settings.decode_tokens, repeats=1)
                measure_.speed.append({"context": long_ids.shape[1], "prefill_tokens_per_s": prefill,
                                       "decode_tokens_per_s": decode})
        report.decode_linears = gemv.describe(switched, next(lm.parameters()).dtype)
    if base is not None:
        report.decode_break_even = decode_break_even(mine.speed, base.speed)
    return report


def measure_peak_bytes(config: dict, params: int, baseline_params: int, *, context: int, batch_size: int,
                       text_chars: int, weight_bytes: int = 4, cast_bytes: int = 0) -> int:
    """Memory `measure` holds above the process's at its peak: both models' weights, then the largest
    of its phases: tokenizing a corpus; a batch's forward (one decoder layer's activations, ~12 x hidden
    + 4 x intermediate values per token, the final hidden states of each model and a chunk of
    log-probabilities); the KV-cache measurement (the whole cache of one block, float32, as the
    original's attention stores it, an upper bound for a smaller cache). Blocks longer than PREFILL_CHUNK
    run in chunks through the cache: one chunk's activations plus the block's cache. Assumes a memory-efficient
    attention (transformers' SDPA, or effattn's own kernels): no (context x context) score matrix.
    Peak resident set of `effattn eval llama --corpus shakespeare --batch-size 1 --no-speed` at contexts
    1K, 4K, 16K: 1,144, 1,431, 2,587 MiB measured, 1,151, 1,278, 2,430 estimated (BENCHMARKS.md).
    `cast_bytes`: a model loaded in another dtype than its checkpoint's is read whole first (the checkpoint's
    bytes, `load_cast_bytes`), beside the models already loaded: a bfloat16 evaluation of the float32 built-in
    model peaked at 1,480 MiB while it loaded the baseline, against 1,211 MiB estimated without it."""
    from .convert.base import kv_bytes_per_token
    from .resources import TOKENIZE_BYTES_PER_CHAR, Dims

    dims = Dims.of(config)
    models = 2 if baseline_params else 1
    layer = min(context, PREFILL_CHUNK) * (12 * dims.hidden + 4 * dims.intermediate) * 4  # one sequence, one layer
    # beyond PREFILL_CHUNK: the block's cache, and the largest later chunk's attention mask against it (SDPA does not
    # form the scores, heads x queries x keys, but holds ~MASK_BYTES per query-key pair)
    chunked = batch_size * (context * kv_bytes_per_token(config, torch.float32)
                            + MASK_BYTES * chunk_mask_pairs(context)) if context > PREFILL_CHUNK else 0
    forward = batch_size * layer + chunked + models * batch_size * context * dims.hidden * 4 \
        + 2 * models * batch_size * min(context, LOGIT_CHUNK) * dims.vocab * 4
    cache = context * kv_bytes_per_token(config, torch.float32) + layer
    return (params + baseline_params) * weight_bytes + max(forward, cache, text_chars * TOKENIZE_BYTES_PER_CHAR,
                                                           cast_bytes)


# Bytes per (query, key) pair of a chunk's attention mask while it runs: the boolean mask and what transformers and
# torch's CPU SDPA make of it; the scores (heads x pairs x 4 bytes) are never formed. SDPA alone (a throwaway script,
# torch 2.13): 8,192 queries against 40,000 keys held 945, 955 and 967 MiB beyond the boolean mask with 1, 6 and 12
# heads (3 bytes per pair, whatever the heads). A tiny model's `effattn eval --context 36000 / 40000 --batch-size 1`
# peaked at 1,115 / 1,926 MiB (/usr/bin/time), 978 / 1,640 estimated at 4 bytes, 1,089 / 1,916 at 5.
MASK_BYTES = 5


def chunk_mask_pairs(context: int, chunk: int = PREFILL_CHUNK) -> int:
    """The (queries x keys) pairs of the largest mask a block of `context` tokens scored in chunks builds: a chunk
    after the first against the cache and itself (the first runs causal, without a mask)."""
    if context <= chunk:
        return 0
    last = (context - 1) // chunk * chunk  # the last chunk's start; it reads every key before it and its own
    pairs = (context - last) * context
    if last - chunk >= chunk:  # the last full chunk after the first: chunk x its end (a loop over the chunks hung a
        pairs = max(pairs, chunk * last)  # dry run given a context of 10^23 tokens)
    return pairs


def load_cast_bytes(ckpts, dtype: torch.dtype | None) -> int:
    """What loading these checkpoints in `dtype` holds beyond the loaded weights, at its peak: transformers
    reads a checkpoint stored in another dtype whole (its pages stay mapped) while it casts it. A checkpoint
    loaded in its own dtype is mapped as the weights themselves: nothing beyond them."""
    return max([c.nbytes for c in ckpts if dtype is not None and dtype != c.dtype], default=0)


def eval_seconds(configs: list[dict], params: list[int], settings: EvalSettings, tokens: dict[str, int], *,
                 dtype: torch.dtype = torch.float32) -> float:
    """Seconds `measure` takes on this CPU (idle) for models of these configs and sizes: each loads, scores
    `tokens` (per corpus, in blocks of settings.context, one more token per block with BOS), measures its cache
    over one block, and with settings.speed prefills and decodes settings.speed_repeats times at the context,
    once more at settings.speed_context. Decode steps are priced at DECODE_EFFICIENCY (bound by memory)."""
    from .resources import FORWARD_EFFICIENCY, MODEL_LOAD_SECONDS, Dims, compute_seconds, decode_seconds

    width = settings.context + int(settings.bos)
    scored = sum(tokens.values()) * width // settings.context
    seconds = 0.0
    for config, n_params in zip(configs, params):
        dims = Dims.of(config)

        def forward(n: int, seq: int) -> float:  # n tokens in causal blocks of seq
            return compute_seconds(2 * n_params * n + dims.layers * dims.scores_flops(n, seq), FORWARD_EFFICIENCY,
                                   dtype)

        def decode(after: int) -> float:
            return decode_seconds(config, n_params, after, settings.decode_tokens)

        seconds += MODEL_LOAD_SECONDS + forward(scored, width) + forward(settings.context, settings.context)
        if settings.speed:
            seconds += settings.speed_repeats * (forward(settings.context, settings.context) + decode(settings.context))
            if settings.speed_context and settings.speed_context != settings.context:
                seconds += forward(settings.speed_context, settings.speed_context) + decode(settings.speed_context)
    return seconds


def corpus_tokens(tokenizer, settings: EvalSettings) -> dict[str, int]:
    """The tokens `measure` reads in each corpus (whole blocks, at most settings.max_tokens), from the
    corpus's first tokens only; refuses a corpus shorter than one block, naming it."""
    from .data.corpora import leading_tokens, shorter_block_fix

    tokens = {}
    for corpus in settings.corpora:
        have = len(leading_tokens(tokenizer, load_text(corpus), max(settings.max_tokens, settings.context)))
        blocks = min(have // settings.context, max(1, settings.max_tokens // settings.context))
        if blocks == 0:
            raise EffattnError(f"corpus {corpus} has {have} tokens, fewer than one block of --context "
                               f"{settings.context}", shorter_block_fix(have, "--context {}"))
        tokens[corpus] = blocks * settings.context
    return tokens


def check_eval_memory(ckpt, base_ckpt, settings: EvalSettings, *, dtype: str = "float32", memory_check: bool = True,
                      device: str = "cpu") -> int:
    """The estimated peak resident set of evaluating the model of checkpoint `ckpt` (and the baseline's,
    `base_ckpt`, or None) with `settings` (on a CUDA `device`: the peak of the GPU's memory); refuses one that
    does not fit, naming --batch-size or --context and the largest value that fits."""
    from .io.load import parse_dtype
    from .resources import check_memory, rss

    base = base_ckpt.num_params if base_ckpt is not None else 0
    weight_bytes = (parse_dtype(dtype) or ckpt.dtype).itemsize
    chars = max(len(load_text(c)) for c in settings.corpora)
    cuda = device.startswith("cuda")
    # a cast happens in host memory, before the weights move to a GPU
    cast = 0 if cuda else load_cast_bytes([c for c in (ckpt, base_ckpt) if c is not None], parse_dtype(dtype))
    now = 0 if cuda else rss()  # on a GPU the text stays in the process: the device holds the rest

    # a batch holds at most the blocks a corpus gives (a --batch-size of 64 over 4 blocks was priced at 64)
    batch = min(settings.batch_size, max(1, settings.max_tokens // settings.context))

    def peak(context=settings.context, batch_size=batch) -> int:
        return now + measure_peak_bytes(ckpt.config, ckpt.num_params, base, context=context + int(settings.bos),
                                        batch_size=batch_size,
                                        text_chars=chars, weight_bytes=weight_bytes, cast_bytes=cast)

    options = [("--batch-size", batch, lambda b: peak(batch_size=b), 1, 1)] if batch > 1 else []
    options.append(("--context" if batch == 1 else "--batch-size 1 --context", settings.context,
                    lambda c: peak(context=c, batch_size=1), 2, 1))
    estimate = peak()
    what = f"evaluating at --context {settings.context:,}"
    if settings.speed and settings.speed_context and peak(settings.speed_context, 1) > estimate:
        estimate, what = peak(settings.speed_context, 1), f"timing at --speed-context {settings.speed_context:,}"
        options = [("--speed-context", settings.speed_context, lambda c: peak(context=c, batch_size=1), 2, 1)]
    check_memory(estimate, what=what, options=options, check=memory_check, device=device if cuda else None)
    return estimate


def evaluate(model, baseline=None, settings: EvalSettings | None = None, *,
             dtype: str = "float32", trust_remote_code: bool = False, allow_pickle: bool = False,
             tokenizer=None, memory_check: bool = True, warn=None, attn_implementation: str | None = None,
             device: str = "cpu", say=None, dry_run: bool = False) -> EvalReport | EvalPlan:
    """Load MODEL (and BASELINE) on `device` and measure them; the library entry point of `effattn eval`.
    The text is tokenized with MODEL's tokenizer, or `tokenizer`'s (a folder or MODEL argument) when
    given. Before any weights load, everything the run needs is checked: both checkpoints, the attention
    kernel, the vocabularies, every corpus (at least one block), the BOS token, and the estimated memory: a
    run that exceeds the machine's (or the GPU's) is refused (`memory_check=False` runs it anyway). `warn`
    gets one-line notes (a context beyond the trained length), `say` the time and memory estimate.
    `dry_run=True` returns that plan (EvalPlan) and loads no weights."""
    from .families import beyond_positions
    from .io.load import as_ref, check_loadable, check_tokenizer_fits, load_model, load_tokenizer, parse_dtype
    from .resources import check_device

    settings = settings or EvalSettings()
    cuda = check_device(device).startswith("cuda")
    # a dry run plans a .gguf from its metadata: it dequantizes nothing (convert --dry-run does the same)
    ref = as_ref(model, trust_remote_code=trust_remote_code, plan_only=dry_run)
    base_ref = as_ref(baseline, trust_remote_code=trust_remote_code, plan_only=dry_run) if baseline is not None \
        else None
    ckpts = [check_loadable(ref, trust_remote_code=trust_remote_code, allow_pickle=allow_pickle,
                            attn_implementation=attn_implementation, dtype=dtype, plan_only=dry_run)]
    if base_ref is not None:
        ckpts.append(check_loadable(base_ref, trust_remote_code=trust_remote_code, allow_pickle=allow_pickle,
                                    dtype=dtype, plan_only=dry_run))
        check_vocabularies(ckpts[0].config.get("vocab_size"), ckpts[1].config.get("vocab_size"))
    tok = load_tokenizer(tokenizer or ref, trust_remote_code=trust_remote_code, plan_only=dry_run)  # measured with
    check_same_tokenizer(tok, base_ref, trust_remote_code=trust_remote_code, plan_only=dry_run)
    check_tokenizer_fits(tok, zip([ref.display] + ([base_ref.display] if base_ref is not None else []),
                                  [c.config for c in ckpts]), TOKENIZER_FIX)
    if settings.bos:
        prefix_token(tok)
    peak = check_eval_memory(ckpts[0], ckpts[1] if base_ref is not None else None, settings, dtype=dtype,
                             memory_check=memory_check, device=device)
    tokens = corpus_tokens(tok, settings)  # after the memory check: tokenizing a corpus is part of the peak
    lengths = [("--context", settings.context)]
    lengths += [("--speed-context", settings.speed_context)] if settings.speed and settings.speed_context else []
    notes = [note for flag, length in lengths
             if (note := beyond_positions(ckpts[0].config, [length], ref.display, f"{flag} {length:,}"))]
    runs_in = parse_dtype(dtype) or ckpts[0].dtype
    seconds = None if cuda else eval_seconds([c.config for c in ckpts], [c.num_params for c in ckpts], settings,
                                             tokens, dtype=runs_in)
    plan = EvalPlan(task="perplexity", model=ref.display, baseline=base_ref.display if base_ref else None,
                    dtype=str(runs_in).removeprefix("torch."), device=device, est_peak_bytes=peak,
                    est_seconds=seconds, work={"tokens": tokens}, notes=notes)
    if dry_run:
        return plan
    for note in notes:
        if warn is not None:
            warn(note)
    if say is not None:
        say(f"{sum(tokens.values()):,} tokens of {len(tokens)} {'corpus' if len(tokens) == 1 else 'corpora'}, "
            f"{len(ckpts)} model{'s' * (len(ckpts) > 1)}: {plan.estimates()}")
    lm, _, ref = load_model(ref, dtype=dtype, trust_remote_code=trust_remote_code, allow_pickle=allow_pickle,
                            tokenizer=False, attn_implementation=attn_implementation, device=device)
    base = None
    if base_ref is not None:
        base, _, base_ref = load_model(base_ref, dtype=dtype, trust_remote_code=trust_remote_code,
                                       allow_pickle=allow_pickle, tokenizer=False, device=device)
    report = measure(lm, tok, name=ref.display, settings=settings, baseline=base,
                     baseline_name=base_ref.display if base_ref else "baseline")
    report.dtype = plan.dtype
    return report
