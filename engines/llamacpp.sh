#!/usr/bin/env bash
# A real llama.cpp `llama-server`, built from the llama.cpp tree vendored in the PyPI sdist of
# llama-cpp-python 0.3.36, and a tiny random-weight Llama GGUF; cached outside the repo.
#
#   bash engines/llamacpp.sh install           # idempotent; ~8-12 min build the first time (2 cores)
#   bash engines/llamacpp.sh serve PORT [ARGS] # exec llama-server on 127.0.0.1:PORT
#   bash engines/llamacpp.sh paths             # print the binary and the model
#
# Cache: ${KVGATE_ENGINE_CACHE:-$HOME/.cache/kvgate-engines}/
#   llamacpp-0.3.36/{venv,dl,build,.installed}   models/tiny-llama.gguf
# Exit codes: 0 ok, 1 failure, 3 the package registry refused a package (a line
# "kvgate-engines: REGISTRY REFUSED: ..." names it). JOBS (default: nproc) sets build parallelism.
set -euo pipefail

LCP_VERSION=0.3.36
GGUF_VERSION=0.19.0
HERE=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
CACHE=${KVGATE_ENGINE_CACHE:-$HOME/.cache/kvgate-engines}
ROOT=$CACHE/llamacpp-$LCP_VERSION
VENV=$ROOT/venv
SRC=$ROOT/dl/llama_cpp_python-$LCP_VERSION/vendor/llama.cpp
BUILD=$ROOT/build
BIN=$BUILD/bin/llama-server
MODEL=$CACHE/models/tiny-llama.gguf
MODEL_SCRIPT=$HERE/make_tiny_gguf.py
STAMP=$ROOT/.installed
LOG=$ROOT/install.log

t0=$(date +%s)
say() { echo "[llamacpp +$(($(date +%s) - t0))s] $*"; }

refused_or_fail() {
  local what=$1
  local hit
  hit=$(grep -E -m1 "No matching distribution found for|Could not find a version that satisfies|HTTP error 40[34]|40[34] Client Error|E: Unable to locate package" "$LOG" || true)
  if [ -n "$hit" ]; then
    echo "kvgate-engines: REGISTRY REFUSED: $what: $hit"
    exit 3
  fi
  echo "kvgate-engines: $what failed; last lines of $LOG:"
  tail -n 30 "$LOG"
  exit 1
}

model_sha() { sha256sum "$MODEL_SCRIPT" | cut -d' ' -f1; }
model_ok() { [ -f "$MODEL" ] && [ "$(cat "$MODEL.generator-sha256" 2>/dev/null)" = "$(model_sha)" ]; }
binary_ok() { [ -x "$BIN" ] && "$BIN" --version >/dev/null 2>&1; }

