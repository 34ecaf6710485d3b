#!/usr/bin/env bash
# Concurrency sweep of `trtllm-qwenvl serve`: streamed chats, each with one random-noise image and text padded so
# that the server-counted prompt is ~ISL tokens (image included), OSL tokens out with EOS ignored. aiperf runs each
# level (in its own venv, as integration/aiperf_smoke.sh); --loadgen uses perf/loadgen.py instead (aiohttp only,
# for machines without aiperf). Writes sweep.csv (loadgen's columns), summary.md, PNG plots and per-level raw data
# to perf/results/sweep_<client>_<device>_<date>_<commit>/ and prints the table last.
#
#   perf/sweep_aiperf.sh [options] MODEL_DIR     starts the server on a free loopback port, stops it at exit
#   perf/sweep_aiperf.sh [options] --url URL     uses a running server (--tokenizer DIR makes aiperf's ISL exact)
# options: --concurrency 1,8,32,64,128 --isl 1000 --osl 128 --image-size 512 --requests-per-level N (2 x c, >= 8)
#          --warmup 4 --loadgen --tokenizer DIR --serve-args "..." --out DIR --timeout 600 (per request, s)
# env: PYTHON (runs the server; .venv/bin/python, else python3), AIPERF_VENV (.venv-aiperf), PERF_VENV (.venv-perf)
set -euo pipefail
cd "$(dirname "$0")/.."
AIPERF_VERSION=0.13.0  # as integration/aiperf_smoke.sh
AIPERF_VENV=${AIPERF_VENV:-.venv-aiperf}
PERF_VENV=${PERF_VENV:-.venv-perf}
CONC=1,8,32,64,128 ISL=1000 OSL=128 IMAGE=512 PER_LEVEL="" WARMUP=4 CLIENT=aiperf TOKENIZER="" SERVE_ARGS=""
URL="" MODEL_DIR="" OUT="" TIMEOUT=600
while [ $# -gt 0 ]; do
  case $1 in
    --concurrency) CONC=$2; shift ;;
    --isl) ISL=$2; shift ;;
    --osl) OSL=$2; shift ;;
    --image-size) IMAGE=$2; shift ;;
    --requests-per-level) PER_LEVEL=$2; shift ;;
    --warmup) WARMUP=$2; shift ;;
    --loadgen) CLIENT=loadgen ;;
    --tokenizer) TOKENIZER=$2; shift ;;
    --serve-args) SERVE_ARGS=$2; shift ;;
    --url) URL=${2%/}; shift ;;
    --out) OUT=$2; shift ;;
    --timeout) TIMEOUT=$2; shift ;;
    -h|--help) sed -n '2,13p' "$0"; exit 0 ;;
    -*) echo "unknown option $1" >&2; exit 2 ;;
    *) MODEL_DIR=$1 ;;
  esac
  shift
done
[ -n "$URL$MODEL_DIR" ] || { sed -n '2,13p' "$0"; exit 2; }

# Client venvs. .venv-perf holds aiohttp + matplotlib (perf/requirements.txt); where pip cannot reach an index
# (the lent GPU) python3 is used as it is, and plots are skipped if it lacks matplotlib.
if [ "$PERF_VENV/.installed" -nt perf/requirements.txt ] ||
   { python3 -m venv "$PERF_VENV" && "$PERF_VENV/bin/pip" install -q -r perf/requirements.txt &&
     touch "$PERF_VENV/.installed"; }; then
  PERF_PY=$PERF_VENV/bin/python
else
  echo "no $PERF_VENV (pip failed); using python3"; PERF_PY=python3
fi
if [ $CLIENT = aiperf ]; then
  [ -x "$AIPERF_VENV/bin/aiperf" ] ||
    { python3 -m venv "$AIPERF_VENV" && "$AIPERF_VENV/bin/pip" install -q "aiperf==$AIPERF_VERSION"; }
fi

DEVICE=$( (nvidia-smi --query-gpu=name --format=csv,noheader 2>/dev/null || true) | head -1 | tr 'A-Z' 'a-z' |
         sed 's/nvidia //; s/[^a-z0-9]\+/_/g; s/_$//')
DEVICE=${DEVICE:-cpu}
COMMIT=$(git rev-parse --short HEAD)
DATE=$(date +%F)
OUT=${OUT:-perf/results/sweep_${CLIENT}_${DEVICE}_${DATE}_${COMMIT}}
mkdir -p "$OUT"
WORK=$(mktemp -d)
SERVER=""
cleanup() {
  if [ -n "$SERVER" ]; then kill "$SERVER" 2>/dev/null || true; wait "$SERVER" 2>/dev/null || true; fi
  rm -rf "$WORK"
}
trap cleanup EXIT

