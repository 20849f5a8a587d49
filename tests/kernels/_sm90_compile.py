"""Compile every dyntree Triton kernel for sm_90 (H100) ahead of time, without a GPU.

Run as a script in a process *without* TRITON_INTERPRET (test_gpu_compile.py does that). It goes
through Triton's full NVIDIA pipeline including ptxas, so it catches what the CPU interpreter
does not (type rules, layouts, register spills). Prints one line per kernel and exits non-zero on
the first failure or when a kernel spills registers.
"""

from __future__ import annotations

import os
import subprocess
import sys
import tempfile

import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource

from dyntree.kernels import kv_compact, tree_accept, tree_attention

CUOBJDUMP = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", "cuobjdump")


def compile_for(fn, types: dict[str, str], consts: dict, num_warps: int = 4, num_stages: int = 2) -> str:
    """Compile like a launch would specialise it: pointers and strides 16-divisible."""
    sig = {n: "constexpr" if n in consts else types.get(n, "i32") for n in fn.arg_names}
    attrs = {
        (i,): [["tt.divisibility", 16]]
        for i, n in enumerate(fn.arg_names)
        if n not in consts and (sig[n].startswith("*") or n.startswith("stride") or n == "row_elems")
    }
    kernel = triton.compile(
        ASTSource(fn, sig, consts, attrs), target=GPUTarget("cuda", 90, 32),
        options=dict(num_warps=num_warps, num_stages=num_stages),
    )
    with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
        f.write(kernel.asm["cubin"])
        f.flush()
        usage = subprocess.run([CUOBJDUMP, "-res-usage", f.name], capture_output=True, text=True, check=True).stdout
    line = [ln for ln in usage.splitlines() if "REG:" in ln][-1].strip()
    if "STACK:0 " not in line:
        raise SystemExit(f"{fn.__name__} {consts}: register spills: {line}")
    return line


def main() -> None:
    h = "*fp16"
    attn = dict(Q=h, K=h, V=h, PT="*i32", PT_ROWS="*i32", SEQ_LENS="*i32", QSL="*i32", BITS="*i32", LSE="*fp32", scale_log2="fp32")
    for head_dim, block_n in ((128, 32), (64, 64)):
        for write_lse in (False, True):
            consts = dict(Q_TILES=2, GROUP=4, HEAD_DIM=head_dim, PAGE_SIZE=16, BLOCK_M=64, BLOCK_N=block_n,
                          IS_TREE=True, WRITE_LSE=write_lse, DOT_PREC="tf32")
            types = dict(attn, OUT="*fp32" if write_lse else h)
            print("tree_attn", head_dim, write_lse, compile_for(tree_attention._tree_attn_kernel, types, consts))
    print("merge", compile_for(tree_attention._merge_splits_kernel, dict(PART="*fp32", LSE="*fp32", OUT="*bf16"), dict(HEAD_DIM=128, BLOCK_S=16)))
    print("greedy", compile_for(
        tree_accept._greedy_accept_kernel,
        dict(TOK="*i64", PAR="*i64", TOP="*i64", OUT_INDEX="*i64", OUT_LEN="*i64", OUT_BONUS="*i64"), dict(BLOCK_T=128)))
    print("sampling", compile_for(
        tree_accept._sampling_accept_kernel,
        dict(PAR="*i64", P="*fp32", Q="*fp32", COIN="*fp32", OUT_INDEX="*i64", OUT_LEN="*i64"), dict(BLOCK_T=128)))
    print("kv_compact", compile_for(
        kv_compact._kv_compact_kernel,
        dict(K="*bf16", V="*bf16", PT="*i32", PT_ROWS="*i32", PREFIX="*i32", IDX="*i64", LEN="*i64"),
        dict(PAGE_SIZE=16, BLOCK_L=128, BLOCK_C=64)))


if __name__ == "__main__":
    if os.environ.get("TRITON_INTERPRET", "0") not in ("", "0"):
        sys.exit("run without TRITON_INTERPRET: kernels must be built for the GPU compiler")
    main()
