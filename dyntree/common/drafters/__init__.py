"""The drafters and their registry: a ``--drafter`` spec ``name[:options]`` -> a drafter.

Built in: ``none`` (plain decoding), ``ngram`` (prompt lookup), ``hydra`` (trained heads; needs
``target=TargetInfo``), ``qspec`` (quantized self-draft; the engine attaches its forward).
:func:`register_drafter` adds more. ``check`` functions validate options without building
anything, so a CLI or an engine plugin can refuse a bad spec before it loads a model.
Specs joined by ``+`` (``hydra+ngram``) make one :class:`~dyntree.common.drafters.union.UnionDrafter`
whose trees offer every part's candidates at every node. ``auto`` (:data:`AUTO`) names no drafter
of its own: :func:`make_engine_drafter`, which every engine (the standalone CLI, vLLM, SGLang)
calls once the target is loaded, resolves it to the shipped Hydra heads united with the n-gram
index (``hydra+ngram``) when the heads fit the target, else to ``ngram``.
"""

from __future__ import annotations

from typing import Any, Callable

from dyntree.common.drafter import Drafter, NoDrafter, TargetInfo
from dyntree.common.drafters.hydra import make_hydra_drafter, parse_hydra_options
from dyntree.common.hydra import HydraMismatchError
from dyntree.common.drafters.ngram import NgramDrafter, parse_ngram_options
from dyntree.common.drafters.union import UnionDrafter
from dyntree.common.drafters.qspec import make_qspec_drafter
from dyntree.common.quant import parse_qspec

__all__ = ["AUTO", "AUTO_HYDRA", "register_drafter", "make_drafter", "make_engine_drafter", "check_drafter_spec", "drafter_names"]

#: The spec that lets the engine pick: the shipped Hydra heads with n-gram when they fit the target, else n-gram.
AUTO = "auto"
#: What :data:`AUTO` resolves to when the shipped heads fit the target.
AUTO_HYDRA = "hydra+ngram"

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


def _parts(spec: str) -> list[str]:
    parts = [p.strip() for p in spec.split("+")]
    if len(parts) > 1 and (not all(parts) or len({_split(p)[0] for p in parts}) != len(parts)):
        raise ValueError(f"drafter spec {spec!r}: join distinct drafters with '+', e.g. hydra+ngram")
    return parts


def check_drafter_spec(spec: str) -> None:
    """Validate a spec ``name[:options]`` (or several joined by ``+``) or :data:`AUTO` without
    building the drafter (no model needed)."""
    if spec == AUTO:
        return
    parts = _parts(spec)
    for part in parts:
        name, options = _split(part)
        if len(parts) > 1 and name in ("none", "qspec"):
            raise ValueError(f"drafter spec {spec!r}: {name!r} cannot be joined with another drafter")
        check = _REGISTRY[name][1]
        if check is not None:
            check(options)


def make_drafter(spec: str, **context: Any) -> Drafter:
    """Build a drafter from a spec ``name[:options]``, or a union of several joined by ``+``;
    unknown names raise ``ValueError``."""
    parts = _parts(spec)
    if len(parts) > 1:
        check_drafter_spec(spec)
        return UnionDrafter([make_drafter(p, **context) for p in parts])
    name, options = _split(spec)
    return _REGISTRY[name][0](options, **context)


def make_engine_drafter(spec: str, target: Callable[[], TargetInfo]) -> tuple[Drafter, str]:
    """The drafter an engine adapter runs, and its resolved spec.

    ``spec`` may be :data:`AUTO`: the shipped Hydra heads with the n-gram index (:data:`AUTO_HYDRA`)
    when they fit the target, else ``ngram``. ``target()`` describes the loaded target
    (embeddings, LM head, tokenizer hash); it is called only for drafters that read it."""
    names = {AUTO} if spec == AUTO else {_split(p)[0] for p in _parts(spec)}
    if not names & {"hydra", AUTO}:
        return make_drafter(spec), spec
    info = target()
    if AUTO not in names:
        return make_drafter(spec, target=info), spec
    try:
        return make_drafter(AUTO_HYDRA, target=info), AUTO_HYDRA
    except HydraMismatchError:
        return make_drafter("ngram"), "ngram"
