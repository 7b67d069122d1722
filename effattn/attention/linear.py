"""The linearized model (`effattn_linear`): a family's causal LM whose softmax attention is replaced by
LoLCATs' hybrid of sliding-window softmax attention and linear attention (Zhang et al. 2024, "LoLCATs:
On Low-Rank Linearizing of Large Language Models", arXiv:2410.10254, HazyResearch/lolcats,
`src/model/linear_attention/linear_window_attention_sw.py`).

`EffattnLinearForCausalLM` is the base family's own model (same modules, same weight names) whose
attention modules are `LinearAttention`: the family's q/k/v/o projections (and q/k norms), the family's
RoPE on q and k, then per layer

* two feature maps (`kernels/linear/features.py`, `linear_feature_map`), one for the queries
  (`self_attn.feature_map_q`) and one for the keys (`self_attn.feature_map_k`), kept separate as in
  LoLCATs (for hedgehog, two sets of per-head linear layers, trained by attention transfer);
* per head h a learned mix, `wf_h = sigmoid(window_factors[h])`, `lf_h = 1 - wf_h`.

For query t with window `W_t = {s : t - window < s <= t}`, far keys `F_t = {s : s <= t - window}`,
`m_t = max_{s in W_t} scale q_t.k_s` and feature maps `fq = phi_q(q)`, `fk = phi_k(k)`:

    out_t = (wf sum_{W_t} exp(scale q_t.k_s - m_t) v_s + lf sum_{F_t} (fq_t.fk_s) v_s)
            / (wf sum_{W_t} exp(scale q_t.k_s - m_t)     + lf sum_{F_t} (fq_t.fk_s) + eps)

With `linear_sinks` = S > 0 the first S positions stay in every later query's softmax (attention sinks,
kernels/linear/naive.py): `W_t` also holds them and `F_t` does not, and the cache keeps their keys and values.
`linear_exact_heads` ([layer, KV head] pairs, chosen by the conversion's `--exact-heads K`) gives a few KV
heads their original attention back (attention/exact.py: full RoPE softmax over every key, a cache that
grows with the sequence on those heads): their query heads skip the maps, the mix and the linear state.
`linear_global_cache` = G > 0 adds LoLA's sparse global cache (kernels/linear/global_cache.py): per query head the G
far keys whose values the linear state recalls worst stay under exact softmax with the window and the sinks; the
cache stays bounded. Its kernel serves training and prefill; with Hedgehog's maps a decoded token goes through a
compiled step that also makes the cache's decisions (kernels/linear/decode.py's `GlobalDecodeState`).
(`linear_window` = 0: pure causal linear attention; a window covering the sequence: the original
softmax attention, wf cancelling up to eps). Only the ratio wf/lf matters (up to eps), so this affine
form loses nothing against LoLCATs' `linear_factor = 1` option.

`window_factors` start at `INIT_WINDOW_FACTOR` = -ln 10, i.e. wf = 1/11, lf = 10/11, wf/lf = 0.1.
LoLCATs' class default is `init_window_factor = 0` (sigmoid 0.5), but its released distillation configs
use `init_window_factor: -2.1972` (sigmoid 0.1) with `affine_attention_factors: false`
(`linear_factor = 1`): the same ratio 0.1, hence the same function, as this initial value.

GQA: the family's G key/value heads are repeated to the H query heads (query head h reads KV head
h // (H / G), as transformers' `repeat_kv`) after RoPE and before the key feature map, as LoLCATs does;
the key map therefore has per-query-head parameters, and the cache holds H heads.

Prefill and training run `hybrid_attention_chunk` (or the quadratic reference, `linear_kernel: naive`);
each layer's `HybridState` (`LinearCache`) holds the window's keys, values and feature keys plus the
linear state S, z, so the cache stops growing after `window` tokens. One token after a cached prefix
goes through `hybrid_attention_step`; several (a chunked prefill) through the chunked kernel
continuing the state, exactly as one call over the whole sequence.

This module imports nothing from effattn but the kernels and wrapped.py, so it is bundled with them into
one `modeling_effattn_linear.py` that `trust_remote_code=True` loads without effattn.
"""

