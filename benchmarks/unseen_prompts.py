"""Write the training prompts a Hydra checkpoint never saw, to measure its acceptance on them.

``train-heads --gen-minutes M`` generates its batches in a seeded order and stops after the first
``n``; the checkpoint's ``config.json`` records the command's data settings and how many
responses were made. This script rebuilds the same batches (same prompt draw, chat-template
encoding, length filter, sort and batch order as :func:`dyntree.training.data.generate_cache`),
finds the ``n`` whose sizes add up to the recorded responses, and writes the prompts of the other
batches (minus any text that also occurs in a generated batch) as JSONL. Those prompts come from
the training sets' distribution but none of them, nor its response, reached the heads.

Run: ``python benchmarks/unseen_prompts.py --heads dyntree/assets/hydra-smollm2 --data
../shared/data/train/dolly15k_prompts.jsonl ../shared/data/train/gpteacher_code_roleplay.jsonl
--out unseen.jsonl`` (``--data`` in the order the checkpoint's command named them).
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import numpy as np
from transformers import AutoTokenizer

from dyntree.common.hydra_checkpoint import read_config
from dyntree.models import model_path
from dyntree.training.data import encode_prompt, read_prompts


def unseen_prompts(training: dict, data: list[str], tokenizer) -> list[str]:
    """The prompts of the batches a ``train-heads`` run with record ``training`` did not generate."""
    gen = training["generation"]
    prompts = read_prompts(data, training["prompts"], training["seed"])
    encoded = [(len(e), p) for p, e in ((p, encode_prompt(tokenizer, p)) for p in prompts)
               if len(e) <= gen["max_prompt_tokens"]]
    encoded.sort(key=lambda t: t[0])  # stable, as generate_cache sorts
    size = gen["batch_size"]
    batches = [[p for _, p in encoded[i:i + size]] for i in range(0, len(encoded), size)]
    order = np.random.default_rng(len(batches)).permutation(len(batches)).tolist()
    done, made = 0, 0
    while made < training["responses"]:
        made += len(batches[order[done]])
        done += 1
    if made != training["responses"]:
        raise SystemExit(f"the first batches of the order hold {made} prompts, the checkpoint records "
                         f"{training['responses']} responses: other data or settings than its command's")
    seen = {p for b in order[:done] for p in batches[b]}
    return [p for b in order[done:] for p in batches[b] if p not in seen]


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--heads", required=True, help="Hydra checkpoint directory")
    ap.add_argument("--data", nargs="+", required=True, help="the checkpoint's training prompt files, in its order")
    ap.add_argument("--model", default="smollm2")
    ap.add_argument("--out", required=True)
    args = ap.parse_args()
    training = read_config(args.heads).training
    names = [Path(d).name for d in args.data]
    if names != training.get("data"):
        raise SystemExit(f"--data names {names}, the checkpoint was trained on {training.get('data')}")
    unseen = unseen_prompts(training, args.data, AutoTokenizer.from_pretrained(model_path(args.model)))
    Path(args.out).write_text("".join(json.dumps({"prompt": p}) + "\n" for p in unseen))
    print(f"{len(unseen)} prompts the heads never saw -> {args.out}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
