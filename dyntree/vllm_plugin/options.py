"""``speculative_config={"method": "dyntree", ...}``: parsing and start-up checks (no vLLM import).

The options are the project's own :class:`~dyntree.common.config.SpecConfig` fields (``drafter``,
``tree``, ``max_nodes``, ``max_depth``, ``adaptive``, ``tree_options``, ``controller``) plus
vLLM's ``method`` and ``num_speculative_tokens`` (an alias of ``max_nodes``). A wrong option fails
with pydantic's message naming the field, before any model loads. ``drafter`` defaults to
``auto``: the shipped Hydra heads when they fit the model, else ``ngram``.
"""

from __future__ import annotations

from typing import Any, Mapping

from pydantic import ValidationError

from dyntree.common.config import SpecConfig
from dyntree.common.drafters import check_drafter_spec

__all__ = ["ENV", "parse_options", "OptionsError"]

#: The environment variable that carries the validated options from the front end to the workers.
ENV = "DYNTREE_VLLM_OPTIONS"


class OptionsError(ValueError):
    """A ``dyntree`` speculative_config that cannot work (the message names the field or feature)."""


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
    auto = opts.get("drafter", "auto") == "auto"
    if auto:
        opts["drafter"] = "ngram"  # validated as a placeholder; the worker picks hydra when the heads fit
    try:
        spec = SpecConfig(**opts)
    except ValidationError as exc:
        raise OptionsError(f"speculative_config for method 'dyntree' is invalid: {exc}") from None
    try:
        check_drafter_spec(spec.drafter)
    except ValueError as exc:
        raise OptionsError(f"speculative_config.drafter: {exc}") from None
    if spec.max_nodes < 1 or spec.max_nodes > 128:
        raise OptionsError(f"speculative_config.max_nodes={spec.max_nodes}: vLLM verifies 1..128 draft tokens per step")
    if spec.adaptive:
        raise OptionsError("speculative_config.adaptive: the adaptive controller is not wired into the vLLM adapter yet; "
                           "leave adaptive false")
    if spec.drafter.partition(":")[0].strip().lower() == "qspec":
        raise OptionsError("speculative_config.drafter 'qspec': the quantized self-draft does not run inside vLLM yet "
                           "(use ngram or hydra)")
    return spec.model_copy(update={"drafter": "auto"}) if auto else spec