import math

import torch
from torch import nn

from effattn.attention.wrapped import AdoptedAttention, StateCache, WrappedCausalLM, WrappedConfig, wrapped_config
from effattn.kernels.rope import apply_rope
from effattn.attention.exact import FullState, exact_heads_of, full_attention, head_rows
from effattn.kernels.linear.naive import HybridParts, combine_parts, hybrid_attention_naive, hybrid_parts_naive
from effattn.kernels.linear.chunk import hybrid_attention_chunk, hybrid_attention_parts
from effattn.kernels.linear.recurrent import HybridState, hybrid_attention_step, state_from_prefill
from effattn.kernels.linear.features import FEATURE_MAPS, HedgehogFeatureMap, feature_map
from effattn.kernels.linear.decode import GlobalDecodeState, LinearDecodeState, can_decode, from_state
from effattn.kernels.linear.decode import from_global_state, global_decode_step
from effattn.kernels.linear.decode import decode_step as native_decode_step
from effattn.kernels.linear.global_cache import global_cache_attention, global_cache_naive

LINEAR_MODEL_TYPE = "effattn_linear"
# every linear-attention setting lives in the config under these names; all other keys belong to the base model
LINEAR_DEFAULTS = {
    "base_model_type": "llama",
    "linear_feature_map": {"name": "hedgehog", "projection_dim": 64},  # name + the map's keyword arguments
    "linear_window": 64,  # keys under exact softmax (the query's own included); 0: pure linear attention
    "linear_sinks": 0,  # first positions kept under exact softmax for every later query (needs a window)
    "linear_chunk_size": 64,  # chunk of the prefill kernel (a speed setting only)
    "linear_eps": 1e-6,  # added to the shared normaliser
    "linear_kernel": "chunk",  # prefill/training kernel: "chunk" (linear time) or "naive" (the quadratic reference)
    "linear_exact_heads": [],  # [layer, KV head] pairs that keep their original attention (a growing cache on those heads)
    "linear_global_cache": 0,  # far keys per head kept exact by self-recall error (LoLA's sparse cache; needs a window)
}
LINEAR_KERNELS = ("chunk", "naive")
# initial window_factors: sigmoid(-ln 10) = 1/11, so wf/lf = 0.1 (LoLCATs' released configs; module docstring)
INIT_WINDOW_FACTOR = -math.log(10.0)


class EffattnLinearConfig(WrappedConfig):
    """The base model's config (every key of it, flat) plus the settings of `LINEAR_DEFAULTS`."""

    model_type = LINEAR_MODEL_TYPE
    DEFAULTS = LINEAR_DEFAULTS


class SplitState:
    """A layer's state when some of its KV heads are exact (`linear_exact_heads`): the linear heads'
    `HybridState`, `LinearDecodeState` or a global cache's state (bounded; None where every head is exact) and the exact
    heads' `FullState` (every key kept)."""

    def __init__(self, linear, exact: FullState):
        self.linear, self.exact = linear, exact

    @property
    def seen(self) -> int:
        return self.exact.seen

    def nbytes(self) -> int:
        return (self.linear.nbytes() if self.linear is not None else 0) + self.exact.nbytes()


class LinearCache(StateCache):
    """Per-layer `HybridState`s (over the H query heads): the last `linear_window` keys, values and
    feature keys, and the linear state S, z of every older key. Its size stops growing once the window
    is full. The states are detached: the cache serves generation, not backpropagation through time."""


def _stored(state: HybridState) -> HybridState:
    """A detached `state` whose window tensors own their memory: a slice of a prefill's keys would keep the
    whole prefill alive, so such a slice is copied; a decoding step's (a slice of its own small window) is not."""

    def own(x: torch.Tensor) -> torch.Tensor:
        x = x.detach()
        return x.clone() if x.untyped_storage().nbytes() > 2 * x.nbytes + 4096 else x

    return HybridState(seen=state.seen, window=state.window, S=state.S.detach(), z=state.z.detach(),
                       k=own(state.k), v=own(state.v), fk=own(state.fk), sinks=state.sinks, sink_k=own(state.sink_k),
                       sink_v=own(state.sink_v))


