"""``dyntree train-heads``: generate self-distillation data with the target, cache its hidden
states, train Hydra heads and write a checkpoint directory.

The main CLI wires this in with :func:`add_train_heads_parser`; ``python -m dyntree.training.cli``
runs the same subcommand on its own.
"""

from __future__ import annotations

import argparse
import json
import shlex
import sys
import time
from pathlib import Path

import torch

__all__ = ["add_train_heads_parser", "run_train_heads", "main"]


def add_train_heads_parser(subparsers: argparse._SubParsersAction) -> argparse.ArgumentParser:
    p = subparsers.add_parser(
        "train-heads",
        help="train Hydra draft heads by self-distillation from a target model",
        description="The target answers the training prompts (greedy, cached), its last hidden "
        "states are cached on disk, and K heads learn its soft labels at offsets 1..K.",
    )
    p.add_argument("--model", required=True, help="target model (smollm2, a HF directory or hub id)")
    p.add_argument("--data", required=True, nargs="+", help="jsonl file(s) with a 'prompt' field")
    p.add_argument("--out", required=True, help="checkpoint directory to write")
    p.add_argument("--heads", type=int, default=4, help="number of heads K (default 4)")
    p.add_argument("--layers", type=int, default=1, help="residual layers per head (default 1)")
    p.add_argument("--layer-width", type=int, default=1,
                   help="inner width of each residual layer in multiples of the hidden size: 1 = "
                   "z + silu(W z) (default), m > 1 = z + W_down silu(W_up z) with m * hidden rows")
    p.add_argument("--vocab-size", type=int, default=8192,
                   help="reduced output vocabulary (most frequent tokens of the data); 0 = full LM head")
    p.add_argument("--independent", action="store_true",
                   help="Medusa-style ablation: heads do not see the drafted tokens")
    p.add_argument("--prefix-attention", action="store_true",
                   help="Hydra++: one decoder layer over the target's hidden states of the whole prefix "
                   "feeds the heads (trained on windows of --window positions)")
    p.add_argument("--prefix-heads", type=int, default=0,
                   help="attention heads of the prefix layer (default: hidden size / 64, or 1)")
    p.add_argument("--window", type=int, default=64,
                   help="with --prefix-attention: positions per training window (a batch holds "
                   "--batch-size / --window windows)")
    p.add_argument("--prompt-positions", action="store_true",
                   help="also train on the prompts' positions (the target's distribution over the prompt "
                   "text, after the chat template's fixed header): more positions from the same cache (1.57x "
                   "for the shipped heads' data; it did not help them); held-out scores stay on responses")
    p.add_argument("--init-from", default=None,
                   help="start from a trained checkpoint's weights and reduced vocabulary (same heads and "
                   "layers; e.g. add --prefix-attention to trained heads, or go on learning from a new "
                   "--cache-dir of freshly generated responses)")
    p.add_argument("--train-fraction", type=float, default=1.0,
                   help="train on a seeded random share (0-1] of the cached training sequences, for data-scaling "
                        "studies (held-out sequences unchanged; default 1)")
    p.add_argument("--loss", default="soft",
                   help="distillation labels: soft (the target's whole softmax, default), hard (its top-1 "
                        "token), topK (its K most likely tokens renormalised, e.g. top8)")
    p.add_argument("--train-dtype", default="fp32", choices=("fp32", "bf16"),
                   help="bf16: the training forward under autocast (fp32 weights and optimiser; faster on a CPU "
                        "with native bf16); the checkpoint is saved as usual")
    p.add_argument("--steps", type=int, default=1500)
    p.add_argument("--batch-size", type=int, default=128)
    p.add_argument("--lr", type=float, default=1e-3)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--prompts", type=int, default=640, help="training prompts to answer (default 640)")
    p.add_argument("--max-new-tokens", type=int, default=64)
    p.add_argument("--max-prompt-tokens", type=int, default=96, help="skip longer prompts")
    p.add_argument("--gen-batch-size", type=int, default=64)
    p.add_argument("--gen-dtype", default="fp32", help="target dtype while generating (fp32, bf16, fp16)")
    p.add_argument("--work-dir", default=None, help="training state and log (default $DYNTREE_CACHE/train-heads/<OUT name>)")
    p.add_argument("--cache-dir", default=None, help="generated data + hidden states (default WORK/cache)")
    p.add_argument("--gen-minutes", type=float, default=None,
                   help="stop generating after this many minutes and use the batches finished so far "
                   "(a random sample of the prompts); rerun with the same --cache-dir to resume")
    p.add_argument("--gen-batches", type=int, default=None,
                   help="generate only the first N batches of the seeded order (the same prompts on any "
                   "machine, unlike --gen-minutes); the rest stay unseen, e.g. for benchmarks/unseen_prompts.py; batches "
                   "already in --cache-dir stay")
    p.add_argument("--generate-only", action="store_true",
                   help="stop once the data cache is complete (generate in the background or on a GPU, "
                   "train later with the same --cache-dir)")
    p.add_argument("--measure-acceptance", action="store_true",
                   help="do not train: measure the --init-from heads' acceptance table on every cached "
                   "sequence (answers to prompts the heads never saw, e.g. from benchmarks/unseen_prompts.py; "
                   "a prefix layer sees each whole sequence) and write the checkpoint with it to --out")
    p.add_argument("--device", default="auto", help="auto, cpu or cuda[:N]")
    p.add_argument("--threads", type=int, default=0, help="CPU threads for torch (0 = torch default)")
    p.set_defaults(func=run_train_heads)
    return p


