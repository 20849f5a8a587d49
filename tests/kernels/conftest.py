"""Kernel tests run Triton's CPU interpreter: set TRITON_INTERPRET=1 before the kernels are built.

If another test module imported ``dyntree.kernels`` first (kernels then built for a GPU), the
kernel modules are reloaded so their ``@triton.jit`` functions are rebuilt for the interpreter.
"""

import importlib
import os
import sys

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
