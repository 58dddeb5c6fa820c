#!/usr/bin/env bash
# emberserve vs llama.cpp (llama-cpp-python's server) on the same GGUF, one after the other, same load.
# Usage: bench/compare_servers.sh [extra bench/serve.py args]   (results in bench/out/*.json and on stdout)
# The llama.cpp server lives in its own venv (.venv-llamacpp, built once: about 8 minutes on 2 cores);
# it is a benchmark-only dependency, not the project's. It ignores ignore_eos, so the end tokens are banned
# with logit_bias instead: both servers then generate exactly max_tokens.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=.venv/bin/python
if [ ! -x .venv-llamacpp/bin/python ]; then
  python3 -m venv .venv-llamacpp
  CMAKE_BUILD_PARALLEL_LEVEL=2 .venv-llamacpp/bin/pip install --quiet "llama-cpp-python[server]==0.3.36"
fi
GGUF=$($PY -c "from engine import KNOWN_MODELS; print(KNOWN_MODELS['smollm2-135m'].path())")
mkdir -p bench/out
wait_ready() { for _ in $(seq 300); do curl -sf "$1" >/dev/null && return 0; sleep 0.2; done; return 1; }

.venv-llamacpp/bin/python -m llama_cpp.server --model "$GGUF" --n_threads 2 --n_ctx 4096 --interrupt_requests False \
  --port 8001 --model_alias smollm2-135m >bench/out/llama.log 2>&1 &
LLAMA=$!
wait_ready http://127.0.0.1:8001/v1/models
$PY bench/serve.py --base-url http://127.0.0.1:8001 --label llama.cpp --extra-body '{"repeat_penalty": 1.0, "logit_bias": {"0": -100, "2": -100}}' \
  --json-out bench/out/llama.cpp.json "$@"
kill $LLAMA; wait $LLAMA 2>/dev/null || true

for dtype in float32 bfloat16; do
  $PY -m server serve --port 8002 --dtype $dtype --log-level warning >bench/out/emberserve-$dtype.log 2>&1 &
  EMBER=$!
  wait_ready http://127.0.0.1:8002/health
  $PY bench/serve.py --base-url http://127.0.0.1:8002 --label "emberserve-$dtype" \
    --json-out bench/out/emberserve-$dtype.json "$@"
  kill $EMBER; wait $EMBER 2>/dev/null || true
done
