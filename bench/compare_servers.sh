#!/usr/bin/env bash
# emberserve vs llama.cpp on the same GGUF, one after the other, same load.
# Usage: bench/compare_servers.sh [MODEL [bench/serve.py args for the load run]]
#   (default smollm2-135m and every scenario; results in bench/out/*.json and on stdout)
#   VARIANTS="default" bench/compare_servers.sh gemma3-270m --concurrency 1 8 --no-prefix   (a narrower run)
# The peer (PEER): `llama-server` (default), llama.cpp's own C++ server with continuous batching, what Ollama runs:
# 16 slots over one unified KV pool (-np 16 -kvu), so that 16 streams decode together; or `llama-cpp-python`, its
# Python server, which runs one request at a time (kept as a second, weaker peer). llama-server comes from
# LLAMA_SERVER_DIR (default ~/.cache/llama-server), built once by the shared build_llama_server.sh (about 10
# minutes on 2 cores, without ggml's AMX path, which segfaults on Q4_1); llama-cpp-python lives in its own venv
# (.venv-llamacpp, built once: about 8 minutes). Both are benchmark-only dependencies, not the project's.
# Per server: the load of bench/serve.py (concurrency 1/4/8/16, ~16 and ~1024-token prompts, 64 tokens, prefix
# reuse), then one stream of 256 output tokens, then its RSS (now and peak). emberserve runs twice: its default
# (bfloat16 activations, int4 weights) and the exact float32 path. Both servers use 2 threads and a 4096-token
# KV pool (llama.cpp's -c / --n_ctx, our --max-context), so their caches hold the same number of tokens. End
# tokens are banned with logit_bias (llama-cpp-python ignores ignore_eos): every request makes max_tokens.
# ALTERNATE=N: instead, start both servers (the peer and emberserve's default) and run one scenario N times each,
# alternating, so that the VM's drift hits both alike: by default the one-stream scenario (256 output tokens, 3
# requests); ALTERNATE_ARGS="--concurrency 8 --max-tokens 64" (bench/serve.py arguments) picks another.
set -euo pipefail
cd "$(dirname "$0")/.."
MODEL=${1:-smollm2-135m}
shift || true
VARIANTS=${VARIANTS:-"default float32:--dtype=float32"}
PY=.venv/bin/python
PEER=${PEER:-llama-server}
LLAMA_SERVER_DIR=${LLAMA_SERVER_DIR:-$HOME/.cache/llama-server}
case "$PEER" in
  llama-server)
    if [ ! -x "$LLAMA_SERVER_DIR/llama-server" ]; then
      echo "no llama-server in $LLAMA_SERVER_DIR: build it with build_llama_server.sh $LLAMA_SERVER_DIR" >&2
      exit 2
    fi ;;
  llama-cpp-python)
    if [ ! -x .venv-llamacpp/bin/python ]; then
      python3 -m venv .venv-llamacpp
      CMAKE_BUILD_PARALLEL_LEVEL=2 .venv-llamacpp/bin/pip install --quiet "llama-cpp-python[server]==0.3.36"
    fi ;;
  *) echo "PEER must be llama-server or llama-cpp-python, not $PEER" >&2; exit 2 ;;
esac
GGUF=$($PY -c "from engine import KNOWN_MODELS; print(KNOWN_MODELS['$MODEL'].path())")
EOS=$($PY -c "
import json, sys
from engine.tokenizer.tokenizer import Tokenizer
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

if [ "$PEER" = llama-server ]; then
  LD_LIBRARY_PATH="$LLAMA_SERVER_DIR" "$LLAMA_SERVER_DIR/llama-server" -m "$GGUF" -t 2 -np 16 -c 4096 -kvu \
    --port 8001 --alias "$MODEL" >bench/out/llama.log 2>&1 &
else
  .venv-llamacpp/bin/python -m llama_cpp.server --model "$GGUF" --n_threads 2 --n_ctx 4096 --interrupt_requests False \
    --port 8001 --model_alias "$MODEL" >bench/out/llama.log 2>&1 &
fi
LLAMA=$!
trap 'kill $(jobs -p) 2>/dev/null || true' EXIT  # no server outlives a failed run
wait_ready http://127.0.0.1:8001/v1/models
if [ -n "${ALTERNATE:-}" ]; then
  $PY -m server serve --model "$MODEL" --port 8002 --max-context 4096 --log-level warning \
    >"bench/out/emberserve-$MODEL-default.log" 2>&1 &
  EMBER=$!
  wait_ready http://127.0.0.1:8002/health
  for round in $(seq "$ALTERNATE"); do
    alternate_run "$PEER-$MODEL" http://127.0.0.1:8001 "{\"repeat_penalty\": 1.0, \"logit_bias\": $EOS}" "$round"
    alternate_run "emberserve-$MODEL-default" http://127.0.0.1:8002 '{}' "$round"
  done
  kill $LLAMA $EMBER; wait 2>/dev/null || true
  exit 0
fi
bench "$PEER-$MODEL" http://127.0.0.1:8001 "{\"repeat_penalty\": 1.0, \"logit_bias\": $EOS}"
rss "$PEER-$MODEL" $LLAMA
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
