"""What effattn's own model classes share: a base family's causal LM (same modules, same weight names)
whose attention is effattn's, and a config that is the base config plus the model's own settings.

Each model (vq.py, linear.py, sinks.py, sparse.py) subclasses `WrappedConfig` (declaring `model_type` and
its `DEFAULTS`) and `WrappedCausalLM` (replacing the attention modules or the attention function), and
writes its config.json with `wrapped_config`. A model with its own cache class runs its decoder through
`forward_cached`, which reads a padded batch row by row. This module imports nothing from effattn, so it is
bundled into each model's `modeling_*.py` for `trust_remote_code=True`.
"""

import copy
import importlib
import os

import torch
from torch import nn
from transformers import AutoConfig, GenerationMixin, PretrainedConfig, PreTrainedModel
from transformers.modeling_outputs import CausalLMOutputWithPast

_NOT_BASE_KEYS = ("model_type", "architectures", "auto_map", "transformers_version")


class WrappedConfig(PretrainedConfig):
    """The base model's config (every key of it, flat) plus the settings of `DEFAULTS` (which must
    include `base_model_type`)."""

    DEFAULTS = {"base_model_type": "llama"}  # (not annotated: transformers makes annotated attributes fields)

    def __init__(self, **kwargs):
        for key, default in self.DEFAULTS.items():
            setattr(self, key, copy.deepcopy(kwargs.pop(key, default)))
        super().__init__(**kwargs)

    def base_config(self) -> PretrainedConfig:
        """The base family's config (e.g. a LlamaConfig) with the same settings."""
        skip = {*_NOT_BASE_KEYS, *self.DEFAULTS}
        values = {k: v for k, v in self.to_dict().items() if k not in skip}
        return AutoConfig.for_model(self.base_model_type, **values)


