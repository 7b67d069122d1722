"""Transformer-VQ models converted from pretrained RoPE models (Llama, Mistral, Qwen2, Qwen3).

`EffattnVQForCausalLM` is the base family's own model (same modules, same weight names) whose
attention modules are replaced by `VQAttention`:

* ReRoPE: keys within `vq_window` positions of the query get exact RoPE; older keys see one constant
  relative position (`vq_far_position`: 4 x the window in new conversions; the window itself, classic
  ReRoPE, in configs without the key), so they enter the logits unrotated (pre-RoPE);
* VQ: those older keys are quantized to a per-layer, per-KV-head codebook (the first `vq_sinks`
  positions excepted), which lets the blockwise kernel summarise them per code (count, value sum):
  linear time, and a cache whose size stops growing after the window (`VQCache`);
* `vq_quantize: false` gives the ReRoPE model alone (no codebook; its cache holds every key);
* `vq_key_means: true` scores each code at the mean of this sequence's far keys that share it instead
  of at its codeword (the codebook only partitions the keys; the cache keeps a key sum per code);
* `vq_heavy_keys: B` keeps, per KV head, the B far keys that have drawn the most attention exact (their own
  logit and value), as H2O keeps heavy hitters; the rest go through their codes (`kernels/vq/heavy.py`);
* `vq_exact_heads` ([layer, KV head] pairs) gives a few KV heads back their original attention (full
  RoPE over every key, no window, no codebook), as DuoAttention and RazorAttention keep full caches for
  the few retrieval heads that need them: those heads' cache grows with the sequence, the others' does not.

Codebooks are buffers. In training mode every VQ attention exposes `effattn_aux_loss` (the
commitment loss ‖k − sg(c)‖², Transformer-VQ's) and updates its codebook by exponential moving
averages of the keys assigned to each code (averaged over processes when torch.distributed runs).

This module imports nothing from effattn but the kernels, so `effattn vq-init` can bundle it with
them into one `modeling_effattn_vq.py` that `trust_remote_code=True` loads without effattn.
"""

import os

import torch
import torch.nn.functional as F
from torch import nn

from effattn.attention.wrapped import AdoptedAttention, StateCache, WrappedCausalLM, WrappedConfig, wrapped_config
from effattn.kernels.vq.chunk import VQState, vq_attention_chunk
from effattn.attention.exact import FullState, exact_heads_of, full_attention, head_rows
from effattn.kernels.vq.codes import code_table, nearest_codes
from effattn.kernels.vq.decode import VQDecodeState, can_decode, from_state, vq_decode_step
from effattn.kernels.vq.heavy import vq_heavy_chunk, vq_heavy_naive
from effattn.kernels.vq.heavy_decode import HeavyDecodeState, heavy_can_decode, heavy_from_state, vq_heavy_decode_step
from effattn.kernels.vq.naive import vq_attention_naive

VQ_MODEL_TYPE = "effattn_vq"
# every VQ setting lives in the config under these names; all other keys belong to the base model
VQ_DEFAULTS = {
    "base_model_type": "llama",
    "vq_quantize": True,
    "codebook_size": 512,
    "vq_window": 256,
    "vq_far_position": None,  # the relative position every far key is seen at; None: the window (classic ReRoPE)
    "vq_sinks": 0,
    "vq_block_size": 64,
    "vq_ema_decay": 0.99,
    "vq_commit_weight": 1e-4,
    "vq_kernel": "chunk",
    "vq_code_bias": False,
    "vq_exact_heads": [],  # [layer, KV head] pairs that keep their original attention (a growing cache on those heads)
    "vq_key_means": False,  # score a far key's code at the mean of the sequence's far keys sharing it, not its codeword
    "vq_bf16_products": False,  # CPU inference: the code columns' products in bfloat16 where the CPU has AMX/AVX-512 BF16
    "vq_heavy_keys": 0,  # far keys per KV head kept exact, chosen by the attention they received (kernels/vq/heavy.py)
}


