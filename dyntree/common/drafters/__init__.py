"""The drafters and their registry: a ``--drafter`` spec ``name[:options]`` -> a drafter.

Built in: ``none`` (plain decoding), ``ngram`` (prompt lookup), ``hydra`` (trained heads; needs
``target=TargetInfo``), ``qspec`` (quantized self-draft; the engine attaches its forward).
:func:`register_drafter` adds more. ``check`` functions validate options without building
anything, so a CLI or an engine plugin can refuse a bad spec before it loads a model.
``auto`` (:data:`AUTO`) names no drafter of its own: :func:`make_engine_drafter`, which every
engine (the standalone CLI, vLLM, SGLang) calls once the target is loaded, resolves it to the
shipped Hydra heads when they fit the target, else to ``ngram``.
"""

from __future__ import annotations

from typing import Any, Callable

from dyntree.common.drafter import Drafter, NoDrafter, TargetInfo
from dyntree.common.drafters.hydra import make_hydra_drafter, parse_hydra_options
from dyntree.common.hydra import HydraMismatchError
from dyntree.common.drafters.ngram import NgramDrafter, parse_ngram_options
from dyntree.common.drafters.qspec import make_qspec_drafter
from dyntree.common.quant import parse_qspec

__all__ = ["AUTO", "register_drafter", "make_drafter", "make_engine_drafter", "check_drafter_spec", "drafter_names"]

#: The spec that lets the engine pick: the shipped Hydra heads when they fit the target, else n-gram.
AUTO = "auto"

Factory = Callable[..., Drafter]
Check = Callable[[str | None], object]


def _no_options(options: str | None) -> None:
    if options:
        raise ValueError(f"drafter 'none' takes no options, got {options!r}")


_REGISTRY: dict[str, tuple[Factory, Check | None]] = {
    "none": (lambda options=None, **_: NoDrafter(), _no_options),
    "ngram": (lambda options=None, **_: NgramDrafter(parse_ngram_options(options)), parse_ngram_options),
    "hydra": (make_hydra_drafter, parse_hydra_options),
    "qspec": (make_qspec_drafter, parse_qspec),
}


def register_drafter(name: str, check: Check | None = None) -> Callable[[Factory], Factory]:
    """Register ``factory(options: str | None, **context) -> Drafter`` under ``name``.

    ``options`` is the text after ``name:``; ``context`` carries what the engine offers
    (``target=TargetInfo``, ...), which a factory takes or ignores by keyword. ``check(options)``
    validates the options without building anything and raises ``ValueError``."""

    def deco(factory: Factory) -> Factory:
        _REGISTRY[name] = (factory, check)
        return factory

    return deco


def drafter_names() -> list[str]:
    return sorted(_REGISTRY)


def _split(spec: str) -> tuple[str, str | None]:
    name, _, options = spec.partition(":")
    name = name.strip().lower()
    if name not in _REGISTRY:
        raise ValueError(f"unknown drafter {spec!r}; choose one of: {', '.join(sorted(_REGISTRY))}")
    return name, options or None


def check_drafter_spec(spec: str) -> None:
    """Validate a spec ``name[:options]`` or :data:`AUTO` without building the drafter (no model needed)."""
    if spec == AUTO:
        return
    name, options = _split(spec)
    check = _REGISTRY[name][1]
    if check is not None:
        check(options)


def make_drafter(spec: str, **context: Any) -> Drafter:
    """Build a drafter from a spec ``name[:options]``; unknown names raise ``ValueError``."""
    name, options = _split(spec)
    return _REGISTRY[name][0](options, **context)


def make_engine_drafter(spec: str, target: Callable[[], TargetInfo]) -> tuple[Drafter, str]:
    """The drafter an engine adapter runs, and its resolved spec.

    ``spec`` may be :data:`AUTO`: the shipped Hydra heads when they fit the target, else ``ngram``.
    ``target()`` describes the loaded target (embeddings, LM head, tokenizer hash); it is called
    only for drafters that read it."""
    name, _ = _split(spec) if spec != AUTO else (AUTO, None)
    if name not in ("hydra", AUTO):
        return make_drafter(spec), spec
    info = target()
    if name == "hydra":
        return make_drafter(spec, target=info), spec
    try:
        return make_drafter("hydra", target=info), "hydra"
    except HydraMismatchError:
        return make_drafter("ngram"), "ngram"
