"""The drafter contract: what every draft source (n-gram lookup, Hydra heads, quantized
self-draft) implements, and the registry that turns a ``--drafter`` spec into an instance.

A drafter sees one :class:`DraftRequest` per live request and returns one
:class:`~dyntree.common.tree.DraftTree` per request, rooted at the request's last committed
token. It never sees engine internals beyond what the request carries; engines translate their
own state into requests (the standalone engine, the vLLM and SGLang adapters).
"""

from __future__ import annotations

import importlib
from abc import ABC, abstractmethod
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Callable, ClassVar, Hashable, Sequence

import torch

from dyntree.common.tree import DraftTree

if TYPE_CHECKING:
    from dyntree.common.builder import PartialTree

__all__ = ["DraftRequest", "Drafter", "NoDrafter", "register_drafter", "make_drafter",
           "check_drafter_spec", "drafter_names"]


@dataclass
class DraftRequest:
    """Everything a drafter may use to propose a tree for one request.

    Attributes:
        request_id: engine-unique id, stable for the request's life.
        token_ids: all committed tokens (prompt + generated); the last one is the tree root.
        max_nodes: the most *draft* nodes the tree may hold (the root is not counted).
        max_depth: the deepest a draft node may sit (root depth 0).
        hidden: the target's last-layer hidden state (after the final norm, i.e. the LM-head
            input) at the committed token *before* the root: the state whose logits produced the
            root. ``None`` when the engine has none (a one-token prompt) or the drafter does not
            ask for it.
        row: the request's row in the engine's batched target KV cache (for self-drafting).
        kv_len: how many committed tokens the target KV cache holds for this request
            (``len(token_ids) - 1``: the root is not cached yet).
        new_hidden: ``[n_new, d]`` the target's last-layer hidden states (same kind as
            ``hidden``) of the committed tokens at positions ``kv_len - n_new .. kv_len - 1``
            (``token_ids[kv_len - n_new : kv_len]``), one row per token in position order: every
            position whose state the engine computed since it last handed this request to the
            drafter (at the first call: the prompt positions ``0 .. kv_len - 1``; later: the
            tokens accepted by the verify steps since, root included, bonus excluded). So
            ``new_hidden[-1]`` is ``hidden``, and the rows of all calls for a request, in order,
            cover positions ``0 .. kv_len - 1`` exactly once. The root (position ``kv_len``) is
            never included: its state is computed by the next verify step. ``None`` when there
            are no new rows or the drafter does not ask for them (``needs_new_hidden``). A
            request handed over several times in one step (one :meth:`Drafter.expand_batch`
            call per depth) carries the same rows each time.
    """

    request_id: Hashable
    token_ids: Sequence[int]
    max_nodes: int
    max_depth: int
    hidden: torch.Tensor | None = None
    row: int = 0
    kv_len: int = 0
    new_hidden: torch.Tensor | None = None

    @property
    def root(self) -> int:
        return int(self.token_ids[-1])


