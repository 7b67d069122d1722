"""The healing loss: distillation from the teacher, optional LM cross-entropy, conversion terms.

    loss = kl * T^2 * KL(p_teacher(T) || p_student(T)) + ce * CE(student, next token)
           + attn_out * mean_l |o_l - t_l|^2 / |t_l|^2 + aux_weight * sum(aux)

With `loss.chunk_tokens`, KL and CE are formed a chunk of tokens at a time from the final hidden
states (`chunked_logit_terms`), never holding the whole micro-batch's logits.

KL is taken between the softmaxes of the logits divided by the temperature T and multiplied by
T^2 so that its gradient keeps the same scale as T changes (Hinton et al. 2015, "Distilling the
Knowledge in a Neural Network", Sec. 2). It is averaged over every position of every sequence.

The attention-output term compares, layer by layer, what each student attention module returns
(o_l, after its output projection) with what the teacher's returns on the same tokens (t_l): the
squared error relative to the teacher's squared norm, averaged over the layers (intermediate-layer
distillation, as TinyBERT does on hidden states and attention maps, Jiao et al. 2020; here on
attention outputs). It gives every converted attention a direct target instead of only the one
the logits pass back through the layers above it. Each model runs on its own hidden states, so a
layer is also asked to absorb the drift of the layers below it.

Conversion-specific terms: after each training forward, every submodule of the student with a
non-None attribute `effattn_aux_loss` (a scalar tensor, e.g. a VQ commitment loss) contributes it.
The trainer reads and then clears the attribute, so a module that skips a forward never counts twice.
"""

from __future__ import annotations

import re

import torch
import torch.nn.functional as F

from ..errors import EffattnError
from .config import Loss

_ATTENTION = re.compile(r"(?:^|\.)layers\.(\d+)\.self_attn$")


def distillation_kl(student_logits: torch.Tensor, teacher_logits: torch.Tensor, temperature: float = 1.0) -> torch.Tensor:
    """T^2 * KL(softmax(t/T) || softmax(s/T)), mean over positions. logits: [B, T, V]."""
    s = F.log_softmax(student_logits.float() / temperature, dim=-1)  # (B, T, V)
    t = F.log_softmax(teacher_logits.float() / temperature, dim=-1)  # (B, T, V)
    kl = F.kl_div(s, t, log_target=True, reduction="none").sum(-1)  # (B, T): sum_v p_t (log p_t - log p_s)
    return kl.mean() * temperature**2


class FinalHidden:
    """A forward hook on a model's final norm keeping its output: the states its vocabulary projection
    reads, so that the logits can be formed a chunk at a time (`chunked_logit_terms`) while the model
    itself projects only its last position (`logits_to_keep=1`)."""

    def __init__(self, model: torch.nn.Module, role: str):
        decoder = model.get_decoder() if hasattr(model, "get_decoder") else None
        norm = getattr(decoder, "norm", None)
        head = model.get_output_embeddings() if hasattr(model, "get_output_embeddings") else None
        if norm is None or head is None:
            raise EffattnError(f"the {role} has no final `norm` and output embeddings to form logits in chunks from",
                               "set loss.chunk_tokens=0 for this model family")
        self.head = head
        self.hidden: torch.Tensor | None = None
        self._handle = norm.register_forward_hook(self._keep)

    def _keep(self, module, args, output):
        self.hidden = output

    def take(self) -> torch.Tensor:
        hidden, self.hidden = self.hidden, None
        if hidden is None:
            raise RuntimeError("the final norm did not run in the last forward")
        return hidden

    def remove(self) -> None:
        self._handle.remove()


def project(head: torch.nn.Module, hidden: torch.Tensor) -> torch.Tensor:
    """head(hidden) for the output embeddings, through a Linear's own tensors rather than its call: under
    FSDP2 the head belongs to a sharded unit whose hooks must not run again outside the model's forward
    (inside a checkpointed chunk they crash torch 2.13's backward); that unit stays gathered from the
    forward until its backward (accelerate's tail unit), so its weight is the whole matrix here."""
    if isinstance(head, torch.nn.Linear):
        return F.linear(hidden, head.weight, head.bias)
    return head(hidden)


def _chunk_terms(hidden, head, teacher_logits, targets, temperature: float, kl: bool, ce: bool):
    logits = project(head, hidden).float()
    zero = logits.new_zeros(())
    kl_sum = zero
    if kl:
        s = F.log_softmax(logits / temperature, dim=-1)
        t = F.log_softmax(teacher_logits.float() / temperature, dim=-1)
        kl_sum = F.kl_div(s, t, log_target=True, reduction="sum")
    ce_sum = F.cross_entropy(logits, targets, ignore_index=-100, reduction="sum") if ce else zero
    return kl_sum, ce_sum


def chunked_logit_terms(student_hidden: torch.Tensor, student_head: torch.nn.Module, ids: torch.Tensor,
                        teacher_hidden: torch.Tensor | None, teacher_head: torch.nn.Module | None, *,
                        temperature: float, kl: bool, ce: bool, chunk: int) -> dict[str, torch.Tensor]:
    """`distillation_kl` and `next_token_ce` from final hidden states [B, T, H], `chunk` tokens at a time.

    Each chunk's student logits are recomputed in the backward pass (activation checkpointing) and the
    teacher's are formed under no_grad, so at most one chunk of [chunk, vocab] logits per model is alive:
    memory no longer grows with batch x seq_len x vocab. Same values as the whole-batch functions."""
    from torch.utils.checkpoint import checkpoint

    B, T, H = student_hidden.shape
    s = student_hidden.reshape(B * T, H)
    t = teacher_hidden.reshape(B * T, -1) if kl else None
    targets = torch.cat((ids[:, 1:], ids.new_full((B, 1), -100)), 1).reshape(B * T)  # no target after the last
    kl_sum = ce_sum = student_hidden.new_zeros((), dtype=torch.float32)
    for a in range(0, B * T, chunk):
        teacher_logits = None
        if kl:
            with torch.no_grad():
                teacher_logits = project(teacher_head, t[a : a + chunk])
        k, c = checkpoint(_chunk_terms, s[a : a + chunk], student_head, teacher_logits, targets[a : a + chunk],
                          temperature, kl, ce, use_reentrant=False)
        kl_sum, ce_sum = kl_sum + k, ce_sum + c
    terms = {}
    if kl:
        terms["kl"] = kl_sum / (B * T) * temperature**2
    if ce:
        terms["ce"] = ce_sum / (B * (T - 1))
    return terms


