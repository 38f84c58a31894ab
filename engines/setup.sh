#!/usr/bin/env bash
# Everything a fresh machine needs before the test suite, beyond Python itself: the system
# libraries the Mooncake Store master links against (libibverbs1, libnuma1, libcurl4), then the
# real engines the real_engine tests use (vLLM, llama-server; cached outside the repo, so later
# runs take ~1 s). README's test command starts with this script, and .ci/run runs that command.
#
#   bash engines/setup.sh
#
# Without root or apt-get, missing libraries are named and the script goes on (the Mooncake
# tests then fail, naming the library). An engine install that fails does not stop the test
# run: the tests' install fixtures rerun the scripts and skip (registry refused) or fail with
# the reason.
set -uo pipefail
HERE=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)

missing=()
for p in libibverbs1 libnuma1 libcurl4; do
  dpkg -s "$p" >/dev/null 2>&1 || missing+=("$p")
done
if [ ${#missing[@]} -gt 0 ]; then
  if [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null; then
    echo "kvgate setup: apt-get install ${missing[*]}"
    { apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq "${missing[@]}"; } \
      >/dev/null 2>&1 || echo "kvgate setup: apt-get install ${missing[*]} FAILED"
  else
    echo "kvgate setup: missing system libraries ${missing[*]} (install them as root:" \
      "apt-get install ${missing[*]}); the Mooncake Store tests need them"
  fi
fi

# Engines: first run ~2-6 min (vLLM) + ~6-12 min (llama.cpp build; ~30 min on a busy box).
for script in vllm_cpu.sh llamacpp.sh; do
  t0=$(date +%s)
  rc=0
  bash "$HERE/$script" install || rc=$?
  echo "kvgate setup: engines/$script install: exit $rc in $(($(date +%s) - t0)) s"
done
exit 0
