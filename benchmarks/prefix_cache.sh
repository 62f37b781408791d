#!/usr/bin/env bash
# Prefix caching benchmark (issue 4): the same server with caching on, then with --no-prefix-caching,
# under a shared-system-prompt load and a multi-turn chat load. Per run it prints the prefix cache hit
# rate and the prompt tokens actually computed (from /metrics before/after), TTFT p50/p99 and throughput.
#   bash benchmarks/prefix_cache.sh [MODEL_DIR] [OUT_DIR]
# Smaller smoke run: NUM_PROMPTS=4 CONVERSATIONS=2 SHARED_PREFIX_LEN=100 bash benchmarks/prefix_cache.sh DIR
# Multi-turn as N users chatting: DATASETS=multi-turn RATE=inf MAX_CONCURRENCY=6 CONVERSATIONS=24 bash ...
# vLLM's multi-turn shape (shared system prompt, a document opening each chat): add
#   SYSTEM_PROMPT_LEN=100 FIRST_TURN_CONTEXT_LEN=200:400
set -euo pipefail
cd "$(dirname "$0")/.."
MODEL=${1:-$(python -c "from llmserve.model.builtin import ensure_default_model; print(ensure_default_model('llama','medium'))")}
OUT=${2:-bench_out/prefix}
PORT=${PORT:-8003}
NUM_PROMPTS=${NUM_PROMPTS:-64}
CONVERSATIONS=${CONVERSATIONS:-16}
RATE=${RATE:-inf}
SHARED_PREFIX_LEN=${SHARED_PREFIX_LEN:-1000}
QUESTION_LEN=${QUESTION_LEN:-50}
OUTPUT_LEN=${OUTPUT_LEN:-64}
NUM_TURNS=${NUM_TURNS:-5}
TURN_OUTPUT_LEN=${TURN_OUTPUT_LEN:-32}  # N or LOW:HIGH (varied replies keep conversations out of lockstep)
SYSTEM_PROMPT_LEN=${SYSTEM_PROMPT_LEN:-0}  # multi-turn: a system prompt shared by all conversations
FIRST_TURN_CONTEXT_LEN=${FIRST_TURN_CONTEXT_LEN:-0}  # multi-turn: N or LOW:HIGH tokens of a document opening each chat
SERVE_ARGS=${SERVE_ARGS:-}
DATASETS=${DATASETS:-"shared-prefix multi-turn"}
MAX_CONCURRENCY=${MAX_CONCURRENCY:-}  # set: a closed loop of that many clients (conversations) instead of arrivals at RATE
URL="http://127.0.0.1:$PORT"
mkdir -p "$OUT"

SERVER=""
stop_server() {
  if [ -n "$SERVER" ]; then kill "$SERVER" 2>/dev/null || true; wait "$SERVER" 2>/dev/null || true; SERVER=""; fi
}
trap stop_server EXIT

scrape() {  # the /metrics counters this script reports, as JSON
  curl -sf "$URL/metrics" | python -c '
import json, sys
from prometheus_client.parser import text_string_to_metric_families
wanted = {"vllm:prefix_cache_queries_total", "vllm:prefix_cache_hits_total", "vllm:prompt_tokens_total",
          "vllm:iteration_tokens_total_sum", "vllm:generation_tokens_total"}
values = {s.name: s.value for f in text_string_to_metric_families(sys.stdin.read()) for s in f.samples if s.name in wanted}
print(json.dumps(values))'
}

report() {  # label before.json after.json result.json
  python - "$@" <<'PY'
import json, sys
label, before, after, result = sys.argv[1:]
b, a = (json.load(open(p)) for p in (before, after))
d = {k: a.get(k, 0.0) - b.get(k, 0.0) for k in a}
run = json.load(open(result))["runs"][-1]
queries, hits = d["vllm:prefix_cache_queries_total"], d["vllm:prefix_cache_hits_total"]
computed = d["vllm:iteration_tokens_total_sum"] - d["vllm:generation_tokens_total"]
print(f"{label:28s} hit rate {hits / queries if queries else 0:6.1%}  prompt tokens {d['vllm:prompt_tokens_total']:8.0f}"
      f"  prefill computed ~{computed:8.0f}  TTFT p50 {run['ttft_ms']['p50']:8.1f} ms  p99 {run['ttft_ms']['p99']:8.1f} ms"
      f"  {run['request_throughput']:6.2f} req/s  {run['output_throughput']:8.1f} tok/s")
PY
}

for mode in on off; do
  flags=()
  [ "$mode" = off ] && flags=(--no-prefix-caching)
  # shellcheck disable=SC2086
  llmserve serve --model "$MODEL" --port "$PORT" --served-model-name bench "${flags[@]}" $SERVE_ARGS \
    >"$OUT/server-$mode.log" 2>&1 &
  SERVER=$!
  for _ in $(seq 300); do curl -sf "$URL/health" >/dev/null && break; sleep 1; done
  for dataset in $DATASETS; do
    if [ "$dataset" = shared-prefix ]; then
      args=(--dataset shared-prefix --shared-prefix-len "$SHARED_PREFIX_LEN" --question-len "$QUESTION_LEN"
            --output-len "$OUTPUT_LEN" --num-prompts "$NUM_PROMPTS")
    else
      args=(--dataset multi-turn --num-turns "$NUM_TURNS" --num-prompts "$CONVERSATIONS" --turn-output-len "$TURN_OUTPUT_LEN"
            --system-prompt-len "$SYSTEM_PROMPT_LEN" --first-turn-context-len "$FIRST_TURN_CONTEXT_LEN"
            --endpoint /v1/chat/completions)
    fi
    [ -n "$MAX_CONCURRENCY" ] && args+=(--max-concurrency "$MAX_CONCURRENCY")
    scrape >"$OUT/$dataset-$mode.before.json"
    llmserve bench serve --base-url "$URL" --tokenizer "$MODEL" "${args[@]}" --request-rate "$RATE" \
      --exact-output-len --seed 0 --no-progress --label "$dataset-cache-$mode" \
      --result-json "$OUT/$dataset-$mode.json" >"$OUT/$dataset-$mode.txt"
    scrape >"$OUT/$dataset-$mode.after.json"
    report "$dataset cache $mode" "$OUT/$dataset-$mode.before.json" "$OUT/$dataset-$mode.after.json" \
      "$OUT/$dataset-$mode.json" | tee -a "$OUT/summary.txt"
  done
  stop_server
done
