#!/usr/bin/env bash
# The GPU checks and figures in one call. Installs nothing: the Python it runs ($PYTHON, default
# `python`) needs CUDA torch and the project's test extras (pytest, triton, transformers).
#
#   bash benchmarks/gpu.sh                                  # everything; results in bench_out/gpu
#   OUT_DIR=/tmp/gpu STEPS="gpu-tests parity" bash benchmarks/gpu.sh
#
# Steps, in order (STEPS picks a subset):
#   gpu-tests     pytest -m gpu (the CUDA-only tests of $GPU_TESTS, default the whole suite)
#   triton-tests  the Triton kernels' tests (attention, fused, int8, triton_linear, quantization, argmax), natively
#   parity        float32 greedy outputs: torch backend = triton backend = triton + CUDA graphs (+ PDL)
#   linear-one-row  the sweep of triton_linear's one-row tiles for $LINEAR_WEIGHTS (gpu_linear.py --rows 1);
#                 the decode step after it runs with the best, per kind and per shape (unless LINEAR_CONFIGS
#                 names a file)
#   decode        batch-1 decode on the Llama-3.1-8B shape: tok/s and % of copy bandwidth (goal, bf16: >= 85%)
#                 for each of $DECODE_VARIANTS (bf16, fp8 and int8 weights, fp8 KV, ...; any + "-nopdl": without
#                 programmatic dependent launch, + "-foldnorms": RMSNorm in the next projection's launch,
#                 + "-foldrotary": rotary and KV write in the decode attention's launch), with each step's
#                 kernel times by kind
#   linear        the 8B shape's linear layers at 1-16 rows, every kernel and a sweep of triton_linear's tiles
#   quality       int8 / fp8 logits against bf16 on the medium model (KL, top-1 agreement)
#   throughput    1,000 requests (in/out 100-1,024 tokens) against transformers static batches (goal >= 10x)
#   overhead      host time not hidden behind the device at batch 256, overlap on and off (goal < 10%)
#   serving       `llmserve serve` against `LLM.generate` on the 8B shape, 1,000 requests, in/out 100-1,024,
#                 at rate inf and at 8 req/s (goals: >= 95% of offline tok/s, ITL p50 <= 1.1x TPOT p50);
#                 the server needs fastapi, uvicorn, pydantic, pyzmq, msgspec, ... in $PYTHON's environment
# Each step's output goes to OUT_DIR/<step>.log (and .json for the benchmarks); a summary table is last.
# Expected on one H200: roughly 1-2 min of tests and parity, 1 min decode, 4-5 min throughput (most
# of it the transformers baseline), 1 min overhead. Where one call must stay under 10 minutes, split
# it: STEPS="gpu-tests triton-tests parity decode overhead", then STEPS=throughput (same OUT_DIR).
# The 8B runs use `make-model --size 8b` (config and tokenizer only) with --load-format dummy.
set -uo pipefail
cd "$(dirname "$0")/.."
PYTHON=${PYTHON:-python}
OUT_DIR=${OUT_DIR:-bench_out/gpu}
STEPS=${STEPS:-gpu-tests triton-tests parity decode linear quality throughput overhead serving}
MODEL_8B=${MODEL_8B:-$OUT_DIR/llama-3.1-8b}
NUM_PROMPTS=${NUM_PROMPTS:-1000}
HF_SAMPLE_BATCHES=${HF_SAMPLE_BATCHES:-2}  # transformers static batches of 128 actually timed
GPU_TESTS=${GPU_TESTS:-tests}
DECODE_VARIANTS=${DECODE_VARIANTS:-bf16,bf16-cublas,fp8,fp8-head,fp8-scaled-mm,int8,bf16-fp8kv,bf16-nopdl,fp8-head-nopdl,fp8-head-foldnorms,fp8-head-foldrotary,fp8-head-foldnorms-foldrotary}
DECODE_MODES=${DECODE_MODES:-graphs}
LINEAR_CONFIGS=${LINEAR_CONFIGS:-}  # gpu_linear.py's JSON: decode with the tiles its sweep found best
LINEAR_WEIGHTS=${LINEAR_WEIGHTS:-bf16,fp8,int8}  # the weight kinds the linear-one-row sweep times
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
mkdir -p "$OUT_DIR"
# steps.tsv keeps each step's latest status, so a run split over several calls sums up as one.
touch "$OUT_DIR/steps.tsv"
grep -v -E "^($(echo $STEPS | tr ' ' '|'))"$'\t' "$OUT_DIR/steps.tsv" > "$OUT_DIR/steps.tsv.new" || true
mv "$OUT_DIR/steps.tsv.new" "$OUT_DIR/steps.tsv"
FAILED=0

