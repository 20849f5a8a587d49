"""Key/value storage that grows in place: a cache's keys and values are views of the first
slots of buffers with spare slots after them, so appending writes only the new tokens instead of
copying the whole cache (what ``torch.cat`` does on every call).

Three caches use it: the standalone engine's target cache (:mod:`dyntree.standalone.kv`), the
quantized self-draft's per-step scratch (:class:`~dyntree.common.fused_draft.ScratchKV`) and the
Hydra prefix layer's cache of a lone sequence (:class:`~dyntree.common.hydra.PrefixKV`).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

__all__ = ["KVStore", "append_kv"]


@dataclass
class KVStore:
    """``[B, H, capacity, D]`` keys and values, of which the first ``used`` slots hold the newest
    cache made from them (a view of those slots is that cache). Both live in one buffer
    ``[2, B, H, capacity, D]``, so one gather and one scatter move a slot's keys and values."""

    buffer: torch.Tensor
    used: int
    keys: torch.Tensor = field(init=False, repr=False)  # buffer[0] and buffer[1], made once
    values: torch.Tensor = field(init=False, repr=False)

    def __post_init__(self) -> None:
        self.keys, self.values = self.buffer[0], self.buffer[1]

    @property
    def nbytes(self) -> int:
        return self.buffer.numel() * self.buffer.element_size()

    def holds(self, keys: torch.Tensor, values: torch.Tensor) -> bool:
        """Whether ``keys``/``values`` are this storage's newest cache (its first ``used`` slots)."""
        return keys.shape[2] == self.used and _leads(keys, self.keys) and _leads(values, self.values)

    def crop(self, length: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Keep the first ``length`` slots (at most ``used``) as the newest cache; returns its views."""
        self.used = min(length, self.used)
        return self.keys[:, :, : self.used], self.values[:, :, : self.used]


def _leads(view: torch.Tensor, buf: torch.Tensor) -> bool:
    """Whether ``view`` is ``buf[:, :, :n]`` for some ``n``."""
    return (view.dim() == 4 and view.data_ptr() == buf.data_ptr() and view.shape[:2] == buf.shape[:2]
            and view.shape[3] == buf.shape[3] and view.stride() == buf.stride())


def append_kv(keys: torch.Tensor | None, values: torch.Tensor | None, new_keys: torch.Tensor,
              new_values: torch.Tensor, store: KVStore | None, spare: int) -> tuple[torch.Tensor, torch.Tensor, KVStore]:
    """``keys``/``values`` (``[B, H, n, D]``; ``None``: empty) followed by ``new_keys``/``new_values``
    (``[B, H, t, D]``) along the slots: views of the first ``n + t`` slots of a storage, and that
    storage.

    Written in place into ``store`` when ``keys``/``values`` are its newest cache and the new slots
    fit (an older cache of the same storage, a branch, must not overwrite a newer one); otherwise
    into new storage of ``n + t + spare`` slots, the cache copied into it once."""
    n = 0 if keys is None else keys.shape[2]
    t = new_keys.shape[2]
    in_place = (store is not None and n + t <= store.keys.shape[2]
                and (store.holds(keys, values) if keys is not None and values is not None else store.used == 0))
    if not in_place:
        shape = (2, *new_keys.shape[:2], n + t + max(spare, 0), new_keys.shape[3])
        store = KVStore(new_keys.new_empty(shape), n)
        if keys is not None and values is not None and n:
            store.keys[:, :, :n], store.values[:, :, :n] = keys, values
    assert store is not None
    store.keys[:, :, n : n + t] = new_keys
    store.values[:, :, n : n + t] = new_values
    store.used = n + t
    return store.keys[:, :, : n + t], store.values[:, :, : n + t], store
