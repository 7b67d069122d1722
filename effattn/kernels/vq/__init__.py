"""Transformer-VQ attention (Lingle 2023) with ReRoPE for converted RoPE models.

``vq_attention_naive`` is the quadratic reference that defines the semantics; ``vq_attention_chunk``
is the blockwise linear-time kernel with the same signature plus a constant-size :class:`VQState`
for chunked prefill and token-by-token decoding; ``nearest_codes`` quantizes the keys.
"""

from effattn.kernels.vq.chunk import VQState, vq_attention_chunk
from effattn.kernels.vq.codes import nearest_codes
from effattn.kernels.vq.naive import vq_attention_naive

__all__ = ["VQState", "nearest_codes", "vq_attention_chunk", "vq_attention_naive"]
