#!/usr/bin/env bash
# `make gpu-check OUT=DIR`: the environment (bench/gpu_env.sh), then bench/gpu_check.py at full size,
# everything it writes and logs under DIR (default var/gpu-check). See docs/benchmarks.md.
set -uo pipefail
OUT=${1:-${OUT:-var/gpu-check}}
mkdir -p "$OUT" && OUT=$(cd "$OUT" && pwd)
cd "$(dirname "$0")/.."
export PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1 TOKENIZERS_PARALLELISM=false
bash bench/gpu_env.sh 2>&1 | tee "$OUT/gpu_setup.log"
if [ "${PIPESTATUS[0]}" -ne 0 ]; then
    echo "gpu-check: no usable torch; see $OUT/gpu_setup.log"
    exit 5
fi
# shellcheck disable=SC2086 (GPU_CHECK_ARGS is a list of flags)
"${GPU_VENV:-.venv-gpu}/bin/python" bench/gpu_check.py --out "$OUT" --budget-s "${GPU_CHECK_BUDGET_S:-380}" \
    ${GPU_CHECK_ARGS:-} 2>&1 | tee "$OUT/gpu_check.log"
exit "${PIPESTATUS[0]}"
