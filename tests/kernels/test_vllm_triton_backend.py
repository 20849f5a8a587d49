"""The vLLM plugin's CUDA tree attention (:mod:`dyntree.vllm_plugin.triton_attention`) on vLLM's GPU
cache layout, run through the Triton interpreter here (compiled for the GPU under
``DYNTREE_KERNEL_TESTS=cuda``): the step's plan, the tree rows of every layer and KV compaction
against dense attention over each request's true history.

A step holds four requests in vLLM's flat query: a plain decode row, a branching tree, a chain
and a second branching tree; two steps run, with an accepted path that is not the first-child
chain compacted in between, so the second step reads what compaction moved. The cache is vLLM's
Triton-backend ``[num_blocks, Hkv, block_size, 2 * D]`` in both stride orders it allocates (NHD and
HND). Controls: a causal mask instead of the ancestor masks, and a skipped compaction, must each
change the rows; rows outside branching trees must stay vLLM's.
"""

from __future__ import annotations

import importlib.util
import os

import pytest
import torch
import torch.nn.functional as F

HAS_VLLM = importlib.util.find_spec("vllm") is not None
pytestmark = pytest.mark.skipif(not HAS_VLLM and not os.environ.get("CI"), reason="vLLM is not installed")

HKV, HQ, D, BLOCK, BLOCKS = 2, 6, 32, 16, 24
DEVICE = torch.device("cpu")  # under DYNTREE_KERNEL_TESTS=cuda the kernels' wrappers move the tensors


def _branching_tree():
    from dyntree.common.tree import DraftTree

    # depth-first: 0 -> 1 -> 2 -> 3, 1 -> 4, 0 -> 5 -> 6
    return DraftTree(torch.arange(10, 17), torch.tensor([-1, 0, 1, 2, 1, 0, 5]), torch.ones(7))


def _small_tree():
    from dyntree.common.tree import DraftTree

    return DraftTree(torch.arange(20, 24), torch.tensor([-1, 0, 0, 2]), torch.ones(4))


