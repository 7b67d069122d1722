"""Transformer-VQ attention with ReRoPE: the readable quadratic reference.

Every (query t, key s) pair is one of three kinds, by relative distance ``delta = t - s``:

* near, ``0 <= delta < W``: exact RoPE, ``logit = scale * <rope(q_t, t), rope(k_s, s)>``;
* far, ``delta >= W``: ReRoPE replaces the relative position by one constant F (``far_cos,
  far_sin``; classically F = W, clipping), so ``logit = scale * <rope(q_t, F), k_hat_s>``
  with the key unrotated (pre-RoPE) and quantized,
  ``k_hat_s = k_s + (codebook[g, codes_s] - k_s).detach()`` (straight-through: the value is the
  codeword, the gradient goes to ``k_s``); the first ``sinks`` keys are never quantized
  (``k_hat_s = k_s``);
* future, ``delta < 0``: masked.

One softmax normalises near and far pairs together; values are never quantized.

Stop-gradient rule. With blocks of ``L = block_size`` queries, a pair is *aggregated* when
``s <= floor(t / L) * L - W``: the key is far for every query of t's block, so the blockwise kernel
(``chunk.py``) folds it into per-code statistics (counts and value sums) built from detached keys
and values. Aggregated pairs therefore use ``k_hat_s.detach()`` and ``v_s.detach()``; the query
still gets its gradient through the logit. Here the rule is applied by masking, so outputs and
gradients of both implementations agree.

Key means (``key_means=True``). A fixed codeword scores every key of its code alike, however far
the keys of this sequence lie from it. With key means, the code of a far key s is scored, for
query t, at the mean of the far keys of t (``s' <= t - W``, sinks excepted) that share its code:

    logit(t, s) = scale * <rope(q_t, F), mu_t(z_s)>,   mu_t(c) = mean of k_s' over far s' with z_s' = c.

The codebook then only partitions the keys; each part is represented by its own keys. A code
that holds one key of the sequence scores it exactly (as ReRoPE alone would), and the sum of
``exp(q . k)`` over a code is right to first order around its mean (the first-order term of
``sum_i exp(q . k_i)`` around ``mu`` vanishes, around a fixed codeword it does not). The cache then
keeps a key sum per code beside the count and the value sum. Inside the means, keys of pairs the
stop-gradient rule aggregates are detached, like their values.

Relation to the paper (Lingle 2023, ``VQAttention`` in the reference JAX code): there the state
carried between blocks (the previous block's quantized keys and values, and the aggregated cache)
is wrapped in ``stop_gradient`` unless ``grad_thru_cache`` is set, so keys and values get gradients
only from queries of their own block: pairs with ``s < floor(t / L) * L`` are cut. Our cut,
``s <= floor(t / L) * L - W``, is a subset of it: we stop gradients only where the blockwise kernel
really aggregates, and the ``W - 1`` exact keys carried from earlier blocks keep theirs within one
call (a state passed between calls is detached, as in the paper). In both, the query keeps its
gradient through every logit, and the codebook gets none from attention (the paper learns it by
EMA through a separate loss; here it is reached only through ``.detach()``). Unlike the paper, near
keys are not quantized: they keep exact RoPE, which is what a converted RoPE model expects.
"""

import torch
import torch.nn.functional as F
from torch import Tensor

from effattn.kernels.rope import apply_rope