def run_train_heads(args: argparse.Namespace) -> int:
    from dyntree.common.hydra import HydraConfig, HydraHeads, HydraMismatchError, default_prefix_heads
    from dyntree.common.hydra_checkpoint import ACCEPTANCE_FILE, read_config, save_heads
    from dyntree.models import cache_root, load_model, parse_dtype, resolve_device
    from dyntree.training.data import generate_cache, read_prompts
    from dyntree.common.hydra import TargetIdentity
    from dyntree.standalone.target import hf_target
    from dyntree.training.trainer import (HeadData, TrainConfig, check_init, checkpoint_token_map, loss_top_k,
                                          measure_acceptance, reduced_token_map, train, warm_start)

    for name in ("heads", "layers", "steps", "batch_size", "prompts", "max_new_tokens", "gen_batch_size", "window"):
        if getattr(args, name) < 1:
            raise SystemExit(f"--{name.replace('_', '-')} must be >= 1, got {getattr(args, name)}")
    if args.gen_batches is not None and args.gen_batches < 1:
        raise SystemExit(f"--gen-batches must be >= 1, got {args.gen_batches}")
    if args.prefix_heads and not args.prefix_attention:
        raise SystemExit("--prefix-heads needs --prefix-attention")
    if args.prompt_positions and args.prefix_attention:
        raise SystemExit("--prompt-positions does not combine with --prefix-attention (its windows are scored "
                         "on responses only)")
    if not 0 < args.train_fraction <= 1:
        raise SystemExit(f"--train-fraction must be in (0, 1], got {args.train_fraction}")
    try:
        loss_top_k(args.loss)
    except ValueError as exc:
        raise SystemExit(f"--{exc}") from None
    if args.measure_acceptance and not args.init_from:
        raise SystemExit("--measure-acceptance needs --init-from (the heads to measure)")
    init = None
    if args.init_from:
        try:
            init = read_config(args.init_from)
        except (HydraMismatchError, ValueError) as exc:
            raise SystemExit(f"--init-from: {exc}") from None
    if args.threads:
        torch.set_num_threads(args.threads)
    torch.manual_seed(args.seed)
    out = Path(args.out)
    work = Path(args.work_dir) if args.work_dir else cache_root() / "train-heads" / out.name
    cache_dir = Path(args.cache_dir) if args.cache_dir else work / "cache"
    device = resolve_device(args.device)
    t0 = time.time()

    model, tok = load_model(args.model, parse_dtype(args.gen_dtype))
    model.to(device)
    target = hf_target(model, tok, args.model)
    identity = TargetIdentity.of(target)
    prefix_heads = (args.prefix_heads or default_prefix_heads(identity.hidden_size)) if args.prefix_attention else 0
    arch = {"num_heads": args.heads, "num_layers": args.layers, "hidden_size": identity.hidden_size,
            "target": identity, "independent": args.independent, "reduced_vocab": args.vocab_size,
            "prefix_attention": args.prefix_attention, "prefix_heads": prefix_heads,
            "layer_width": args.layer_width}
    try:
        planned = HydraConfig(**arch)  # refuse a bad architecture before generating data
    except HydraMismatchError as exc:
        raise SystemExit(str(exc)) from None
    if init is not None and not args.measure_acceptance:
        try:
            check_init(init, planned, args.init_from)  # likewise a checkpoint that cannot seed this run
        except HydraMismatchError as exc:
            raise SystemExit(f"--init-from: {exc}") from None
    prompts = read_prompts(args.data, args.prompts, args.seed)
    cache = generate_cache(model, tok, prompts, cache_dir, batch_size=args.gen_batch_size,
                           max_new_tokens=args.max_new_tokens, max_prompt_tokens=args.max_prompt_tokens,
                           time_budget_s=args.gen_minutes * 60 if args.gen_minutes is not None else None,
                           max_batches=args.gen_batches)
    t_gen = time.time() - t0
    print(f"data: {cache.meta['sequences']} responses, {cache.meta.get('response_tokens', cache.meta['tokens'])} "
          f"response tokens ({t_gen:.0f} s)", file=sys.stderr)
    if args.generate_only:
        return 0

    embed, lm_head = target.embed, target.lm_head
    if args.measure_acceptance:
        return _measure_only(args, identity, embed, lm_head, cache, device, t0)
    vocab = identity.vocab_size
    if args.init_from:  # the checkpoint's reduced vocabulary, also when this cache is new data
        token_map = checkpoint_token_map(args.init_from)
    else:
        token_map = reduced_token_map(cache.token_counts(vocab), args.vocab_size) if args.vocab_size else None
    command = "dyntree train-heads " + " ".join(shlex.quote(a) for a in sys.argv[sys.argv.index("train-heads") + 1:]) \
        if "train-heads" in sys.argv else " ".join(shlex.quote(a) for a in sys.argv)
    cfg = HydraConfig(
        **arch,
        training={"command": command, "data": [Path(d).name for d in args.data], "prompts": args.prompts,
                  "responses": cache.meta["sequences"],
                  "tokens": cache.meta.get("response_tokens", cache.meta["tokens"]),
                  "generation": cache.meta["settings"] | {"dtype": args.gen_dtype}, "steps": args.steps,
                  "batch_size": args.batch_size, "lr": args.lr, "seed": args.seed,
                  **({"window": args.window} if args.prefix_attention else {}),
                  **({"prompt_positions": True} if args.prompt_positions else {}),
                  **({"loss": args.loss} if args.loss != "soft" else {}),
                  **({"train_dtype": args.train_dtype} if args.train_dtype != "fp32" else {}),
                  **({"train_fraction": args.train_fraction} if args.train_fraction < 1 else {}),
                  **({"init_from": args.init_from} if args.init_from else {})},
    )
    heads = HydraHeads(cfg, embed.float().to(device), lm_head.float().to(device),
                       token_map.to(device) if token_map is not None else None).to(device)
    if args.init_from:
        try:
            warm_start(heads, args.init_from)
        except HydraMismatchError as exc:
            raise SystemExit(f"--init-from: {exc}") from None
    del model
    data = HeadData(cache, args.heads, val_fraction=0.02, seed=args.seed, device=device,
                    prompt_positions=args.prompt_positions, train_fraction=args.train_fraction)
    tcfg = TrainConfig(steps=args.steps, batch_size=args.batch_size, lr=args.lr, seed=args.seed, window=args.window,
                       loss=args.loss, autocast=args.train_dtype)
    result = train(heads, data, tcfg, work)
    heads.config.training.update({"val": result["val"], "wall_s": round(time.time() - t0, 1)})
    save_heads(heads, out, torch.float16)
    table = measure_acceptance(heads, data)
    table.save(out / ACCEPTANCE_FILE)
    print(json.dumps({"out": str(out), "val": result["val"], "wall_s": round(time.time() - t0, 1)}))
    return 0


