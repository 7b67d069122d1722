"""Hybrid sliding-window softmax + linear attention, for linearizing softmax attention (issue 17).

The LoLCATs hybrid (Zhang et al. 2024, "LoLCATs: On Low-Rank Linearizing of Large Language Models",
HazyResearch/lolcats, ``src/model/linear_attention/linear_window_attention_sw.py``): exact softmax
over a sliding window of the most recent keys, linear attention over every older key, one shared
normaliser. With ``q, k: [B, T, H, D]``, ``v: [B, T, H, Dv]``, feature-mapped ``fq, fk: [B, T, H, F]``,
for query t the window is ``W_t = {s : t - window < s <= t}``, the far keys ``F_t = {s : s <= t - window}``,
``m_t = max_{s in W_t} scale * q_t . k_s`` and, with per-head weights ``wf = window_factor``,
``lf = linear_factor``:

    num_t = wf * sum_{s in W_t} exp(scale q_t.k_s - m_t) v_s + lf * sum_{s in F_t} (fq_t.fk_s) v_s
    den_t = wf * sum_{s in W_t} exp(scale q_t.k_s - m_t)     + lf * sum_{s in F_t} (fq_t.fk_s)
    out_t = num_t / (den_t + eps)

As in LoLCATs, ``m_t`` is subtracted inside the exponential only (the linear terms are not
rescaled) and is not detached. ``window = 0`` is pure causal linear attention.

* :func:`hybrid_attention_naive`: the quadratic reference that defines the semantics;
* :func:`hybrid_attention_chunk`: the chunked kernel, linear time and memory in T, same signature
  plus ``chunk_size``;
* :func:`hybrid_attention_parts` (chunked) and :func:`hybrid_parts_naive` (reference): the four sums before
  the factors weigh them, which :func:`combine_parts` combines (fitting only the factors needs them once);
* :func:`hybrid_attention_step`, :class:`HybridState`, :func:`init_state`, :func:`state_from_prefill`:
  token-by-token decoding with a constant-size state;
* :func:`global_cache_attention`, :func:`global_cache_naive`, :class:`GlobalCacheState` (``global_cache.py``): LoLA's
  sparse global cache on top of the hybrid, far keys the linear state recalls worst kept exact, constant memory;
* :mod:`.features`: the feature maps (``elu``, ``performer``, ``taylor``, ``hedgehog``).
"""

from effattn.kernels.linear.chunk import hybrid_attention_chunk, hybrid_attention_parts
from effattn.kernels.linear.features import (
    FEATURE_MAPS,
    EluFeatureMap,
    HedgehogFeatureMap,
    PerformerFeatureMap,
    TaylorFeatureMap,
    feature_map,
)
from effattn.kernels.linear.global_cache import GlobalCacheState, global_cache_attention, global_cache_naive
from effattn.kernels.linear.naive import HybridParts, combine_parts, hybrid_attention_naive, hybrid_parts_naive
from effattn.kernels.linear.recurrent import HybridState, hybrid_attention_step, init_state, state_from_prefill

__all__ = [
    "FEATURE_MAPS",
    "EluFeatureMap",
    "GlobalCacheState",
    "HedgehogFeatureMap",
    "HybridParts",
    "HybridState",
    "PerformerFeatureMap",
    "TaylorFeatureMap",
    "combine_parts",
    "feature_map",
    "global_cache_attention",
    "global_cache_naive",
    "hybrid_attention_chunk",
    "hybrid_attention_naive",
    "hybrid_attention_parts",
    "hybrid_attention_step",
    "hybrid_parts_naive",
    "init_state",
    "state_from_prefill",
]
