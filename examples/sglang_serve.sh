#!/usr/bin/env bash
# An OpenAI-compatible SGLang server with dyntree tree speculation (needs a GPU; query it with
# `python examples/openai_client.py PROMPT --base-url http://127.0.0.1:30000/v1`).
#
#   bash examples/sglang_serve.sh [extra sglang.launch_server flags...]
#
# MODEL (default: SmolLM2 from `dyntree model-path`), PORT (30000), PYTHON (python) and
# DYNTREE_SGLANG_CONFIG (default: examples/sglang_options.json, the options SGLang has no flag for)
# come from the environment. SGLang's own flags set the budget: 17 verify slots per request (the
# root + 16 draft nodes), depth <= 8, <= 4 children per node.
set -euo pipefail
HERE="$(cd "$(dirname "$0")" && pwd)"
PYTHON="${PYTHON:-python}"
MODEL="${MODEL:-$("$PYTHON" -m dyntree model-path smollm2)}"
export DYNTREE_SGLANG_CONFIG="${DYNTREE_SGLANG_CONFIG:-$HERE/sglang_options.json}"
exec "$PYTHON" -m sglang.launch_server --model-path "$MODEL" --port "${PORT:-30000}" \
  --speculative-algorithm DYNTREE --speculative-num-draft-tokens 17 --speculative-num-steps 8 \
  --speculative-eagle-topk 4 --attention-backend triton "$@"
