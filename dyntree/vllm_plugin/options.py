"""``speculative_config={"method": "dyntree", ...}``: parsing and start-up checks (no vLLM import).

The options are the project's own :class:`~dyntree.common.config.SpecConfig` fields (``drafter``,
``tree``, ``max_nodes``, ``max_depth``, ``tree_options``, ...), validated by the shared
:func:`~dyntree.common.engine_options.parse_spec_options`, plus vLLM's ``method`` and
``num_speculative_tokens`` (an alias of ``max_nodes``). The adaptive controller is on unless
``"adaptive": false``. A wrong option fails with pydantic's
message naming the field, before any model loads.
"""

from __future__ import annotations

from typing import Any, Mapping

from dyntree.common.config import SpecConfig
from dyntree.common.engine_options import OptionsError, parse_spec_options

__all__ = ["ENV", "parse_options", "OptionsError"]

#: The environment variable that carries the validated options from the front end to the workers.
ENV = "DYNTREE_VLLM_OPTIONS"


def parse_options(config: Mapping[str, Any]) -> SpecConfig:
    """Validate a ``speculative_config`` dict whose ``method`` is ``dyntree``."""
    opts = {k.replace("-", "_"): v for k, v in config.items() if k != "method"}
    n = opts.pop("num_speculative_tokens", None)
    if n is not None:
        if "max_nodes" in opts and int(opts["max_nodes"]) != int(n):
            raise OptionsError(
                f"speculative_config: num_speculative_tokens={n} and max_nodes={opts['max_nodes']} disagree "
                "(num_speculative_tokens is the node budget; give one of them)"
            )
        opts["max_nodes"] = n
    spec = parse_spec_options(opts, "speculative_config", "vLLM")
    if spec.max_nodes < 1 or spec.max_nodes > 128:
        raise OptionsError(f"speculative_config.max_nodes={spec.max_nodes}: vLLM verifies 1..128 draft tokens per step")
    return spec
