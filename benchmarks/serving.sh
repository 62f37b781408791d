#!/usr/bin/env bash
# Serving benchmark (issue 3): llmserve against the transformers one-request-at-a-time baseline, in one run.
# Both servers serve the same checkpoint; each sweep runs while the other server is idle.
#   bash benchmarks/serving.sh [MODEL_DIR] [OUT_DIR]
set -euo pipefail
cd "$(dirname "$0")/.."
MODEL=${1:-$(python -c "from llmserve.model.builtin import ensure_default_model; print(ensure_default_model('llama','medium'))")}
OUT=${2:-bench_out/serving}
RATES=${RATES:-0.25,0.5,1,2,4}
PROMPTS=${PROMPTS:-16}
SAT_PROMPTS=${SAT_PROMPTS:-128}
BASE_SAT_PROMPTS=${BASE_SAT_PROMPTS:-32}
SLO=${SLO:-ttft=3000,tpot=300}
SERVE_ARGS=${SERVE_ARGS:---max-num-batched-tokens 512}
COMMON=(--tokenizer "$MODEL" --dataset random --random-input-len-range "${INPUT_LEN:-32:256}"
        --random-output-len-range "${OUTPUT_LEN:-16:128}" --exact-output-len --slo "$SLO" --seed 0 --no-progress)
mkdir -p "$OUT"

python benchmarks/baselines/hf_server.py --model "$MODEL" --port 8001 --dtype bfloat16 >"$OUT/baseline.log" 2>&1 &
BASE=$!
# shellcheck disable=SC2086
llmserve serve --model "$MODEL" --port 8002 --served-model-name medium $SERVE_ARGS >"$OUT/llmserve.log" 2>&1 &
OURS=$!
trap 'kill $BASE $OURS 2>/dev/null || true' EXIT
for port in 8001 8002; do
  for _ in $(seq 300); do curl -sf "http://127.0.0.1:$port/health" >/dev/null && break; sleep 1; done
done

# The baseline serves one request at a time, so its saturated throughput needs few requests; llmserve
# needs enough of them to keep its batch full.
for target in "baseline 8001 $BASE_SAT_PROMPTS" "llmserve 8002 $SAT_PROMPTS"; do
  set -- $target
  if [ -z "${SKIP_SWEEP:-}" ]; then
    echo "== $1: rate sweep =="
    llmserve bench serve --base-url "http://127.0.0.1:$2" "${COMMON[@]}" --num-prompts "$PROMPTS" \
      --request-rate "$RATES" --label "$1" --result-json "$OUT/$1-sweep.json"
  fi
  echo "== $1: saturation ($3 requests at once) =="
  llmserve bench serve --base-url "http://127.0.0.1:$2" "${COMMON[@]}" --num-prompts "$3" \
    --request-rate inf --label "$1" --result-json "$OUT/$1-saturated.json"
done
if [ -z "${SKIP_SWEEP:-}" ]; then
  llmserve bench plot "$OUT/llmserve-sweep.json" "$OUT/baseline-sweep.json" --labels llmserve,baseline -o "$OUT/sweep.png"
  echo "plot: $OUT/sweep.png"
fi
