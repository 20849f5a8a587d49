"""User-facing configuration: what to speculate with (:class:`SpecConfig`) and how to sample
(:class:`SamplingParams`). Pydantic models with ``extra="forbid"``, so a misspelt or invalid field
fails with an error that names it. The engine adapters parse ``speculative_config`` into
:class:`SpecConfig` too.
"""

from __future__ import annotations

from pydantic import BaseModel, ConfigDict, Field, field_validator

__all__ = ["SpecConfig", "SamplingParams"]


class SpecConfig(BaseModel):
    """How to speculate.

    ``drafter`` is a drafter spec ``name[:options]`` (``none``, ``ngram``, ...); ``max_nodes``
    bounds the draft nodes per tree (the root is not counted) and ``max_depth`` their depth.
    """

    model_config = ConfigDict(extra="forbid", frozen=True)

    drafter: str = Field("ngram", min_length=1)
    max_nodes: int = Field(16, ge=0, le=256)
    max_depth: int = Field(8, ge=0, le=64)


class SamplingParams(BaseModel):
    """How to pick tokens; ``temperature == 0`` is greedy."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    max_new_tokens: int = Field(128, ge=1)
    temperature: float = Field(0.0, ge=0.0)
    top_k: int = Field(0, ge=0, description="0 = no top-k filter")
    top_p: float = Field(1.0, gt=0.0, le=1.0)
    seed: int | None = None
    stop: tuple[str, ...] = ()
    ignore_eos: bool = False

    @field_validator("stop")
    @classmethod
    def _nonempty_stops(cls, v: tuple[str, ...]) -> tuple[str, ...]:
        if any(not s for s in v):
            raise ValueError("stop strings must be non-empty")
        return v

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0
