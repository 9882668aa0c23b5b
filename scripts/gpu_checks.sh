#!/usr/bin/env bash
# What only a lent GPU shows, as one call with its own timeouts (at most 10 minutes; 3.5 on an H200): the
# CUDA tests, then the speed round's decode goals (benchmarks/decode_floor.py: the compiled decode at batch 64
# and 2k new tokens against its memory-traffic floor and against transformers' generate). Needs
# `.gpu/smollm2-shape`, written here by `python benchmarks/decode_floor.py --save-shape .gpu/smollm2-shape` and
# carried to the GPU machine. Results go under $OUT (default /tmp/gpu_checks).
set -u
cd "$(dirname "$0")/.."
OUT=${OUT:-/tmp/gpu_checks}
mkdir -p "$OUT"
export PYTHONPATH=${PYTHONPATH:-}:$PWD
nvidia-smi --query-gpu=name,memory.total --format=csv | tee "$OUT/gpu.txt"
timeout 270 python -m pytest -q -m cuda -p no:cacheprovider --durations=8 2>&1 | tee "$OUT/pytest_cuda.txt" | tail -30
timeout 330 python benchmarks/decode_floor.py --device cuda --model .gpu/smollm2-shape --random-weights \
    --out "$OUT/rollout_gpu_floor.json" 2>&1 | tee "$OUT/decode_floor.txt" | tail -20
