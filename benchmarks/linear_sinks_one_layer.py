"""Attention sinks in linear attention, one layer in isolation: does keeping the first positions under exact
softmax lower the attention-transfer error on calibration text the steps never saw?

    python benchmarks/linear_sinks_one_layer.py LAYERS SINKS        # e.g. 5,15,25 0,1,4; STEPS=40 by default
    python benchmarks/linear_sinks_one_layer.py 5,15 4,4/128         # a variant S/P: S sinks, hedgehog P (default 64)

SmolLM2's layer L gets a LinearAttention (hedgehog maps, window 64, `linear_sinks` S, the quadratic reference
kernel); its maps and mix train for STEPS Adam steps at lr 1e-2 (the conversion's default transfer) on 4
sequences of 2,048 tokens of `calib` against the original layer's attention output, batches of 2, through
`convert.refine.refine_layer` (the conversion's own steps). Printed:
the relative squared error on 2 further `calib` sequences before the steps and after, and on the 4 trained
ones after. A screen for the conversion's `--sinks` default, on calibration text only (no evaluation corpus).
"""

from __future__ import annotations

import copy
import os
import sys
import time

import torch

from effattn.attention.linear import EffattnLinearConfig, LinearAttention, linear_config_from
from effattn.convert.calibrate import CalibSettings, calibration_tokens
from effattn.convert.refine import RefineSettings, attention_out, refine_layer, relative_error
from effattn.io.load import load_model


def main() -> None:
    torch.manual_seed(0)
    layers = [int(x) for x in sys.argv[1].split(",")]
    variants = [tuple(int(y) for y in x.split("/")) + (64,) for x in sys.argv[2].split(",")]  # (sinks, P, ...)
    settings = RefineSettings(steps=int(os.environ.get("STEPS", 40)), lr=1e-2, target="attention", batch_size=2)
    model, _, ref = load_model("llama")
    cfg = model.config.to_dict()
    ids = calibration_tokens(ref.path, CalibSettings(tokens=6 * 2048, seq_len=2048))
    with torch.no_grad():
        hs = model(ids, output_hidden_states=True).hidden_states
    cos, sin = model.model.rotary_emb(hs[0], torch.arange(ids.shape[1])[None])
    for L in layers:
        layer = model.model.layers[L]
        x = hs[L].detach()
        xtr, xte = x[:4], x[4:]
        with torch.no_grad():
            yte = torch.cat([attention_out(layer, xte[i:i + 1], cos, sin) for i in range(len(xte))])
        for sinks, pdim, *_ in variants:
            fmap = {"name": "hedgehog", "projection_dim": pdim}
            lcfg = EffattnLinearConfig(**linear_config_from(cfg, linear_window=64, linear_sinks=sinks,
                                                            linear_feature_map=fmap, linear_kernel="naive"))
            mod = copy.deepcopy(layer)
            mod.self_attn = LinearAttention(mod.self_attn, lcfg, L).float()

            def held_out() -> float:
                with torch.no_grad():
                    return relative_error(torch.cat([attention_out(mod, xte[i:i + 1], cos, sin)
                                                     for i in range(len(xte))]), yte)

            before = held_out()
            trainable = [n for n, _ in mod.self_attn.named_parameters()
                         if n == "window_factors" or n.startswith("feature_map_")]
            t0 = time.time()
            fit = refine_layer(mod, layer, xtr, cos, sin, settings, trainable=trainable)  # the conversion's own steps
            print(f"layer {L} sinks {sinks} P {pdim}: test before {before:.4f} | after: train {fit['after']:.4f} "
                  f"test {held_out():.4f} | {time.time() - t0:.0f} s", flush=True)


if __name__ == "__main__":
    main()
