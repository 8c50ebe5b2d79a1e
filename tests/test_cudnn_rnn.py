"""cuDNN's RNN has no fake kernel that knows its memory, so traces on fake CUDA tensors run RNN
modules on PyTorch's native RNN kernels. The switch is checked here on CPU; tests/test_gpu.py traces
an LSTM on fake CUDA tensors where a GPU is present."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from memfit.tracing.model_state import cudnn_rnn_disabled


class _Recording(nn.LSTM):
    """An LSTM that writes down whether cuDNN was on while it ran."""

    seen: list[bool]

    def forward(self, *args, **kwargs):  # type: ignore[override]
        self.seen.append(torch.backends.cudnn.enabled)
        return super().forward(*args, **kwargs)


class _Model(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.before = nn.Linear(4, 4)
        self.rnn = _Recording(4, 4, batch_first=True)
        self.rnn.seen = []
        self.seen_after: list[bool] = []

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out, _ = self.rnn(self.before(x))
        self.seen_after.append(torch.backends.cudnn.enabled)
        return out


def test_cudnn_is_off_inside_rnn_modules_only_and_restored() -> None:
    model = _Model()
    assert torch.backends.cudnn.enabled
    with cudnn_rnn_disabled(model):
        model(torch.randn(2, 3, 4)).sum().backward()
        model(torch.randn(2, 3, 4))
    assert model.rnn.seen == [False, False]
    assert model.seen_after == [True, True]  # convolutions and the rest keep cuDNN
    assert torch.backends.cudnn.enabled
    assert not model.rnn._forward_pre_hooks and not model.rnn._forward_hooks


def test_a_failing_rnn_forward_leaves_cudnn_as_it_was() -> None:
    model = _Model()
    with pytest.raises(RuntimeError), cudnn_rnn_disabled(model):
        model.rnn(torch.randn(2, 3, 5))  # wrong feature size: the LSTM raises inside its forward
    assert model.rnn.seen == [False]
    assert torch.backends.cudnn.enabled
    assert not model.rnn._forward_pre_hooks and not model.rnn._forward_hooks


def test_models_without_rnns_are_left_alone() -> None:
    model = nn.Linear(2, 2)
    torch.backends.cudnn.enabled = False
    try:
        with cudnn_rnn_disabled(model):
            assert not torch.backends.cudnn.enabled
        assert not torch.backends.cudnn.enabled
    finally:
        torch.backends.cudnn.enabled = True
