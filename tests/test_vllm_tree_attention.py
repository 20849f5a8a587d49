"""The vLLM plugin's tree attention, layer by layer, without an engine: keys and values written into a
paged CPU cache by vLLM's own cache writer (every layout this CPU has), the planned tree rows
(:func:`~dyntree.vllm_plugin.attention.plan_tree_rows`, :func:`~dyntree.vllm_plugin.attention.tree_rows_attention`)
against dense attention over the request's whole history with the ancestor mask, over two steps
so the prefix mirror is filled once and then only topped up. The tree's leading chain is vLLM's
kernel's (its rows are left alone here); every other row is computed. Controls: a causal mask
instead of the ancestor mask, and a mirror that skips its top-up, must each change the rows.
"""

from __future__ import annotations

import importlib.util
import os

import pytest
import torch
import torch.nn.functional as F

HAS_VLLM = importlib.util.find_spec("vllm") is not None
pytestmark = pytest.mark.skipif(not HAS_VLLM and not os.environ.get("CI"), reason="vLLM is not installed")

HKV, HQ, D, BLOCK, BLOCKS = 2, 6, 32, 32, 12


def _layouts() -> list[tuple[str, torch.dtype]]:
    cases = [("vec", torch.float32), ("vec", torch.bfloat16)]
    if torch.cpu._is_amx_tile_supported():
        cases.append(("amx", torch.bfloat16))
    return cases


def _tree():
    from dyntree.common.tree import DraftTree

    # depth-first: 0 -> 1 -> 2 -> 3, 1 -> 4, 0 -> 5 -> 6
    parents = torch.tensor([-1, 0, 1, 2, 1, 0, 5])
    return DraftTree(torch.arange(10, 17), parents, torch.ones(7))


def _step(tree, prefix: int, start: int, mask: torch.Tensor):
    from dyntree.common.tree import DraftBatch
    from dyntree.vllm_plugin.step import TreeStep

    return TreeStep(DraftBatch.from_trees(["r"], [tree]), rows=[0], starts=[start], prefix=[prefix], masks=[mask])