def far_position(config) -> int:
    """The constant relative position ReRoPE gives every key beyond the window (the window by default)."""
    return getattr(config, "vq_far_position", None) or config.vq_window


# a ReRoPE-only model keeps every key exact: every position is a "sink" to the kernel
_ALL_SINKS = 1 << 62
# the decode steps by kind (plain VQ, heavy hitters): (layout, can_decode, from_state, step)
_DECODERS = {False: (VQDecodeState, can_decode, from_state, vq_decode_step),
             True: (HeavyDecodeState, heavy_can_decode, heavy_from_state, vq_heavy_decode_step)}


class EffattnVQConfig(WrappedConfig):
    """The base model's config (every key of it, flat) plus the VQ settings of `VQ_DEFAULTS`."""

    model_type = VQ_MODEL_TYPE
    DEFAULTS = VQ_DEFAULTS


class SplitState:
    """A layer's state when some of its KV heads are exact: the quantized heads' `VQState` (constant
    size) and the exact heads' `FullState` (every key kept)."""

    def __init__(self, quantized: VQState, exact: FullState):
        self.quantized, self.exact = quantized, exact

    @property
    def seen(self) -> int:
        return self.quantized.seen

    def nbytes(self) -> int:
        return self.quantized.nbytes() + self.exact.nbytes()


class VQCache(StateCache):
    """Per-layer `VQState`s: the window's keys/values, the sinks and per-code statistics. Its size
    stops growing once the window is full (for `vq_quantize: false`, every key is kept; for the KV
    heads of `vq_exact_heads`, theirs are)."""


