"""benchmarks/block_spread.py: its per-block losses are effattn eval's perplexity, and the BOS run scores the
same targets after one more token."""

from __future__ import annotations

import importlib.util
import math
from pathlib import Path

import torch
import torch.nn.functional as F
from transformers import AutoModelForCausalLM

from effattn.evaluate import corpus_scores

_spec = importlib.util.spec_from_file_location("block_spread", Path(__file__).parents[1] / "benchmarks" / "block_spread.py")
block_spread = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(block_spread)


def test_block_losses_are_evals_perplexity_and_bos_scores_the_same_targets(tiny):
    model = AutoModelForCausalLM.from_pretrained(tiny("llama"), dtype=torch.float64).eval()
    blocks = torch.randint(3, model.config.vocab_size, (3, 17), generator=torch.Generator().manual_seed(0))
    plain = block_spread.block_losses(model, blocks, None)
    assert math.isclose(math.exp(sum(plain) / len(plain)), corpus_scores(model, blocks)["perplexity"], rel_tol=1e-6)
    bos = block_spread.block_losses(model, blocks, 1)
    for block, got in zip(blocks, bos):
        ids = torch.cat([torch.tensor([1]), block])[None]
        with torch.no_grad():
            logits = model(input_ids=ids).logits[0]
        assert math.isclose(got, F.cross_entropy(logits[1:-1], block[1:]).item(), rel_tol=1e-6)
    assert max(abs(a - b) for a, b in zip(plain, bos)) > 1e-6  # the token in front changes the scores
