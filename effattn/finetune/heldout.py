"""Periodic evaluation during a fine-tune: perplexity on held-out text and top-1 agreement with the teacher.

The teacher is scored once (its perplexity and its top-1 prediction at every position); each
evaluation then needs one forward pass of the student only. Numbers use the same blocks as
`effattn eval` (evenly spread over each corpus), so they are comparable with it at equal settings (`bos: true`
is `effattn eval --bos`: each block is read after the prefix token, whose own prediction is not scored).
"""

from __future__ import annotations

from contextlib import nullcontext
from dataclasses import dataclass

import torch

from ..data.corpora import load_text, token_blocks
from ..evaluate import log_probs, perplexity, prefix_token, target_nll, with_prefix
from .config import Eval


@dataclass
class HeldOut:
    corpus: str
    blocks: torch.Tensor  # (N, T), or (N, 1 + T) with the prefix token in front
    skip: int = 0  # leading positions not scored (1: the prefix token)
    teacher_top1: torch.Tensor | None = None  # (N, T)
    teacher_perplexity: float | None = None


@torch.no_grad()
def score(model, blocks: torch.Tensor, batch_size: int, autocast=nullcontext, skip: int = 0) -> tuple[float, torch.Tensor]:
    """(perplexity, top-1 predictions [N, T - skip]) of `model` on blocks [N, T], the first `skip` positions'
    predictions left out."""
    nll, count, top1 = 0.0, 0, []
    for i in range(0, len(blocks), batch_size):
        ids = blocks[i : i + batch_size]
        logp = log_probs(model, ids, autocast)[:, skip:]  # (B, T - skip, V)
        nll += target_nll(logp, ids[:, skip:])
        count += ids[:, skip + 1 :].numel()
        top1.append(logp.argmax(-1).cpu())
    return perplexity(nll / count), torch.cat(top1)


def held_out_sets(tokenizer, cfg: Eval) -> list[HeldOut]:
    prefix = prefix_token(tokenizer) if cfg.bos else None
    sets = []
    for c in cfg.corpora:
        blocks = token_blocks(tokenizer, load_text(c), cfg.seq_len, cfg.tokens, spread=True)
        if prefix is not None:
            blocks = with_prefix(blocks, prefix)
        sets.append(HeldOut(c, blocks, skip=int(prefix is not None)))
    return sets


def score_teacher(teacher, sets: list[HeldOut], batch_size: int, autocast=nullcontext) -> None:
    for s in sets:
        s.teacher_perplexity, s.teacher_top1 = score(teacher, s.blocks, batch_size, autocast, s.skip)


def evaluate_student(model, sets: list[HeldOut], batch_size: int, autocast=nullcontext) -> dict[str, dict[str, float]]:
    """{corpus: {"perplexity", "agreement"}} with the model in eval mode (restored afterwards)."""
    was_training = model.training
    model.eval()
    out = {}
    for s in sets:
        ppl, top1 = score(model, s.blocks, batch_size, autocast, s.skip)
        out[s.corpus] = {"perplexity": ppl}
        if s.teacher_top1 is not None:
            out[s.corpus]["agreement"] = (top1 == s.teacher_top1).float().mean().item()
    model.train(was_training)
    return out