def _measure_only(args: argparse.Namespace, identity, embed: torch.Tensor, lm_head: torch.Tensor, cache,
                  device: torch.device, t0: float) -> int:
    """``--measure-acceptance``: the --init-from checkpoint, unchanged, with an acceptance table
    measured on every cached sequence, written to --out."""
    import shutil

    from dyntree.common.hydra_checkpoint import ACCEPTANCE_FILE, load_heads
    from dyntree.training.trainer import HeadData, measure_acceptance

    heads = load_heads(args.init_from, identity, embed.float(), lm_head.float(), torch.float32, device)
    data = HeadData(cache, heads.num_heads, val_fraction=1.0, seed=args.seed, device=device)
    source = (f"{cache.meta['sequences']} responses to prompts the heads never saw "
              f"({', '.join(Path(d).name for d in args.data)})")
    table = measure_acceptance(heads, data, source=source)
    out, src = Path(args.out), Path(args.init_from)
    out.mkdir(parents=True, exist_ok=True)
    if out.resolve() != src.resolve():
        for f in src.iterdir():
            if f.is_file() and f.name != ACCEPTANCE_FILE:
                shutil.copy2(f, out / f.name)
    table.save(out / ACCEPTANCE_FILE)
    print(json.dumps({"out": str(out), "acceptance": table.source, "wall_s": round(time.time() - t0, 1)}))
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="dyntree")
    sub = parser.add_subparsers(dest="command", required=True)
    add_train_heads_parser(sub)
    args = parser.parse_args(argv)
    return args.func(args)


if __name__ == "__main__":
    raise SystemExit(main())
