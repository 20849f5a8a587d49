"""User-facing configuration: what to speculate with (:class:`SpecConfig`) and how to sample
(:class:`SamplingParams`). Pydantic models with ``extra="forbid"``, so a misspelt or invalid field
fails with an error that names it. The engine adapters parse ``speculative_config`` into
:class:`SpecConfig` too.
"""

from __future__ import annotations

from typing import Any

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

from dyntree.common.options import Budget, ControllerOptions, TreeMode, TreeOptions

__all__ = ["SpecConfig", "SamplingParams"]


class SpecConfig(BaseModel):
    """How to speculate.

    ``drafter`` is a drafter spec ``name[:options]`` (``none``, ``ngram``, ...); ``max_nodes``
    bounds the draft nodes per tree (the root is not counted) and ``max_depth`` their depth.

    ``tree`` picks the tree shape: ``None`` = the drafter's own trees (its ``propose``, or the
    builder's ``beam`` shape for drafters without one); ``chain``, ``static``, ``dyntree`` or
    ``beam`` = the :class:`~dyntree.common.builder.TreeBuilder` over the drafter's ``expand``
    (``tree_options`` tunes it). ``adaptive`` turns on the speculation
    controller, which sets each request's node and depth budget per step (at most ``max_nodes`` /
    ``max_depth``) and may fall back to plain decoding; ``controller`` tunes it. The budget and
    mode live here only (:meth:`budget`; the builder and the controller are handed them).
    ``screened_head``: greedy steps find each row's argmax through an fp16 copy of an fp32 LM head
    with an exact error bound, and run the head itself only on rows the copy cannot settle
    (:mod:`dyntree.kernels.screened_head`; the vLLM plugin on x86 CPUs; outputs unchanged).
    """

    model_config = ConfigDict(extra="forbid", frozen=True)

    drafter: str = Field("ngram", min_length=1)
    max_nodes: int = Field(16, ge=0, le=256)
    max_depth: int = Field(8, ge=0, le=64)
    tree: TreeMode | None = None
    adaptive: bool = False
    tree_options: TreeOptions = TreeOptions()
    controller: ControllerOptions = ControllerOptions()
    screened_head: bool = True

    @model_validator(mode="before")
    @classmethod
    def _budget_in_one_place(cls, data: Any) -> Any:
        """``tree_options.mode`` / ``.max_nodes`` / ``.max_depth`` and ``controller.max_nodes`` /
        ``.max_depth`` are not options: say where they belong."""
        if isinstance(data, dict):
            for name in ("tree_options", "controller"):
                given = data.get(name)
                fields = set(given) if isinstance(given, dict) else set()
                for field in sorted(fields & {"mode", "max_nodes", "max_depth"}):
                    use = "tree" if field == "mode" else field
                    raise ValueError(f"{name}.{field} is not an option of {name}: use SpecConfig.{use}")
        return data

    @property
    def budget(self) -> Budget:
        """The largest tree per request (a tree is never deeper than its node count)."""
        return Budget(self.max_nodes, min(self.max_depth, self.max_nodes))

    def controller_options(self, acceptance_prior: float | None = None,
                           level_ms: float | None = None) -> ControllerOptions:
        """The controller's options: chains only in ``chain`` mode, the drafter's
        ``acceptance_prior`` unless ``alpha_prior`` was set explicitly, and ``level_ms`` (the
        drafter's price of a level per drafting request) unless ``draft_ms_per_depth_row`` was."""
        update: dict[str, object] = {}
        if acceptance_prior is not None and "alpha_prior" not in self.controller.model_fields_set:
            update["alpha_prior"] = acceptance_prior
        if level_ms is not None and "draft_ms_per_depth_row" not in self.controller.model_fields_set:
            update["draft_ms_per_depth_row"] = level_ms
        if self.tree == "chain":
            update["allow_trees"] = False
        return self.controller.model_copy(update=update)


class SamplingParams(BaseModel):
    """How to pick tokens; ``temperature == 0`` is greedy."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    max_new_tokens: int = Field(128, ge=1)
    temperature: float = Field(0.0, ge=0.0)
    top_k: int = Field(0, ge=0, description="0 = no top-k filter")
    top_p: float = Field(1.0, gt=0.0, le=1.0)
    seed: int | None = Field(None, ge=0, lt=2**63)
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