def _run(isa: str, dtype: torch.dtype, skip_top_up: bool = False, causal: bool = False,
         form: str | None = None, commit: list[int] | None = None,
         committed: list[int] | None = None, whole: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """Two steps of one request (prefix 45, then 50): the tree rows and the dense reference
    (``form``: the attention form a dispatch picks; None: no dispatch; ``whole``: the plan computes
    the leading chain's rows too, as when vLLM's kernel is skipped). With ``commit``, the
    first step's tree accepts those nodes (root first) and the second step starts right after
    them, nothing left to copy; the mirror is told ``committed`` (default: ``commit``)."""
    from vllm import _custom_ops as ops

    from dyntree.kernels.cpu_attention import IMPLS, AttentionDispatch

    from dyntree.vllm_plugin.attention import plan_tree_rows, tree_rows_attention
    from dyntree.vllm_plugin.kv_layout import KVLayout
    from dyntree.vllm_plugin.mirror import PrefixMirror

    g = torch.Generator().manual_seed(0)
    tree = _tree()
    t = tree.size
    keys = torch.randn(50, HKV, D, generator=g).to(dtype)  # the committed history
    values = torch.randn(50, HKV, D, generator=g).to(dtype)
    cache = torch.zeros(BLOCKS, HKV, BLOCK, 2 * D, dtype=dtype)
    block_row = torch.randperm(BLOCKS, generator=g)[:4].to(torch.int32)  # scattered blocks
    key_cache, value_cache = cache.view(BLOCKS, HKV, 2 * BLOCK, D).chunk(2, dim=2)

    def slots(positions: torch.Tensor) -> torch.Tensor:
        return block_row[positions // BLOCK].long() * BLOCK + positions % BLOCK

    layout = KVLayout.for_spec(isa, dtype, BLOCK, HKV, D)
    mirror = PrefixMirror(1, HKV, D, dtype)
    ancestors = tree.ancestor_mask()
    mask = torch.tril(torch.ones(t, t, dtype=torch.bool)) if causal else ancestors
    got, want = [], []
    for prefix in (45, 50 if commit is None else 45 + len(commit)):
        # the committed prefix (after the last step's compaction) and this step's nodes are in the
        # cache: vLLM writes the nodes' K/V at their linear slots before attention runs
        node_keys = torch.randn(t, HKV, D, generator=g).to(dtype)
        node_values = torch.randn(t, HKV, D, generator=g).to(dtype)
        all_keys, all_values = torch.cat([keys[:prefix], node_keys]), torch.cat([values[:prefix], node_values])
        ops.cpu_attn_reshape_and_cache(all_keys, all_values, key_cache, value_cache, slots(torch.arange(prefix + t)), isa)
        start = 3  # another request's rows come first in the step's flat query
        query = torch.randn(start + t + 2, HQ, D, generator=g).to(dtype)
        step_keys = torch.zeros(start + t + 2, HKV, D, dtype=dtype)
        step_values = torch.zeros_like(step_keys)
        step_keys[start : start + t], step_values[start : start + t] = node_keys, node_values
        dispatch = None if form is None else AttentionDispatch({(1, 16, 64): {n: float(n != form) for n in IMPLS}})
        plan = plan_tree_rows(_step(tree, prefix, start, mask), [0], layout, mirror, {"layer": 0},
                              block_row[None], dtype, dispatch, whole)
        if skip_top_up and prefix == 50:
            assert plan.requests[0].sync_index.numel() > 0  # the second step tops up 5 positions
            plan.requests[0] = plan.requests[0].__class__(**{**plan.requests[0].__dict__,
                                                             "sync_index": torch.empty(0, dtype=torch.int64)})
        out = torch.zeros(start + t + 2, HQ * D, dtype=dtype)
        tree_rows_attention(plan, "layer", query, step_keys, step_values, cache, out, D**-0.5)
        lead = 0 if whole else tree.lead_chain
        assert whole or (lead == 4 and torch.all(out[start : start + lead] == 0))  # the leading chain is vLLM's kernel's
        got.append(out[start + lead : start + t].float())
        if commit is not None and prefix == 45:  # the verified tree's accepted nodes are the next positions
            assert plan.requests[0].sync_index.numel() > 0  # the first tree fills the mirror
            mirror.commit("r", prefix, committed if committed is not None else commit)
            keys[prefix : prefix + len(commit)] = node_keys[commit]
            values[prefix : prefix + len(commit)] = node_values[commit]
        elif commit is not None:
            assert plan.requests[0].sync_index.numel() == 0  # nothing to copy out of vLLM's cache
        bias = torch.zeros(t, prefix + t)
        bias[:, prefix:].masked_fill_(~ancestors, float("-inf"))
        q = query[start : start + t].float().transpose(0, 1)[None]
        k = all_keys.float().transpose(0, 1)[None]
        v = all_values.float().transpose(0, 1)[None]
        ref = F.scaled_dot_product_attention(q, k, v, attn_mask=bias, scale=D**-0.5, enable_gqa=True)
        want.append(ref[0].transpose(0, 1).reshape(t, -1)[lead:])
        assert torch.all(out[:start] == 0) and torch.all(out[start + t :] == 0)  # other rows untouched
    return torch.cat(got), torch.cat(want)


@pytest.mark.parametrize("form", [None, "gqa", "rows", "matmul"])
@pytest.mark.parametrize("isa,dtype", _layouts())
def test_tree_rows_equal_dense_attention(isa: str, dtype: torch.dtype, form: str | None) -> None:
    """Every attention form the builder's dispatch may pick (and none) gives the dense result."""
    got, want = _run(isa, dtype, form=form)
    tol = 1e-5 if dtype == torch.float32 else 3e-2
    assert torch.allclose(got, want, atol=tol, rtol=tol), (got - want).abs().max()


@pytest.mark.parametrize("isa,dtype", _layouts())
def test_whole_step_rows_equal_dense_attention(isa: str, dtype: torch.dtype) -> None:
    """A plan that serves every row of the step (vLLM's kernel skipped) computes the leading chain too."""
    got, want = _run(isa, dtype, whole=True, form="gqa")
    assert got.shape[0] == 2 * _tree().size
    tol = 1e-5 if dtype == torch.float32 else 3e-2
    assert torch.allclose(got, want, atol=tol, rtol=tol), (got - want).abs().max()


@pytest.mark.parametrize("control", ["causal", "no_top_up", "commit_unmoved"])
def test_controls_change_the_rows(control: str) -> None:
    got, want = _run("vec", torch.float32, skip_top_up=control == "no_top_up", causal=control == "causal",
                     commit=[0, 1, 4] if control == "commit_unmoved" else None,
                     committed=[0, 1, 2] if control == "commit_unmoved" else None)
    assert not torch.allclose(got, want, atol=1e-3)


@pytest.mark.parametrize("accepted", [[0, 1, 4], [0, 5, 6], [0, 1, 2, 3], [0]])
def test_a_committed_tree_is_the_next_steps_prefix(accepted: list[int]) -> None:
    """The mirror moves a verified tree's accepted nodes into place as vLLM's compaction does (off
    the leading chain, along it, root alone): the next step reads them there and copies nothing."""
    got, want = _run("vec", torch.float32, commit=accepted)
    assert torch.allclose(got, want, atol=1e-5, rtol=1e-5), (got - want).abs().max()


def test_chains_are_left_to_vllms_kernel() -> None:
    from dyntree.common.tree import DraftBatch, DraftTree
    from dyntree.vllm_plugin.step import TreeStep

    trees = [DraftTree.chain(1, [2, 3, 4]), _tree()]
    step = TreeStep(DraftBatch.from_trees(["a", "b"], trees), [0, 1], [0, 4], [9, 9], [t.ancestor_mask() for t in trees])
    assert step.branching == [1]
    # a branching tree's leading chain too: root, first child, ... while each parent is the row before
    assert [t.lead_chain for t in trees] == [4, 4]
    bfs = DraftTree(torch.arange(5), torch.tensor([-1, 0, 0, 1, 1]), torch.ones(5))
    assert bfs.lead_chain == 2 and DraftTree.root_only(7).lead_chain == 1


def test_mirror_grows_keeps_and_releases() -> None:
    from dyntree.vllm_plugin.mirror import PrefixMirror

    m = PrefixMirror(2, 1, 4, torch.float32)
    assert m.reserve("a", 10, 20) == 0
    m.buffer("a")[:, :, :, :10] = torch.arange(10.0)[:, None]
    assert m.reserve("a", 12, 200) == 10  # grown: the synced positions are kept
    assert m.buffer("a").shape[3] >= 200 and torch.equal(m.buffer("a")[1, 0, 0, :10, 0], torch.arange(10.0))
    with pytest.raises(RuntimeError, match="shrank"):
        m.reserve("a", 5, 20)
    m.release("a")
    assert len(m) == 0 and m.reserve("a", 7, 9) == 0


@pytest.mark.parametrize("isa,dtype", _layouts())
def test_mirror_sync_tops_up_every_layer_from_the_paged_cache(isa: str, dtype: torch.dtype) -> None:
    """What the quantized self-draft reads its prefix from (``PrefixMirror.sync``): every layer's
    positions up to the request's length, copied out of vLLM's paged cache, and later only the
    positions committed since (positions already copied are never read again: here they are
    overwritten in the cache, and the copy keeps the old values). A tree planned right after finds
    nothing left to copy."""
    from vllm import _custom_ops as ops

    from dyntree.vllm_plugin.attention import plan_tree_rows
    from dyntree.vllm_plugin.kv_layout import KVLayout
    from dyntree.vllm_plugin.mirror import PrefixMirror

    g = torch.Generator().manual_seed(1)
    layers = 3
    keys = torch.randn(layers, 60, HKV, D, generator=g).to(dtype)
    values = torch.randn(layers, 60, HKV, D, generator=g).to(dtype)
    caches = [torch.zeros(BLOCKS, HKV, BLOCK, 2 * D, dtype=dtype) for _ in range(layers)]
    block_row = torch.randperm(BLOCKS, generator=g)[:2].to(torch.int32)
    slots = block_row[torch.arange(60) // BLOCK].long() * BLOCK + torch.arange(60) % BLOCK

    def write(i: int, positions: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
        key_cache, value_cache = caches[i].view(BLOCKS, HKV, 2 * BLOCK, D).chunk(2, dim=2)
        ops.cpu_attn_reshape_and_cache(k, v, key_cache, value_cache, slots[positions], isa)

    for i in range(layers):
        write(i, torch.arange(60), keys[i], values[i])
    layout = KVLayout.for_spec(isa, dtype, BLOCK, HKV, D)
    mirror = PrefixMirror(layers, HKV, D, dtype)
    index = lambda start, end: layout.span_index(block_row, start, end)  # noqa: E731
    buf = mirror.sync("r", 40, 16, caches, index)
    assert buf.shape[3] >= 56
    for i in range(layers):
        assert torch.equal(buf[i, 0, :, :40], keys[i, :40].transpose(0, 1))
        assert torch.equal(buf[i, 1, :, :40], values[i, :40].transpose(0, 1))
        write(i, torch.arange(40), torch.zeros(40, HKV, D, dtype=dtype), torch.zeros(40, HKV, D, dtype=dtype))
    buf = mirror.sync("r", 52, 16, caches, index)  # tops up 40 .. 51 only
    for i in range(layers):
        assert torch.equal(buf[i, 0, :, :52], keys[i, :52].transpose(0, 1))
        assert torch.equal(buf[i, 1, :, :52], values[i, :52].transpose(0, 1))
    tree = _tree()
    plan = plan_tree_rows(_step(tree, 52, 0, tree.ancestor_mask()), [0], layout, mirror,
                          {f"layer{i}": i for i in range(layers)}, block_row[None], dtype)
    assert plan.requests[0].synced == 52 and plan.requests[0].sync_index.numel() == 0