class VQAttention(AdoptedAttention):
    """A family's attention module (its projections and q/k norms, same names) with ReRoPE+VQ."""

    def __init__(self, attn: nn.Module, config: EffattnVQConfig, layer_idx: int):
        super().__init__(attn, layer_idx)
        self.config = config
        kv_heads = config.num_key_value_heads
        size = max(1, config.codebook_size) if config.vq_quantize else 1
        self.register_buffer("codebook", torch.randn(kv_heads, size, self.head_dim))
        self.register_buffer("ema_counts", torch.ones(kv_heads, size))
        self.register_buffer("ema_sums", self.codebook.clone())
        # whitening W of the code-assignment distance ‖Wᵀ(k − c)‖² (vq-init --metric query fits it)
        self.register_buffer("code_metric", torch.eye(self.head_dim).repeat(kv_heads, 1, 1))
        # per-code logit correction (vq_code_bias): the keys a code stands for sum to more attention
        # than its centroid alone, Σ_i exp(q·k_i) ≈ n_c exp(q·c + b_c); vq-init fits b_c on calibration text
        self.register_buffer("code_bias", torch.zeros(kv_heads, size))
        self.effattn_aux_loss = None
        _ = self.exact_heads  # a bad vq_exact_heads fails at load time
        if getattr(config, "vq_key_means", False) and config.vq_code_bias:
            raise ValueError("vq_key_means and vq_code_bias do not combine: the code bias corrects a fixed "
                             "codeword, key means replace it; set one of them to false in config.json")
        if self.heavy_keys and config.vq_sinks:
            raise ValueError("vq_heavy_keys and vq_sinks do not combine: heavy hitters keep the first positions exact "
                             "when they draw attention; set vq_sinks to 0 in config.json")

    @property
    def heavy_keys(self) -> int:
        """Far keys per KV head kept exact by the attention they received (0: the plain VQ kernels)."""
        return int(getattr(self.config, "vq_heavy_keys", 0) or 0) if self.config.vq_quantize else 0

    @property
    def exact_heads(self) -> list[int]:
        """This layer's KV heads that keep their original attention (`vq_exact_heads`)."""
        return exact_heads_of(getattr(self.config, "vq_exact_heads", None), self.layer_idx, self.codebook.shape[0],
                              "vq_exact_heads")

    def forward(self, hidden_states, position_embeddings=None, attention_mask=None, cache=None, vq_far=None,
                **kwargs):
        if vq_far is None:
            raise ValueError("VQAttention needs vq_far (the RoPE table at the far relative position); "
                             "run it inside EffattnVQForCausalLM")
        cfg = self.config
        B, T, _ = hidden_states.shape
        self.effattn_aux_loss = None  # set again below where this layer has quantized heads and trains
        q, k, v = self.project(hidden_states)
        cos, sin = (x[0].to(q.dtype) for x in position_embeddings)  # (T, D): one sequence layout per batch
        rope = (cos, sin, *(x.to(q.dtype) for x in vq_far))
        state = cache.states.get(self.layer_idx) if cache is not None else None
        G = k.shape[2]
        exact = self.exact_heads
        quant = [g for g in range(G) if g not in exact]
        if not cfg.vq_quantize:  # ReRoPE alone: every key exact, far ones at the far position
            out, new_state = self._attend_rerope(q, k, v, rope, state, cache is not None)
        elif not exact:
            out, new_state = self._attend_quantized(q, k, v, rope, state, cache is not None)
        elif not quant:
            out, new_state = full_attention(q, k, v, cos, sin, self.scaling, state)
        else:  # some heads of each kind: each group runs its own kernel, the outputs go back in head order
            rep = q.shape[2] // G
            rows = lambda heads: head_rows(heads, rep, q.device)  # noqa: E731
            sq, se = (state.quantized, state.exact) if state is not None else (None, None)
            out_q, sq = self._attend_quantized(q[:, :, rows(quant)], k[:, :, quant], v[:, :, quant], rope, sq,
                                               cache is not None, heads=quant)
            out_e, se = full_attention(q[:, :, rows(exact)], k[:, :, exact], v[:, :, exact], cos, sin, self.scaling, se)
            out = torch.cat((out_q, out_e), 2)[:, :, torch.argsort(torch.cat((rows(quant), rows(exact))))]
            new_state = SplitState(sq, se) if cache is not None else None
        if cache is not None:
            cache.states[self.layer_idx] = new_state
        return self.o_proj(out.reshape(B, T, -1)), None

    def _kernel(self, args, sinks, state, stateful, key_means=False):
        cfg = self.config
        q = args[0]
        # one token, no autograd: a decode step in its own layout (heavy hitters' or plain VQ's); several
        # positions after decode steps: the layout's plain state back for the blockwise kernel
        layout, can_step, to_layout, step = _DECODERS[bool(self.heavy_keys)]
        if stateful and self._decodes(q) and can_step(state, q.shape[1]):
            if not isinstance(state, layout):
                state = to_layout(state, args[3], args[7], args[8], self.scaling, q.shape[2], q.dtype)
            q, k, v, _, codes, cos, sin = args[:7]
            return step(q, k, v, codes, cos, sin, state)
        if isinstance(state, layout):
            state = state.to_state()
        if self.heavy_keys:  # heavy hitters (quantized models only): their own kernels
            settings = dict(window=cfg.vq_window, update=cfg.vq_block_size, budget=self.heavy_keys, scale=self.scaling,
                            key_means=key_means)
            if cfg.vq_kernel == "naive" and not stateful:
                return vq_heavy_naive(*args, **settings), None
            if stateful:
                return vq_heavy_chunk(*args, **settings, state=state, return_state=True)
            return vq_heavy_chunk(*args, **settings), None
        settings = dict(window=cfg.vq_window, block_size=cfg.vq_block_size, sinks=sinks, scale=self.scaling,
                        key_means=key_means, bf16_products=bool(getattr(cfg, "vq_bf16_products", False)))
        if cfg.vq_kernel == "naive" and not stateful:  # the reference has no state: full sequences only
            settings.pop("bf16_products")
            return vq_attention_naive(*args, **settings), None
        if stateful:
            return vq_attention_chunk(*args, **settings, state=state, return_state=True)
        return vq_attention_chunk(*args, **settings), None

    def _decodes(self, q) -> bool:
        """Whether a one-token call may take the decode step: inference (no autograd, the codebook fixed);
        EFFATTN_VQ_DECODE=0 turns it off (the chunk kernel then runs, computing the same thing)."""
        return (not self.training and not (torch.is_grad_enabled() and q.requires_grad)
                and os.environ.get("EFFATTN_VQ_DECODE", "1") != "0")

    def _code_table(self, codebook, metric, dtype, heads):
        """`nearest_codes`' table of these heads' codebook, computed once while the codebook stays as it is
        (in training the EMA moves it every step: computed anew each call)."""
        if self.training:
            return None
        key = (self.codebook._version, self.code_metric._version, self.codebook.data_ptr(), dtype,
               None if heads is None else tuple(heads))
        cached = getattr(self, "_table", None)
        if cached is None or cached[0] != key:
            self._table = cached = (key, code_table(codebook, metric, dtype))
        return cached[1]

    def _attend_rerope(self, q, k, v, rope, state, stateful):
        """ReRoPE alone: every key is kept exact (a cache that grows with the sequence)."""
        codebook = k.new_zeros(k.shape[2], 1, k.shape[3])
        codes = torch.zeros(k.shape[:3], dtype=torch.long, device=k.device)
        return self._kernel((q, k, v, codebook, codes, *rope), _ALL_SINKS, state, stateful)

    def _attend_quantized(self, q, k, v, rope, state, stateful, heads=None):
        """ReRoPE + VQ on the KV heads `heads` (all by default): far keys read through their codebooks."""
        cfg = self.config
        pick = (lambda t: t) if heads is None else (lambda t: t[heads])
        codebook, metric = pick(self.codebook), pick(self.code_metric)
        codes = nearest_codes(k.detach(), codebook, metric, table=self._code_table(codebook, metric, k.dtype, heads))
        k_raw = k
        cos, sin, far_cos, far_sin = rope
        if cfg.vq_code_bias:
            q, k, codebook, cos, sin, far_cos, far_sin = self._with_code_bias(
                q, k, codebook, cos, sin, far_cos, far_sin, pick(self.code_bias))
        out, new_state = self._kernel((q, k, v, codebook.to(q.dtype), codes, cos, sin, far_cos, far_sin),
                                      cfg.vq_sinks, state, stateful, key_means=bool(getattr(cfg, "vq_key_means", False)))
        if self.training:
            self._learn_codebook(k_raw, codes, state.seen if state is not None else 0, heads)
        return out, new_state

    def _with_code_bias(self, q, k, codebook, cos, sin, far_cos, far_sin, code_bias):
        """One extra RoPE pair that never rotates (cos 1, sin 0): queries carry 1 there, keys 0 and
        codewords b_c / scale, so every code logit gains b_c and nothing else changes."""
        h = self.head_dim // 2

        def extend(x, value, last=0.0):  # (..., D) -> (..., D + 2): [x1, value, x2, last]
            value = value if torch.is_tensor(value) else torch.full_like(x[..., :1], value)
            return torch.cat((x[..., :h], value, x[..., h:], torch.full_like(x[..., :1], last)), dim=-1)

        bias = (code_bias / self.scaling).to(codebook.dtype)[..., None]  # (G, C, 1)
        return (extend(q, 1.0), extend(k, 0.0), extend(codebook, bias), extend(cos, 1.0, 1.0),
                extend(sin, 0.0), extend(far_cos, 1.0, 1.0), extend(far_sin, 0.0))

    def _learn_codebook(self, k: torch.Tensor, codes: torch.Tensor, first_position: int, heads=None) -> None:
        """Commitment loss on the keys (their gradient) and an EMA step of the codebook (no gradient),
        for the KV heads `heads` (all by default): exact heads' codebooks neither pull nor move."""
        cfg = self.config
        keep = torch.arange(first_position, first_position + k.shape[1], device=k.device) >= cfg.vq_sinks
        k, codes = k[:, keep], codes[:, keep]
        if k.shape[1] == 0:
            self.effattn_aux_loss = None
            return
        idx = torch.arange(self.codebook.shape[0], device=k.device) if heads is None else torch.tensor(heads, device=k.device)
        codebook = self.codebook[idx]  # (G', C, D): the codebooks of these heads
        chosen = codebook[torch.arange(k.shape[2], device=k.device), codes].to(k.dtype)  # (B, T, G', D)
        self.effattn_aux_loss = cfg.vq_commit_weight * (k - chosen.detach()).float().pow(2).sum(-1).mean()
        with torch.no_grad():
            onehot = F.one_hot(codes, codebook.shape[1]).float()  # (B, T, G', C)
            counts = onehot.sum((0, 1))  # (G', C)
            sums = torch.einsum("btgc,btgd->gcd", onehot, k.float())
            if torch.distributed.is_available() and torch.distributed.is_initialized():
                torch.distributed.all_reduce(counts)
                torch.distributed.all_reduce(sums)
            decay = cfg.vq_ema_decay
            ema_counts = self.ema_counts[idx].mul_(decay).add_(counts, alpha=1 - decay)
            ema_sums = self.ema_sums[idx].mul_(decay).add_(sums, alpha=1 - decay)
            used = ema_counts > 1e-6  # codes never used keep their codeword
            update = ema_sums / ema_counts.clamp_min(1e-6)[..., None]
            self.ema_counts.index_copy_(0, idx, ema_counts)
            self.ema_sums.index_copy_(0, idx, ema_sums)
            self.codebook.index_copy_(0, idx, torch.where(used[..., None], update, codebook))


