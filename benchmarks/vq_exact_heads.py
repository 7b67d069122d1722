"""What exact far keys on a few KV heads would buy a VQ model, zero-shot (a development measurement).

    python benchmarks/vq_exact_heads.py VQ_MODEL K1,K2,...

Ranks the model's (layer, KV head) pairs by the relative attention-output error their quantization
causes on 8,192 tokens of `calib` (blocks of 2,048), then evaluates the model with the far keys of the
top K heads left exact (ReRoPE alone on those heads, the others quantized) on the VQ tables' blocks.
It patches the quadratic reference kernel, so it is slow (minutes per K); no effattn model keeps
exact heads yet. The zero-shot and original perplexities used for "gap closed" are the W=64 table's.
"""
import json, math, sys, torch
import effattn.attention.vq as vqmod
from effattn.io.load import load_model
from effattn.data import load_text, token_blocks
from effattn.evaluate import corpus_scores

torch.set_grad_enabled(False)
orig = vqmod.vq_attention_naive
CUR = [0]; EXACT = {}; ERR = {}; MODE = ["eval"]

def wrapped(q, k, v, codebook, codes, cos, sin, far_cos, far_sin, *, window, block_size, sinks, scale):
    out = orig(q, k, v, codebook, codes, cos, sin, far_cos, far_sin, window=window, block_size=block_size, sinks=sinks, scale=scale)
    li, T, H, G = CUR[0], q.shape[1], q.shape[2], k.shape[2]
    heads = EXACT.get(li, ())
    if MODE[0] == "calib" or heads:
        ex = orig(q, k, v, codebook, codes, cos, sin, far_cos, far_sin, window=window, block_size=block_size, sinks=T, scale=scale)
        grp = torch.arange(H) // (H // G)  # query head -> kv head
        if MODE[0] == "calib":
            e = (out - ex).float().pow(2).sum((0, 1, 3)) / ex.float().pow(2).sum((0, 1, 3))  # per query head
            for g in range(G):
                ERR[(li, g)] = ERR.get((li, g), 0.0) + e[grp == g].mean().item()
        else:
            mask = torch.tensor([int(g) in heads for g in grp])[None, None, :, None]
            out = torch.where(mask, ex, out)
    return out

vqmod.vq_attention_naive = wrapped
model, tok, _ = load_model(sys.argv[1]); model.eval()
model.config.vq_kernel = "naive"
for i, m in enumerate(model.vq_attention_modules()):
    assert m.config is model.config
    m.register_forward_pre_hook(lambda mod, a, i=i: CUR.__setitem__(0, i))
base, _, _ = load_model("llama")
MODE[0] = "calib"
for row in token_blocks(tok, load_text("calib"), 2048, 8192, spread=True).split(1):
    model(input_ids=row, use_cache=False)
MODE[0] = "eval"
ranked = sorted(ERR, key=ERR.get, reverse=True)
print("top heads", [(l, g, round(ERR[(l, g)] / 4, 3)) for l, g in ranked[:18]], flush=True)
ref = {"shakespeare": 28.78, "britannica": 26.97}
zs = {"shakespeare": 35.27, "britannica": 35.81}
rows = []
for K in [int(x) for x in sys.argv[2].split(",")]:
    EXACT.clear()
    for l, g in ranked[:K]:
        EXACT.setdefault(l, set()).add(g)
    row = {"K": K}
    for c in ref:
        s = corpus_scores(model, token_blocks(tok, load_text(c), 2048, 8192, spread=True), base)
        row[c] = {"ppl": round(s["perplexity"], 2), "agree": round(s["agreement"], 4),
                  "gap_closed_vs_zero_shot": round((math.log(zs[c]) - math.log(s["perplexity"])) / (math.log(zs[c]) - math.log(ref[c])), 3)}
    print(json.dumps(row), flush=True)
