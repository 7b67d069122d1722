"""Build one decoder layer of a model at a time, with its real transformers module.

Sequential (layer-by-layer) calibration runs the calibration activations through layer i, converts
it, and feeds the converted layer's outputs to layer i+1. Only one layer's weights are ever
materialised: the module is built on the meta device from the config and filled with that layer's
tensors, so a 70B model calibrates in the memory of one of its layers plus the activations.
"""

from __future__ import annotations

from typing import Any

import torch

from ..families import Family


class LayerFactory:
    def __init__(self, config: dict[str, Any], family: Family):
        from transformers import AutoConfig

        self.family = family
        cfg = dict(config)
        model_type = cfg.pop("model_type")
        for key in ("architectures", "auto_map", "quantization_config", "transformers_version"):
            cfg.pop(key, None)
        self._base = (model_type, cfg)
        self.config = AutoConfig.for_model(model_type, **cfg)
        self._rotary = None

    def _hf_config(self, **overrides):
        from transformers import AutoConfig

        model_type, cfg = self._base
        config = AutoConfig.for_model(model_type, **(cfg | overrides))
        config._attn_implementation = "sdpa"
        return config

    def layer(self, layer: int, tensors: dict[str, torch.Tensor], num_kv_heads: int) -> torch.nn.Module:
        """The decoder layer `layer` as a float32 module holding `tensors` (full checkpoint names)."""
        from transformers import AutoModelForCausalLM

        overrides = {"num_hidden_layers": 1, "num_key_value_heads": num_kv_heads}
        layer_types = self._base[1].get("layer_types")
        if layer_types:  # per-layer attention kinds (full / sliding window): keep this layer's
            overrides["layer_types"] = [layer_types[layer]]
        config = self._hf_config(**overrides)
        with torch.device("meta"):
            skeleton = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
        module = skeleton.model.layers[0]
        prefix = self.family.prefix(layer)
        state = {name[len(prefix):]: t.float() for name, t in tensors.items() if name.startswith(prefix)}
        module.load_state_dict(state, strict=True, assign=True)
        return module.requires_grad_(False).eval()

    def _rotary_embedding(self) -> torch.nn.Module:
        """The model's own rotary embedding module (transformers'), built once."""
        if self._rotary is None:
            from transformers import AutoModelForCausalLM

            layer_types = self._base[1].get("layer_types")
            config = self._hf_config(num_hidden_layers=1, **({"layer_types": layer_types[:1]} if layer_types else {}))
            with torch.device("meta"):
                skeleton = AutoModelForCausalLM.from_config(config)
            self._rotary = type(skeleton.model.rotary_emb)(config=config)
        return self._rotary

    def rope(self, length: int, starts: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """cos, sin [1, T, d] for positions 0..T-1, exactly as the model's rotary embedding makes them; with
        `starts` [N], [N, T, d] for positions starts[i]..starts[i]+T-1 (all 0: still one row)."""
        positions = torch.arange(length)[None]
        if starts is not None and bool(starts.any()):
            positions = starts[:, None] + positions
        return self._rotary_embedding()(torch.zeros(1, dtype=torch.float32), positions)

    def inv_freq(self) -> torch.Tensor:
        """RoPE's angle per position of each rotary pair (radians; [rotary dims / 2]), as the model's rotary
        embedding applies it at positions within its context (every RoPE type transformers knows)."""
        return self._rotary_embedding().inv_freq.double()
