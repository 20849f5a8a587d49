"""The LM head's fp16 screen (dyntree.kernels.screened_head) against its reference (the fp32 head's
argmax), with the control that the error bound is what keeps it exact; and how the vLLM plugin
wraps a model's ``compute_logits`` with it (dyntree.vllm_plugin.logits)."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from dyntree.common.config import SamplingParams
from dyntree.kernels.screened_head import ScreenedHead, reference_argmax

pytestmark = pytest.mark.skipif(not ScreenedHead.available(), reason="this torch lacks FBGEMM's fp16 GEMM")


def _head(w: torch.Tensor):
    calls: list[int] = []

    def head(h: torch.Tensor) -> torch.Tensor:
        calls.append(h.shape[0])
        return h @ w.T

    return head, calls


def _flip_pair(d: int = 64) -> tuple[torch.Tensor, torch.Tensor]:
    """A head whose fp16 copy puts token 2 above token 1 where the fp32 head puts token 1 first
    (each row's fp16 rounding moves its logit, in opposite directions), and a state that reads it."""
    w = torch.zeros(8, d)
    w[:, 2] = torch.linspace(-1, -0.5, 8)
    w[1, :2] = torch.tensor([1 + 4.8e-4, 1.0])  # fp16: (1, 1) -> 2.0 where fp32 reads 2.00048
    w[2, :2] = torch.tensor([1 + 5.2e-4, 1 - 1.0e-4])  # fp16: (1.00098, 1) -> 2.00098, fp32 2.00042
    h = torch.zeros(1, d)
    h[0, :2] = 1.0
    return w, h


def test_settled_rows_are_the_fp32_heads_argmax_and_the_rest_run_the_head() -> None:
    g = torch.Generator().manual_seed(0)
    w = torch.randn(4096, 96, generator=g) * 0.2
    h = torch.randn(300, 96, generator=g) * 6
    w[7] = w[9]  # an exact tie in the fp32 logits: never settled
    h[:20] = w[7] * 40  # rows whose best tokens are 7 and 9
    h[20:40] = w[100] * 40 + torch.randn(20, 96, generator=g) * 1e-3  # confident rows
    h[40, 5] = float("nan")
    screen = ScreenedHead.build(w)
    assert screen is not None
    head, calls = _head(w)
    want = reference_argmax(head, h)
    winners = screen.screen(h)
    settled = winners >= 0
    assert torch.equal(winners[settled], want[settled])
    assert not settled[:20].any() and settled[20:40].all() and not settled[40]
    assert settled.float().mean() > 0.8
    calls.clear()
    got = screen.logits(h, head)
    assert torch.equal(got.argmax(-1), want)
    assert calls == [int((~settled).sum())]  # the head ran on the unsettled rows only, once
    assert torch.isneginf(got[settled]).sum(-1).eq(w.shape[0] - 1).all()


def test_the_error_bound_keeps_an_fp16_reordering_exact() -> None:
    w, h = _flip_pair()
    head, _ = _head(w)
    w16 = torch.ops.quantized.linear_unpack_fp16(torch.ops.quantized.linear_prepack_fp16(w, None))[0]
    assert int(reference_argmax(head, h)) == 1 and int((h @ w16.T).argmax()) == 2  # the case is real
    screen = ScreenedHead.build(w)
    assert screen is not None
    assert int(screen.screen(h)) == 1  # settled by the candidates' float64 products
    # control: without the bound the screen settles on the fp16 copy's argmax, which is wrong
    screen.bound = torch.zeros_like(screen.bound)
    screen.bound_max = 0.0
    assert int(screen.screen(h)) == 2


def test_heads_it_cannot_screen_are_refused() -> None:
    w = torch.randn(64, 32)
    assert ScreenedHead.build(w.bfloat16()) is None
    assert ScreenedHead.build(w * 1e5) is None  # beyond fp16's range
    w[3, 3] = float("inf")
    assert ScreenedHead.build(w) is None


def _model(w: torch.Tensor, **processor) -> SimpleNamespace:
    head, calls = _head(w)
    lp = {"logits_as_input": False, "soft_cap": None, "scale": 1.0, "org_vocab_size": w.shape[0], **processor}
    model = SimpleNamespace(lm_head=SimpleNamespace(weight=w), logits_processor=SimpleNamespace(**lp),
                            compute_logits=head)
    model.calls = calls
    return model


def test_the_vllm_plugin_screens_greedy_steps_only() -> None:
    from dyntree.vllm_plugin.logits import SCREEN_MAX_ROWS, install_screen, screenable

    g = torch.Generator().manual_seed(1)
    w = torch.randn(2048, 64, generator=g) * 0.2
    h = w[[5, 6, 7]] * 40
    greedy, sampled = SamplingParams(), SamplingParams(temperature=0.7)
    proposer = SimpleNamespace(step=None)
    model = _model(w)
    assert install_screen(model, proposer)  # type: ignore[arg-type]

    def rows_through_the_head(params: dict, hidden: torch.Tensor = h) -> int:
        proposer.step = SimpleNamespace(params=params)
        model.calls.clear()
        out = model.compute_logits(hidden)
        assert torch.equal(out.argmax(-1), (hidden @ w.T).argmax(-1))
        return sum(model.calls)

    assert rows_through_the_head({"a": greedy, "b": greedy}) == 0
    assert rows_through_the_head({"a": greedy, "b": sampled}) == 3  # sampling reads every logit
    assert rows_through_the_head({"a": greedy, "b": None}) == 3  # a request vLLM samples itself
    many = w[torch.arange(SCREEN_MAX_ROWS + 1)] * 40
    assert rows_through_the_head({"a": greedy}, many) == SCREEN_MAX_ROWS + 1
    # models whose logits are more than h W^T keep their head
    assert screenable(_model(w)) is not None
    for extra in ({"soft_cap": 30.0}, {"scale": 0.5}, {"logits_as_input": True}):
        assert screenable(_model(w, **extra)) is None
    padded = _model(torch.cat([w, torch.zeros(64, 64)]), org_vocab_size=2048)
    assert screenable(padded).shape[0] == 2048  # type: ignore[union-attr]