def check_vq_inputs(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    codebook: Tensor,
    codes: Tensor,
    cos: Tensor,
    sin: Tensor,
    far_cos: Tensor,
    far_sin: Tensor,
    window: int,
    block_size: int,
    sinks: int,
) -> None:
    """Raise ``ValueError`` with a full explanation if the VQ attention inputs are inconsistent."""
    for name, x in (("q", q), ("k", k), ("v", v)):
        if x.dim() != 4:
            raise ValueError(
                f"{name} must have 4 dimensions [batch, time, heads, head_dim], got shape {tuple(x.shape)}; "
                f"reshape it to [B, T, heads, head_dim]."
            )
    B, T, H, D = q.shape
    G = k.shape[2]
    if k.shape[:2] != (B, T) or v.shape[:3] != (B, T, G):
        raise ValueError(
            f"q, k and v must share batch and time sizes and k, v the number of key/value heads, "
            f"got q {tuple(q.shape)}, k {tuple(k.shape)}, v {tuple(v.shape)}; pass tensors of one sequence chunk."
        )
    if k.shape[3] != D:
        raise ValueError(f"k has head_dim {k.shape[3]} but q has {D}; queries and keys must have the same head_dim.")
    if H % G:
        raise ValueError(
            f"q has {H} heads, which is not a multiple of the {G} key/value heads of k; use a number of "
            f"key/value heads that divides the number of query heads (grouped-query attention)."
        )
    if D % 2:
        raise ValueError(f"head_dim must be even for rotate-half RoPE, got {D}; use an even head_dim.")
    if T == 0:
        raise ValueError("The sequence is empty (T=0); pass at least one position.")
    if codebook.dim() != 3 or codebook.shape[0] != G or codebook.shape[2] != D:
        raise ValueError(
            f"codebook must have shape [kv_heads, codebook_size, head_dim] = [{G}, C, {D}], "
            f"got {tuple(codebook.shape)}; pass one codebook per key/value head in pre-RoPE key space."
        )
    if codes.shape != (B, T, G) or codes.dtype not in (torch.int64, torch.int32):
        raise ValueError(
            f"codes must be an integer tensor of shape [B, T, kv_heads] = [{B}, {T}, {G}], got "
            f"{codes.dtype} {tuple(codes.shape)}; pass the code index of every key (e.g. its nearest centroid)."
        )
    C = codebook.shape[1]
    if codes.min() < 0 or codes.max() >= C:
        raise ValueError(
            f"codes must lie in [0, {C}) for a codebook of {C} entries, got values in "
            f"[{int(codes.min())}, {int(codes.max())}]; compute codes with this codebook."
        )
    for name, table in (("cos", cos), ("sin", sin)):
        if table.shape != (T, D):
            raise ValueError(
                f"{name} must have shape [T, head_dim] = [{T}, {D}], got {tuple(table.shape)}; "
                f"pass the RoPE table rows of this chunk's absolute positions."
            )
    for name, table in (("far_cos", far_cos), ("far_sin", far_sin)):
        if table.shape != (D,):
            raise ValueError(
                f"{name} must have shape [head_dim] = [{D}], got {tuple(table.shape)}; "
                f"pass the RoPE table row of the far relative position (e.g. `window`)."
            )
    for name, value, low in (("window", window, 1), ("block_size", block_size, 1), ("sinks", sinks, 0)):
        if not isinstance(value, int) or isinstance(value, bool) or value < low:
            raise ValueError(f"{name} must be an integer >= {low}, got {value!r}; pass an integer of at least {low}.")


def compute_dtype(dtype: torch.dtype) -> torch.dtype:
    """Accumulation dtype: float32 for half/bfloat16/float32 inputs, float64 stays float64."""
    return torch.promote_types(dtype, torch.float32)