if ! "$PYTHON" -c 'import sys, torch; sys.exit(0 if torch.cuda.is_available() else 1)'; then
  echo "error: $PYTHON sees no CUDA device" >&2
  exit 1
fi
"$PYTHON" -c 'import torch; p = torch.cuda.get_device_properties(0); print(f"{p.name}, {p.total_memory / 2**30:.0f} GiB, torch {torch.__version__}, CUDA {torch.version.cuda}")'

wanted() { [[ " $STEPS " == *" $1 "* ]]; }

run_step() {  # name command...: run it, keep its output in OUT_DIR/name.log, record exit status and seconds
  local name=$1 start=$SECONDS rc
  shift
  echo
  echo "=== $name: $*"
  "$@" 2>&1 | tee "$OUT_DIR/$name.log"
  rc=${PIPESTATUS[0]}
  [ "$rc" = 0 ] || FAILED=1
  printf '%s\t%s\t%s\n' "$name" "$rc" "$((SECONDS - start))" >> "$OUT_DIR/steps.tsv"
}

if wanted gpu-tests; then
  # shellcheck disable=SC2086
  run_step gpu-tests "$PYTHON" -m pytest -q -p no:cacheprovider -m gpu -rs $GPU_TESTS
fi
if wanted triton-tests; then
  TRITON_TESTS=(tests/model/test_triton_attention.py tests/model/test_fused_kernels.py tests/model/test_triton_int8.py
                tests/model/test_triton_linear.py tests/model/test_quantization.py tests/sampling/test_triton_argmax.py)
  if [ -f "${TRITON_TESTS[0]}" ]; then
    run_step triton-tests "$PYTHON" -m pytest -q -p no:cacheprovider -rs "${TRITON_TESTS[@]}"
  else
    echo "triton-tests: ${TRITON_TESTS[0]} is missing" >&2
    printf 'triton-tests\tmissing\t0\n' >> "$OUT_DIR/steps.tsv"
    FAILED=1
  fi
fi
if wanted parity; then
  run_step parity "$PYTHON" benchmarks/gpu_parity.py --json "$OUT_DIR/parity.json"
fi
if wanted decode || wanted throughput || wanted overhead || wanted serving; then
  [ -f "$MODEL_8B/config.json" ] || "$PYTHON" -m llmserve.cli make-model "$MODEL_8B" --size 8b
fi
if wanted linear-one-row; then
  run_step linear-one-row "$PYTHON" benchmarks/gpu_linear.py --rows 1 --weights "$LINEAR_WEIGHTS" --json "$OUT_DIR/linear-one-row.json"
  [ -f "$OUT_DIR/linear-one-row.json" ] && LINEAR_CONFIGS=${LINEAR_CONFIGS:-$OUT_DIR/linear-one-row.json}
fi
if wanted decode; then
  run_step decode "$PYTHON" benchmarks/gpu_decode.py --model "$MODEL_8B" --variants "$DECODE_VARIANTS" \
    --modes "$DECODE_MODES" --profile ${LINEAR_CONFIGS:+--linear-configs "$LINEAR_CONFIGS"} --json "$OUT_DIR/decode.json"
fi
if wanted linear; then
  run_step linear "$PYTHON" benchmarks/gpu_linear.py --json "$OUT_DIR/linear.json"
fi
if wanted quality; then
  run_step quality "$PYTHON" benchmarks/quantization_quality.py --json "$OUT_DIR/quality.json"
fi
if wanted throughput; then
  run_step throughput "$PYTHON" benchmarks/gpu_throughput.py --model "$MODEL_8B" --num-prompts "$NUM_PROMPTS" \
    --hf-sample-batches "$HF_SAMPLE_BATCHES" --json "$OUT_DIR/throughput.json"
fi
if wanted overhead; then
  run_step overhead "$PYTHON" benchmarks/gpu_overhead.py --model "$MODEL_8B" --json "$OUT_DIR/overhead.json"
fi

if wanted serving; then
  SERVING=(--model "$MODEL_8B" --engine-args "--load-format dummy" --num-prompts "$NUM_PROMPTS"
           --input-len 100:1024 --output-len 100:1024 --rounds 1)
  run_step serving "$PYTHON" benchmarks/serve_vs_offline.py "${SERVING[@]}" --json "$OUT_DIR/serving.json"
  run_step serving-8rps "$PYTHON" benchmarks/serve_vs_offline.py "${SERVING[@]}" --server-only --request-rate 8 \
    --json "$OUT_DIR/serving-8rps.json"
fi

echo
"$PYTHON" benchmarks/gpu_summary.py "$OUT_DIR"
exit $FAILED
