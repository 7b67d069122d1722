"""The attention-sinks model (`effattn_sinks`): a family's causal LM whose attention keeps the first
`sink_tokens` tokens and a sliding window of `attention_window` (StreamingLLM), with a bounded cache.

transformers 5 has no native form of it (SinkCache left the library), so effattn registers this model;
`trust_remote_code=True` loads the bundled copy. The cache holds, per windowed layer, the sinks and the
last window - 1 keys and values, before RoPE: every rotation happens at attention time at a small
position (kernels/sinks.py), so memory and numerics stay the same however long the stream. Layers in
`sink_full_layers` keep full attention (and a growing cache).
"""

from __future__ import annotations

import torch
from torch import nn

from effattn.attention.wrapped import AdoptedAttention, WrappedCausalLM, WrappedConfig, wrapped_config
from effattn.kernels.sinks import sink_attention

SINKS_MODEL_TYPE = "effattn_sinks"
SINKS_DEFAULTS = {
    "base_model_type": "llama",
    "sink_tokens": 4,
    "attention_window": 256,  # not `sliding_window`: transformers would build its own truncating cache
    "sink_full_layers": [],  # layers that keep full attention
}


class EffattnSinksConfig(WrappedConfig):
    """The base model's config (every key of it, flat) plus the settings of `SINKS_DEFAULTS`."""

    model_type = SINKS_MODEL_TYPE
    DEFAULTS = SINKS_DEFAULTS


class SinkLayerCache:
    """One layer's keys and values before RoPE, with their positions: the sinks and the recent window
    (windowed layers), or everything (full layers)."""

    def __init__(self):
        self.k = self.v = self.pos = None

    def extend(self, k: torch.Tensor, v: torch.Tensor, pos: torch.Tensor):
        """Append the new (B, T, G, D) keys/values at `pos`; return everything the new queries may read."""
        if self.k is None:
            return k, v, pos
        return torch.cat((self.k, k), 1), torch.cat((self.v, v), 1), torch.cat((self.pos, pos))

    def keep(self, k: torch.Tensor, v: torch.Tensor, pos: torch.Tensor, window: int | None, sinks: int) -> None:
        """Hold what later queries can still see: the sinks and the last window - 1 positions."""
        if window is not None:
            held = (pos < sinks) | (pos > pos[-1] - window + 1)
            k, v, pos = k[:, held], v[:, held], pos[held]
        self.k, self.v, self.pos = k, v, pos

    def nbytes(self) -> int:
        return 0 if self.k is None else self.k.numel() * self.k.element_size() * 2


class SinkCache:
    """Per-layer `SinkLayerCache`s; its size stops growing once the window is full (on windowed layers)."""

    def __init__(self):
        self.layers: dict[int, SinkLayerCache] = {}
        self.seen = 0  # positions consumed so far

    def get_seq_length(self, layer_idx: int = 0) -> int:
        return self.seen

    def __len__(self) -> int:
        return len(self.layers)

    def nbytes(self) -> int:
        return sum(layer.nbytes() for layer in self.layers.values())


class SinkAttention(AdoptedAttention):
    """A family's attention module (its projections and q/k norms, same names) with sinks + window."""

    def __init__(self, attn: nn.Module, config: EffattnSinksConfig, layer_idx: int):
        super().__init__(attn, layer_idx)
        full = {int(i) for i in config.sink_full_layers or []}
        self.window = None if layer_idx in full else int(config.attention_window)
        self.sinks = int(config.sink_tokens)

    def forward(self, hidden_states, position_embeddings=None, attention_mask=None, cache=None, sink_rope=None,
                position_ids=None, **kwargs):
        if sink_rope is None:
            raise ValueError("SinkAttention needs sink_rope (the model's RoPE tables by position); run it inside "
                             "EffattnSinksForCausalLM")
        B, T, _ = hidden_states.shape
        q, k, v = self.project(hidden_states)
        pos = position_ids[0]
        layer = None
        if cache is not None:
            layer = cache.layers.setdefault(self.layer_idx, SinkLayerCache())
            k_all, v_all, k_pos = layer.extend(k, v, pos)
        else:
            k_all, v_all, k_pos = k, v, pos
        out = sink_attention(q, k_all, v_all, pos, k_pos, sink_rope, window=self.window, sinks=self.sinks,
                             scale=self.scaling)
        if layer is not None:
            layer.keep(k_all.detach(), v_all.detach(), k_pos, self.window, self.sinks)
        return self.o_proj(out.reshape(B, T, -1)), None


class EffattnSinksForCausalLM(WrappedCausalLM):
    """The base family's causal LM with every attention replaced by `SinkAttention`."""

    config_class = EffattnSinksConfig

    def __init__(self, config: EffattnSinksConfig):
        super().__init__(config)
        self.build_base(config)
        for i, layer in enumerate(self.model.layers):
            layer.self_attn = SinkAttention(layer.self_attn, config, i)
        self.post_init()

    def forward(self, input_ids=None, attention_mask=None, position_ids=None, cache=None, inputs_embeds=None,
                labels=None, use_cache=None, logits_to_keep=0, past_key_values=None, **kwargs):
        return self.forward_cached(SinkCache, self.forward_decoder, input_ids, attention_mask, position_ids, cache,
                                   inputs_embeds, labels, use_cache, logits_to_keep, past_key_values, **kwargs)

    def forward_decoder(self, input_ids, inputs_embeds, position_ids, cache):
        """The decoder on a batch without padding, its final norm included."""
        body = self.model
        x = body.embed_tokens(input_ids) if inputs_embeds is None else inputs_embeds
        past = cache.seen if cache is not None else 0
        position_ids = self.check_positions(position_ids, past, x.shape[1], x.device, cached=cache is not None)
        # without a cache (training) a sequence may be read at any place in the text (a heal's spread
        # positions). Every score here depends on distances alone, so it is the stream from its own start:
        # its first tokens are the sinks, as when a stream is decoded.
        position_ids = position_ids - position_ids[:, :1] + past

        # one RoPE table per forward for every layer: windowed layers rotate at distances within the
        # chunk, its window and the sinks; full layers at the text's positions
        full = bool(self.config.sink_full_layers)
        cfg = self.config
        longest = past + x.shape[1] if full else min(past, cfg.attention_window + cfg.sink_tokens) + x.shape[1]
        cos_t, sin_t = body.rotary_emb(x, torch.arange(longest, device=x.device)[None])
        cos_t, sin_t = cos_t[0], sin_t[0]

        def rope(positions: torch.Tensor):
            return cos_t[positions], sin_t[positions]

        for layer in body.layers:
            x = layer(x, position_embeddings=None, position_ids=position_ids, cache=cache, sink_rope=rope)
        if cache is not None:
            cache.seen = past + x.shape[1]
        return body.norm(x)


def sinks_config_from(base: dict, **settings) -> dict:
    """The config.json dict of a sinks model built on the base model's config dict."""
    return wrapped_config(base, EffattnSinksConfig, settings, "EffattnSinksForCausalLM", "modeling_effattn_sinks.py")