class _Cache:
    """One layer's vLLM Triton cache with each request's true K/V history beside it."""

    def __init__(self, layout: str, g: torch.Generator) -> None:
        if layout == "NHD":  # physical [blocks, block, Hkv, 2D], seen in vLLM's logical order
            self.kv = torch.zeros(BLOCKS, BLOCK, HKV, 2 * D, device=DEVICE).permute(0, 2, 1, 3)
        else:
            self.kv = torch.zeros(BLOCKS, HKV, BLOCK, 2 * D, device=DEVICE)
        self.table = torch.randperm(BLOCKS, generator=g).to(torch.int32).view(4, BLOCKS // 4)  # 4 requests
        self.history: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}

    def write(self, row: int, start: int, keys: torch.Tensor, values: torch.Tensor) -> None:
        """What vLLM's cache writer does: positions ``start ..`` of batch row ``row`` (linear slots)."""
        for i in range(keys.shape[0]):
            p = start + i
            block, off = int(self.table[row, p // BLOCK]), p % BLOCK
            self.kv[block, :, off, :D] = keys[i]
            self.kv[block, :, off, D:] = values[i]


def _dense(q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, prefix: int, mask: torch.Tensor) -> torch.Tensor:
    t = mask.shape[0]
    bias = torch.zeros(t, prefix + t)
    bias[:, prefix:].masked_fill_(~mask, float("-inf"))
    out = F.scaled_dot_product_attention(q.transpose(0, 1)[None], keys.transpose(0, 1)[None],
                                         values.transpose(0, 1)[None], attn_mask=bias, scale=D**-0.5, enable_gqa=True)
    return out[0].transpose(0, 1).reshape(t, -1)


def _run(layout: str, causal: bool = False, skip_compaction: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """Two steps; returns the branching trees' rows of both steps and their dense references."""
    from dyntree.common.tree import DraftBatch, DraftTree
    from dyntree.vllm_plugin.step import TreeStep
    from dyntree.vllm_plugin.triton_attention import compact_triton, plan_tree_batch, tree_rows_triton

    g = torch.Generator().manual_seed(0)
    cache = _Cache(layout, g)
    prefix = [37, 20, 51, 16]  # committed tokens per batch row
    history = [(torch.randn(p, HKV, D, generator=g), torch.randn(p, HKV, D, generator=g)) for p in prefix]
    for row, (k, v) in enumerate(history):
        cache.write(row, 0, k, v)
    trees = [DraftTree.chain(5, []), _branching_tree(), DraftTree.chain(6, [7, 8]), _small_tree()]
    got, want = [], []
    for step_no in range(2):
        sizes = [t.size for t in trees]
        starts = [sum(sizes[:i]) for i in range(len(trees))]
        masks = [t.ancestor_mask() for t in trees]
        if causal:
            masks = [torch.tril(torch.ones_like(m)) for m in masks]
        nodes = [(torch.randn(n, HKV, D, generator=g), torch.randn(n, HKV, D, generator=g)) for n in sizes]
        for row, (k, v) in enumerate(nodes):
            cache.write(row, prefix[row], k, v)
        step = TreeStep(DraftBatch.from_trees([f"r{i}" for i in range(4)], trees), list(range(4)), starts, prefix, masks)
        assert step.branching == ([] if causal else [1, 3])
        branching = [1, 3]  # the causal control still sends them through the tree kernel
        query = torch.randn(sum(sizes), HQ, D, generator=g)
        out = torch.full((sum(sizes), HQ * D), 7.0, device=DEVICE)  # what vLLM's kernel left there
        plan = plan_tree_batch(step, branching, DEVICE, backend="triton")
        assert plan.max_seq_len == max(prefix[b] + sizes[b] for b in branching)
        tree_rows_triton(plan, query, cache.kv, cache.table, out, D**-0.5)
        for b in range(4):
            rows = slice(starts[b], starts[b] + sizes[b])
            if b not in branching:
                assert torch.all(out[rows] == 7.0)  # left to vLLM's kernel
                continue
            keys = torch.cat([history[b][0], nodes[b][0]])
            values = torch.cat([history[b][1], nodes[b][1]])
            got.append(out[rows])
            want.append(_dense(query[rows], keys, values, prefix[b], trees[b].ancestor_mask()))
        if step_no == 1:
            break
        # accept: row 1 takes 0 -> 5 -> 6 (not its first-child chain), row 3 takes 0 -> 2 -> 3, rows 0 and 2 their whole chain
        accepted = {0: [0], 1: [0, 5, 6], 2: [0, 1, 2], 3: [0, 2, 3]}
        from dyntree.vllm_plugin.step import Move

        moves = [Move(b, prefix[b], torch.tensor(accepted[b])) for b in (1, 3)]
        if not skip_compaction:
            compact_triton([cache.kv], cache.table, moves, backend="triton")
        for b in range(4):
            idx = torch.tensor(accepted[b])
            history[b] = (torch.cat([history[b][0], nodes[b][0][idx]]), torch.cat([history[b][1], nodes[b][1][idx]]))
            prefix[b] += len(accepted[b])
        trees = [DraftTree.chain(9, [1]), _small_tree(), DraftTree.chain(3, []), _branching_tree()]
    return torch.cat(got), torch.cat(want)


@pytest.mark.parametrize("layout", ["NHD", "HND"])
def test_tree_rows_equal_dense_attention_over_vllms_gpu_cache(layout: str) -> None:
    got, want = _run(layout)
    assert torch.allclose(got, want, atol=2e-5, rtol=1e-4), (got - want).abs().max()


@pytest.mark.parametrize("control", ["causal", "no_compaction"])
def test_controls_change_the_rows(control: str) -> None:
    got, want = _run("NHD", causal=control == "causal", skip_compaction=control == "no_compaction")
    assert not torch.allclose(got, want, atol=1e-3)


def test_vllms_kernel_reads_no_prefix_for_branching_trees() -> None:
    from dyntree.common.tree import DraftBatch, DraftTree
    from dyntree.vllm_plugin.step import TreeStep
    from dyntree.vllm_plugin.triton_attention import plan_tree_batch, without_tree_prefix

    trees = [DraftTree.chain(5, [6]), _branching_tree(), _small_tree()]
    step = TreeStep(DraftBatch.from_trees(["a", "b", "c"], trees), [2, 0, 3], [9, 0, 11], [40, 30, 20],
                    [t.ancestor_mask() for t in trees])
    seq_lens = torch.tensor([37, 9, 42, 24, 5], dtype=torch.int32)
    out = without_tree_prefix(seq_lens, plan_tree_batch(step, step.branching, DEVICE))
    assert out.tolist() == [7, 9, 42, 4, 5] and seq_lens.tolist() == [37, 9, 42, 24, 5]  # a copy


def test_builder_keeps_the_runner_hooks_contract() -> None:
    from dyntree.vllm_plugin.attention import TreeCPUAttentionMetadataBuilder
    from dyntree.vllm_plugin.step import TreeAttentionBuilder
    from dyntree.vllm_plugin.triton_attention import TreeTritonAttentionBackend, TreeTritonAttentionMetadataBuilder

    for cls in (TreeCPUAttentionMetadataBuilder, TreeTritonAttentionMetadataBuilder):
        for name in ("plan_trees", "release", "compact", "build"):
            assert callable(getattr(cls, name)), (cls, name)
    assert TreeTritonAttentionBackend.get_builder_cls() is TreeTritonAttentionMetadataBuilder
    builder = object.__new__(TreeTritonAttentionMetadataBuilder)  # vLLM's __init__ needs a whole engine config
    builder.layers = {}
    assert isinstance(builder, TreeAttentionBuilder)
