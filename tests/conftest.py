"""Fixtures: tiny random models of every family (built here, no downloads) and the real SmolLM2."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch

FAMILY_CONFIGS = {
    "llama": ("LlamaConfig", {"attention_bias": False}),
    "mistral": ("MistralConfig", {}),
    "qwen2": ("Qwen2Config", {}),
    "qwen3": ("Qwen3Config", {"attention_bias": False}),
}


def byte_tokenizer():
    """A byte-level BPE tokenizer with no merges: 256 byte tokens plus BOS/EOS, no files needed."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    byte_to_unicode = pre_tokenizers.ByteLevel.alphabet()
    vocab = {ch: i for i, ch in enumerate(sorted(byte_to_unicode))}
    vocab["<s>"], vocab["</s>"] = len(vocab), len(vocab) + 1
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    return PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<s>", eos_token="</s>")


def make_tiny(path: Path, family: str = "llama", *, heads: int = 6, kv_heads: int = 3, head_dim: int = 8,
              layers: int = 2, hidden: int = 48, tie: bool = True, seed: int = 0, dtype=torch.float32,
              max_shard_size: str | None = None, **overrides) -> Path:
    """Save a tiny random model of `family` (with a byte tokenizer) to `path` and return it."""
    import transformers

    cls_name, extra = FAMILY_CONFIGS[family]
    config = getattr(transformers, cls_name)(
        vocab_size=258, hidden_size=hidden, intermediate_size=2 * hidden, num_hidden_layers=layers,
        num_attention_heads=heads, num_key_value_heads=kv_heads, head_dim=head_dim, max_position_embeddings=512,
        tie_word_embeddings=tie, bos_token_id=256, eos_token_id=257, **(extra | overrides))
    torch.manual_seed(seed)
    model = transformers.AutoModelForCausalLM.from_config(config, dtype=dtype)
    with torch.no_grad():  # random init is tiny (std 0.02); larger weights make differences visible
        for name, p in model.named_parameters():
            if "norm" not in name:
                p.normal_(0, 0.3 if p.ndim > 1 else 0.1)
    kwargs = {"max_shard_size": max_shard_size} if max_shard_size else {}
    model.save_pretrained(path, **kwargs)
    byte_tokenizer().save_pretrained(path)
    return path


@pytest.fixture
def tiny(tmp_path):
    """Factory: tiny(family="llama", **kw) -> folder of a tiny random model."""
    counter = iter(range(1000))

    def factory(family: str = "llama", **kw) -> Path:
        return make_tiny(tmp_path / f"{family}-{next(counter)}", family, **kw)

    return factory


def logits_of(folder: Path, ids: torch.Tensor) -> torch.Tensor:
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    with torch.no_grad():
        return model(input_ids=ids).logits


@pytest.fixture(scope="session")
def smollm2_path():
    """The real SmolLM2-135M-Instruct, fetched and converted once (cached in EFFATTN_CACHE)."""
    from effattn.io.resolve import resolve_model

    return resolve_model("llama").path


@pytest.fixture(autouse=True)
def _quiet_transformers():
    from transformers.utils import logging as hf_logging

    hf_logging.set_verbosity_error()
    hf_logging.disable_progress_bar()
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
