"""A step's draft tokens ride back to vLLM's engine core with the step's own output.

With a speculative method and synchronous scheduling (dyntree's), vLLM's engine core asks the
worker for the drafts in a second RPC after every step (``EngineCore.post_step`` calls the
executor's ``take_draft_token_ids``), whether anything was drafted or not: between processes
(``vllm serve``) a round trip on every step (``docs/vllm.md`` has its cost). Here the worker
puts the same :class:`DraftTokenIds` (what ``take_draft_token_ids`` would return then: the runner
only reads them) on the step's ``ModelRunnerOutput`` (:func:`attach`), the scheduler keeps them as
it takes the output in (``Scheduler.update_from_output``), and ``post_step`` hands them to the
scheduler exactly as vLLM's own would, without the RPC (:func:`install`). A step whose output
carries none (another engine's, an empty step's) goes vLLM's own way. vLLM 0.32 (CPU) and 0.26
(CUDA) have the same ``post_step``.
"""

from __future__ import annotations

from typing import Any

__all__ = ["DRAFTS", "attach", "install"]

#: The attribute of vLLM's ``ModelRunnerOutput`` (and, until ``post_step``, of its scheduler) that
#: carries the step's drafts.
DRAFTS = "dyntree_drafts"

_NONE = object()


def attach(runner: Any, output: Any) -> None:
    """Put ``runner``'s drafts for the next step on ``output``, the ``ModelRunnerOutput`` its
    ``sample_tokens`` returns (``None`` when it drafted nothing: vLLM's own answer then)."""
    from vllm.v1.outputs import EMPTY_MODEL_RUNNER_OUTPUT, ModelRunnerOutput

    if type(output) is ModelRunnerOutput and output is not EMPTY_MODEL_RUNNER_OUTPUT:
        drafts = runner.take_draft_token_ids()
        if drafts is not None:  # the batch's ids as they are now, not the list the runner mutates
            drafts = type(drafts)(list(drafts.req_ids), drafts.draft_token_ids)
        setattr(output, DRAFTS, drafts)


def install(engine_core_cls: type, scheduler_cls: type) -> None:
    """Wrap ``scheduler_cls.update_from_output`` to keep an output's drafts and
    ``engine_core_cls.post_step`` to use them (idempotent); raises if vLLM moved either."""
    if getattr(engine_core_cls, "_dyntree_inline", False):
        return
    take_in, post = getattr(scheduler_cls, "update_from_output", None), getattr(engine_core_cls, "post_step", None)
    if take_in is None or post is None or not hasattr(scheduler_cls, "update_draft_token_ids"):
        raise RuntimeError(f"dyntree: vLLM's {scheduler_cls.__name__}.update_from_output / update_draft_token_ids or "
                           f"{engine_core_cls.__name__}.post_step is gone; this vLLM is not supported")

    def update_from_output(self: Any, scheduler_output: Any, model_runner_output: Any) -> Any:
        self.__dict__[DRAFTS] = getattr(model_runner_output, DRAFTS, _NONE)
        return take_in(self, scheduler_output, model_runner_output)

    def post_step(self: Any, model_executed: bool) -> None:
        drafts = self.scheduler.__dict__.pop(DRAFTS, _NONE)
        if drafts is _NONE:  # not carried: vLLM asks the worker
            post(self, model_executed)
        elif drafts is not None and self.check_for_draft_tokens and not self.async_scheduling and model_executed:
            self.scheduler.update_draft_token_ids(drafts)  # vLLM's own condition and call, without the RPC

    scheduler_cls.update_from_output = update_from_output
    engine_core_cls.post_step = post_step
    engine_core_cls._dyntree_inline = True
