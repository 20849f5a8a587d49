"""The ``hydra`` drafter: trained Hydra heads score the tree builder's frontiers, one batched head
forward per depth.

Spec: ``hydra[:OPTIONS]`` where OPTIONS is a comma-separated list of a checkpoint directory
(default: the heads shipped for SmolLM2 in ``dyntree/assets/hydra-smollm2``), ``width=W`` /
``topk=T`` settings of its own (``beam``) trees: at every depth each frontier node offers head
``d``'s top-``T`` tokens and the ``W`` best by cumulative head probability become the next
frontier; ``W`` defaults to ``ceil(max_nodes / depth)`` so the node budget is spread evenly over the
depths, ``T`` to ``W``; and ``table=off`` to ignore the checkpoint's measured acceptance table
(``acceptance.json``, the dynamic tree's calibration; an ablation); and ``int8=on|off``: run the
heads' output-row product on int8 weights (fp32 heads: an int8 GEMM; bf16 heads: the engine's
weight-only kernel, ``TargetInfo.weight_kernel``, the standalone engine's on a CPU), and where the
engine offers that kernel the heads' and the prefix layer's linears with int8 weights too
(:meth:`~dyntree.common.hydra.HydraHeads.use_int8`; default on where the heads run on a CPU in fp32
with torch's FBGEMM engine or in bf16 with the kernel; it changes the drafts slightly, never the
output); ``context=N``: a request's prefix layer, when it starts (its first draft, or after the
engine skipped positions), reads only the last ``N`` committed positions (default
:data:`PREFIX_CONTEXT`; ``0``: all of them). Trees are at most ``num_heads`` deep.

Head ``d`` reads the target's last-layer hidden state at the token before the root (pushed by the
engine through :meth:`HydraDrafter.observe_hidden`) and the embeddings of the path's tokens. Heads
with prefix attention (Hydra++) keep each request's prefix-layer KV cache: the states pushed since
the last step are run through the layer in one batched forward at the step's first ``expand``,
and the layer's output at the newest position feeds the heads; :meth:`release` drops the cache.
A request that starts (its first draft) or resumes after more idle steps than one step commits
positions catches up in a batched forward of its own, timed apart (:meth:`HydraDrafter.catch_up` says how many positions
each request has to catch up, :meth:`HydraDrafter.pop_catch_up` what it cost: a one-time cost per
committed position, priced at the draft that pays it, not a cost of every step's drafts); one that
idled past ``context`` positions starts its layer over on the last ``context`` of them, so a
resume costs at most what a new request's start does.

Pure torch: the target's weights and identity arrive as a :class:`~dyntree.common.drafter.TargetInfo`.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Hashable, Sequence

import torch

from dyntree.common.drafter import Candidates, DraftRequest, Drafter, TargetInfo, top_candidates
from dyntree.common.calibration import AcceptanceTable
from dyntree.common.hydra import HydraHeads, PrefixKV, TargetIdentity
from dyntree.common.hydra_checkpoint import load_acceptance, load_heads
from dyntree.kernels.cpu_linear import LinearDispatch
from dyntree.kernels.cpu_weight_only import int8_available

if TYPE_CHECKING:
    from dyntree.common.builder import PartialTree
    from dyntree.common.config import SamplingParams

__all__ = ["HydraDrafter", "HydraOptions", "SHIPPED_HEADS", "make_hydra_drafter", "parse_hydra_options"]

#: The heads trained for SmolLM2-135M-Instruct that ship with the package.
SHIPPED_HEADS = Path(__file__).resolve().parents[2] / "assets" / "hydra-smollm2"

#: The most committed positions a request's prefix layer reads when it starts (its first draft, or
#: after the engine skipped positions): the last ones. The shipped heads were trained on windows of
#: 64 positions; reading a whole prompt costs one layer pass per prompt token and moved tau by
#: nothing measurable (``docs/measurements.md``).
PREFIX_CONTEXT = 64


@dataclass(frozen=True)
class HydraOptions:
    path: Path = SHIPPED_HEADS
    width: int | None = None
    topk: int | None = None
    table: bool = True
    int8: bool | None = None  # None: on a CPU, where the heads run in fp32 with FBGEMM or bf16 with a kernel
    context: int = PREFIX_CONTEXT


def parse_hydra_options(options: str | None) -> HydraOptions:
    """Parse ``PATH``, ``width=W``, ``topk=T``, ``context=N``, ``table=on|off``, ``int8=on|off``
    (comma separated, any order, all optional; ``context=0`` reads every position)."""
    path, ints, switches = SHIPPED_HEADS, {}, {}
    for item in (options or "").split(","):
        item = item.strip()
        if not item:
            continue
        key, eq, value = item.partition("=")
        if not eq:
            path = Path(item).expanduser()
            continue
        if key in ("table", "int8"):
            if value not in ("on", "off"):
                raise ValueError(f"hydra option {key}={value!r} must be 'on' or 'off'")
            switches[key] = value == "on"
            continue
        if key not in ("width", "topk", "context"):
            raise ValueError(f"hydra option {key!r} is unknown; use PATH, width=W, topk=T, context=N, table=on|off, "
                             "int8=on|off")
        try:
            ints[key] = int(value)
        except ValueError:
            raise ValueError(f"hydra option {key}={value!r} must be an integer") from None
        if ints[key] < (0 if key == "context" else 1):
            raise ValueError(f"hydra option {key} must be >= {0 if key == 'context' else 1}, got {ints[key]}")
    if not (path / "config.json").is_file():
        raise ValueError(f"hydra checkpoint {path} has no config.json (train one with `dyntree train-heads`)")
    return HydraOptions(path, ints.get("width"), ints.get("topk"), switches.get("table", True), switches.get("int8"),
                        ints.get("context", PREFIX_CONTEXT))


@dataclass
class _State:
    """One request's hidden states: rows pushed but not yet consumed (the first ``pending_rows``
    rows of storage kept for the request, see :meth:`HydraDrafter._append`), how many were pushed
    in all, the heads' current input, and (prefix attention) the prefix layer's cache."""

    rows: torch.Tensor | None = None
    pending_rows: int = 0
    pushed: int = 0
    last: torch.Tensor | None = None
    kv: PrefixKV | None = None

    def pending(self) -> torch.Tensor:
        """``[pending_rows, d]``: the rows pushed since the prefix layer last ran (a view)."""
        assert self.rows is not None
        return self.rows[: self.pending_rows]


class HydraDrafter(Drafter):
    """Drafts with :class:`~dyntree.common.hydra.HydraHeads` over the target's hidden states."""

    name = "hydra"
    needs_hidden = True

    def __init__(self, heads: HydraHeads, width: int | None = None, topk: int | None = None,
                 table: AcceptanceTable | None = None, context: int = PREFIX_CONTEXT) -> None:
        if context < 0:
            raise ValueError(f"hydra: context must be >= 0 (0: every position), got {context}")
        self.heads = heads.eval()
        self.context = context
        self.acceptance_table = table
        self.beam_width, self.beam_topk = width, topk
        self.max_depth = heads.num_heads
        self.device = heads.out_weight.device
        self.dtype = heads.out_weight.dtype
        self._state: dict[Hashable, _State] = {}
        self._catch_up = (0.0, 0)  # prefix-layer seconds and positions spent catching up since pop_catch_up

    def observe_hidden(self, request_id: Hashable, states: torch.Tensor, start: int | None = None) -> None:
        self._check_hidden(f"request {request_id!r}", states)
        if states.shape[0]:
            self._push(request_id, self._own(states), start)

    def observe_hidden_rows(self, request_ids: Sequence[Hashable], states: torch.Tensor,
                            starts: Sequence[int | None]) -> None:
        """The step's rows in one call; each request takes its row."""
        self._check_hidden(f"a step of {len(request_ids)} requests", states)
        if states.shape[0] != len(request_ids):
            raise ValueError(f"{len(request_ids)} requests but {states.shape[0]} rows of hidden states")
        rows = self._own(states)
        for i, (rid, start) in enumerate(zip(request_ids, starts)):
            self._push(rid, rows[i : i + 1], start)

    def _own(self, states: torch.Tensor) -> torch.Tensor:
        """``states`` on the drafter's device, in its dtype, never a view of the engine's forward
        output kept past the call: a copy where the heads keep a row as it is (no prefix layer);
        with a prefix layer :meth:`_append` copies the rows into the request's storage itself."""
        return states.to(self.device, self.dtype, copy=self.heads.prefix is None)

    def _check_hidden(self, whose: str, states: torch.Tensor) -> None:
        d = self.heads.config.hidden_size
        if states.dim() != 2 or states.shape[1] != d:
            raise ValueError(f"{whose}: hidden states of shape {tuple(states.shape)}; expected [n, {d}]")

    def _push(self, request_id: Hashable, rows: torch.Tensor, start: int | None) -> None:
        """The request's next committed positions' states ``rows`` (:meth:`_own`)."""
        s = self._state.setdefault(request_id, _State())
        if start is not None and start != s.pushed:
            # the engine skipped positions (a prefix-cache hit) or recomputes some (preemption) and
            # says where its rows start: plain heads read only the newest state; a prefix layer
            # starts over there, at those absolute positions (less context for the drafts, which
            # verification keeps lossless)
            if self.heads.prefix is not None:
                s.kv, s.pending_rows, s.last = None, 0, None
            s.pushed = start
        s.pushed += rows.shape[0]
        if self.heads.prefix is None:
            s.last = rows[-1]
            return
        if self.context and s.pending_rows + rows.shape[0] > self.context:
            s.kv = None  # idle past the context: the layer starts over on the last ``context`` positions
        self._append(s, rows)

    def _append(self, s: _State, rows: torch.Tensor) -> None:
        """Write ``rows`` after the request's pending rows, in place in storage kept for the
        request, so a decoding step's push leaves no allocation behind (small buffers that outlive
        every step fragment the allocator's heap: the engine's large per-step buffers then keep
        landing on fresh pages). With a bounded ``context`` the storage holds ``2 * context`` rows;
        a push past them keeps only the newest ``context`` positions (the layer reads no more when
        it starts), so an idle request copies rows once per ``context`` pushes. Unbounded, the
        storage doubles when it is full."""
        c, n = self.context, s.pending_rows
        if c and n + rows.shape[0] > 2 * c:
            rows = torch.cat([s.pending(), rows])[-c:] if rows.shape[0] < c else rows[-c:]
            n = 0
        m = rows.shape[0]
        if s.rows is None or n + m > s.rows.shape[0]:
            grown = rows.new_empty(2 * c if c else 2 * (n + m), rows.shape[1])
            if n:
                grown[:n] = s.pending()
            s.rows = grown
        s.rows[n : n + m] = rows
        s.pending_rows = n + m

    def catch_up(self, requests: Sequence[DraftRequest]) -> list[int]:
        if self.heads.prefix is None:
            return [0] * len(requests)
        states = [self._state.get(r.request_id) for r in requests]
        return [self._to_run(s) if s is not None and self._catching(s) else 0 for s in states]

    def _to_run(self, s: _State) -> int:
        """The pending positions the prefix layer runs over (a layer that starts reads at most
        the last ``context``)."""
        return min(s.pending_rows, self.context) if self.context and s.kv is None else s.pending_rows

    def pop_catch_up(self) -> tuple[float, int]:
        (spent, positions), self._catch_up = self._catch_up, (0.0, 0)
        return spent * 1e3, positions

    def _catching(self, s: _State) -> bool:
        """The request's layer starts, or it has more positions pending than one step commits
        (it did not draft for a while): a few idle steps' positions ride with the step's batch."""
        return s.pending_rows > 0 and (s.kv is None or s.pending_rows > self.max_depth + 1)

    def release(self, request_id: Hashable) -> None:
        self._state.pop(request_id, None)

    def route_linears(self, dispatch: "LinearDispatch | None") -> None:
        self.heads.router.dispatch = dispatch

    def _inputs(self, requests: Sequence[DraftRequest]) -> list[torch.Tensor | None]:
        """The heads' input ``[d]`` per request (``None``: no state yet, nothing to draft from)."""
        for r in requests:
            have = self._state[r.request_id].pushed if r.request_id in self._state else 0
            if have != r.kv_len:
                raise ValueError(
                    f"request {r.request_id!r}: the engine pushed hidden states for {have} positions, but "
                    f"{r.kv_len} tokens are committed before the root (observe_hidden must cover every "
                    "committed position once, in order)"
                )
        if self.heads.prefix is not None:
            self._advance([self._state[r.request_id] for r in requests if r.kv_len > 0])
        return [self._state[r.request_id].last if r.kv_len > 0 else None for r in requests]

    def _advance(self, states: list[_State]) -> None:
        """Run the prefix layer over every request's pending positions: those that catch up
        (:meth:`_catching`) in one timed batch, the rest in another."""
        catching = [s for s in states if self._catching(s)]
        if catching:
            positions = sum(self._to_run(s) for s in catching)
            started = time.perf_counter()
            self._forward_pending(catching)
            spent, done = self._catch_up
            self._catch_up = (spent + time.perf_counter() - started, done + positions)
        self._forward_pending([s for s in states if s.pending_rows])

    def _forward_pending(self, todo: list[_State]) -> None:
        """Run the prefix layer over the pending positions of ``todo``, in one batch."""
        if not todo:
            return
        rows = [s.pending()[s.pending_rows - self._to_run(s) :] for s in todo]
        width = max(x.shape[0] for x in rows)
        if all(x.shape[0] == width for x in rows):  # no padding (a lone request, every decoding step)
            hidden, valid = torch.stack(rows), None
        else:
            hidden = torch.zeros(len(todo), width, self.heads.config.hidden_size, device=self.device, dtype=self.dtype)
            valid = torch.zeros(len(todo), width, dtype=torch.bool, device=self.device)
            for b, x in enumerate(rows):
                hidden[b, : x.shape[0]] = x
                valid[b, : x.shape[0]] = True
        have = torch.tensor([s.pushed - x.shape[0] for s, x in zip(todo, rows)], device=self.device)
        positions = have[:, None] + torch.arange(width, device=self.device)
        assert self.heads.prefix is not None
        past = PrefixKV.stack([s.kv if s.kv is not None else self.heads.prefix.empty_kv(1, hidden) for s in todo])
        with torch.inference_mode():
            out, kv = self.heads.prefix_forward(hidden, positions, past, valid)
        for b, (s, x) in enumerate(zip(todo, rows)):
            s.kv, s.last, s.pending_rows = kv.row(b), out[b, x.shape[0] - 1].clone(), 0

    @torch.inference_mode()
    def expand(self, requests: Sequence[DraftRequest], frontiers: Sequence[Sequence[int]],
               partials: Sequence["PartialTree"], k: int, shaping: "SamplingParams | None",
               entropy: bool = True) -> Candidates:
        """Head ``d`` scores the nodes at depth ``d - 1`` (one batched forward per distinct depth);
        nodes deeper than the last head, and requests without a hidden state, get no candidates."""
        inputs = self._inputs(requests)
        rows = sum(len(f) for f in frontiers)
        by_depth: dict[int, list[tuple[int, int, list[int]]]] = {}
        row = 0
        for b, (front, part) in enumerate(zip(frontiers, partials)):
            for node in front:
                path = part.path_tokens(node)
                if inputs[b] is not None and len(path) <= self.heads.num_heads:
                    by_depth.setdefault(len(path), []).append((b, row, path))
                row += 1
        token_map = self.heads.token_map if self.heads.config.reduced_vocab else None
        out = None
        for depth, items in by_depth.items():
            hidden = torch.stack([inputs[b] for b, _, _ in items])
            path = torch.tensor([p for _, _, p in items], dtype=torch.int64, device=self.device)
            c = top_candidates(self.heads.head_logits(depth, hidden, path), k, shaping, token_map, entropy)
            if len(items) == rows and c.ids.shape[1] == k:  # every row, in order: the candidates as they are
                return c
            out = out if out is not None else Candidates.empty(rows, k, entropy)
            idx = torch.tensor([r for _, r, _ in items])
            width = c.ids.shape[1]
            out.ids[idx, :width], out.probs[idx, :width] = c.ids, c.probs
            if out.entropy is not None and c.entropy is not None:
                out.entropy[idx] = c.entropy
        return out if out is not None else Candidates.empty(rows, k, entropy)


