#!/usr/bin/env bash
# GPU check (under 15 minutes): the DeepSpeed training engine and the torch generation engine (and vLLM,
# where importable) on one GPU, with a ~400M-parameter Llama built locally; prints tokens/s for each and
# writes JSON. Self-contained: it needs python3 with CUDA torch, transformers and safetensors, and takes
# DeepSpeed from the environment or from wheels carried in .whl/ (no network on GPU machines here).
#
#   bash benchmarks/gpu_check.sh --fetch     # on a machine with PyPI: put DeepSpeed + its deps in .whl/
#   bash benchmarks/gpu_check.sh [OUT_DIR]   # on the GPU machine (OUT_DIR defaults to $OUT or benchmarks/results)
# Never blocks anything: CI does not run it; run it whenever a GPU machine is lent.
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$ROOT"
PY="${PYTHON:-python3}"

if [[ "${1:-}" == "--fetch" ]]; then
  # DeepSpeed is an sdist (built there against the local torch); the rest are wheels for CPython 3.12
  mkdir -p .whl
  "$PY" -m pip download --no-deps --no-binary deepspeed -d .whl deepspeed==0.19.8
  # the GPU machine's Python (3.12 on the lent H200s); pydantic and pydantic-core resolved together
  "$PY" -m pip download --only-binary=:all: --python-version "${GPU_PYTHON:-3.12}" --implementation cp \
    --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 --platform manylinux_2_28_x86_64 -d .whl \
    hjson py-cpuinfo "pydantic>=2,<3" einops msgpack psutil ninja
  echo "[gpu_check] wheels in .whl/: carry it to the GPU machine"
  exit 0
fi

OUT_DIR="${1:-${OUT:-$ROOT/benchmarks/results}}"
mkdir -p "$OUT_DIR"
"$PY" -c "import torch, sys; sys.exit(0 if torch.cuda.is_available() else 'no CUDA GPU visible to torch')"
if ! "$PY" -c "import deepspeed" 2>/dev/null; then
  if compgen -G ".whl/*" >/dev/null; then
    "$PY" -m pip install -q --no-index --no-deps --no-build-isolation --target /tmp/areal-site .whl/*
    export PYTHONPATH="/tmp/areal-site${PYTHONPATH:+:$PYTHONPATH}"
    "$PY" -c "import deepspeed" || { echo "[gpu_check] DeepSpeed from .whl/ does not import (above)" >&2; exit 2; }
  else
    echo "[gpu_check] DeepSpeed is not installed here; run 'bash benchmarks/gpu_check.sh --fetch' where PyPI is reachable and carry .whl/" >&2
    exit 2
  fi
fi
gen=torch
"$PY" -c "import vllm" 2>/dev/null && gen=torch,vllm
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader || true
# ~400M parameters: hidden 1024, 24 layers, MLP 4096; 512 sequences x 256 new tokens; bf16
export PYTHONUNBUFFERED=1
timeout 280 "$PY" benchmarks/engines.py --device cuda --dtype bfloat16 --hidden 1024 --layers 24 --heads 16 \
  --prompts 64 --samples 8 --max-new 256 --gen "$gen" --train deepspeed,torch --zero-stage 2 \
  --tokens-per-mb 16384 --kv-cache-gib 16 --repeats 2 --out "$OUT_DIR/gpu_check.json"
# one PPO step of a Qwen2.5-1.5B-shaped model (vocabulary 151,936, 28 layers, random weights) on 32k
# tokens per micro-batch, packed and padded, with DeepSpeed ZeRO-2 bf16 and with the torch engine
model="$OUT_DIR/qwen2.5-1.5b-shaped"
for engine in deepspeed torch; do
  timeout 290 "$PY" benchmarks/train_memory.py --device cuda --bf16 --hidden 1536 --layers 28 --heads 12 \
    --budgets 32768 --equal-budget 0 --big-chunk 0 --engine "$engine" --optimizer-step --checkpointing \
    --mem-limit-gib 0 --keep-model "$model" --out "$OUT_DIR/train_memory_gpu_$engine.json"
done
