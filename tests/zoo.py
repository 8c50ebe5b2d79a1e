"""Small models built from configs with random weights, and independent memory counts on real tensors."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from harness.accuracy import reference


class BasicBlock(nn.Module):
    """A ResNet basic block: conv-BN-ReLU-conv-BN plus the shortcut."""

    def __init__(self, channels: int) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(channels, channels, 3, padding=1, bias=False)
        self.bn1 = nn.BatchNorm2d(channels)
        self.conv2 = nn.Conv2d(channels, channels, 3, padding=1, bias=False)
        self.bn2 = nn.BatchNorm2d(channels)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = F.relu(self.bn1(self.conv1(x)))
        return F.relu(self.bn2(self.conv2(out)) + x)


class SmallResNet(nn.Module):
    def __init__(self, channels: int = 32, blocks: int = 3, classes: int = 10) -> None:
        super().__init__()
        self.stem = nn.Sequential(nn.Conv2d(3, channels, 3, padding=1, bias=False), nn.BatchNorm2d(channels), nn.ReLU())
        self.blocks = nn.Sequential(*[BasicBlock(channels) for _ in range(blocks)])
        self.head = nn.Linear(channels, classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.blocks(self.stem(x))
        return self.head(x.mean(dim=(2, 3)))


class Bottleneck(nn.Module):
    """torchvision's ResNet-50 block: 1x1 down, 3x3 (carrying the stride), 1x1 up by 4, batch norm after each."""

    def __init__(self, inplanes: int, planes: int, stride: int = 1) -> None:
        super().__init__()
        width, out = planes, planes * 4
        self.conv1, self.bn1 = nn.Conv2d(inplanes, width, 1, bias=False), nn.BatchNorm2d(width)
        self.conv2, self.bn2 = nn.Conv2d(width, width, 3, stride, 1, bias=False), nn.BatchNorm2d(width)
        self.conv3, self.bn3 = nn.Conv2d(width, out, 1, bias=False), nn.BatchNorm2d(out)
        self.relu = nn.ReLU(inplace=True)
        self.downsample = None
        if stride != 1 or inplanes != out:
            self.downsample = nn.Sequential(nn.Conv2d(inplanes, out, 1, stride, bias=False), nn.BatchNorm2d(out))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        identity = x if self.downsample is None else self.downsample(x)
        out = self.relu(self.bn1(self.conv1(x)))
        out = self.relu(self.bn2(self.conv2(out)))
        return self.relu(self.bn3(self.conv3(out)) + identity)


class ResNet50(nn.Module):
    """torchvision's ``resnet50`` layer for layer (``width`` 64; a smaller width for CPU tests), without
    torchvision: a 7x7 stem at stride 2, max pooling, stages of 3, 4, 6 and 3 bottlenecks, a 1000-way head."""

    def __init__(self, width: int = 64, classes: int = 1000) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(3, width, 7, 2, 3, bias=False)
        self.bn1, self.relu, self.maxpool = nn.BatchNorm2d(width), nn.ReLU(inplace=True), nn.MaxPool2d(3, 2, 1)
        layers, inplanes = [], width
        for index, blocks in enumerate((3, 4, 6, 3)):
            planes = width * 2**index
            stage = [Bottleneck(inplanes, planes, 1 if index == 0 else 2)]
            inplanes = planes * 4
            stage += [Bottleneck(inplanes, planes) for _ in range(blocks - 1)]
            layers.append(nn.Sequential(*stage))
        self.layer1, self.layer2, self.layer3, self.layer4 = layers
        self.fc = nn.Linear(inplanes, classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.maxpool(self.relu(self.bn1(self.conv1(x))))
        x = self.layer4(self.layer3(self.layer2(self.layer1(x))))
        return self.fc(torch.flatten(nn.functional.adaptive_avg_pool2d(x, 1), 1))


class LSTMClassifier(nn.Module):
    def __init__(self, vocab: int = 500, hidden: int = 64, layers: int = 2, classes: int = 5) -> None:
        super().__init__()
        self.embed = nn.Embedding(vocab, hidden)
        self.lstm = nn.LSTM(hidden, hidden, num_layers=layers, batch_first=True)
        self.head = nn.Linear(hidden, classes)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        out, _ = self.lstm(self.embed(tokens))
        return self.head(out[:, -1])


@dataclass
class Case:
    """A model, a batch, and how to get a scalar loss from them."""

    name: str
    model: nn.Module
    batch: Any
    loss_fn: Callable[[Any, Any], torch.Tensor] | None
    forward_fn: Callable[[nn.Module, Any], Any] | None

    def loss_of(self, model: nn.Module, batch: Any) -> torch.Tensor:
        """The scalar loss of one real forward, as memfit's trace computes it."""
        output = self.forward_fn(model, batch) if self.forward_fn else _call(model, batch)
        return self.loss_fn(output, batch) if self.loss_fn else output.loss


def gpt2_case(batch: int = 2, seq: int = 64) -> Case:
    from transformers import GPT2Config, GPT2LMHeadModel

    torch.manual_seed(0)
    model = GPT2LMHeadModel(GPT2Config(n_layer=2, n_embd=64, n_head=4, vocab_size=1000, n_positions=128))
    ids = torch.randint(0, 1000, (batch, seq))
    return Case("gpt2", model, {"input_ids": ids, "labels": ids}, None, None)


def bert_case(batch: int = 2, seq: int = 64) -> Case:
    from transformers import BertConfig, BertForSequenceClassification

    torch.manual_seed(0)
    config = BertConfig(
        num_hidden_layers=2, hidden_size=64, num_attention_heads=4, intermediate_size=128, vocab_size=1000
    )
    model = BertForSequenceClassification(config)
    ids = torch.randint(0, 1000, (batch, seq))
    return Case("bert", model, {"input_ids": ids, "labels": torch.zeros(batch, dtype=torch.long)}, None, None)


def resnet_case(batch: int = 4) -> Case:
    torch.manual_seed(0)
    images = torch.randn(batch, 3, 16, 16)
    labels = torch.randint(0, 10, (batch,))
    return Case(
        "resnet",
        SmallResNet(),
        (images, labels),
        lambda out, b: F.cross_entropy(out, b[1]),
        lambda model, b: model(b[0]),
    )


def lstm_case(batch: int = 4, seq: int = 24) -> Case:
    torch.manual_seed(0)
    tokens = torch.randint(0, 500, (batch, seq))
    labels = torch.randint(0, 5, (batch,))
    return Case(
        "lstm",
        LSTMClassifier(),
        (tokens, labels),
        lambda out, b: F.cross_entropy(out, b[1]),
        lambda model, b: model(b[0]),
    )


CASES: dict[str, Callable[[], Case]] = {
    "gpt2": gpt2_case,
    "bert": bert_case,
    "resnet": resnet_case,
    "lstm": lstm_case,
}


def saved_activation_bytes(case: Case) -> int:
    """Bytes a real CPU forward of ``case`` keeps for backward (see ``reference.saved_activation_bytes``)."""
    return reference.saved_activation_bytes(case.model, case.batch, case.loss_of)


def _call(model: nn.Module, batch: Any) -> Any:
    if isinstance(batch, dict):
        return model(**batch)
    if isinstance(batch, (list, tuple)):
        return model(*batch)
    return model(batch)
