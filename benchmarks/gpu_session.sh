#!/usr/bin/env bash
# The prepared GPU session of issue 3 (Triton FlashAttention-2 kernels on an H200): every GPU check and
# measurement in one run of at most ~8 minutes, each step under its own time limit, results in $OUT.
#
#   OUT=/path/to/results bash benchmarks/gpu_session.sh      # from the repository root
#
# Steps (each runs even if one before it failed or timed out):
#   env                      nvidia-smi; python, torch, CUDA, cuDNN, triton versions
#   pytest                   the Triton tests on CUDA (tests marked triton or cuda), autotuned path included
#   attention_bf16_d64       benchmarks/attention.py in bfloat16, head dim 64, n = 1024 ... 16384, causal and
#   attention_bf16_d128      not: SDPA's flash, memory-efficient and cuDNN kernels and the Triton kernel;
#                            forward, backward and forward+backward TFLOP/s, ratios to the best SDPA kernel,
#                            errors against float32, the tiles autotuning chose, and the targets table
# Each step's output goes to $OUT/<step>.txt; $OUT/summary.txt names the failed steps and repeats the
# tiles and targets tables. Peak memory is not measured (a fresh process per case costs minutes).
set -u

cd "$(dirname "$0")/.." || exit 1
OUT=${OUT:-gpu_session_results}
mkdir -p "$OUT" && OUT=$(cd "$OUT" && pwd)
PY=${PYTHON:-python3}
# The package is imported from the source tree rather than installed: the GPU machine reaches no package
# index, which `pip install -e .` needs for its build requirements; these modules need torch, numpy, tqdm, triton.
export PYTHONPATH="$PWD/src${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1
unset TRITON_INTERPRET
FAILED=""
START=$SECONDS

step() {  # step NAME LIMIT_S COMMAND...: COMMAND under a time limit, output to the terminal and $OUT/NAME.txt
    local name=$1 limit=$2
    shift 2
    echo "=== $name (limit $limit s): $*" | tee "$OUT/$name.txt"
    local t0=$SECONDS
    timeout -k 10 "$limit" "$@" 2>&1 | tee -a "$OUT/$name.txt"
    local rc=${PIPESTATUS[0]}
    echo "=== $name: exit code $rc after $((SECONDS - t0)) s" | tee -a "$OUT/$name.txt"
    if [ "$rc" -eq 124 ] || [ "$rc" -eq 137 ]; then
        FAILED="$FAILED $name(timed out)"
    elif [ "$rc" -ne 0 ]; then
        FAILED="$FAILED $name(exit $rc)"
    fi
}

VERSIONS_PY=$(mktemp)
cat >"$VERSIONS_PY" <<'EOF'
import sys

import torch

print("python", sys.version.split()[0], sys.executable)
print("torch", torch.__version__, "CUDA", torch.version.cuda, "cuDNN", torch.backends.cudnn.version())
if torch.cuda.is_available():
    print("GPU", torch.cuda.get_device_name(), "capability", torch.cuda.get_device_capability())
else:
    print("GPU none: torch.cuda.is_available() is False")
import triton

print("triton", triton.__version__)
EOF
step env 30 bash -c "nvidia-smi; \"$PY\" \"$VERSIONS_PY\""

XDIST=""  # compile the kernels of several tests at once where pytest-xdist is there
"$PY" -c "import xdist" 2>/dev/null && XDIST="-n 4"
# shellcheck disable=SC2086
step pytest 150 "$PY" -m pytest -q -m "triton or cuda" tests/attention/test_triton.py tests/attention/test_tiled.py \
    -rs -p no:cacheprovider --durations=10 $XDIST

for dim in 64 128; do
    step "attention_bf16_d$dim" 150 "$PY" benchmarks/attention.py --dtype bfloat16 --dims "$dim" \
        --sizes 1024 2048 4096 8192 16384 --backends sdpa-flash sdpa-efficient sdpa-cudnn triton --no-memory --repeats 30
done

{
    echo "=== summary after $((SECONDS - START)) s"
    echo "failed steps:${FAILED:- none}"
    echo "--- pytest"
    grep -E "passed|failed|error" "$OUT/pytest.txt" | tail -n 3
    for dim in 64 128; do
        echo "--- attention_bf16_d$dim: triton rows at n >= 4096 (also if the step was cut short)"
        grep -E '^\| (4096|8192|16384) \| .*\| triton \|' "$OUT/attention_bf16_d$dim.txt"
        sed -n '/^# Triton tiles/,/^===/p' "$OUT/attention_bf16_d$dim.txt"
    done
} | tee "$OUT/summary.txt"
rm -f "$VERSIONS_PY"
[ -z "$FAILED" ]
