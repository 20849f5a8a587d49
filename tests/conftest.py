"""Shared fixtures: the real model in fp32 and chat-formatted Spec-Bench prompts."""

from __future__ import annotations

import pytest
import torch

from spec_support import spec_bench


@pytest.fixture(scope="session")
def smol():
    """SmolLM2-135M-Instruct in fp32 (exactness tests belong in fp32)."""
    from dyntree.models import load_model

    return load_model("smollm2", torch.float32)


@pytest.fixture(scope="session")
def smol_prompts(smol):
    """Chat-formatted token ids of 20 Spec-Bench prompts spread over all categories."""
    from dyntree.standalone.bench import encode_prompt

    _, tok = smol
    return [encode_prompt(tok, q["turns"][0], chat=True) for q in spec_bench(20, stride=24)]
