"""What vLLM's worker cannot see of its scheduler: how many requests wait for a place in the batch.

vLLM's scheduler owns the queue, and its ``SchedulerOutput`` tells the worker what runs, not what
waits. :func:`install` wraps ``Scheduler.schedule`` so that every output also carries
:data:`WAITING` (the scheduler's own count, ``get_request_counts``), which the runner hooks read
(:func:`waiting`) and hand to the speculator: with nothing waiting, a request that finishes early
frees a place nobody takes, so the controller plans for the pace of the request that will finish
last (``ControllerOptions.objective``).
"""

from __future__ import annotations

from typing import Any

__all__ = ["WAITING", "install", "waiting"]

#: The attribute of vLLM's ``SchedulerOutput`` that holds the waiting requests' count.
WAITING = "dyntree_waiting"


def install(scheduler_cls: type) -> None:
    """Wrap ``scheduler_cls.schedule`` once (idempotent); raises if vLLM moved what it needs."""
    if getattr(scheduler_cls, "_dyntree_patched", False):
        return
    orig = getattr(scheduler_cls, "schedule", None)
    if orig is None or not hasattr(scheduler_cls, "get_request_counts"):
        raise RuntimeError(f"dyntree: vLLM's {scheduler_cls.__name__}.schedule or .get_request_counts is gone; "
                           "this vLLM is not supported")

    def schedule(self: Any, *args: Any, **kwargs: Any) -> Any:
        out = orig(self, *args, **kwargs)
        setattr(out, WAITING, int(self.get_request_counts()[1]))
        return out

    scheduler_cls.schedule = schedule
    scheduler_cls._dyntree_patched = True


def waiting(scheduler_output: Any) -> int | None:
    """The waiting requests' count a wrapped scheduler put on its output (``None``: not known)."""
    return getattr(scheduler_output, WAITING, None)