if [ -z "$URL" ]; then
  PYTHON=${PYTHON:-$([ -x .venv/bin/python ] && echo .venv/bin/python || echo python3)}
  PORT=$(python3 -c 'import socket; s = socket.socket(); s.bind(("127.0.0.1", 0)); print(s.getsockname()[1])')
  URL=http://127.0.0.1:$PORT
  MAX_C=$(tr , '\n' <<<"$CONC" | sort -n | tail -1)
  # --max_batch_size covers the top level so it is not queued by the scheduler; later --serve-args win.
  # shellcheck disable=SC2086
  HF_HUB_OFFLINE=1 "$PYTHON" -m trtllm_qwenvl serve "$MODEL_DIR" --host 127.0.0.1 --port "$PORT" \
    --served_model_name "$(basename "$MODEL_DIR")" --max_batch_size "$MAX_C" --log_level warning $SERVE_ARGS \
    > "$WORK/server.log" 2>&1 &
  SERVER=$!
  deadline=$((SECONDS + 1800))  # real checkpoints load and capture graphs first
  until curl -sf "$URL/health" >/dev/null; do
    kill -0 "$SERVER" 2>/dev/null || { echo "the server exited:"; tail -30 "$WORK/server.log"; exit 1; }
    [ $SECONDS -lt $deadline ] || { echo "the server did not start in 30 min"; tail -30 "$WORK/server.log"; exit 1; }
    sleep 0.5
  done
  head -1 "$WORK/server.log"
fi
MODEL=$(curl -sf "$URL/v1/models" | python3 -c 'import json, sys; print(json.load(sys.stdin)["data"][0]["id"])')

# Warm up and measure the prompt's fixed part (image + chat template) the same way for both clients.
PROBE=$("$PERF_PY" perf/loadgen.py --url "$URL" --model "$MODEL" --isl "$ISL" --osl "$OSL" --image-size "$IMAGE" \
  --warmup "$WARMUP" --timeout "$TIMEOUT" --seed 1000 --probe | tee /dev/stderr)
FIXED=$(sed -n 's/^fixed_tokens=//p' <<<"$PROBE")

if [ $CLIENT = loadgen ]; then
  "$PERF_PY" perf/loadgen.py --url "$URL" --model "$MODEL" --concurrency "$CONC" --isl "$ISL" --osl "$OSL" \
    --image-size "$IMAGE" --warmup 0 --timeout "$TIMEOUT" ${PER_LEVEL:+--requests-per-level $PER_LEVEL} \
    ${TOKENIZER:+--tokenizer "$TOKENIZER"} --out "$OUT" > "$WORK/loadgen.txt" || true
  sed '/^$/q' "$WORK/loadgen.txt"
  [ -f "$OUT/sweep.csv" ] || { echo "loadgen wrote no results:"; tail -20 "$WORK/loadgen.txt"; exit 1; }
