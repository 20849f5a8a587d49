"""``speculative_config={"method": "dyntree", ...}``: parsing and start-up checks (no vLLM import).

The options are the project's own :class:`~dyntree.common.config.SpecConfig` fields (``drafter``,
``tree``, ``max_nodes``, ``max_depth``, ``tree_options``, ...), validated by the shared
:func:`~dyntree.common.engine_options.parse_spec_options`, plus vLLM's ``method`` and
``num_speculative_tokens`` (an alias of ``max_nodes``; :data:`DEFAULT_MAX_NODES` when neither is
given). The adaptive controller is on unless ``"adaptive": false``. A wrong option fails with pydantic's
message naming the field, before any model loads.
"""

from __future__ import annotations

from typing import Any, Mapping

from dyntree.common.config import SpecConfig
from dyntree.common.engine_options import OptionsError, parse_spec_options

__all__ = ["DEFAULT_MAX_NODES", "ENV", "parse_options", "OptionsError"]

#: The node budget unless the config sets one: with its root, one request's verify is then 16
#: query rows, one M-tile of the GEMM kernels vLLM's CPU backend runs (oneDNN's AMX kernels tile
#: the rows by 16: a 17th row costs a second tile in every linear layer).
DEFAULT_MAX_NODES = 15

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
    opts.setdefault("max_nodes", DEFAULT_MAX_NODES)
    spec = parse_spec_options(opts, "speculative_config", "vLLM")
    if spec.max_nodes < 1 or spec.max_nodes > 128:
        raise OptionsError(f"speculative_config.max_nodes={spec.max_nodes}: vLLM verifies 1..128 draft tokens per step")
    return spec
