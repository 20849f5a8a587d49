"""Engine adapters' speculation options: a mapping of :class:`~dyntree.common.config.SpecConfig`
fields, validated before any engine starts (no engine import).

Both adapters (vLLM's ``speculative_config``, SGLang's options file) end here, so a wrong option
fails the same way everywhere: pydantic's message naming the field, prefixed by where it came
from. ``drafter`` defaults to ``auto`` (the shipped Hydra heads when they fit the model, else
n-gram; resolved by :func:`~dyntree.common.drafters.make_engine_drafter` once the model is loaded).
"""

from __future__ import annotations

from typing import Any, Mapping

from pydantic import ValidationError

from dyntree.common.config import SpecConfig
from dyntree.common.drafters import AUTO, check_drafter_spec
from dyntree.common.quant import parse_qspec

__all__ = ["OptionsError", "parse_spec_options"]


class OptionsError(ValueError):
    """Engine options that cannot work (the message names the field, flag or feature)."""


def parse_spec_options(options: Mapping[str, Any], where: str, engine: str) -> SpecConfig:
    """Validate ``options`` (SpecConfig fields; ``-`` and ``_`` alike) for an engine adapter.

    ``where`` prefixes every message (``speculative_config``, the options file, ...); ``engine``
    names the adapter. The adaptive controller is on unless the options turn it off; the quantized
    self-draft runs weight-only quantization inside an engine (activation-quantized specs are
    refused)."""
    options = {"adaptive": True, "drafter": AUTO, **options}
    opts = {k.replace("-", "_"): v for k, v in options.items()}
    try:
        spec = SpecConfig(**opts)
    except ValidationError as exc:
        raise OptionsError(f"{where} is invalid: {exc}") from None
    try:
        check_drafter_spec(spec.drafter)
    except ValueError as exc:
        raise OptionsError(f"{where}.drafter: {exc}") from None
    name, _, qopts = spec.drafter.partition(":")
    if name.strip().lower() == "qspec":
        q = parse_qspec(qopts or None)
        if q.act_bits is not None or not q.quantized:
            raise OptionsError(f"{where}.drafter {spec.drafter!r}: inside {engine} the self-draft runs weight-only "
                               f"quantization (w8a16 or w4a16), not {q}")
    return spec