class Drafter(ABC):
    """Proposes draft trees. Subclasses set ``name`` and implement :meth:`propose`.

    Class flags tell the engine what to supply:
        needs_hidden: fill :attr:`DraftRequest.hidden`.
        needs_new_hidden: fill :attr:`DraftRequest.new_hidden` (the hidden states of every
            committed token, delivered once; for drafters that keep a state over the whole
            prefix). A class or instance attribute: a drafter may decide it per instance.
        needs_target_kv: pass the engine's target KV cache object as ``target_kv`` to
            :meth:`propose` (self-drafting reads the target's prefix KV; it must not modify it).
        samples: the trees carry ``draft_dists`` (required for lossless sampling).
        drafts_with_builder: the drafter implements :meth:`expand_batch`, so the engine can shape
            its trees with :class:`~dyntree.common.builder.TreeBuilder` (``SpecConfig.tree`` =
            ``chain`` / ``static`` / ``dyntree``) instead of calling :meth:`propose`.
    """

    name: ClassVar[str] = ""
    needs_hidden: ClassVar[bool] = False
    needs_new_hidden: bool = False
    needs_target_kv: ClassVar[bool] = False
    samples: ClassVar[bool] = False
    drafts_with_builder: ClassVar[bool] = False

    @abstractmethod
    def propose(self, requests: Sequence[DraftRequest], target_kv: Any = None) -> list[DraftTree]:
        """One tree per request, in order; a tree may be just the root (no speculation)."""

    def expand_batch(
        self,
        requests: Sequence[DraftRequest],
        frontiers: Sequence[Sequence[int]],
        partials: Sequence["PartialTree"],
        vocab_size: int,
        target_kv: Any = None,
    ) -> list[torch.Tensor]:
        """Score the next token after frontier nodes of trees under construction (tree modes).

        Called once per depth for the whole batch. ``frontiers[b]`` lists node indices of
        ``partials[b]`` (the tree being grown for ``requests[b]``; ``partials[b].path_tokens(i)``
        gives the tokens from the root to node ``i``). A call whose partial trees hold only their
        roots starts a new step. Returns one ``[len(frontiers[b]), vocab_size]`` float tensor per
        request: logits or log-probabilities of the token after each frontier node, ``-inf`` for
        tokens the drafter rules out (a row of all ``-inf``: no children). The engine shapes them
        with the request's temperature / top-k / top-p exactly like the target's logits.
        Only drafters with ``drafts_with_builder = True`` implement this.
        """
        raise NotImplementedError(f"drafter {self.name!r} does not implement expand_batch (drafts_with_builder is False)")

    def observe(self, request_id: Hashable, token_ids: Sequence[int], accepted_depth: int) -> None:
        """Called after each verify step with the request's full committed tokens and how many
        draft tokens were accepted (0 = only the bonus token). Default: nothing."""

    def release(self, request_id: Hashable) -> None:
        """The request finished; drop any per-request state. Default: nothing."""


class NoDrafter(Drafter):
    """Plain decoding through the same engine: every tree is just the root."""

    name = "none"

    def propose(self, requests: Sequence[DraftRequest], target_kv: Any = None) -> list[DraftTree]:
        return [DraftTree.root_only(r.root) for r in requests]


_REGISTRY: dict[str, Callable[..., Drafter]] = {}
_CHECKS: dict[str, Callable[[str | None], None]] = {}
#: Modules whose import registers the built-in drafters (imported on first registry use).
_BUILTIN_MODULES = ("dyntree.common.ngram", "dyntree.standalone.hydra_drafter", "dyntree.standalone.qspec")


def register_drafter(
    name: str, check: Callable[[str | None], None] | None = None
) -> Callable[[Callable[..., Drafter]], Callable[..., Drafter]]:
    """Register a factory ``factory(options: str | None, **context) -> Drafter`` under ``name``.

    ``options`` is the text after ``name:`` in a spec such as ``qspec:w4a16,g128``; ``context``
    carries what the engine can offer (``model``, ``tokenizer``, ...), which a factory takes or
    ignores by keyword. ``check(options)``, if given, validates the options without building
    anything (so a CLI can refuse a bad spec before loading a model); it raises ``ValueError``.
    """

    def deco(factory: Callable[..., Drafter]) -> Callable[..., Drafter]:
        _REGISTRY[name] = factory
        if check is not None:
            _CHECKS[name] = check
        return factory

    return deco


register_drafter("none")(lambda options=None, **_: NoDrafter())


def drafter_names() -> list[str]:
    _load_builtin_drafters()
    return sorted(_REGISTRY)


def _split(spec: str) -> tuple[str, str | None]:
    _load_builtin_drafters()
    name, _, options = spec.partition(":")
    name = name.strip().lower()
    if name not in _REGISTRY:
        raise ValueError(f"unknown drafter {spec!r}; choose one of: {', '.join(sorted(_REGISTRY))}")
    return name, options or None


def check_drafter_spec(spec: str) -> None:
    """Validate a spec ``name[:options]`` without building the drafter (no model needed)."""
    name, options = _split(spec)
    if name in _CHECKS:
        _CHECKS[name](options)


def make_drafter(spec: str, **context: Any) -> Drafter:
    """Build a drafter from a spec ``name[:options]``; unknown names raise ``ValueError``."""
    name, options = _split(spec)
    return _REGISTRY[name](options, **context)


def _load_builtin_drafters() -> None:
    for module in _BUILTIN_MODULES:
        importlib.import_module(module)