class EffattnVQForCausalLM(WrappedCausalLM):
    """The base family's causal LM with every attention replaced by `VQAttention`."""

    config_class = EffattnVQConfig

    def __init__(self, config: EffattnVQConfig):
        super().__init__(config)
        self.build_base(config)
        for i, layer in enumerate(self.model.layers):
            layer.self_attn = VQAttention(layer.self_attn, config, i)
        self.post_init()

    def _init_weights(self, module):
        super()._init_weights(module)
        if isinstance(module, VQAttention):  # a fresh model (not loaded): random unit-scale codebook
            with torch.no_grad():
                module.codebook.normal_()
                module.ema_counts.fill_(1.0)
                module.ema_sums.copy_(module.codebook)
                module.code_metric.copy_(torch.eye(module.head_dim).expand_as(module.code_metric))
                module.code_bias.zero_()

    def forward(self, input_ids=None, attention_mask=None, position_ids=None, cache=None, inputs_embeds=None,
                labels=None, use_cache=None, logits_to_keep=0, past_key_values=None, **kwargs):
        def far_rope(x):  # the RoPE tables at the far position every quantized key is scored from
            far = torch.tensor([[far_position(self.config)]], device=x.device)
            return {"vq_far": tuple(t[0, 0] for t in self.model.rotary_emb(x, far))}

        def run(ids, embeds, positions, layer_cache):
            return self.decoder_layers(layer_cache, ids, positions, embeds, layer_kwargs=far_rope)

        return self.forward_cached(VQCache, run, input_ids, attention_mask, position_ids, cache, inputs_embeds, labels,
                                   use_cache, logits_to_keep, past_key_values, **kwargs)

    def vq_attention_modules(self) -> list[VQAttention]:
        return [layer.self_attn for layer in self.model.layers]


def vq_config_from(base: dict, **settings) -> dict:
    """The config.json dict of a VQ model built on the base model's config dict."""
    return wrapped_config(base, EffattnVQConfig, settings, "EffattnVQForCausalLM", "modeling_effattn_vq.py")