def next_token_ce(logits: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
    """Cross-entropy of predicting ids[:, 1:] from logits[:, :-1]. logits: [B, T, V], ids: [B, T]."""
    return F.cross_entropy(logits[:, :-1].float().reshape(-1, logits.shape[-1]), ids[:, 1:].reshape(-1))


def attention_modules(model: torch.nn.Module) -> list[torch.nn.Module]:
    """Each decoder layer's attention module (`...layers.N.self_attn`), in layer order."""
    found = {}
    for name, module in model.named_modules():
        match = _ATTENTION.search(name)
        if match:
            found[int(match.group(1))] = module
    return [found[i] for i in sorted(found)]


class AttentionOutputs:
    """Forward hooks keeping what each attention module of `model` returned in its last forward."""

    def __init__(self, model: torch.nn.Module, role: str):
        modules = attention_modules(model)
        if not modules:
            raise EffattnError(f"the {role} has no `layers.N.self_attn` modules to compare attention outputs on",
                               "set loss.attn_out=0 for this model family")
        self.outputs: list[torch.Tensor | None] = [None] * len(modules)
        self._handles = [m.register_forward_hook(self._keep(i)) for i, m in enumerate(modules)]

    def _keep(self, i: int):
        def hook(module, args, output):
            self.outputs[i] = output[0] if isinstance(output, tuple) else output
        return hook

    def take(self) -> list[torch.Tensor]:
        outputs, self.outputs = self.outputs, [None] * len(self.outputs)
        if any(o is None for o in outputs):
            raise RuntimeError("an attention module did not run in the last forward")
        return outputs

    def remove(self) -> None:
        for handle in self._handles:
            handle.remove()


def attention_output_error(student: list[torch.Tensor], teacher: list[torch.Tensor]) -> torch.Tensor:
    """mean over layers of |o_s - o_t|^2 / |o_t|^2 (sums over batch, positions and features)."""
    if len(student) != len(teacher):
        raise EffattnError(f"the student has {len(student)} attention layers and the teacher {len(teacher)}",
                           "distil attention outputs from the model the student was converted from, or set loss.attn_out=0")
    terms = []
    for s, t in zip(student, teacher):
        s, t = s.float(), t.float().detach()  # (B, T, hidden)
        terms.append((s - t).pow(2).sum() / t.pow(2).sum().clamp_min(1e-12))
    return torch.stack(terms).mean()


def take_aux_losses(model: torch.nn.Module) -> list[torch.Tensor]:
    """The `effattn_aux_loss` of every submodule that set one, clearing them."""
    terms = []
    for module in model.modules():
        term = getattr(module, "effattn_aux_loss", None)
        if term is not None:
            terms.append(term)
            module.effattn_aux_loss = None
    return terms


def heal_loss(cfg: Loss, student_logits: torch.Tensor | None, teacher_logits: torch.Tensor | None, ids: torch.Tensor,
              model: torch.nn.Module, attention: tuple[list[torch.Tensor], list[torch.Tensor]] | None = None,
              chunked: tuple[torch.Tensor, torch.nn.Module, torch.Tensor | None, torch.nn.Module | None] | None = None,
              ) -> dict[str, torch.Tensor]:
    """{"loss": weighted total, "kl", "ce", "attn_out", "aux": the unweighted terms that are on}.

    attention: (student, teacher) attention outputs per layer, needed when cfg.attn_out > 0.
    chunked: (student hidden, student head, teacher hidden, teacher head): KL and CE formed
    cfg.chunk_tokens tokens at a time from the final hidden states instead of from the logits."""
    terms: dict[str, torch.Tensor] = {}
    total = ids.new_zeros((), dtype=torch.float32)
    if chunked is not None and (cfg.kl > 0 or cfg.ce > 0):
        terms |= chunked_logit_terms(chunked[0], chunked[1], ids, chunked[2], chunked[3], temperature=cfg.temperature,
                                     kl=cfg.kl > 0, ce=cfg.ce > 0, chunk=cfg.chunk_tokens)
    else:
        if cfg.kl > 0:
            terms["kl"] = distillation_kl(student_logits, teacher_logits, cfg.temperature)
        if cfg.ce > 0:
            terms["ce"] = next_token_ce(student_logits, ids)
    if cfg.kl > 0:
        total = total + cfg.kl * terms["kl"]
    if cfg.ce > 0:
        total = total + cfg.ce * terms["ce"]
    if cfg.attn_out > 0:
        terms["attn_out"] = attention_output_error(*attention)
        total = total + cfg.attn_out * terms["attn_out"]
    aux = take_aux_losses(model)
    if aux:
        terms["aux"] = torch.stack([a.float() for a in aux]).sum()
        if cfg.aux_weight > 0:
            total = total + cfg.aux_weight * terms["aux"]
    terms["loss"] = total
    return terms
