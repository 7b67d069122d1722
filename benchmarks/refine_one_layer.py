"""Local refinement of one MQA layer in isolation: how far Adam steps (count, lr, batch, schedule) lower the
attention-output error on calibration sequences the steps never saw.

    python benchmarks/refine_one_layer.py LAYER STEPS:LR:BATCH:SCHEDULE [...]   # SCHEDULE: cos or const

SmolLM2's layer LAYER is converted 3 -> 1 KV heads by the default calibrated method (fitted on the first 24 of
32 calibration sequences of 512 tokens, the original model's activations at that depth), then each config
trains a copy of its q/k/v/o on those 24 sequences (`attention` target) and prints the relative squared error
on them (train) and on the other 8 (test). A screen for choosing refinement settings, not a conversion:
`effattn convert --refine-*` does the same inside the layer-wise runner.
"""

from __future__ import annotations

import copy
import sys
import time

import torch
from transformers import LlamaConfig
from transformers.models.llama.modeling_llama import LlamaDecoderLayer

from effattn.attention.functional import project_qkv
from effattn.convert.calibrate import CalibSettings, batches, calibration_tokens, refit_o_proj
from effattn.convert.gqa import METHODS, LayerAttention, _Moments
from effattn.convert.refine import attention_out
from effattn.families import AttentionShape
from effattn.io.load import load_model


def main() -> None:
    torch.manual_seed(0)
    model, _, ref = load_model("llama")
    cfg = model.config.to_dict()
    shape = AttentionShape.of(cfg)
    calib = CalibSettings(tokens=16384, seq_len=512)
    ids = calibration_tokens(ref.path, calib)
    L = int(sys.argv[1])
    with torch.no_grad():
        hs = model(ids, output_hidden_states=True).hidden_states
    cos, sin = model.model.rotary_emb(hs[0], torch.arange(ids.shape[1])[None])
    eps, d = cfg["rms_norm_eps"], shape.head_dim
    layer = model.model.layers[L]
    a = layer.self_attn
    old = LayerAttention(q=a.q_proj.weight.data, k=a.k_proj.weight.data, v=a.v_proj.weight.data, o=a.o_proj.weight.data)
    x = hs[L].detach()
    xtr, xte = x[:24], x[24:]
    h = layer.input_layernorm(xtr).detach()
    moments = _Moments()
    for sl in batches(h, 4):
        moments.add(*project_qkv(h[sl], old, d, eps))
    new = METHODS["calibrated"].convert_layer(old, shape, 1, stats=moments.stats())
    new.o = refit_o_proj(new, old, h, cos, sin, shape, eps, calib)
    mqa = LlamaConfig(**{**cfg, "num_key_value_heads": 1})
    mqa._attn_implementation = "sdpa"
    base = LlamaDecoderLayer(mqa, L)
    sd = layer.state_dict() | {f"self_attn.{p}_proj.weight": getattr(new, p) for p in "qkvo"}
    base.load_state_dict(sd)
    base.eval()

    def outputs(mod, xs):
        return torch.cat([attention_out(mod, xs[sl], cos, sin) for sl in batches(xs, 4)])

    with torch.no_grad():
        ytr, yte = outputs(layer, xtr), outputs(layer, xte)

    def err(mod, xs, ys) -> float:
        with torch.no_grad():
            return ((outputs(mod, xs) - ys).pow(2).sum() / ys.pow(2).sum()).item()

    print(f"calibrated merge: train {err(base, xtr, ytr):.4f} test {err(base, xte, yte):.4f}", flush=True)
    energy = ytr.pow(2).sum() / ytr[..., 0].numel()
    for spec in sys.argv[2:]:
        steps, lr, bs, sched = spec.split(":")
        steps, lr, bs = int(steps), float(lr), int(bs)
        mod = copy.deepcopy(base)
        params = list(mod.self_attn.parameters())
        mod.requires_grad_(False)
        for p in params:
            p.requires_grad_(True)
        opt = torch.optim.Adam(params, lr=lr)
        schedule = torch.optim.lr_scheduler.CosineAnnealingLR(opt, steps) if sched == "cos" else None
        gen = torch.Generator().manual_seed(0)
        t0 = time.time()
        for _ in range(steps):
            pick = torch.randint(len(xtr), (bs,), generator=gen)
            loss = (attention_out(mod, xtr[pick], cos, sin) - ytr[pick]).pow(2).sum(-1).mean() / energy
            loss.backward()
            opt.step()
            opt.zero_grad()
            if schedule:
                schedule.step()
        dt = time.time() - t0
        print(f"{spec}: train {err(mod, xtr, ytr):.4f} test {err(mod, xte, yte):.4f} ({dt / steps * 1000:.0f} ms/step)",
              flush=True)


if __name__ == "__main__":
    main()