else
  # aiperf's --isl counts its own text only. Its tokenizer (default: the model's) sizes that text; with neither,
  # its builtin tiktoken tokenizer makes ISL approximate. Each level gets its own seed: aiperf's noise images and
  # text come from it, and a repeated seed would repeat prompts, i.e. prefix-cache hits (so also no aiperf
  # warm-up: it replays the first prompts of the profiling phase).
  TEXT_ISL=$(( ISL > FIXED ? ISL - FIXED : 1 ))
  for c in ${CONC//,/ }; do
    n=${PER_LEVEL:-$(( 2 * c > 8 ? 2 * c : 8 ))}
    echo "aiperf: concurrency $c, $n requests, $TEXT_ISL text tokens + $FIXED image and template tokens"
    env -u HF_HUB_OFFLINE "$AIPERF_VENV/bin/aiperf" profile --model "$MODEL" --url "$URL" --endpoint-type chat \
      --streaming --concurrency "$c" --request-count "$n" --tokenizer "${TOKENIZER:-${MODEL_DIR:-builtin}}" \
      --isl "$TEXT_ISL" --prompt-input-tokens-stddev 0 --osl "$OSL" --output-tokens-stddev 0 \
      --extra-inputs ignore_eos:true --extra-inputs temperature:0 --image-width-mean "$IMAGE" \
      --image-height-mean "$IMAGE" --image-batch-size 1 --image-format png --use-server-token-count \
      --random-seed "$c" --request-timeout-seconds "$TIMEOUT" --ui-type none --artifact-dir "$WORK/c$c" \
      > "$WORK/aiperf_c$c.log" 2>&1 || { echo "aiperf failed at concurrency $c:"; tail -20 "$WORK/aiperf_c$c.log"; }
    cp "$WORK/c$c/profile_export_aiperf.json" "$OUT/aiperf_c$c.json" 2>/dev/null || true
  done
  # One CSV row per level, in loadgen's columns. ITL is aiperf's inter_chunk_latency (gaps between content
  # chunks, pooled over requests), which is what loadgen measures; aiperf's own inter_token_latency is a per-request
  # mean, (e2e - TTFT) / (OSL - 1).
  "$PERF_PY" - "$OUT" "$CONC" <<'PY'
import csv, json, pathlib, sys
sys.path.insert(0, "perf")
from loadgen import COLUMNS
out, levels = pathlib.Path(sys.argv[1]), [int(c) for c in sys.argv[2].split(",")]
rows = []
for c in levels:
    path = out / f"aiperf_c{c}.json"
    if not path.exists():
        continue
    d = json.loads(path.read_text())
    def get(metric, stat="avg"):
        v = (d.get(metric) or {}).get(stat)
        return float("nan") if v is None else round(v, 2)
    errors = sum(e.get("count", 1) for e in d.get("error_summary") or [])
    rows.append({"concurrency": c, "requests": int(get("completed_request_count")), "errors": errors,
                 "duration_s": get("benchmark_duration"), "req_per_s": get("request_throughput"),
                 "output_tok_per_s": get("output_token_throughput"), "ttft_p50_ms": get("time_to_first_token", "p50"),
                 "ttft_p90_ms": get("time_to_first_token", "p90"), "ttft_p99_ms": get("time_to_first_token", "p99"),
                 "itl_p50_ms": get("inter_chunk_latency", "p50"), "itl_p99_ms": get("inter_chunk_latency", "p99"),
                 "e2e_p50_ms": get("request_latency", "p50"), "isl_mean": get("input_sequence_length"),
                 "osl_mean": get("output_sequence_length"),
                 "cached_tokens_mean": get("usage_prompt_cache_read_tokens")})
with open(out / "sweep.csv", "w", newline="") as f:
    writer = csv.DictWriter(f, COLUMNS)
    writer.writeheader()
    writer.writerows(rows)
PY
fi

# After the sweep nothing may be left running or holding KV blocks; anything else is a server leak.
GAUGES='num_requests_(running|waiting)|kv_cache_blocks_used|num_preemptions_total|request_finished_total'
curl -sf "$URL/metrics" | grep -E "^trtllm_qwenvl_($GAUGES)" > "$OUT/server_metrics_after.txt" || true
[ -s "$WORK/server.log" ] && cp "$WORK/server.log" "$OUT/server.log"
TITLE="$CLIENT, $DEVICE, $COMMIT: ISL $ISL (${IMAGE}px image), OSL $OSL"
if "$PERF_PY" -c 'import matplotlib' 2>/dev/null; then
  "$PERF_PY" perf/plot_sweep.py "$OUT/sweep.csv" --title "$TITLE"
else
  echo "no matplotlib here: plot later with perf/plot_sweep.py $OUT/sweep.csv"
fi
TABLE=$("$PERF_PY" -c 'import csv, sys; sys.path.insert(0, "perf"); from loadgen import format_table
print(format_table(list(csv.DictReader(open(sys.argv[1])))))' "$OUT/sweep.csv")
DIRTY=$(git diff --quiet HEAD -- . 2>/dev/null || echo " (working tree modified)")
cat > "$OUT/summary.md" <<EOF
# Serving sweep: $CLIENT against \`trtllm-qwenvl serve\`, $DATE

- device: ${DEVICE}; commit ${COMMIT}${DIRTY}
- model: ${MODEL_DIR:-$MODEL at $URL}${SERVE_ARGS:+; serve args: $SERVE_ARGS}
- streamed chats: one ${IMAGE}x${IMAGE} noise PNG each ($FIXED tokens with the chat template) + text to ISL $ISL;
  OSL $OSL with ignore_eos, temperature 0; closed loop at each concurrency, after $WARMUP warm-up requests;
  ${PER_LEVEL:-2 x concurrency (at least 8)} requests per level
- ITL: gaps between content chunks, pooled over requests; TTFT: first content chunk
- server after the sweep: $(tr '\n' ';' < "$OUT/server_metrics_after.txt" | sed 's/trtllm_qwenvl_//g; s/;$//; s/;/; /g')

$TABLE

Plots: ttft.png, itl.png, throughput.png
EOF
echo "wrote $OUT"
echo
echo "$TABLE"
