"""dyntree inside SGLang: ``python -m sglang.launch_server ... --speculative-algorithm DYNTREE``.

:func:`register` is the ``sglang.srt.plugins`` entry point; SGLang's ``load_plugins`` runs it in
the launcher and again in every spawned scheduler, DP-controller and detokenizer process. It is
cheap and idempotent and imports only SGLang's light registry modules:

* ``SpeculativeAlgorithm.register("DYNTREE", spec_class=...)``
  (:mod:`dyntree.sglang_plugin.spec`), whose ``handle_server_args`` maps SGLang's
  ``--speculative-*`` flags and the options file onto a validated
  :class:`~dyntree.common.config.SpecConfig` and refuses what cannot work
  (:mod:`dyntree.sglang_plugin.options`);
* a ``handle_cuda_graph_config`` resolution hook that turns the decode CUDA graph off for
  DYNTREE (SGLang captures plugin verify graphs without a tree mask);
* the worker factory, which imports :class:`~dyntree.sglang_plugin.worker.DynTreeWorker` only
  in the scheduler, when SGLang builds it.

Supported: SGLang 0.5.23 (its plugin seams change between releases); other versions are
refused with a message naming the supported one.
"""

from __future__ import annotations

from typing import Any

from dyntree.sglang_plugin.options import NAME

__all__ = ["register", "SUPPORTED", "check_version", "NAME"]

#: SGLang releases this adapter was built and tested against.
SUPPORTED = ("0.5.23",)

_registered = False


def check_version(version: str) -> None:
    if version not in SUPPORTED:
        raise RuntimeError(
            f"dyntree's SGLang plugin supports SGLang {', '.join(SUPPORTED)}; this is SGLang {version}. "
            f"Install sglang=={SUPPORTED[-1]} or drop --speculative-algorithm {NAME}."
        )


def register() -> None:
    """The ``sglang.srt.plugins`` entry point (see the module docstring)."""
    global _registered
    if _registered:
        return
    import sglang
    from sglang.srt.arg_groups.resolution_hooks import register_resolution_hook
    from sglang.srt.speculative.spec_info import SpeculativeAlgorithm

    from dyntree.sglang_plugin.spec import missing_methods, spec_class

    check_version(sglang.__version__)
    cls = spec_class()
    missing = missing_methods(cls)
    if missing:
        raise RuntimeError(f"dyntree's SGLang spec class lacks {missing} of this SGLang's SpeculativeAlgorithm")
    try:
        SpeculativeAlgorithm.register(NAME, supports_overlap=False, spec_class=cls)(_worker_factory)
    except ValueError as exc:  # already registered in this process (e.g. by an earlier import path)
        if "already" not in str(exc).lower():
            raise
    register_resolution_hook("handle_cuda_graph_config")(_no_decode_cuda_graph)
    _registered = True


def _worker_factory(server_args: Any) -> type:
    from dyntree.sglang_plugin.worker import DynTreeWorker

    return DynTreeWorker


def _no_decode_cuda_graph(server_args: Any, previous: Any) -> None:
    """DYNTREE verifies eagerly: SGLang would capture its verify graph without the tree mask."""
    if str(server_args.speculative_algorithm or "").upper() == NAME and not server_args.disable_decode_cuda_graph:
        from sglang.srt.arg_groups.overrides import declare_resolution

        declare_resolution(server_args, "dyntree", disable_decode_cuda_graph=True)
    previous(server_args)
