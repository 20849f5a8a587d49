"""What Hydra heads borrow from a Hugging Face target model: its identity (hidden size,
vocabulary, tokenizer hash) and its frozen input-embedding and LM-head weights."""

from __future__ import annotations

import hashlib
import json
from typing import Any

import torch

from dyntree.common.hydra import TargetIdentity

__all__ = ["target_identity", "target_weights", "tokenizer_sha256"]


def tokenizer_sha256(tokenizer: Any) -> str:
    """sha256 of the tokenizer's vocabulary (token -> id, sorted), independent of file layout."""
    vocab = sorted(tokenizer.get_vocab().items(), key=lambda kv: kv[1])
    return hashlib.sha256(json.dumps(vocab, ensure_ascii=False).encode()).hexdigest()


def target_weights(model: Any) -> tuple[torch.Tensor, torch.Tensor]:
    """The target's input embedding and LM-head weight matrices, both ``[vocab, hidden]``."""
    embed = model.get_input_embeddings().weight.detach()
    lm_head = model.get_output_embeddings().weight.detach()
    return embed, lm_head


def target_identity(model: Any, tokenizer: Any, name: str) -> TargetIdentity:
    _, lm_head = target_weights(model)
    return TargetIdentity(
        name=name,
        hidden_size=int(model.config.hidden_size),
        vocab_size=int(lm_head.shape[0]),
        tokenizer_sha256=tokenizer_sha256(tokenizer),
    )
