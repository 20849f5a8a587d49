"""vLLM offline inference with dyntree tree speculation: one ``speculative_config`` switch.

    python examples/vllm_offline.py [--model DIR] [--max-tokens 64]

Needs vLLM 0.32 with dyntree installed beside it (README.md, "Quick start 2: vLLM"); vLLM finds the
plugin through its entry point. Without ``--model`` it serves SmolLM2 from ``dyntree model-path``.
"""

from __future__ import annotations

import argparse

from vllm import LLM, SamplingParams

PROMPTS = ["Write a python function that returns the n-th fibonacci number.",
           "Name three uses of a binary search tree."]


def main(model: str, max_tokens: int) -> None:
    llm = LLM(model=model, max_model_len=1024, disable_log_stats=False,
              speculative_config={"method": "dyntree", "drafter": "ngram", "num_speculative_tokens": 16})
    chats = [[{"role": "user", "content": p}] for p in PROMPTS]
    for out in llm.chat(chats, SamplingParams(temperature=0, max_tokens=max_tokens), use_tqdm=False):
        print(out.outputs[0].text.strip(), end="\n---\n")
    counters = ("vllm:spec_decode_num_drafts", "vllm:spec_decode_num_draft_tokens", "vllm:spec_decode_num_accepted_tokens")
    print({m.name: m.value for m in llm.get_metrics() if m.name in counters})  # vLLM's own spec-decode counters


if __name__ == "__main__":  # vLLM starts engine processes that re-import this file
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default=None, help="HF checkpoint directory (default: SmolLM2 via dyntree)")
    p.add_argument("--max-tokens", type=int, default=64)
    a = p.parse_args()
    if a.model is None:
        from dyntree.models import model_path

        a.model = str(model_path("smollm2"))
    main(a.model, a.max_tokens)
