"""A test-only converted model with conversion-specific state, standing in for the VQ conversion.

Every layer's attention output passes through an `AuxProbe`: in training mode it sets
`effattn_aux_loss` (a commitment-like penalty) and updates an EMA buffer inside its forward, the
interface the fine-tuning loop supports. It is a registered transformers model class
(`AutoConfig.register`), as effattn's own converted models are.
"""

from __future__ import annotations

from pathlib import Path

import torch
from torch import nn
from transformers import AutoConfig, AutoModelForCausalLM, LlamaConfig, LlamaForCausalLM

MODEL_TYPE = "effattn_test_aux"


class AuxProbe(nn.Module):
    def __init__(self, dim: int):
        super().__init__()
        self.scale = nn.Parameter(torch.ones(dim))
        self.register_buffer("ema", torch.zeros(dim))
        self.effattn_aux_loss = None

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # x: [B, T, D]
        x = x * self.scale
        if self.training:
            self.effattn_aux_loss = x.float().pow(2).mean()
            with torch.no_grad():
                self.ema.mul_(0.9).add_(0.1 * x.float().mean(dim=(0, 1)))
        return x


class AuxLlamaConfig(LlamaConfig):
    model_type = MODEL_TYPE


class AuxLlamaForCausalLM(LlamaForCausalLM):
    config_class = AuxLlamaConfig

    def __init__(self, config):
        super().__init__(config)
        for layer in self.model.layers:
            layer.self_attn.probe = AuxProbe(config.hidden_size)
            layer.self_attn.o_proj.register_forward_hook(lambda m, args, out, probe=layer.self_attn.probe: probe(out))


def register() -> None:
    from transformers import CONFIG_MAPPING

    if MODEL_TYPE not in CONFIG_MAPPING:
        AutoConfig.register(MODEL_TYPE, AuxLlamaConfig)
        AutoModelForCausalLM.register(AuxLlamaConfig, AuxLlamaForCausalLM)


def make_aux_model(path: Path, teacher: Path) -> Path:
    """The tiny llama at `teacher` with a probe in every layer (probes start as the identity)."""
    register()
    base = AutoModelForCausalLM.from_pretrained(teacher, dtype=torch.float32)
    config = AuxLlamaConfig(**{k: v for k, v in base.config.to_dict().items() if k not in ("model_type", "architectures")})
    model = AuxLlamaForCausalLM(config)
    missing, unexpected = model.load_state_dict(base.state_dict(), strict=False)
    assert not unexpected and all(".probe." in k for k in missing), (missing, unexpected)
    model.save_pretrained(path)
    from transformers import AutoTokenizer

    AutoTokenizer.from_pretrained(teacher).save_pretrained(path)
    return path
