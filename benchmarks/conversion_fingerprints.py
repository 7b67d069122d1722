"""Fingerprints of conversions of tiny random models: one line per case, the hash of the written tensors,
of config.json and of the recorded conversion settings. Run it from two checkouts to show that a
restructuring changed no result:

    PYTHONPATH=OLD python benchmarks/conversion_fingerprints.py /tmp/fp-old > old.txt
    PYTHONPATH=NEW python benchmarks/conversion_fingerprints.py /tmp/fp-new > new.txt
    diff old.txt new.txt   # the settings hash differs only where a new option is recorded (or a path)
"""

import hashlib, json, sys
from pathlib import Path
from effattn.convert import convert
from effattn.testing import make_model
root = Path(sys.argv[1]); root.mkdir(exist_ok=True)
src = make_model(root / "tiny", "llama", heads=6, kv_heads=3, layers=2)
q3 = make_model(root / "q3", "qwen3", heads=6, kv_heads=3, layers=2)
calib = root / "calib.txt"; calib.write_text("the quick brown fox jumps over the lazy dog. " * 400)
cases = [("gqa-mean", src, "gqa", {"kv_heads": 1, "method": "mean"}), ("gqa-align", src, "gqa", {"kv_heads": 1, "method": "align"}),
         ("gqa-pca", src, "gqa", {"kv_heads": 1, "method": "pca", "calib": str(calib), "calib_tokens": 2048}),
         ("gqa-cal", src, "gqa", {"kv_heads": 1, "method": "calibrated", "calib": str(calib), "calib_tokens": 2048}),
         ("mha", src, "mha", {"method": "calibrated", "calib": str(calib), "calib_tokens": 2048}),
         ("q3-cal", q3, "mqa", {"calib": str(calib), "calib_tokens": 2048}),
         ("rerope", src, "rerope", {"window": 16}),
         ("vq", src, "vq", {"window": 16, "codebook_size": 8, "calib": str(calib), "calib_tokens": 2048, "calib_seq_len": 64}),
         ("vq-x2", src, "vq", {"window": 16, "codebook_size": 8, "calib": str(calib), "calib_tokens": 2048, "calib_seq_len": 64, "exact_heads": 2}),
         ("vq-q-bias", src, "vq", {"window": 16, "codebook_size": 8, "calib": str(calib), "calib_tokens": 2048, "calib_seq_len": 64, "metric": "query", "code_bias": True, "key_means": False})]
for name, model, to, opts in cases:
    out = convert(model, root / name, to=to, options=opts, measure=False, force=True).out
    h = hashlib.sha1(b"".join(p.read_bytes() for p in sorted(out.glob("*.safetensors")))).hexdigest()[:12]
    cfg = json.loads((out / "config.json").read_text()); cfg.pop("transformers_version", None)
    rec = json.loads((out / "effattn.json").read_text())["conversion"]
    rec.pop("calib", None)  # a path under the output root
    print(name, h, hashlib.sha1(json.dumps(cfg, sort_keys=True).encode()).hexdigest()[:8],
          hashlib.sha1(json.dumps(rec, sort_keys=True).encode()).hexdigest()[:8], flush=True)