def repeat_heads(x: torch.Tensor, rep: int) -> torch.Tensor:
    """[B, T, G, D] -> [B, T, G * rep, D], head h holding head h // rep (transformers' repeat_kv order)."""
    return x if rep == 1 else x.repeat_interleave(rep, dim=2)


def build_feature_map(spec: dict | None, head_dim: int, heads: int) -> nn.Module:
    """The feature map a config's `linear_feature_map` describes ({"name": ..., **its keyword arguments}),
    at its initial values."""
    spec = dict(spec or {})
    name = spec.pop("name", None)
    if name not in FEATURE_MAPS:
        raise ValueError(f"linear_feature_map names {name!r}; use one of {sorted(FEATURE_MAPS)}")
    return feature_map(name, head_dim, heads, **spec)


class LinearAttention(AdoptedAttention):
    """A family's attention module (its projections and q/k norms, same names) with LoLCATs' hybrid
    sliding-window + linear attention; adds `feature_map_q`, `feature_map_k` and `window_factors` [H]."""

    # what effattn finetune trains with any `train.params` (LoLCATs' stage 2: LoRA plus the maps)
    effattn_trainable = ("feature_map_q", "feature_map_k", "window_factors")

    def __init__(self, attn: nn.Module, config: EffattnLinearConfig, layer_idx: int):
        super().__init__(attn, layer_idx)
        self.config = config
        self.heads = config.num_attention_heads
        kv_heads = getattr(config, "num_key_value_heads", None) or self.heads
        if self.heads % kv_heads:
            raise ValueError(f"num_attention_heads={self.heads} is not a multiple of num_key_value_heads={kv_heads}")
        self.groups = self.heads // kv_heads  # query heads per KV head
        if config.linear_kernel not in LINEAR_KERNELS:
            raise ValueError(f"linear_kernel is {config.linear_kernel!r}; use one of {list(LINEAR_KERNELS)}")
        self.feature_map_q = build_feature_map(config.linear_feature_map, self.head_dim, self.heads)
        self.feature_map_k = build_feature_map(config.linear_feature_map, self.head_dim, self.heads)
        self.window_factors = nn.Parameter(torch.full((self.heads,), INIT_WINDOW_FACTOR))

    def mix(self) -> tuple[torch.Tensor, torch.Tensor]:
        """Per-head (window_factor, linear_factor), each [H]: sigmoid(window_factors) and 1 minus it."""
        wf = torch.sigmoid(self.window_factors)
        return wf, 1 - wf

    @property
    def exact_heads(self) -> list[int]:
        """This layer's KV heads that keep their original attention (`linear_exact_heads`)."""
        return exact_heads_of(getattr(self.config, "linear_exact_heads", None), self.layer_idx,
                              self.heads // self.groups, "linear_exact_heads")

    def forward(self, hidden_states, position_embeddings=None, attention_mask=None, cache=None, **kwargs):
        if position_embeddings is None:
            raise ValueError("LinearAttention needs position_embeddings (the RoPE tables); run it inside "
                             "EffattnLinearForCausalLM")
        B, T, _ = hidden_states.shape
        q, k, v = self.project(hidden_states)  # [B, T, H, D], [B, T, G, D], [B, T, G, D]
        state = cache.states.get(self.layer_idx) if cache is not None else None
        exact = self.exact_heads
        if not exact:
            out, state = self._hybrid(q, k, v, position_embeddings, state, cache is not None)
        else:  # the exact heads' original attention, the others' hybrid; the outputs go back in head order
            G = k.shape[2]
            linear = [g for g in range(G) if g not in exact]
            rows_e, rows_l = head_rows(exact, self.groups, q.device), head_rows(linear, self.groups, q.device)
            cos, sin = (x.to(q.dtype) for x in position_embeddings)  # [B or 1, T, D]
            out_e, exact_state = full_attention(q[:, :, rows_e], k[:, :, exact], v[:, :, exact], cos, sin, self.scaling,
                                                state.exact if state is not None else None)
            if linear:
                out_l, linear_state = self._hybrid(q[:, :, rows_l], k[:, :, linear], v[:, :, linear], position_embeddings,
                                                   state.linear if state is not None else None, cache is not None,
                                                   rows=rows_l)
                out = torch.cat((out_l, out_e), 2)[:, :, torch.argsort(torch.cat((rows_l, rows_e)))]
            else:
                out, linear_state = out_e, None
            state = SplitState(linear_state, exact_state)
        if cache is not None:
            cache.states[self.layer_idx] = state
        return self.o_proj(out.reshape(B, T, -1)), None  # [B, T, H * D] -> [B, T, hidden]

    def _hybrid(self, q, k, v, position_embeddings, state, stateful: bool, rows: torch.Tensor | None = None):
        """The hybrid attention of the query heads `rows` (all by default; q [B, T, len(rows), D], k and v their
        KV heads), continuing `state`; returns the output [B, T, len(rows), D] and the state to cache (None
        unless `stateful`)."""
        cfg = self.config
        T = q.shape[1]
        capacity = int(cfg.linear_global_cache)  # LoLA's global cache: its own kernels
        hedgehog = isinstance(self.feature_map_q, HedgehogFeatureMap)
        pick = (lambda x: x) if rows is None else (lambda x: x[rows])  # noqa: E731  per-head parameters
        maps = (self.feature_map_q.weight, self.feature_map_k.weight) if hedgehog else ()
        # one token after a cached prefix: the compiled step (with a global cache, for Hedgehog's maps)
        if (hedgehog or not capacity) and can_decode(state, q, *maps):
            return self._decode(q, k, v, position_embeddings, state, hedgehog, rows)
        if isinstance(state, (LinearDecodeState, GlobalDecodeState)):  # anything else continues the plain state
            state = state.to_state()
        q, k, v, fq, fk = self._kernel_inputs(q, k, v, position_embeddings, rows)
        wf, lf = (pick(x) for x in self.mix())  # [H] each
        settings = dict(window=cfg.linear_window, window_factor=wf, linear_factor=lf, scale=self.scaling,
                        eps=float(cfg.linear_eps), sinks=int(cfg.linear_sinks))
        if capacity and cfg.linear_kernel == "naive" and state is None and not stateful:  # the quadratic reference
            return global_cache_naive(q, k, v, fq, fk, **settings, capacity=capacity), None
        if capacity:  # training, a prefill and decoding alike (kernels/linear/global_cache.py)
            out, state = global_cache_attention(q, k, v, fq, fk, **settings, capacity=capacity, state=state,
                                                return_state=True, key_map=lambda keys: self._key_features(keys, rows))
            return out, (state.detached() if stateful else None)
        if state is not None and T == 1:  # one token after a cached prefix: the recurrent step
            out, state = hybrid_attention_step(q, k, v, fq, fk, state, **settings)
        elif cfg.linear_kernel == "naive" and state is None:  # the quadratic reference
            out = hybrid_attention_naive(q, k, v, fq, fk, **settings)
            state = state_from_prefill(k, v, fk, settings["window"], settings["sinks"]) if stateful else None
        elif cfg.linear_kernel == "naive":  # several tokens after a cached prefix: the step, token by token
            outs = []
            for t in range(T):
                o, state = hybrid_attention_step(*(x[:, t:t + 1] for x in (q, k, v, fq, fk)), state, **settings)
                outs.append(o)  # [B, 1, H, D]
            out = torch.cat(outs, dim=1)  # [B, T, H, D]
        else:  # a whole sequence (training, a prefill), or several tokens continuing the cached state
            out, state = hybrid_attention_chunk(q, k, v, fq, fk, **settings, chunk_size=cfg.linear_chunk_size,
                                                state=state, return_state=True)
        return out, (_stored(state) if stateful else None)

    def _kernel_inputs(self, q, k, v, position_embeddings, rows: torch.Tensor | None = None) -> tuple:
        """The kernels' inputs from the projections (q [B, T, len(rows), D], k and v their KV heads): q and k
        rotated, k and v repeated to the query heads, and the feature maps of both: (q, k, v, fq, fk)."""
        cos, sin = (x.to(q.dtype)[:, :, None] for x in position_embeddings)  # [B or 1, T, 1, D]
        q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
        k, v = repeat_heads(k, self.groups), repeat_heads(v, self.groups)  # [B, T, H, D] each
        return (q, k, v, *self._features(q, k, rows))  # fq, fk: [B, T, H, F] each

    def parts(self, hidden_states: torch.Tensor, position_embeddings) -> HybridParts:
        """The hybrid's four sums on whole sequences (no cache; kernels/linear/naive.py's `HybridParts`): what
        the mix weighs. `from_parts` gives this attention's output from them for any mix, so fitting only the
        mix (a feature map without parameters) runs the kernel once per sequence instead of once per step."""
        if self.exact_heads:
            raise ValueError(f"layer {self.layer_idx} has exact heads {self.exact_heads}: their output does not come "
                             "from the mix; use forward()")
        if self.config.linear_global_cache:
            raise ValueError(f"layer {self.layer_idx} has a global cache (linear_global_cache="
                             f"{self.config.linear_global_cache}), whose four sums are not computed apart; "
                             "use forward()")
        q, k, v = self.project(hidden_states)  # [B, T, H, D], [B, T, G, D], [B, T, G, D]
        q, k, v, fq, fk = self._kernel_inputs(q, k, v, position_embeddings)
        cfg = self.config
        if cfg.linear_kernel == "naive":
            return hybrid_parts_naive(q, k, v, fq, fk, window=cfg.linear_window, scale=self.scaling,
                                      sinks=int(cfg.linear_sinks))
        return hybrid_attention_parts(q, k, v, fq, fk, window=cfg.linear_window, scale=self.scaling,
                                      chunk_size=cfg.linear_chunk_size, sinks=int(cfg.linear_sinks))

    def from_parts(self, parts: HybridParts) -> torch.Tensor:
        """This attention's output [B, T, hidden] from `parts`, with the current mix (autograd reaches
        `window_factors` and o_proj)."""
        wf, lf = self.mix()
        out = combine_parts(parts, wf, lf, float(self.config.linear_eps))  # [B, T, H, D]
        return self.o_proj(out.reshape(*out.shape[:2], -1).to(self.o_proj.weight.dtype))

    def _features(self, q: torch.Tensor, k: torch.Tensor, rows: torch.Tensor | None):
        """The feature maps of the query heads `rows` (all by default) on rotated q and k [B, T, len(rows), D]:
        the maps hold per-query-head parameters for every head, so a subset runs on a tensor of all H heads
        (zeros elsewhere), then is selected."""
        if rows is None:
            return self.feature_map_q(q), self.feature_map_k(k)
        full = lambda x: x.new_zeros(*x.shape[:2], self.heads, x.shape[3]).index_copy(2, rows, x)  # noqa: E731
        return self.feature_map_q(full(q))[:, :, rows], self._key_features(k, rows)

    def _key_features(self, k: torch.Tensor, rows: torch.Tensor | None) -> torch.Tensor:
        """The key map of the query heads `rows` (all by default) on rotated, repeated keys [B, n, len(rows), D]."""
        if rows is None:
            return self.feature_map_k(k)
        return self.feature_map_k(k.new_zeros(*k.shape[:2], self.heads, k.shape[3]).index_copy(2, rows, k))[:, :, rows]

    def _decode(self, q, k, v, position_embeddings, state, hedgehog: bool, rows: torch.Tensor | None) -> tuple:
        """One token of the query heads `rows` (all by default) through the compiled step
        (kernels/linear/decode.py), the state kept in the step's ring layout (with a global cache, its
        `GlobalDecodeState`); returns ([B, 1, len(rows), D], the advanced state). ``hedgehog``: the maps are Hedgehog's, which the step computes itself."""
        pick = (lambda x: x) if rows is None else (lambda x: x[rows])  # noqa: E731  per-head parameters
        cos, sin = (x[0, 0].to(q.dtype) for x in position_embeddings)  # [D]: this position's row
        settings = dict(scale=self.scaling, eps=float(self.config.linear_eps))
        fmq, fmk = self.feature_map_q, self.feature_map_k
        factors = pick(self.window_factors)
        maps = (pick(fmq.weight), None if fmq.bias is None else pick(fmq.bias), pick(fmk.weight),
                None if fmk.bias is None else pick(fmk.bias)) if hedgehog else None
        if self.config.linear_global_cache:  # the step with the cache's decisions (Hedgehog's maps only)
            if not isinstance(state, GlobalDecodeState):
                state = from_global_state(state)
            return global_decode_step(state, q, k, v, cos, sin, factors, hedgehog=maps, **settings), state
        if not isinstance(state, LinearDecodeState):
            state = from_state(state)
        if hedgehog:  # RoPE and the maps run in the step too
            return native_decode_step(state, q, k, v, cos, sin, factors, hedgehog=maps, **settings), state
        q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
        fq, fk = self._features(q, repeat_heads(k, self.groups), rows)
        return native_decode_step(state, q, k, v, cos, sin, factors, fq=fq, fk=fk, rope=False, **settings), state


class EffattnLinearForCausalLM(WrappedCausalLM):
    """The base family's causal LM with every attention replaced by `LinearAttention`."""

    config_class = EffattnLinearConfig

    def __init__(self, config: EffattnLinearConfig):
        super().__init__(config)
        self.build_base(config)
        for i, layer in enumerate(self.model.layers):
            layer.self_attn = LinearAttention(layer.self_attn, config, i)
        self.post_init()

    def initialize_weights(self):
        """transformers' initialization, then the linear-attention tensors it does not know. Every
        module under `self.model` is initialized by the base family's own `_init_weights` (a nested
        PreTrainedModel dispatches its own), so the mix and the feature maps are handled here: those a
        checkpoint did not provide (no `_is_hf_initialized` flag) get their initial values (the maps'
        constructors' values, `INIT_WINDOW_FACTOR`)."""
        super().initialize_weights()
        for attn in self.linear_attention_modules():
            for module in (attn, attn.feature_map_q, attn.feature_map_k):
                own = [*module.parameters(recurse=False), *module.buffers(recurse=False)]
                if any(not getattr(t, "_is_hf_initialized", False) for t in own):
                    self._init_linear_module(module)

    @torch.no_grad()
    def _init_linear_module(self, module: nn.Module) -> None:
        if isinstance(module, LinearAttention):
            module.window_factors.fill_(INIT_WINDOW_FACTOR)
            return
        fresh = build_feature_map(self.config.linear_feature_map, module.head_dim, module.heads)  # the map's own initial values
        tensors = {**dict(module.named_parameters()), **dict(module.named_buffers())}
        for name, value in fresh.state_dict().items():
            tensors[name].copy_(value)

    def forward(self, input_ids=None, attention_mask=None, position_ids=None, cache=None, inputs_embeds=None,
                labels=None, use_cache=None, logits_to_keep=0, past_key_values=None, **kwargs):
        def run(ids, embeds, positions, layer_cache):
            return self.decoder_layers(layer_cache, ids, positions, embeds)

        return self.forward_cached(LinearCache, run, input_ids, attention_mask, position_ids, cache, inputs_embeds,
                                   labels, use_cache, logits_to_keep, past_key_values, **kwargs)

    def linear_attention_modules(self) -> list[LinearAttention]:
        return [layer.self_attn for layer in self.model.layers]


def linear_config_from(base: dict, **settings) -> dict:
    """The config.json dict of a linearized model built on the base model's config dict."""
    return wrapped_config(base, EffattnLinearConfig, settings, "EffattnLinearForCausalLM",
                          "modeling_effattn_linear.py")
