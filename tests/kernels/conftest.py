"""Kernel tests run Triton's CPU interpreter by default: TRITON_INTERPRET=1 is set before the
kernels are built. If another test module imported ``dyntree.kernels`` first (kernels then built
for a GPU), the kernel modules are reloaded so their ``@triton.jit`` functions are rebuilt.

``DYNTREE_KERNEL_TESTS=cuda`` runs the same tests with the kernels compiled for the GPU instead:
every Triton entry point is wrapped so that its CPU tensor arguments travel to the GPU, tensors
the kernel writes in place are copied back, and its result returns to the CPU; the torch
references the tests compare against still run on the CPU.
"""

import functools
import importlib
import os
import sys

import torch

ON_GPU = os.environ.get("DYNTREE_KERNEL_TESTS") == "cuda"
if not ON_GPU:
    os.environ["TRITON_INTERPRET"] = "1"

for _name in (
    "dyntree.kernels._triton",
    "dyntree.kernels.tree_attention",
    "dyntree.kernels.tree_accept",
    "dyntree.kernels.kv_compact",
    "dyntree.kernels.w4a16",
    "dyntree.kernels.dispatch",
    "dyntree.kernels",
):
    if _name in sys.modules:
        importlib.reload(sys.modules[_name])


def _on_cuda(fn):
    """``fn`` run on CUDA copies of its tensor arguments, with in-place writes copied back."""

    @functools.wraps(fn)
    def wrapper(*args, **kwargs):
        moved = {}

        def to_cuda(x):
            if isinstance(x, torch.Tensor) and not x.is_cuda:
                moved[id(x)] = (x, x.cuda())
                return moved[id(x)][1]
            return x

        out = fn(*[to_cuda(a) for a in args], **{k: to_cuda(v) for k, v in kwargs.items()})
        for cpu, gpu in moved.values():
            cpu.copy_(gpu.cpu())
        if isinstance(out, torch.Tensor):
            return out.cpu()
        if isinstance(out, tuple):
            return tuple(o.cpu() if isinstance(o, torch.Tensor) else o for o in out)
        return out

    return wrapper


if ON_GPU:
    assert torch.cuda.is_available(), "DYNTREE_KERNEL_TESTS=cuda needs a CUDA GPU"
    from dyntree.kernels import _triton, kv_compact, tree_accept, tree_attention

    _triton.interpreting = lambda: True  # CPU tensors may ask for backend="triton": the wrappers move them
    for _mod, _fn in ((tree_attention, "paged_tree_attention_triton"), (tree_accept, "tree_accept_greedy_triton"),
                      (tree_accept, "tree_accept_sampling_triton"), (kv_compact, "kv_compact_triton")):
        setattr(_mod, _fn, _on_cuda(getattr(_mod, _fn)))
