"""The healing loss: distillation from the teacher, optional LM cross-entropy, conversion terms.

    loss = kl * T^2 * KL(p_teacher(T) || p_student(T)) + ce * CE(student, next token) + aux_weight * sum(aux)

KL is taken between the softmaxes of the logits divided by the temperature T and multiplied by
T^2 so that its gradient keeps the same scale as T changes (Hinton et al. 2015, "Distilling the
Knowledge in a Neural Network", Sec. 2). It is averaged over every position of every sequence.

Conversion-specific terms: after each training forward, every submodule of the student with a
non-None attribute `effattn_aux_loss` (a scalar tensor, e.g. a VQ commitment loss) contributes it.
The trainer reads and then clears the attribute, so a module that skips a forward never counts twice.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from .config import Loss


def distillation_kl(student_logits: torch.Tensor, teacher_logits: torch.Tensor, temperature: float = 1.0) -> torch.Tensor:
    """T^2 * KL(softmax(t/T) || softmax(s/T)), mean over positions. logits: [B, T, V]."""
    s = F.log_softmax(student_logits.float() / temperature, dim=-1)  # (B, T, V)
    t = F.log_softmax(teacher_logits.float() / temperature, dim=-1)  # (B, T, V)
    kl = F.kl_div(s, t, log_target=True, reduction="none").sum(-1)  # (B, T): sum_v p_t (log p_t - log p_s)
    return kl.mean() * temperature**2


def next_token_ce(logits: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
    """Cross-entropy of predicting ids[:, 1:] from logits[:, :-1]. logits: [B, T, V], ids: [B, T]."""
    return F.cross_entropy(logits[:, :-1].float().reshape(-1, logits.shape[-1]), ids[:, 1:].reshape(-1))


def take_aux_losses(model: torch.nn.Module) -> list[torch.Tensor]:
    """The `effattn_aux_loss` of every submodule that set one, clearing them."""
    terms = []
    for module in model.modules():
        term = getattr(module, "effattn_aux_loss", None)
        if term is not None:
            terms.append(term)
            module.effattn_aux_loss = None
    return terms


def heal_loss(cfg: Loss, student_logits: torch.Tensor, teacher_logits: torch.Tensor | None, ids: torch.Tensor,
              model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """{"loss": weighted total, "kl", "ce", "aux": the unweighted terms that are on}."""
    terms: dict[str, torch.Tensor] = {}
    total = student_logits.new_zeros((), dtype=torch.float32)
    if cfg.kl > 0:
        terms["kl"] = distillation_kl(student_logits, teacher_logits, cfg.temperature)
        total = total + cfg.kl * terms["kl"]
    if cfg.ce > 0:
        terms["ce"] = next_token_ce(student_logits, ids)
        total = total + cfg.ce * terms["ce"]
    aux = take_aux_losses(model)
    if aux:
        terms["aux"] = torch.stack([a.float() for a in aux]).sum()
        if cfg.aux_weight > 0:
            total = total + cfg.aux_weight * terms["aux"]
    terms["loss"] = total
    return terms