def vq_attention_naive(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    codebook: Tensor,
    codes: Tensor,
    cos: Tensor,
    sin: Tensor,
    far_cos: Tensor,
    far_sin: Tensor,
    *,
    window: int,
    block_size: int,
    sinks: int = 0,
    scale: float | None = None,
    key_means: bool = False,
) -> Tensor:
    """Quadratic reference for Transformer-VQ attention with ReRoPE (see the module docstring).

    Args:
        q: (B, T, H, D) pre-RoPE queries.
        k: (B, T, G, D) pre-RoPE keys, ``H % G == 0``; query head h reads key/value head ``h // (H // G)``.
        v: (B, T, G, Dv) values.
        codebook: (G, C, D) one codebook per key/value head, in pre-RoPE key space.
        codes: (B, T, G) integer code of every key.
        cos, sin: (T, D) RoPE tables at the absolute positions ``0 .. T-1``.
        far_cos, far_sin: (D,) RoPE table at ReRoPE's far relative position F (classically ``window``).
        window: W >= 1, keys with ``t - s < W`` are exact.
        block_size: L >= 1, query block length of the stop-gradient rule.
        sinks: the first ``sinks`` keys are never quantized.
        scale: logit scale, default ``D ** -0.5``.
        key_means: score each far key's code at the mean of the far keys sharing it (see above)
            instead of at its codeword.

    Returns:
        (B, T, H, Dv) attention output in the dtype of ``q``.
    """
    check_vq_inputs(q, k, v, codebook, codes, cos, sin, far_cos, far_sin, window, block_size, sinks)
    B, T, H, D = q.shape
    G = k.shape[2]
    scale = D**-0.5 if scale is None else scale
    in_dtype, dt = q.dtype, compute_dtype(q.dtype)
    q, k, v, codebook = q.to(dt), k.to(dt), v.to(dt), codebook.to(dt)
    cos, sin = cos.to(dt)[:, None, :], sin.to(dt)[:, None, :]  # (T, 1, D), broadcast over heads
    far_cos, far_sin = far_cos.to(dt), far_sin.to(dt)

    # straight-through quantized keys; sinks stay exact
    codewords = codebook[torch.arange(G, device=k.device), codes.long()]  # (B, T, G, D)
    k_hat = k + (codewords - k).detach()
    is_sink = torch.arange(T, device=k.device)[None, :, None, None] < sinks
    k_hat = torch.where(is_sink, k, k_hat)

    # expand key/value heads to query heads (grouped-query attention)
    group = H // G
    k, k_hat, v = (x.repeat_interleave(group, dim=2) for x in (k, k_hat, v))  # (B, T, H, *)

    q_near = apply_rope(q, cos, sin) * scale
    k_near = apply_rope(k, cos, sin)
    q_far = apply_rope(q, far_cos, far_sin) * scale  # query rotated by the clipped distance W
    near = torch.einsum("bthd,bshd->bhts", q_near, k_near)  # (B, H, T, T)
    far = torch.einsum("bthd,bshd->bhts", q_far, k_hat)
    far_aggregated = torch.einsum("bthd,bshd->bhts", q_far, k_hat.detach())

    t = torch.arange(T, device=q.device)[:, None]
    s = torch.arange(T, device=q.device)[None, :]
    delta = t - s  # (T, T)
    aggregated = s <= (t // block_size) * block_size - window  # (T, T), implies delta >= W
    if key_means:
        # <q_far_t, mu_t(c)> = (sum over far s' of t with code c of <q_far_t, k_s'>) / (their number)
        exact = torch.einsum("bthd,bshd->bhts", q_far, k)  # (B, H, T, T), unquantized
        exact = torch.where(aggregated, torch.einsum("bthd,bshd->bhts", q_far, k.detach()), exact)
        in_code = (delta >= window) & (s >= sinks)  # (T, T): the far pairs that go through a code
        onehot = F.one_hot(codes.long(), codebook.shape[1]).to(dt).repeat_interleave(group, dim=2)  # (B, T, H, C)
        onehot = onehot.transpose(1, 2)  # (B, H, T, C), indexed by key position
        code_sum = exact.masked_fill(~in_code, 0.0) @ onehot  # (B, H, T, C)
        code_count = in_code.to(dt) @ onehot  # (B, H, T, C)
        code_logit = code_sum / code_count.clamp(min=1.0)
        key_code = codes.long().repeat_interleave(group, dim=2).transpose(1, 2)[:, :, None, :].expand(-1, -1, T, -1)
        far = torch.where(is_sink[0, :, 0, 0], exact, code_logit.gather(-1, key_code))  # (B, H, T, T)
        far_aggregated = far  # the keys of aggregated pairs are already detached inside the means
    logits = torch.where(delta < window, near, torch.where(aggregated, far_aggregated, far))
    logits = logits.masked_fill(delta < 0, float("-inf"))
    probs = torch.softmax(logits, dim=-1)  # (B, H, T, T)

    v = v.transpose(1, 2)  # (B, H, T, Dv)
    out = probs.masked_fill(aggregated, 0.0) @ v + probs.masked_fill(~aggregated, 0.0) @ v.detach()
    return out.transpose(1, 2).to(in_dtype)  # (B, T, H, Dv)
