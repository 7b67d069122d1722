"""The sparse-attention model (`effattn_sparse`): a family's causal LM whose attention reads only the
(query, key) pairs of a pattern (Longformer, BigBird, strided; kernels/patterns.py).

The pattern runs as an attention function registered in transformers' attention registry under
`effattn_sparse`: the family's own attention modules (projections, RoPE, cache) call it in place of
SDPA. A prefill runs FlexAttention's block-sparse kernel (`sparse_kernel: flex`, compiled) or the
masked-softmax reference (`naive`); a step after cached positions (decoding, chunked prefill) runs the
reference on its few rows, as does a prefill shorter than FLEX_MIN_LENGTH. Keys are kept in the ordinary cache: global and random blocks can read any
earlier position, so the pattern saves compute, not cache memory.
"""

from __future__ import annotations

import torch
from transformers.modeling_outputs import CausalLMOutputWithPast

from effattn.attention.wrapped import WrappedCausalLM, WrappedConfig, wrapped_config
from effattn.kernels.patterns import Pattern, flex_attention_pattern, naive_attention

SPARSE_MODEL_TYPE = "effattn_sparse"
SPARSE_ATTENTION = "effattn_sparse"
SPARSE_DEFAULTS = {
    "base_model_type": "llama",
    "sparse_pattern": {"name": "strided", "stride": 128, "local": None},
    "sparse_kernel": "flex",  # flex (FlexAttention, compiled) or naive (the masked-softmax reference)
}
_PATTERNS: dict[str, Pattern] = {}
# prefills shorter than this run the reference: compiling a kernel costs more than it saves there
FLEX_MIN_LENGTH = 512
LEFT_PAD = "effattn_left_pad"  # the keyword that carries a batch's left padding (B,) down to the attention function


def pattern_of(settings: dict) -> Pattern:
    """The Pattern of a config's `sparse_pattern` (one object per distinct setting: block masks are cached on it)."""
    key = repr(sorted(settings.items()))
    if key not in _PATTERNS:
        _PATTERNS[key] = Pattern(**settings)
    return _PATTERNS[key]


def sparse_attention_forward(module, query, key, value, attention_mask, scaling=None, dropout=0.0, **kwargs):
    """transformers' attention-function signature: query (B, H, Tq, D), key/value (B, G, Tk, D), rotated,
    the cache already extended -> (attn_output (B, Tq, H, D), None)."""
    config = module.config
    pattern = pattern_of(config.sparse_pattern)
    scale = scaling if scaling is not None else query.shape[-1] ** -0.5
    fresh = query.shape[2] == key.shape[2]
    flex_dtype = query.dtype in (torch.float32, torch.float16, torch.bfloat16)  # FlexAttention's (float64: reference)
    left_pad = kwargs.get(LEFT_PAD)  # a left-padded batch: the reference, each row's pattern from its first token
    if left_pad is None and fresh and flex_dtype and getattr(config, "sparse_kernel", "flex") == "flex" \
            and query.shape[2] >= FLEX_MIN_LENGTH:
        out = flex_attention_pattern(query, key, value, pattern, scale)
    else:
        out = naive_attention(query, key, value, pattern, scale, left_pad=left_pad)
    return out.transpose(1, 2).contiguous(), None


def register_attention() -> None:
    from transformers import AttentionInterface

    AttentionInterface.register(SPARSE_ATTENTION, sparse_attention_forward)


register_attention()


class EffattnSparseConfig(WrappedConfig):
    """The base model's config (every key of it, flat) plus the settings of `SPARSE_DEFAULTS`."""

    model_type = SPARSE_MODEL_TYPE
    DEFAULTS = SPARSE_DEFAULTS

    def base_config(self):
        config = super().base_config()
        config.sparse_pattern, config.sparse_kernel = dict(self.sparse_pattern), self.sparse_kernel
        return config


class EffattnSparseForCausalLM(WrappedCausalLM):
    """The base family's causal LM, its attention function the registered sparse pattern."""

    config_class = EffattnSparseConfig

    def __init__(self, config: EffattnSparseConfig):
        super().__init__(config)
        self.build_base(config, attn_implementation=SPARSE_ATTENTION)
        self.post_init()
        self.model.config._attn_implementation = SPARSE_ATTENTION  # post_init may have set the default

    def forward(self, input_ids=None, attention_mask=None, position_ids=None, cache=None, inputs_embeds=None,
                labels=None, use_cache=None, logits_to_keep=0, past_key_values=None, **kwargs):
        cache = cache if cache is not None else past_key_values
        pad = self.left_padding(attention_mask, "EffattnSparseForCausalLM")
        out = self.model(input_ids=input_ids, position_ids=position_ids, cache=cache, inputs_embeds=inputs_embeds,
                         use_cache=use_cache, **({LEFT_PAD: pad} if pad is not None else {}))
        logits, loss = self.logits_and_loss(out.last_hidden_state, logits_to_keep, labels, **kwargs)
        return CausalLMOutputWithPast(loss=loss, logits=logits, cache=getattr(out, "cache", None))


def sparse_config_from(base: dict, **settings) -> dict:
    """The config.json dict of a sparse model built on the base model's config dict."""
    return wrapped_config(base, EffattnSparseConfig, settings, "EffattnSparseForCausalLM", "modeling_effattn_sparse.py")
