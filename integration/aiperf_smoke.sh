#!/usr/bin/env bash
# Soak: aiperf (in its own venv, since it pins older huggingface_hub, pillow and rich) against
# `trtllm-qwenvl serve` on the tiny Qwen2.5-VL checkpoint: streamed image chats, 64 requests at concurrency 8.
# Fails unless every request succeeds and the KV pool is empty afterwards. Saves the metrics table to
# perf/results/aiperf_smoke_<host>_<date>.md. Not part of CI (the aiperf venv is about 1.2 GB).
set -euo pipefail
cd "$(dirname "$0")/.."
AIPERF_VENV=${AIPERF_VENV:-.venv-aiperf}
PORT=${PORT:-8321}
CKPT=.cache/tiny/qwen2_5_vl
WORK=$(mktemp -d)
make -s venv
[ -x "$AIPERF_VENV/bin/aiperf" ] || { python3 -m venv "$AIPERF_VENV" && "$AIPERF_VENV/bin/pip" install -q aiperf==0.13.0; }
[ -f "$CKPT/config.json" ] || HF_HUB_OFFLINE=1 .venv/bin/python -m trtllm_qwenvl make-tiny --arch qwen2_5_vl "$CKPT"

HF_HUB_OFFLINE=1 .venv/bin/python -m trtllm_qwenvl serve "$CKPT" --host 127.0.0.1 --port "$PORT" \
  --served_model_name tiny-vl --config examples/serve_config.yaml --log_level warning > "$WORK/server.log" 2>&1 &
SERVER=$!
trap 'kill $SERVER 2>/dev/null; wait $SERVER 2>/dev/null || true' EXIT
until curl -sf "http://127.0.0.1:$PORT/health" >/dev/null; do
  kill -0 $SERVER 2>/dev/null || { echo "the server exited:"; cat "$WORK/server.log"; exit 1; }
  sleep 0.2
done
head -1 "$WORK/server.log"

# aiperf resolves the tokenizer through huggingface_hub; a local path needs no network, but HF_HUB_OFFLINE must
# be unset for its loader. Token counts come from the server's usage: re-tokenizing random-weight text on the client
# does not round-trip.
env -u HF_HUB_OFFLINE "$AIPERF_VENV/bin/aiperf" profile --model tiny-vl --url "http://127.0.0.1:$PORT" \
  --endpoint-type chat --streaming --request-count 64 --concurrency 8 --tokenizer "$CKPT" \
  --prompt-input-tokens-mean 200 --prompt-input-tokens-stddev 0 --output-tokens-mean 32 --output-tokens-stddev 0 \
  --extra-inputs ignore_eos:true --image-width-mean 224 --image-height-mean 224 --image-batch-size 1 \
  --use-server-token-count --random-seed 0 --ui-type none --artifact-dir "$WORK/artifacts" | tee "$WORK/aiperf.txt"

.venv/bin/python - "$WORK" "$PORT" <<'PY'
import datetime, json, pathlib, platform, re, subprocess, sys, urllib.request
work, port = pathlib.Path(sys.argv[1]), sys.argv[2]
summary = json.loads(next(work.glob("artifacts/**/*aiperf.json")).read_text())
errors = (summary.get("error_summary") or [])
metrics = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics").read().decode()
kv_used = float(re.search(r"^trtllm_qwenvl_kv_cache_blocks_used (\S+)", metrics, re.M).group(1))
done = float(re.search(r'^trtllm_qwenvl_request_finished_total\{finished_reason="length"\} (\S+)', metrics, re.M).group(1))
commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True).stdout.strip()
table = (work / "aiperf.txt").read_text()
date = datetime.date.today().isoformat()
out = pathlib.Path("perf/results") / f"aiperf_smoke_{platform.node() or 'cpu'}_{date}.md"
out.parent.mkdir(parents=True, exist_ok=True)
out.write_text(f"# aiperf smoke: tiny Qwen2.5-VL on CPU, {date}, commit {commit}\n\n"
               "64 streamed chat requests at concurrency 8, one 224x224 image + ~200 text tokens each, 32 output "
               "tokens (ignore_eos), aiperf 0.13.0.\n\n"
               f"errors: {len(errors)}; server requests finished by length: {done:.0f}; KV blocks in use after: "
               f"{kv_used:.0f}\n\n```\n{table}\n```\n")
print(f"wrote {out}")
sys.exit(1 if errors or kv_used or done < 64 else 0)
PY
