"""Tiny random models for tests and benchmarks: built locally, no downloads.

`make_model(path, family, ...)` saves a random checkpoint of a supported family with a byte-level
tokenizer, so every effattn command can run on it.
"""

from __future__ import annotations

from pathlib import Path

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

    vocab = {ch: i for i, ch in enumerate(sorted(pre_tokenizers.ByteLevel.alphabet()))}
    vocab["<s>"], vocab["</s>"] = len(vocab), len(vocab) + 1
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    return PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<s>", eos_token="</s>")


def make_model(path: Path, family: str = "llama", *, heads: int = 6, kv_heads: int = 3, head_dim: int = 8,
               layers: int = 2, hidden: int = 48, intermediate: int | None = None, tie: bool = True, seed: int = 0,
               dtype=torch.float32, max_shard_size: str | None = None, init_std: float = 0.3, **overrides) -> Path:
    """Save a random model of `family` (with a byte tokenizer) to `path` and return the path.

    Weights are drawn with std `init_std` (not transformers' tiny 0.02) so that differences
    between conversions are visible in the logits.
    """
    import transformers

    cls_name, extra = FAMILY_CONFIGS[family]
    config = getattr(transformers, cls_name)(**(dict(
        vocab_size=258, hidden_size=hidden, intermediate_size=intermediate or 2 * hidden, num_hidden_layers=layers,
        num_attention_heads=heads, num_key_value_heads=kv_heads, head_dim=head_dim, max_position_embeddings=4096,
        tie_word_embeddings=tie, bos_token_id=256, eos_token_id=257) | extra | overrides))
    torch.manual_seed(seed)
    model = transformers.AutoModelForCausalLM.from_config(config, dtype=dtype)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" not in name:
                p.normal_(0, init_std if p.ndim > 1 else init_std / 3)
    kwargs = {"max_shard_size": max_shard_size} if max_shard_size else {}
    model.save_pretrained(path, **kwargs)
    byte_tokenizer().save_pretrained(path)
    return Path(path)
