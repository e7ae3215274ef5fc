#!/usr/bin/env bash
# GPU check of the weight-update modes and vLLM's weight-transfer path (under 10 minutes): vLLM (or the torch
# engine where vLLM does not import) on one GPU with a ~400M-parameter Llama built locally, 256 answers in
# flight with long-tailed lengths up to 4096 tokens, new weights every 8 s; prints generation tokens/s for
# keep_kv, recompute and drain across 4 loads each and writes JSON. Needs python3 with CUDA torch,
# transformers and safetensors.
#
#   bash benchmarks/gpu_weight_loads.sh [OUT_DIR]   # OUT_DIR defaults to $OUT or benchmarks/results
# Never blocks anything: CI does not run it; run it whenever a GPU machine is lent.
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$ROOT"
PY="${PYTHON:-python3}"
OUT_DIR="${1:-${OUT:-$ROOT/benchmarks/results}}"
mkdir -p "$OUT_DIR"
"$PY" -c "import torch, sys; sys.exit(0 if torch.cuda.is_available() else 'no CUDA GPU visible to torch')"
engine=torch
"$PY" -c "import vllm" 2>/dev/null && engine=vllm
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader || true
export PYTHONUNBUFFERED=1
# 256 answers x mean 683 tokens of a 24-layer, 1024-wide model: about 17 GiB of KV cache in bf16
timeout 280 "$PY" benchmarks/weight_loads.py --engine "$engine" --device cuda --dtype bfloat16 --hidden 1024 \
  --layers 24 --heads 16 --max-new 4096 --in-flight 256 --period-s 8 --loads 4 --repeats 1 --kv-cache-gib 40 \
  --out "$OUT_DIR/weight_loads_gpu.json"
# vLLM's weight-transfer path (issue 50): a TP 1 and, with 3 GPUs, a TP 2 generator of a ~0.9B-parameter Llama
# receive 4 versions from a trainer process on a GPU of its own (NCCL wants one rank per GPU) through vLLM's nccl
# engine, two of them mid-answer (keep_kv); prints sync s/GB, whether every checksum and every token's version
# (vLLM's stamp) equals what was sent, and tokens/s. One GPU: skipped with a line saying so
if [[ "$engine" == vllm ]]; then
  timeout 280 "$PY" benchmarks/vllm_transfer.py --device cuda --dtype bfloat16 --tp 1 2 --hidden 2048 --layers 16 \
    --heads 16 --requests 256 --max-new 512 --load-every 64 --kv-cache-gib 20 --out "$OUT_DIR/vllm_transfer_gpu.json"
fi
