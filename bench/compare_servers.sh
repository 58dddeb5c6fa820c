#!/usr/bin/env bash
# emberserve vs llama.cpp (llama-cpp-python's server) on the same GGUF, one after the other, same load.
# Usage: bench/compare_servers.sh [MODEL [bench/serve.py args for the load run]]
#   (default smollm2-135m and every scenario; results in bench/out/*.json and on stdout)
#   VARIANTS="default" bench/compare_servers.sh gemma3-270m --concurrency 1 8 --no-prefix   (a narrower run)
# Per server: the load of bench/serve.py (concurrency 1/4/8/16, ~16 and ~1024-token prompts, 64 tokens, prefix
# reuse), then one stream of 256 output tokens, then its RSS (now and peak). emberserve runs twice: its default
# (bfloat16 activations, int4 weights) and the exact float32 path.
# The llama.cpp server lives in its own venv (.venv-llamacpp, built once: about 8 minutes on 2 cores); it is a
# benchmark-only dependency, not the project's. Both servers get a 4096-token context (llama.cpp's --n_ctx, our
# --max-context), so their KV caches hold the same number of tokens. llama.cpp ignores ignore_eos, so the end
# tokens are banned with logit_bias instead: both servers then generate exactly max_tokens.
# ALTERNATE=N: instead, start both servers (llama.cpp and emberserve's default) and run one scenario N times each,
# alternating, so that the VM's drift hits both alike: by default the one-stream scenario (256 output tokens, 3
# requests); ALTERNATE_ARGS="--concurrency 8 --max-tokens 64" (bench/serve.py arguments) picks another.
set -euo pipefail
cd "$(dirname "$0")/.."
MODEL=${1:-smollm2-135m}
shift || true
VARIANTS=${VARIANTS:-"default float32:--dtype=float32"}
PY=.venv/bin/python
if [ ! -x .venv-llamacpp/bin/python ]; then
  python3 -m venv .venv-llamacpp
  CMAKE_BUILD_PARALLEL_LEVEL=2 .venv-llamacpp/bin/pip install --quiet "llama-cpp-python[server]==0.3.36"
fi
GGUF=$($PY -c "from engine import KNOWN_MODELS; print(KNOWN_MODELS['$MODEL'].path())")
EOS=$($PY -c "
import json, sys
from engine.tokenizer import Tokenizer
from engine.weights.gguf import read_gguf_metadata
tok = Tokenizer.from_gguf_metadata(read_gguf_metadata(sys.argv[1]))
print(json.dumps({str(t): -100 for t in sorted(tok.end_token_ids)}))" "$GGUF")
LOAD_ARGS=("$@")
mkdir -p bench/out
wait_ready() { for _ in $(seq 600); do curl -sf "$1" >/dev/null && return 0; sleep 0.2; done; return 1; }
rss() {  # label pid -> bench/out/<label>-rss.json
  awk -v label="$1" '/^VmRSS/{rss=$2} /^VmHWM/{hwm=$2} END{printf "{\"label\": \"%s\", \"rss_mib\": %.0f, \"peak_rss_mib\": %.0f}\n", label, rss/1024, hwm/1024}' \
    "/proc/$2/status" | tee "bench/out/$1-rss.json"
}
bench() {  # label base-url extra-body
  $PY bench/serve.py --base-url "$2" --label "$1" --extra-body "$3" --json-out "bench/out/$1.json" "${LOAD_ARGS[@]}"
  $PY bench/serve.py --base-url "$2" --label "$1" --extra-body "$3" --json-out "bench/out/$1-decode256.json" \
    --concurrency 1 --prompt-tokens 16 --max-tokens 256 --requests 3 --no-prefix
}

read -r -a ALT_ARGS <<< "${ALTERNATE_ARGS:---concurrency 1 --max-tokens 256 --requests 3}"
alternate_run() {  # label base-url extra-body round
  $PY bench/serve.py --base-url "$2" --label "$1" --extra-body "$3" --json-out "bench/out/$1-alternate-$4.json" \
    --prompt-tokens 16 --no-prefix "${ALT_ARGS[@]}"
}

.venv-llamacpp/bin/python -m llama_cpp.server --model "$GGUF" --n_threads 2 --n_ctx 4096 --interrupt_requests False \
  --port 8001 --model_alias "$MODEL" >bench/out/llama.log 2>&1 &
LLAMA=$!
wait_ready http://127.0.0.1:8001/v1/models
if [ -n "${ALTERNATE:-}" ]; then
  $PY -m server serve --model "$MODEL" --port 8002 --max-context 4096 --log-level warning \
    >"bench/out/emberserve-$MODEL-default.log" 2>&1 &
  EMBER=$!
  wait_ready http://127.0.0.1:8002/health
  for round in $(seq "$ALTERNATE"); do
    alternate_run "llama.cpp-$MODEL" http://127.0.0.1:8001 "{\"repeat_penalty\": 1.0, \"logit_bias\": $EOS}" "$round"
    alternate_run "emberserve-$MODEL-default" http://127.0.0.1:8002 '{}' "$round"
  done
  kill $LLAMA $EMBER; wait 2>/dev/null || true
  exit 0
fi
bench "llama.cpp-$MODEL" http://127.0.0.1:8001 "{\"repeat_penalty\": 1.0, \"logit_bias\": $EOS}"
rss "llama.cpp-$MODEL" $LLAMA
kill $LLAMA; wait $LLAMA 2>/dev/null || true

for variant in $VARIANTS; do
  label="emberserve-$MODEL-${variant%%:*}"
  args=""; [[ "$variant" == *:* ]] && args="${variant#*:}"
  # shellcheck disable=SC2086
  $PY -m server serve --model "$MODEL" --port 8002 --max-context 4096 --log-level warning $args \
    >"bench/out/$label.log" 2>&1 &
  EMBER=$!
  wait_ready http://127.0.0.1:8002/health
  bench "$label" http://127.0.0.1:8002 '{}'
  rss "$label" $EMBER
  kill $EMBER; wait $EMBER 2>/dev/null || true
done