install_toolchain() {
  local need=()
  command -v cmake >/dev/null || need+=(cmake)
  command -v g++ >/dev/null || need+=(g++)
  command -v ninja >/dev/null || need+=(ninja-build)
  [ ${#need[@]} -eq 0 ] && return 0
  [ "$(id -u)" = 0 ] || {
    echo "kvgate-engines: missing ${need[*]}; install them (apt-get install ${need[*]})"
    exit 1
  }
  say "apt-get install ${need[*]}"
  { apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq "${need[@]}"; } \
    >>"$LOG" 2>&1 || refused_or_fail "apt-get install ${need[*]}"
}

install_venv() {
  if [ -x "$VENV/bin/python" ] && "$VENV/bin/python" -c 'import gguf, numpy' 2>/dev/null; then
    return 0
  fi
  say "venv with gguf==$GGUF_VERSION: $VENV"
  [ -x "$VENV/bin/python" ] || python3 -m venv "$VENV"
  "$VENV/bin/pip" install --disable-pip-version-check -q "gguf==$GGUF_VERSION" numpy >>"$LOG" 2>&1 ||
    refused_or_fail "pip install gguf"
}

install_source() {
  [ -f "$SRC/tools/server/server.cpp" ] && return 0
  say "pip download llama-cpp-python==$LCP_VERSION (sdist; it vendors llama.cpp)"
  mkdir -p "$ROOT/dl"
  "$VENV/bin/pip" download --disable-pip-version-check -q --no-deps --no-binary :all: \
    "llama-cpp-python==$LCP_VERSION" -d "$ROOT/dl" >>"$LOG" 2>&1 ||
    refused_or_fail "pip download llama-cpp-python"
  tar xzf "$ROOT/dl/llama_cpp_python-$LCP_VERSION.tar.gz" -C "$ROOT/dl"
}

build_server() {
  local jobs=${JOBS:-$(nproc)}
  say "building llama-server with $jobs jobs (~8-12 min on 2 idle cores); log: $ROOT/build.log"
  # Static, server target only, no web UI and no HTTPS: nothing is fetched at build time.
  # GGML_NATIVE=ON tunes for this CPU; the cache lives on this machine only.
  {
    cmake -S "$SRC" -B "$BUILD" -G Ninja -DCMAKE_BUILD_TYPE=Release -DBUILD_SHARED_LIBS=OFF \
      -DGGML_NATIVE=ON -DLLAMA_BUILD_SERVER=ON -DLLAMA_BUILD_TOOLS=ON -DLLAMA_BUILD_TESTS=OFF \
      -DLLAMA_BUILD_EXAMPLES=OFF -DLLAMA_BUILD_UI=OFF -DLLAMA_USE_PREBUILT_UI=OFF -DLLAMA_OPENSSL=OFF &&
      cmake --build "$BUILD" --target llama-server -j "$jobs"
  } >"$ROOT/build.log" 2>&1 || {
    echo "kvgate-engines: llama-server build failed; last lines of $ROOT/build.log:"
    tail -n 30 "$ROOT/build.log"
    exit 1
  }
}

install_model() {
  model_ok && return 0
  say "writing the tiny GGUF to $MODEL"
  mkdir -p "$(dirname "$MODEL")"
  "$VENV/bin/python" "$MODEL_SCRIPT" --out "$MODEL.tmp" >>"$LOG" 2>&1 ||
    refused_or_fail "make_tiny_gguf.py"
  mv "$MODEL.tmp" "$MODEL"
  model_sha >"$MODEL.generator-sha256"
}

cmd_install() {
  mkdir -p "$ROOT"
  exec 9>"$ROOT/.lock"
  flock 9 # a second install waits for the first instead of racing it
  if [ -f "$STAMP" ] && [ -x "$BIN" ] && model_ok; then
    say "cached: $BIN"
    return 0
  fi
  rm -f "$STAMP"
  : >"$LOG"
  install_venv
  if binary_ok; then
    say "llama-server present: $BIN"
  else
    install_toolchain
    install_source
    build_server # ninja resumes a half-finished build
    binary_ok || {
      echo "kvgate-engines: $BIN does not run"
      exit 1
    }
  fi
  install_model
  date -u +%FT%TZ >"$STAMP"
  say "installed: $("$BIN" --version 2>&1 | grep -m1 version || true)"
}

cmd_serve() {
  local port=${1:?usage: llamacpp.sh serve PORT [llama-server args]}
  shift
  [ -f "$STAMP" ] || {
    echo "not installed: run 'bash engines/llamacpp.sh install'" >&2
    exit 1
  }
  # -t 1: busy-waiting threads at -t 2 slow everything when engines, gateway and client share 2 cores.
  exec "$BIN" -m "$MODEL" --host 127.0.0.1 --port "$port" --metrics --slots -t 1 --alias tiny \
    --no-webui "$@"
}

case "${1:-}" in
install) cmd_install ;;
serve)
  shift
  cmd_serve "$@"
  ;;
paths) printf 'server=%s\nmodel=%s\n' "$BIN" "$MODEL" ;;
*)
  echo "usage: $0 install | serve PORT [llama-server args] | paths" >&2
  exit 2
  ;;
esac
