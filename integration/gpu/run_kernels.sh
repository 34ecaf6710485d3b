#!/usr/bin/env bash
# One device call: every kernel against its torch reference, then the timing table (printed last).
# Logs and the table go to $OUT (default /tmp/kern_out). Exit status: the tests' if they failed, else the bench's.
set -uo pipefail
cd "$(dirname "$0")/../.."
OUT=${OUT:-/tmp/kern_out}
mkdir -p "$OUT"

{
  nvidia-smi --query-gpu=name,driver_version,memory.total,clocks.sm,clocks.mem --format=csv
  python3 -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__)"
  git log -1 --format='HEAD %H' 2>/dev/null
} > "$OUT/device.txt" 2>&1
cat "$OUT/device.txt"

timeout 400 python3 -m pytest -q -rs -s integration/gpu/test_kernels.py > "$OUT/test_kernels.log" 2>&1
test_rc=$?
grep -E "^(prefill|decode|graph|mrope|vision|pos embed|vit)|triton [0-9]|: [0-9.]+e" "$OUT/test_kernels.log" \
  | sed 's/^[.sF]*//' > "$OUT/test_errors.txt"
grep -E "FAILED|ERROR|Error|passed|failed" "$OUT/test_kernels.log" | tail -40
echo "pytest exit: $test_rc"

timeout 180 python3 integration/gpu/bench_kernels.py --out "$OUT" > "$OUT/bench_kernels.log" 2>&1
bench_rc=$?
tail -5 "$OUT/bench_kernels.log" | grep -i error
cat "$OUT/bench_kernels.md" 2>/dev/null
echo "bench exit: $bench_rc"
[ "$test_rc" -ne 0 ] && exit "$test_rc"
exit "$bench_rc"
