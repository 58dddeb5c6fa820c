#!/usr/bin/env bash
# Issue 36's GPU benchmark on the device machine, in parts that each finish within a device command's ten minutes.
# Every part writes $OUT/<part>.json (bench/gpu.py's report), <part>.md (its tables) and <part>.log (progress).
#
#   bash bench/gpu_moe.sh build            llama.cpp's llama-server with CUDA from .peer/llama.cpp.tar.gz (~4 min),
#                                          built under $PEER_ROOT (/tmp: kept while the machine stays warm)
#   bash bench/gpu_moe.sh moe-ours         our engine, batch 1 and 64, on qwen3-30b-a3b (all 48 layers, 61 GB) and
#                                          gpt-oss-20b (bf16 experts, 42 GB); builds llama-server meanwhile (nice 19)
#                                          unless BUILD=0
#   bash bench/gpu_moe.sh moe-peer-qwen    qwen3-30b-a3b@12 (12 of its 48 layers, 16 GB: its f16 GGUF fits the disk
#                                          beside it): our engine, our server and llama-server at 1, 32, 128 streams
#   bash bench/gpu_moe.sh moe-peer-gptoss  gpt-oss-20b-mxfp4 (MXFP4 experts as published, 14 GB; the GGUF keeps them
#                                          MXFP4): the same
#   bash bench/gpu_moe.sh dense            llama-1b and llama-8b: our server and llama-server at 1, 32, 128 streams
#   bash bench/gpu_moe.sh dense-1b         llama-1b only
#   bash bench/gpu_moe.sh dry-run          every part's path on the CPU with tiny shapes (llama-server for the CPU)
#   bash bench/gpu_moe.sh summary          $OUT/*.json as one markdown (bench/gpu.py --merge)
# A peer part builds llama-server first when it is not there (another ~4 min); its GGUF is converted by llama.cpp's
# convert_hf_to_gguf.py (bench/peer_convert.py) at nice 19 beside our engine and server parts. Extra arguments go to
# bench/gpu.py (e.g. --shapes qwen3-30b-a3b@24). The device has no network: carry .peer (the tarball) and .whl (the
# server's wheels, installed into /tmp/site when the device lacks them).
# Environment: OUT (default /tmp/gpu-moe-out), PEER_ROOT (/tmp/emberserve-peer), PY (python3), BUILD (0: moe-ours
# builds nothing), JOBS (build jobs), PEER_CPU (1: build for the CPU).
set -euo pipefail
cd "$(dirname "$0")/.."
PART=${1:?"usage: bench/gpu_moe.sh PART [gpu.py args]: build|moe-ours|moe-peer-qwen|moe-peer-gptoss|dense|dense-1b|..."}
shift
export OUT=${OUT:-/tmp/gpu-moe-out}
PY=${PY:-python3}
export PEER_ROOT=${PEER_ROOT:-/tmp/emberserve-peer}
TARBALL=${TARBALL:-.peer/llama.cpp.tar.gz}
mkdir -p "$OUT"
T0=$(date +%s)
say() { echo "[gpu_moe.sh $(( $(date +%s) - T0 ))s] $*" >&2; }

