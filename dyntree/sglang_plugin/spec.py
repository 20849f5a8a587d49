"""DYNTREE's entry in SGLang's speculative-algorithm registry: :func:`spec_class`.

SGLang's ``CustomSpecAlgo`` duck-types the ``SpeculativeAlgorithm`` enum but, in 0.5.23, lacks
methods the scheduler calls unconditionally (``carries_draft_hidden_states``,
``create_future_map``, ``need_topk``, ``get_platform_worker_cls``); :func:`missing_methods`
derives the enum's public interface from the installed SGLang so a new upstream method fails a
test rather than a user's server. The class answers like NGRAM where SGLang branches on the
algorithm (no draft model, no draft KV, synchronous, decode-only verify) and hands
``handle_server_args`` to :func:`~dyntree.sglang_plugin.options.resolve_server_args`.
"""

from __future__ import annotations

import functools
from typing import Any

__all__ = ["spec_class", "missing_methods"]


def missing_methods(cls: type) -> list[str]:
    """Public methods of the installed ``SpeculativeAlgorithm`` enum that ``cls`` lacks."""
    from sglang.srt.speculative.spec_info import SpeculativeAlgorithm

    interface = {n for n, v in vars(SpeculativeAlgorithm).items() if not n.startswith("_") and callable(v)}
    interface -= {"from_string", "register"}  # classmethods of the enum itself
    return sorted(n for n in interface if not hasattr(cls, n))


@functools.cache
def spec_class() -> type:
    """The ``spec_class`` DYNTREE registers with (built on first use: it subclasses SGLang's)."""
    from sglang.srt.speculative.spec_registry import CustomSpecAlgo

    class DynTreeSpec(CustomSpecAlgo):
        """DYNTREE as SGLang's scheduler sees it."""

        def has_draft_kv(self) -> bool:
            return False  # trees live only in the verify window; no draft KV to reserve

        def carries_draft_hidden_states(self) -> bool:
            return False

        def need_topk(self) -> bool:
            return False

        def get_platform_worker_cls(self) -> type | None:
            return None

        def create_future_map(self, device: Any, req_to_token_pool: Any, needs_cpu_seq_lens: bool = True,
                              needs_confidence_relay: bool = False) -> Any:
            from sglang.srt.managers.overlap_utils import FutureMap

            return FutureMap(device, self, req_to_token_pool, needs_cpu_seq_lens, needs_confidence_relay)

        def handle_server_args(self, server_args: Any) -> None:
            from dyntree.sglang_plugin.options import resolve_server_args

            resolve_server_args(server_args)

    return DynTreeSpec