class AdoptedAttention(nn.Module):
    """An attention module that adopts a family attention module's projections and q/k norms (same
    weight names, so the checkpoint loads unchanged); subclasses compute the attention."""

    def __init__(self, attn: nn.Module, layer_idx: int):
        super().__init__()
        for name in ("q_proj", "k_proj", "v_proj", "o_proj", "q_norm", "k_norm"):
            if getattr(attn, name, None) is not None:
                setattr(self, name, getattr(attn, name))
        self.has_qk_norm = getattr(attn, "q_norm", None) is not None
        self.layer_idx = layer_idx
        self.head_dim = attn.head_dim
        self.scaling = attn.scaling

    def project(self, hidden_states: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Pre-RoPE q (B, T, H, D), k and v (B, T, G, D), after the q/k norms where the family has them."""
        B, T, _ = hidden_states.shape
        q = self.q_proj(hidden_states).view(B, T, -1, self.head_dim)
        k = self.k_proj(hidden_states).view(B, T, -1, self.head_dim)
        v = self.v_proj(hidden_states).view(B, T, -1, self.head_dim)
        if self.has_qk_norm:
            q, k = self.q_norm(q), self.k_norm(k)
        return q, k, v


class StateCache:
    """A cache of per-layer state objects (each with `seen` and `nbytes()`), for models whose cache is
    not transformers' key/value lists: subclasses name what a state holds."""

    def __init__(self):
        self.states: dict = {}

    def get_seq_length(self, layer_idx: int = 0) -> int:
        state = self.states.get(layer_idx)
        return 0 if state is None else state.seen

    def __len__(self) -> int:
        return len(self.states)

    def nbytes(self) -> int:
        return sum(state.nbytes() for state in self.states.values())


class RowCaches:
    """The cache of a padded batch: one cache per row, holding that row's real tokens alone (`forward_rows`).
    `seen` counts the batch's columns, padding included, as generate() counts them."""

    def __init__(self, rows: list):
        self.rows = rows
        self.seen = 0

    def get_seq_length(self, layer_idx: int = 0) -> int:
        return self.seen

    def __len__(self) -> int:
        return max((len(row) for row in self.rows), default=0)

    def nbytes(self) -> int:
        return sum(row.nbytes() for row in self.rows)


class WrappedCausalLM(PreTrainedModel, GenerationMixin):
    """The base family's causal LM (`self.model`, `self.lm_head`), built from the config's base config."""

    base_model_prefix = "model"
    supports_gradient_checkpointing = True
    _supports_sdpa = True
    _tied_weights_keys = {"lm_head.weight": "model.embed_tokens.weight"}

    def build_base(self, config: WrappedConfig, attn_implementation: str = "sdpa"):
        """Set `self.model` and `self.lm_head` from the base family's *ForCausalLM; returns the base config."""
        from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING

        base_config = config.base_config()
        base_config._attn_implementation = attn_implementation
        base = MODEL_FOR_CAUSAL_LM_MAPPING[type(base_config)](base_config)
        self._no_split_modules = getattr(base, "_no_split_modules", None)
        self.model, self.lm_head = base.model, base.lm_head
        return base_config

    def save_pretrained(self, save_directory, *args, **kwargs):
        """transformers copies a model's own code into the folder only when the model was loaded from that code
        (trust_remote_code); loaded through `import effattn`, the saved config.json would name a modeling file
        the folder lacks, and the folder would load nowhere without effattn. The code is written here then."""
        super().save_pretrained(save_directory, *args, **kwargs)
        modules = set((getattr(self.config, "auto_map", None) or {}).values())
        files = {f"{m.split('.')[0]}.py" for m in modules}
        missing = [f for f in files if not os.path.exists(os.path.join(save_directory, f))]
        if missing and kwargs.get("is_main_process", True):
            # effattn is installed (the code did not come from a bundled file); imported by name, as transformers
            # requires every module a bundled file imports, even in a branch it never takes
            models = importlib.import_module("effattn.models")
            models.model_spec(self.config.model_type).write_code(save_directory)

    def get_input_embeddings(self):
        return self.model.embed_tokens

    def set_input_embeddings(self, value):
        self.model.embed_tokens = value

    def get_output_embeddings(self):
        return self.lm_head

    def set_output_embeddings(self, value):
        self.lm_head = value

    def fresh_cache(self, cache, use_cache, cache_class):
        """Replace the empty cache generate() prepares by a `cache_class()` (when caching); returns the cache or None."""
        if use_cache and not isinstance(cache, cache_class):
            if cache is not None and cache.get_seq_length() > 0:
                raise ValueError(f"{type(self).__name__} needs its own {cache_class.__name__}, got a filled "
                                 f"{type(cache).__name__}")
            return cache_class()
        return cache if isinstance(cache, cache_class) else None

    def forward_cached(self, cache_class, run, input_ids, attention_mask, position_ids, cache, inputs_embeds, labels,
                       use_cache, logits_to_keep, past_key_values, **kwargs):
        """The causal LM's forward for a model with its own cache class. `run(input_ids, inputs_embeds, position_ids,
        cache)` is the decoder on a batch without padding (its final norm included). A batch whose attention mask
        pads it runs row by row (`forward_rows`)."""
        cache = cache if cache is not None else past_key_values
        use_cache = getattr(self.config, "use_cache", True) if use_cache is None else use_cache
        padded = attention_mask is not None and not bool(attention_mask.all())
        if padded or isinstance(cache, RowCaches):
            x, cache = self.forward_rows(cache_class, run, input_ids, attention_mask, position_ids, cache,
                                         inputs_embeds, use_cache)
        else:
            cache = self.fresh_cache(cache, use_cache, cache_class)
            x = run(input_ids, inputs_embeds, position_ids, cache)
        logits, loss = self.logits_and_loss(x, logits_to_keep, labels, **kwargs)
        return CausalLMOutputWithPast(loss=loss, logits=logits, cache=cache)

    def forward_rows(self, cache_class, run, input_ids, attention_mask, position_ids, cache, inputs_embeds,
                     use_cache):
        """A padded batch (generate()'s prompts of different lengths, padded in front; padding anywhere): each row's
        real tokens run alone, with the row's own cache (`RowCaches`), so each row reads as its sequence alone, at
        positions counted over its own tokens. The kernels keep one position per token for a whole batch; this
        costs a forward per row, the speed of the prompts one at a time. Returns (hidden states with zeros at the
        padding, the cache)."""
        name = type(self).__name__
        ids = input_ids if inputs_embeds is None else inputs_embeds
        B, T = ids.shape[:2]
        if attention_mask is None:
            mask = torch.ones(B, T, dtype=torch.bool, device=ids.device)
        elif attention_mask.dim() != 2 or attention_mask.shape[0] != B or attention_mask.shape[1] < T:
            raise ValueError(f"{name} takes a 2-D attention mask (batch, tokens so far), got shape "
                             f"{tuple(attention_mask.shape)} for {B} rows of {T} new tokens")
        else:
            mask = attention_mask[:, -T:].bool()
        if not isinstance(cache, RowCaches):
            if cache is not None and cache.get_seq_length() > 0:
                raise ValueError(f"{name}: a padded batch needs a fresh cache (its rows keep their own), got a "
                                 f"filled {type(cache).__name__}")
            cache = RowCaches([cache_class() for _ in range(B)]) if use_cache else None
        elif len(cache.rows) != B:
            raise ValueError(f"{name}: the cache holds {len(cache.rows)} rows, the batch has {B}")
        rows = []
        for b in range(B):
            cols = mask[b].nonzero()[:, 0]
            if cols.numel() == 0:  # nothing real in this row's new columns
                continue
            pos = None if position_ids is None else position_ids[b:b + 1, cols]
            row_ids = None if input_ids is None or inputs_embeds is not None else input_ids[b:b + 1, cols]
            row_embeds = None if inputs_embeds is None else inputs_embeds[b:b + 1, cols]
            rows.append((b, cols, run(row_ids, row_embeds, pos, None if cache is None else cache.rows[b])[0]))
        if not rows:
            raise ValueError(f"{name}: the attention mask leaves no token to read")
        x = rows[0][2].new_zeros(B, T, rows[0][2].shape[-1])
        for b, cols, h in rows:
            x[b, cols] = h
        if cache is not None:
            cache.seen += T
        return x, cache

    def decoder_layers(self, cache, input_ids, position_ids, inputs_embeds, layer_kwargs=None):
        """The base family's decoder on a batch without padding: embeddings, the RoPE tables, every layer (with
        `cache=` and `layer_kwargs(x)`'s extra arguments) and the final norm."""
        body = self.model
        x = body.embed_tokens(input_ids) if inputs_embeds is None else inputs_embeds
        past = cache.get_seq_length() if cache is not None else 0
        position_ids = self.check_positions(position_ids, past, x.shape[1], x.device, cached=cache is not None)
        cos, sin = body.rotary_emb(x, position_ids)
        extra = layer_kwargs(x) if layer_kwargs is not None else {}
        for layer in body.layers:
            x = layer(x, position_embeddings=(cos, sin), position_ids=position_ids, cache=cache, **extra)
        return body.norm(x)

    @staticmethod
    def check_positions(position_ids, past: int, length: int, device, cached: bool = True):
        """Positions past..past+length-1 (given ones must start where the cache ends; a forward without a cache,
        as in training, may read a sequence at any positions)."""
        if position_ids is None:
            return torch.arange(past, past + length, device=device)[None]
        if cached and int(position_ids[0, 0]) != past:
            raise ValueError(f"position_ids start at {int(position_ids[0, 0])} but the cache holds {past} positions")
        return position_ids

    @staticmethod
    def left_padding(attention_mask, name: str):
        """Each row's padding tokens in front, (B,), for a model whose attention takes them (a batch of prompts
        of different lengths, as generate() pads them); None when no row is padded in front. Padding behind the
        tokens needs nothing (no real token reads a later one); padding between tokens is refused."""
        if attention_mask is None or attention_mask.dim() != 2 or bool(attention_mask.all()):
            return None
        mask = attention_mask.bool()
        pad = (mask.long().cumsum(-1) == 0).sum(-1)  # the zeros before each row's first real token
        real = mask.sum(-1)
        last = mask.shape[1] - mask.flip(-1).long().argmax(-1)  # one past each row's last real token
        if bool(((pad + real) != last).any()):
            raise ValueError(f"{name} takes padding in front of the tokens (or behind them), not between them")
        return pad if bool(pad.any()) else None

    def logits_and_loss(self, x, logits_to_keep, labels, **kwargs):
        """The head on the last `logits_to_keep` positions (0: all), and the LM loss when labels are given."""
        keep = slice(-logits_to_keep, None) if isinstance(logits_to_keep, int) else logits_to_keep
        logits = self.lm_head(x[:, keep, :])
        loss = None
        if labels is not None:
            loss = self.loss_function(logits=logits, labels=labels, vocab_size=self.config.vocab_size, **kwargs)
        return logits, loss


def wrapped_config(base: dict, config_class, settings: dict, architecture: str, modeling_file: str) -> dict:
    """The config.json dict of a wrapped model on the base model's config dict: the base keys, then
    `config_class.DEFAULTS` overridden by `settings`, and the auto_map of the bundled code."""
    unknown = set(settings) - set(config_class.DEFAULTS)
    if unknown:
        raise ValueError(f"unknown {config_class.model_type} settings {sorted(unknown)}")
    config = {k: copy.deepcopy(v) for k, v in base.items() if k not in ("architectures", "auto_map")}
    config["base_model_type"] = base["model_type"]
    config["model_type"] = config_class.model_type
    config["architectures"] = [architecture]
    config.update({k: copy.deepcopy(settings.get(k, v)) for k, v in config_class.DEFAULTS.items()
                   if k != "base_model_type"})
    module = modeling_file.removesuffix(".py")
    config["auto_map"] = {"AutoConfig": f"{module}.{config_class.__name__}",
                          "AutoModelForCausalLM": f"{module}.{architecture}"}
    return config