def make_hydra_drafter(options: str | None = None, *, target: TargetInfo | None = None, **_: object) -> HydraDrafter:
    """Factory for ``--drafter hydra[:PATH][,width=W][,topk=T]``; needs the target's weights."""
    opts = parse_hydra_options(options)
    if target is None:
        raise ValueError("hydra drafter needs the target's weights and identity (make_drafter(..., target=TargetInfo))")
    identity = TargetIdentity.of(target)
    device = target.embed.device
    # the target's dtype, except fp16 on a CPU (emulated there): a bf16 target on a CPU means one
    # with native bf16 (``--dtype auto``) or a user's choice, and fp32 heads would cost ~1/6 of a step
    dtype = torch.float32 if device.type == "cpu" and target.embed.dtype == torch.float16 else target.embed.dtype
    # int8 weights: fp32 heads through FBGEMM, bf16 heads through the engine's weight-only kernel
    fbgemm = dtype == torch.float32 and int8_available()
    int8_fits = device.type == "cpu" and (fbgemm or (dtype == torch.bfloat16 and target.weight_kernel is not None))
    if opts.int8 and not int8_fits:
        raise ValueError(f"hydra option int8=on needs heads on a CPU, in fp32 with torch's FBGEMM engine or in bf16 "
                         f"with the engine's weight-only int8 kernel; these run in "
                         f"{str(dtype).removeprefix('torch.')} on {device.type}"
                         + ("" if int8_available() or dtype != torch.float32 else " and this torch has no FBGEMM")
                         + ("" if target.weight_kernel is not None or dtype != torch.bfloat16
                            else " and the engine offers no weight-only kernel"))
    heads = load_heads(opts.path, identity, target.embed, target.lm_head, dtype=dtype, device=device)
    if opts.int8 is not False and int8_fits:
        heads.use_int8(target.weight_kernel)
    return HydraDrafter(heads, opts.width, opts.topk, load_acceptance(opts.path) if opts.table else None, opts.context)
