#!/usr/bin/env bash
# The GPU preset's short run on a lent machine (bench/schedule_gpu_short.py prepared its files here): joins
# the model's parts, makes the GPU environment (bench/gpu_env.sh), runs the experiment on the carried token
# files and layouts, and leaves under $OUT the runs file, results.json and the logs.
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-var/gpu-short/out}
mkdir -p "$OUT"
D=var/gpu-short
cat "$D"/model.part-* > "$D/model.gguf" || { echo "gpu-short: the model's parts are not all here"; exit 3; }
if ! bash bench/gpu_env.sh > "$OUT/gpu_env.log" 2>&1; then
    echo "gpu-short: no usable torch; see $OUT/gpu_env.log"
    exit 5
fi
PY=${GPU_VENV:-.venv-gpu}/bin/python
# shellcheck disable=SC2046 (the flags are words)
timeout "${GPU_SHORT_BUDGET_S:-480}" "$PY" bench/schedule_experiment.py \
    $("$PY" -m bench.schedule_gpu_short flags) --model "$D/model.gguf" --device cuda --runs-dir "$OUT" \
    2>&1 | tee "$OUT/run.log"
status=${PIPESTATUS[0]}
cp "$D/work/results.json" "$OUT/" 2>/dev/null
exit "$status"
