"""The benchmark models: the digits CNN, a ResNet-18-like CNN, a 4-layer Transformer encoder and a MobileNetV2-like CNN.

Every model is written so that both torch.ao FX graph mode (``symbolic_trace``) and ``torch.export``
capture it whole: no data-dependent control flow, residual adds as ``a + b``, attention written out
with ``Linear`` / ``LayerNorm`` / ``matmul`` / ``softmax`` (``nn.TransformerEncoderLayer`` calls the
fused ``_native_multi_head_attention`` fast path, which FX quantization cannot instrument).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Callable

import torch
from torch import nn

from qlightning.examples.digits import DigitsCNN


# ---------------------------------------------------------------------------------------------- ResNet


class BasicBlock(nn.Module):
    """ResNet BasicBlock: conv-bn-relu, conv-bn, + identity (or 1x1 conv-bn projection), relu."""

    def __init__(self, c_in: int, c_out: int, stride: int = 1) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(c_in, c_out, 3, stride, 1, bias=False)
        self.bn1 = nn.BatchNorm2d(c_out)
        self.relu1 = nn.ReLU()
        self.conv2 = nn.Conv2d(c_out, c_out, 3, 1, 1, bias=False)
        self.bn2 = nn.BatchNorm2d(c_out)
        self.relu2 = nn.ReLU()
        self.downsample = None
        if stride != 1 or c_in != c_out:
            self.downsample = nn.Sequential(nn.Conv2d(c_in, c_out, 1, stride, bias=False), nn.BatchNorm2d(c_out))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        identity = x if self.downsample is None else self.downsample(x)
        out = self.relu1(self.bn1(self.conv1(x)))
        out = self.bn2(self.conv2(out))
        return self.relu2(out + identity)


class ResNet18Like(nn.Module):
    """ResNet-18 layout (BasicBlock x [2, 2, 2, 2], widths w, 2w, 4w, 8w) with a CIFAR stem.

    ``width=64`` is ResNet-18 proper (11.2M parameters); the benchmark uses ``width=32`` (2.8M
    parameters, a quarter of the FLOPs) on 3x32x32 inputs so that a train step takes ~0.1 s on one
    core. The stem is a 3x3 conv (no 7x7 conv / max-pool), as usual for 32x32 inputs.
    """

    def __init__(self, width: int = 32, num_classes: int = 10, in_channels: int = 3) -> None:
        super().__init__()
        self.stem = nn.Sequential(nn.Conv2d(in_channels, width, 3, 1, 1, bias=False), nn.BatchNorm2d(width), nn.ReLU())
        layers = []
        c_in = width
        for i, blocks in enumerate((2, 2, 2, 2)):
            c_out = width * 2**i
            for b in range(blocks):
                layers.append(BasicBlock(c_in, c_out, stride=2 if (i > 0 and b == 0) else 1))
                c_in = c_out
        self.layers = nn.Sequential(*layers)
        self.pool = nn.AdaptiveAvgPool2d(1)
        self.fc = nn.Linear(c_in, num_classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.layers(self.stem(x))
        return self.fc(torch.flatten(self.pool(x), 1))


# ---------------------------------------------------------------------------------------------- MobileNetV2


class InvertedResidual(nn.Module):
    """MobileNetV2's block: 1x1 expand conv-bn-relu6 (when ``expand > 1``), 3x3 depthwise conv-bn-relu6, 1x1
    project conv-bn, + identity when the shape is kept (torchvision's ``InvertedResidual``)."""

    def __init__(self, c_in: int, c_out: int, stride: int, expand: int) -> None:
        super().__init__()
        hidden = c_in * expand
        layers: list[nn.Module] = []
        if expand != 1:
            layers += [nn.Conv2d(c_in, hidden, 1, bias=False), nn.BatchNorm2d(hidden), nn.ReLU6()]
        layers += [
            nn.Conv2d(hidden, hidden, 3, stride, 1, groups=hidden, bias=False), nn.BatchNorm2d(hidden), nn.ReLU6(),
            nn.Conv2d(hidden, c_out, 1, bias=False), nn.BatchNorm2d(c_out),
        ]
        self.conv = nn.Sequential(*layers)
        self.residual = stride == 1 and c_in == c_out

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.conv(x) if self.residual else self.conv(x)


class MobileNetV2Like(nn.Module):
    """MobileNetV2's layout (torchvision's inverted-residual settings, 17 blocks, ReLU6, a 1x1 head conv) at
    ``width`` times its channels, with the usual 32x32 changes: a stride-1 stem and a stride-1 second stage.

    ``width=0.5`` (the benchmark's): 0.7M parameters; depthwise convolutions make a third of its convolutions.
    """

    SETTINGS = ((1, 16, 1, 1), (6, 24, 2, 1), (6, 32, 3, 2), (6, 64, 4, 2), (6, 96, 3, 1), (6, 160, 3, 2), (6, 320, 1, 1))

    def __init__(self, width: float = 0.5, num_classes: int = 10, in_channels: int = 3) -> None:
        super().__init__()

        def channels(c: int) -> int:  # torchvision's _make_divisible(c * width, 8)
            return max(8, int(c * width + 4) // 8 * 8)

        c_in = channels(32)
        layers: list[nn.Module] = [nn.Sequential(nn.Conv2d(in_channels, c_in, 3, 1, 1, bias=False),
                                                 nn.BatchNorm2d(c_in), nn.ReLU6())]
        for expand, c, n, s in self.SETTINGS:
            for i in range(n):
                layers.append(InvertedResidual(c_in, channels(c), s if i == 0 else 1, expand))
                c_in = channels(c)
        last = max(1280, channels(1280))
        layers.append(nn.Sequential(nn.Conv2d(c_in, last, 1, bias=False), nn.BatchNorm2d(last), nn.ReLU6()))
        self.features = nn.Sequential(*layers)
        self.pool = nn.AdaptiveAvgPool2d(1)
        self.classifier = nn.Linear(last, num_classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.classifier(torch.flatten(self.pool(self.features(x)), 1))


# ---------------------------------------------------------------------------------------------- Transformer


class SelfAttention(nn.Module):
    def __init__(self, d_model: int, heads: int) -> None:
        super().__init__()
        self.heads, self.head_dim = heads, d_model // heads
        self.q = nn.Linear(d_model, d_model)
        self.k = nn.Linear(d_model, d_model)
        self.v = nn.Linear(d_model, d_model)
        self.out = nn.Linear(d_model, d_model)
        self.scale = 1.0 / math.sqrt(self.head_dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, s, d = x.shape
        q = self.q(x).reshape(b, s, self.heads, self.head_dim).transpose(1, 2)
        k = self.k(x).reshape(b, s, self.heads, self.head_dim).transpose(1, 2)
        v = self.v(x).reshape(b, s, self.heads, self.head_dim).transpose(1, 2)
        attn = torch.softmax(torch.matmul(q, k.transpose(-2, -1)) * self.scale, dim=-1)
        ctx = torch.matmul(attn, v).transpose(1, 2).reshape(b, s, d)
        return self.out(ctx)


class EncoderBlock(nn.Module):
    """Pre-LayerNorm encoder block: x + attn(ln(x)), then x + ffn(ln(x)) with a GELU MLP."""

    def __init__(self, d_model: int, heads: int, d_ff: int) -> None:
        super().__init__()
        self.ln1 = nn.LayerNorm(d_model)
        self.attn = SelfAttention(d_model, heads)
        self.ln2 = nn.LayerNorm(d_model)
        self.fc1 = nn.Linear(d_model, d_ff)
        self.act = nn.GELU()
        self.fc2 = nn.Linear(d_ff, d_model)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.ln1(x))
        return x + self.fc2(self.act(self.fc1(self.ln2(x))))


class TransformerEncoder(nn.Module):
    """Input projection, ``layers`` pre-LN encoder blocks (d_model 256, 4 heads, FFN 1024), mean pool, head.

    Input: ``(batch, seq, in_features)`` float features (no embedding table, so that every op
    between input and output can be quantized statically).
    """

    def __init__(
        self, in_features: int = 32, d_model: int = 256, heads: int = 4, d_ff: int = 1024, layers: int = 4,
        num_classes: int = 10,
    ) -> None:
        super().__init__()
        self.proj = nn.Linear(in_features, d_model)
        self.blocks = nn.Sequential(*[EncoderBlock(d_model, heads, d_ff) for _ in range(layers)])
        self.ln = nn.LayerNorm(d_model)
        self.head = nn.Linear(d_model, num_classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.ln(self.blocks(self.proj(x)))
        return self.head(x.mean(dim=1))


# ---------------------------------------------------------------------------------------------- chains


class ConvBnReluChain(nn.Module):
    """``blocks`` conv-bn-relu blocks (8 channels, 8x8 input) + pool + linear: prepare/convert scaling."""

    def __init__(self, blocks: int, channels: int = 8) -> None:
        super().__init__()
        layers: list[nn.Module] = [nn.Conv2d(1, channels, 3, padding=1, bias=False), nn.BatchNorm2d(channels), nn.ReLU()]
        for _ in range(blocks - 1):
            layers += [nn.Conv2d(channels, channels, 3, padding=1, bias=False), nn.BatchNorm2d(channels), nn.ReLU()]
        self.features = nn.Sequential(*layers)
        self.pool = nn.AdaptiveAvgPool2d(1)
        self.fc = nn.Linear(channels, 10)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc(torch.flatten(self.pool(self.features(x)), 1))


# ---------------------------------------------------------------------------------------------- registry


@dataclass
class ModelSpec:
    """One benchmark model: how to build it and its inputs."""

    name: str
    title: str
    build: Callable[[], nn.Module]
    input_shape: tuple[int, ...]  # one sample, without the batch dimension
    train_batch: int
    num_classes: int = 10

    def inputs(self, batch: int, seed: int = 0) -> torch.Tensor:
        g = torch.Generator().manual_seed(seed)
        return torch.randn((batch, *self.input_shape), generator=g)

    def labels(self, batch: int, seed: int = 0) -> torch.Tensor:
        g = torch.Generator().manual_seed(seed + 1)
        return torch.randint(0, self.num_classes, (batch,), generator=g)


def digits_inputs(batch: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Real digits images (scikit-learn), the first ``batch`` of the training split."""
    from qlightning.examples.digits import DigitsDataModule

    dm = DigitsDataModule(seed=0)
    dm.setup()
    x, y = dm.splits["train"].tensors
    reps = -(-batch // len(x))
    return x.repeat(reps, 1, 1, 1)[:batch], y.repeat(reps)[:batch]


class _DigitsSpec(ModelSpec):
    def inputs(self, batch: int, seed: int = 0) -> torch.Tensor:
        return digits_inputs(batch)[0]

    def labels(self, batch: int, seed: int = 0) -> torch.Tensor:
        return digits_inputs(batch)[1]


MODELS: dict[str, ModelSpec] = {
    "digits_cnn": _DigitsSpec("digits_cnn", "digits CNN", lambda: DigitsCNN(), (1, 8, 8), 64),
    "resnet18_like": ModelSpec("resnet18_like", "ResNet-18-like (width 32)", lambda: ResNet18Like(width=32), (3, 32, 32), 32),
    "transformer": ModelSpec("transformer", "Transformer (4 layers, d=256, seq 64)", lambda: TransformerEncoder(), (64, 32), 16),
    "mobilenet_v2_like": ModelSpec("mobilenet_v2_like", "MobileNetV2-like (width 0.5)", lambda: MobileNetV2Like(0.5), (3, 32, 32), 32),
}
QUICK_OVERRIDES = {
    # --quick: a narrower ResNet and a shorter sequence keep the smoke run under ~3 minutes on 2 cores
    "resnet18_like": ModelSpec("resnet18_like", "ResNet-18-like (width 16)", lambda: ResNet18Like(width=16), (3, 32, 32), 16),
    "transformer": ModelSpec("transformer", "Transformer (4 layers, d=256, seq 32)", lambda: TransformerEncoder(), (32, 32), 16),
    "mobilenet_v2_like": ModelSpec("mobilenet_v2_like", "MobileNetV2-like (width 0.25)", lambda: MobileNetV2Like(0.25), (3, 32, 32), 16),
}


def model_spec(name: str, quick: bool = False) -> ModelSpec:
    if quick and name in QUICK_OVERRIDES:
        return QUICK_OVERRIDES[name]
    return MODELS[name]
