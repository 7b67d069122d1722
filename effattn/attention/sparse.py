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

import copy

import torch
from transformers import AutoConfig, GenerationMixin, PretrainedConfig, PreTrainedModel
from transformers.modeling_outputs import CausalLMOutputWithPast

from effattn.kernels.patterns import Pattern, flex_attention_pattern, naive_attention

SPARSE_MODEL_TYPE = "effattn_sparse"
SPARSE_ATTENTION = "effattn_sparse"
SPARSE_DEFAULTS = {
    "base_model_type": "llama",
    "sparse_pattern": {"name": "strided", "stride": 128, "local": None},
    "sparse_kernel": "flex",  # flex (FlexAttention, compiled) or naive (the masked-softmax reference)
}
_NOT_BASE = {"model_type", "architectures", "auto_map", "transformers_version", *SPARSE_DEFAULTS}
_PATTERNS: dict[str, Pattern] = {}
# prefills shorter than this run the reference: compiling a kernel costs more than it saves there
FLEX_MIN_LENGTH = 512


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
    if fresh and flex_dtype and getattr(config, "sparse_kernel", "flex") == "flex" and query.shape[2] >= FLEX_MIN_LENGTH:
        out = flex_attention_pattern(query, key, value, pattern, scale)
    else:
        out = naive_attention(query, key, value, pattern, scale)
    return out.transpose(1, 2).contiguous(), None


def register_attention() -> None:
    from transformers import AttentionInterface

    AttentionInterface.register(SPARSE_ATTENTION, sparse_attention_forward)


register_attention()


class EffattnSparseConfig(PretrainedConfig):
    """The base model's config (every key of it, flat) plus the settings of `SPARSE_DEFAULTS`."""

    model_type = SPARSE_MODEL_TYPE

    def __init__(self, **kwargs):
        for key, default in SPARSE_DEFAULTS.items():
            setattr(self, key, copy.deepcopy(kwargs.pop(key, default)))
        super().__init__(**kwargs)

    def base_config(self) -> PretrainedConfig:
        values = {k: v for k, v in self.to_dict().items() if k not in _NOT_BASE}
        config = AutoConfig.for_model(self.base_model_type, **values)
        config.sparse_pattern, config.sparse_kernel = dict(self.sparse_pattern), self.sparse_kernel
        return config


class EffattnSparsePreTrainedModel(PreTrainedModel):
    config_class = EffattnSparseConfig
    base_model_prefix = "model"
    supports_gradient_checkpointing = True
    _supports_sdpa = True
    _tied_weights_keys = {"lm_head.weight": "model.embed_tokens.weight"}


class EffattnSparseForCausalLM(EffattnSparsePreTrainedModel, GenerationMixin):
    """The base family's causal LM, its attention function the registered sparse pattern."""

    def __init__(self, config: EffattnSparseConfig):
        super().__init__(config)
        from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING

        base_config = config.base_config()
        base_config._attn_implementation = SPARSE_ATTENTION
        base = MODEL_FOR_CAUSAL_LM_MAPPING[type(base_config)](base_config)
        self._no_split_modules = getattr(base, "_no_split_modules", None)
        self.model, self.lm_head = base.model, base.lm_head
        self.post_init()
        self.model.config._attn_implementation = SPARSE_ATTENTION  # post_init may have set the default

    def get_input_embeddings(self):
        return self.model.embed_tokens

    def set_input_embeddings(self, value):
        self.model.embed_tokens = value

    def get_output_embeddings(self):
        return self.lm_head

    def set_output_embeddings(self, value):
        self.lm_head = value

    def forward(self, input_ids=None, attention_mask=None, position_ids=None, cache=None, inputs_embeds=None,
                labels=None, use_cache=None, logits_to_keep=0, past_key_values=None, **kwargs):
        cache = cache if cache is not None else past_key_values
        if attention_mask is not None and attention_mask.dim() == 2 and not bool(attention_mask.all()):
            raise ValueError("EffattnSparseForCausalLM does not support padding: pass sequences of equal length "
                             "(batch=1 for generation of different prompts)")
        out = self.model(input_ids=input_ids, position_ids=position_ids, cache=cache, inputs_embeds=inputs_embeds,
                         use_cache=use_cache)
        x = out.last_hidden_state
        keep = slice(-logits_to_keep, None) if isinstance(logits_to_keep, int) else logits_to_keep
        logits = self.lm_head(x[:, keep, :])
        loss = None
        if labels is not None:
            loss = self.loss_function(logits=logits, labels=labels, vocab_size=self.config.vocab_size, **kwargs)
        return CausalLMOutputWithPast(loss=loss, logits=logits, cache=getattr(out, "cache", None))


def sparse_config_from(base: dict, **settings) -> dict:
    """The config.json dict of a sparse model built on the base model's config dict."""
    unknown = set(settings) - set(SPARSE_DEFAULTS)
    if unknown:
        raise ValueError(f"unknown sparse settings {sorted(unknown)}")
    config = {k: copy.deepcopy(v) for k, v in base.items() if k not in ("architectures", "auto_map")}
    config["base_model_type"] = base["model_type"]
    config["model_type"] = SPARSE_MODEL_TYPE
    config["architectures"] = ["EffattnSparseForCausalLM"]
    config.update({k: settings.get(k, v) for k, v in SPARSE_DEFAULTS.items() if k != "base_model_type"})
    config["auto_map"] = {"AutoConfig": "modeling_effattn_sparse.EffattnSparseConfig",
                          "AutoModelForCausalLM": "modeling_effattn_sparse.EffattnSparseForCausalLM"}
    return config
