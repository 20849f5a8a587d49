"""`dyntree bench`: plain decoding and speculative modes side by side on a prompt file.

Every mode runs through the same :class:`SpecEngine` (mode ``none`` = the ``none`` drafter), on
the same prompts, batch size and dtype, so tokens/s, tau and outputs are directly comparable.
The result is one JSON document (schema in README.md).
"""

from __future__ import annotations

import json
import platform
import time
from dataclasses import dataclass
from datetime import datetime, timezone
from pathlib import Path
from typing import Any, Sequence

import torch
from tqdm.auto import tqdm

from dyntree.common.config import SamplingParams, SpecConfig
from dyntree.common.drafter import make_drafter
from dyntree.standalone.engine import RequestOutput, SpecEngine

__all__ = ["Prompt", "load_prompts", "encode_prompt", "run_bench", "MODES"]

MODES = ("none", "dyntree")


@dataclass(frozen=True)
class Prompt:
    id: Any
    text: str
    category: str | None = None


def load_prompts(path: str | Path, limit: int | None = None, categories: Sequence[str] | None = None) -> list[Prompt]:
    """Read a JSONL prompt file: text from ``turns`` (first turn), ``prompt`` or ``question``;
    id from ``id``, ``question_id`` or ``task_id`` (else the line number)."""
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"prompt file {path} does not exist")
    prompts: list[Prompt] = []
    with path.open() as f:
        for lineno, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                rec = json.loads(line)
            except json.JSONDecodeError as exc:
                raise ValueError(f"{path}:{lineno}: not valid JSON ({exc.msg})") from None
            if "turns" in rec and rec["turns"]:
                text = rec["turns"][0]
            elif "prompt" in rec:
                text = rec["prompt"]
            elif "question" in rec:
                text = rec["question"]
            else:
                raise ValueError(f"{path}:{lineno}: a prompt line needs `turns`, `prompt` or `question`")
            if not isinstance(text, str) or not text:
                raise ValueError(f"{path}:{lineno}: the prompt text is empty or not a string")
            pid = next((rec[k] for k in ("id", "question_id", "task_id") if k in rec), lineno)
            cat = rec.get("category")
            if categories and cat not in categories:
                continue
            prompts.append(Prompt(pid, text, cat))
            if limit is not None and len(prompts) >= limit:
                break
    if not prompts:
        what = f" in categories {list(categories)}" if categories else ""
        raise ValueError(f"prompt file {path} holds no prompts{what}")
    return prompts


def encode_prompt(tokenizer, text: str, chat: bool) -> list[int]:
    """Token ids for ``text``; with ``chat``, wrapped in the model's chat template."""
    if chat:
        text = tokenizer.apply_chat_template([{"role": "user", "content": text}], tokenize=False, add_generation_prompt=True)
        return tokenizer(text, add_special_tokens=False).input_ids
    return tokenizer(text).input_ids


def _versions() -> dict[str, str]:
    import transformers

    import dyntree

    return {"dyntree": dyntree.__version__, "torch": torch.__version__,
            "transformers": transformers.__version__, "python": platform.python_version()}


def _device() -> str:
    if torch.cuda.is_available():
        return torch.cuda.get_device_name(0)
    return f"cpu ({platform.machine()}, {torch.get_num_threads()} threads)"


def _summarise(mode: str, drafter: str, outs: list[RequestOutput], wall: float) -> dict[str, Any]:
    steps = sum(o.steps for o in outs)
    tokens = sum(len(o.token_ids) for o in outs)
    depth = max((len(o.accepted_per_depth) for o in outs), default=0)
    per_depth = [sum(o.accepted_per_depth[d] for o in outs if d < len(o.accepted_per_depth)) / max(steps, 1)
                 for d in range(depth)]
    return {
        "mode": mode,
        "drafter": drafter,
        "tokens": tokens,
        "steps": steps,
        "wall_s": round(wall, 3),
        "tokens_per_s": round(tokens / wall, 3) if wall > 0 else 0.0,
        "tau": round(tokens / steps, 4) if steps else 0.0,
        "accepted_per_depth": [round(x, 4) for x in per_depth],
        "draft_nodes_per_step": round(sum(o.draft_nodes for o in outs) / max(steps, 1), 3),
        "outputs": [{"id": o.request_id, "token_ids": o.token_ids} for o in outs],
    }


def run_bench(
    model,
    tokenizer,
    prompts: Sequence[Prompt],
    modes: Sequence[str],
    drafter: str,
    spec: SpecConfig,
    params: SamplingParams,
    batch_size: int,
    chat: bool,
    model_name: str,
    dtype: str,
) -> dict[str, Any]:
    """Run every mode over ``prompts`` and return the result document."""
    bad = [m for m in modes if m not in MODES]
    if bad or not modes:
        raise ValueError(f"unknown mode(s) {bad}; choose from {', '.join(MODES)}")
    if batch_size < 1:
        raise ValueError(f"batch size must be >= 1, got {batch_size}")
    encoded = [encode_prompt(tokenizer, p.text, chat) for p in prompts]
    ids = [p.id for p in prompts]
    category = {p.id: p.category for p in prompts}
    runs = []
    for mode in modes:
        name = "none" if mode == "none" else drafter
        engine = SpecEngine(model, tokenizer, make_drafter(name, model=model, tokenizer=tokenizer), spec)
        outs: list[RequestOutput] = []
        start = time.perf_counter()
        for i in tqdm(range(0, len(encoded), batch_size), desc=f"bench {mode}", unit="batch"):
            outs += engine.generate(encoded[i : i + batch_size], params, ids[i : i + batch_size])
        wall = time.perf_counter() - start
        run = _summarise(mode, name, outs, wall)
        run["draft_s"] = round(engine.timing["draft_s"], 3)
        run["verify_s"] = round(engine.timing["verify_s"], 3)
        run["by_category"] = {
            cat: _summarise(mode, name, [o for o in outs if category[o.request_id] == cat], wall)["tau"]
            for cat in sorted({c for c in category.values() if c is not None})
        }
        runs.append(run)
    base = next((r for r in runs if r["mode"] == "none"), None)
    for run in runs:
        if base is None:
            run["identical_to_none"] = None
            run["speedup"] = None
            continue
        ref = {o["id"]: o["token_ids"] for o in base["outputs"]}
        same = [o["token_ids"] == ref[o["id"]] for o in run["outputs"]]
        run["identical_to_none"] = round(sum(same) / len(same), 4)
        run["speedup"] = round(run["tokens_per_s"] / base["tokens_per_s"], 4) if base["tokens_per_s"] else None
    return {
        "date": datetime.now(timezone.utc).isoformat(timespec="seconds"),
        "device": _device(),
        "versions": _versions(),
        "model": model_name,
        "dtype": dtype,
        "batch_size": batch_size,
        "chat": chat,
        "num_prompts": len(prompts),
        "spec": spec.model_dump(),
        "sampling": params.model_dump(),
        "runs": runs,
    }