# The server's dependencies that the device lacks (../shared/reference/gpu.md), from the carried wheels.
if ! "$PY" -c "import fastapi, uvicorn, sse_starlette, pydantic_settings, llguidance" 2>/dev/null; then
  if [ ! -f /tmp/site/.installed ] && compgen -G ".whl/*.whl" >/dev/null; then
    say "installing .whl/*.whl into /tmp/site"
    "$PY" -m pip install --quiet --no-index --no-deps --target /tmp/site .whl/*.whl && touch /tmp/site/.installed
  fi
  export PYTHONPATH=/tmp/site${PYTHONPATH:+:$PYTHONPATH}
fi

peer_flags() {  # cmake flags: CUDA for the H100/H200 (sm_90) where nvcc is, else the CPU (the dry run)
  local nvcc
  nvcc=$(command -v nvcc || ls /usr/local/cuda/bin/nvcc 2>/dev/null || true)
  if [ -n "$nvcc" ] && [ "${PEER_CPU:-0}" != 1 ]; then
    echo "-DGGML_CUDA=ON -DCMAKE_CUDA_ARCHITECTURES=90 -DCMAKE_CUDA_COMPILER=$nvcc"
  else
    echo "-DGGML_NATIVE=ON"
  fi
}

build() {  # llama-server under $PEER_ROOT/build, the source (its converter too) under $PEER_ROOT/llama.cpp
  if [ -x "$PEER_ROOT/build/bin/llama-server" ]; then
    say "llama-server ready in $PEER_ROOT/build/bin (cached)"
    return
  fi
  [ -f "$TARBALL" ] || { say "no $TARBALL: carry .peer (see bench/gpu_moe.sh)"; return 2; }
  mkdir -p "$PEER_ROOT"
  [ -f "$PEER_ROOT/llama.cpp/CMakeLists.txt" ] || tar xzf "$TARBALL" -C "$PEER_ROOT"
  say "building llama-server ($(peer_flags)), log $OUT/build.log"
  # shellcheck disable=SC2046
  { cmake -S "$PEER_ROOT/llama.cpp" -B "$PEER_ROOT/build" -DCMAKE_BUILD_TYPE=Release $(peer_flags) \
      -DLLAMA_BUILD_SERVER=ON -DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_EXAMPLES=OFF -DLLAMA_OPENSSL=OFF \
      -DLLAMA_USE_PREBUILT_UI=OFF -DLLAMA_BUILD_UI=OFF -DLLAMA_CURL=OFF \
    && cmake --build "$PEER_ROOT/build" --target llama-server -j "${JOBS:-$(nproc)}"; } >"$OUT/build.log" 2>&1 \
    || { say "build failed:"; tail -30 "$OUT/build.log" >&2; return 1; }
  say "llama-server built"
}

unpack() {  # the converter needs the source even when the build is cached elsewhere
  [ -f "$PEER_ROOT/llama.cpp/convert_hf_to_gguf.py" ] || { mkdir -p "$PEER_ROOT"; tar xzf "$TARBALL" -C "$PEER_ROOT"; }
}

bench() {  # name, gpu.py args...: one report
  local name=$1
  shift
  say "$name: bench/gpu.py $*"
  # the markdown (stdout up to the JSON block, which --json-out has) to <name>.md; progress to the log and stderr
  "$PY" bench/gpu.py --json-out "$OUT/$name.json" "$@" 2> >(tee "$OUT/$name.log" >&2) \
    | sed '/^```json$/,$d' >"$OUT/$name.md" || say "$name: bench/gpu.py exited with an error (see $name.log)"
  say "$name: done; $OUT/$name.md:"
  cat "$OUT/$name.md"
}

ENGINE_ARGS=(--batches 1,64 --decode-steps 48 --prompt-tokens 128 --ttft-prompts 128,2048)
SERVER_ARGS=(--server-concurrency 1,32,128 --server-prompt-tokens 128 --server-max-tokens 256)
case "$PART" in
  build)
    build ;;
  moe-ours)
    builder=""
    if [ "${BUILD:-1}" = 1 ] && [ ! -x "$PEER_ROOT/build/bin/llama-server" ]; then
      # 12 of the 16 cores at the lowest priority: the timed steps keep theirs (the build's own log: build.log)
      say "building llama-server in the background (nice 19, 12 jobs) while the engine runs"
      JOBS=12 nice -n 19 bash bench/gpu_moe.sh build >/dev/null 2>&1 &
      builder=$!
    fi
    bench moe-ours --shapes qwen3-30b-a3b,gpt-oss-20b --parts bandwidth,engine,ttft --fit-layers \
      "${ENGINE_ARGS[@]}" --budget-s 500 --part-budget engine=90,ttft=40 "$@"
    if [ -n "$builder" ]; then
      say "waiting for the llama-server build"
      wait "$builder" && say "llama-server built meanwhile" || say "llama-server build failed: $OUT/build.log"
    fi ;;
  moe-peer-qwen | moe-peer-gptoss)
    build
    unpack
    shape=$([ "$PART" = moe-peer-qwen ] && echo qwen3-30b-a3b@12 || echo gpt-oss-20b-mxfp4)
    bench "$PART" --shapes "$shape" --parts bandwidth,engine,ttft,server,peer --peer-convert-early \
      "${ENGINE_ARGS[@]}" --ttft-prompts 128 "${SERVER_ARGS[@]}" --budget-s 540 \
      --part-budget engine=60,server=150,peer=300 "$@" ;;
  dense | dense-1b)
    build
    unpack
    shapes=$([ "$PART" = dense ] && echo llama-1b,llama-8b || echo llama-1b)
    bench "$PART" --shapes "$shapes" --parts bandwidth,server,peer --peer-convert-early "${SERVER_ARGS[@]}" \
      --budget-s 540 --part-budget server=90,peer=300 "$@" ;;
  dry-run)
    # the CPU: tiny shapes through every part, a llama-server for the CPU (PEER_CPU=1 builds one if missing)
    PEER_CPU=1 build
    unpack
    bench dry-run --device cpu --shapes tiny,tiny-qwen3-moe,tiny-gpt-oss-mxfp4 \
      --parts bandwidth,anchor,engine,ttft,server,peer --batches 1,4 --decode-steps 4 --ttft-prompts 16 \
      --server-concurrency 1,4 --server-max-tokens 8 --server-prompt-tokens 16 --peer-args "-np 4 -c 2048 -t 2" \
      --budget-s 600 "$@" ;;
  summary)
    "$PY" bench/gpu.py --merge "$OUT"/*.json --json-out "${SUMMARY_JSON:-/tmp/gpu-moe-summary.json}" ;;
  *)
    echo "unknown part $PART" >&2
    exit 2 ;;
esac
say "$PART finished"
