#!/usr/bin/env bash
# Every GPU suite in one device call; a short table is printed last. Logs go to $OUT (default /tmp/gpu_out).
#
# The GPU box lacks some wheels: carry .whl/ (../shared/tools/gpu_wheels.sh server video fla tokenizer) and run
#   bash integration/gpu/run_all.sh
# Suite names as arguments run a subset: bash integration/gpu/run_all.sh engine parity_bf16
# fla goes on the path only for its own suite: with fla importable, HF transformers binds it for Qwen3.5 and the
# CPU-side HF references of the engine suite would call Triton kernels on CPU tensors.
set -uo pipefail
cd "$(dirname "$0")/../.."
OUT=${OUT:-/tmp/gpu_out}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1
if [ -d .whl ]; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site \
    $(ls .whl/*.whl | grep -v -e fla -e flash_linear) || exit 1
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/fla \
    $(ls .whl/*.whl | grep -e fla -e flash_linear) || exit 1
fi
BASE=/tmp/site:$PWD
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader | tee "$OUT/device.txt"

rows=()
run_suite() {  # name, PYTHONPATH, test file
  PYTHONPATH=$2 timeout 450 python3 -m pytest -q -rs "$3" > "$OUT/$1.log" 2>&1
  local rc=$? summary
  summary=$(grep -E "[0-9]+ (passed|failed|skipped|error)" "$OUT/$1.log" | tail -1)
  rows+=("| $1 | ${summary:-no summary (exit $rc)} |")
  [ "$rc" -eq 0 ] || status=1
}
status=0
suites=${*:-kernels engine parity_bf16 gated_deltanet}
for suite in $suites; do
  case $suite in
    kernels) run_suite kernels "$BASE" integration/gpu/test_kernels.py ;;
    engine) run_suite engine "$BASE" integration/gpu/test_engine_gpu.py ;;
    parity_bf16) run_suite parity_bf16 "$BASE" integration/gpu/test_parity_bf16.py ;;
    gated_deltanet) run_suite gated_deltanet "/tmp/fla:$BASE" integration/gpu/test_gated_deltanet_gpu.py ;;
    *) echo "unknown suite $suite"; exit 2 ;;
  esac
done

echo
echo "| suite | result |"
echo "|---|---|"
printf '%s\n' "${rows[@]}"
exit $status
