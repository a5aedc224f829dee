"""Models for the synthetic benchmark: ResNet-50 (defined here, torchvision's architecture and
parameter names, without torchvision) and the super-resolution models of ``hpdl.sr``'s
registry (EDSR, EDSR-baseline, SRResNet).

Each benchmark model comes with the random batch it trains on and its loss, so that the
benchmark loop is the same for classification and super-resolution.
"""

from __future__ import annotations

import dataclasses
from typing import Callable, List, Optional, Tuple, Type

import torch
import torch.nn.functional as F
from torch import nn

from hpdl.sr.registry import model_names

__all__ = ["Bottleneck", "ResNet", "Workload", "benchmark_models", "build_workload", "gradient_bytes", "resnet50",
           "sr_models"]


def sr_models() -> Tuple[str, ...]:
    """Return the super-resolution models of hpdl.sr's registry, spelled with dashes as on the command line.

    Read at each call, so an architecture registered after this module was imported is one too.
    """
    return tuple(name.replace("_", "-") for name in model_names())


def benchmark_models() -> Tuple[str, ...]:
    """Return every model the benchmarks build: the registry's, and ResNet-50, their own reference."""
    return sr_models() + ("resnet50",)


def _conv3x3(in_ch: int, out_ch: int, stride: int = 1) -> nn.Conv2d:
    return nn.Conv2d(in_ch, out_ch, 3, stride=stride, padding=1, bias=False)


def _conv1x1(in_ch: int, out_ch: int, stride: int = 1) -> nn.Conv2d:
    return nn.Conv2d(in_ch, out_ch, 1, stride=stride, bias=False)


class Bottleneck(nn.Module):
    """1x1 reduce, 3x3 (carrying the stride, "ResNet v1.5"), 1x1 expand x4, plus the shortcut."""

    expansion = 4

    def __init__(self, inplanes: int, planes: int, stride: int = 1, downsample: Optional[nn.Module] = None):
        super().__init__()
        self.conv1 = _conv1x1(inplanes, planes)
        self.bn1 = nn.BatchNorm2d(planes)
        self.conv2 = _conv3x3(planes, planes, stride)
        self.bn2 = nn.BatchNorm2d(planes)
        self.conv3 = _conv1x1(planes, planes * self.expansion)
        self.bn3 = nn.BatchNorm2d(planes * self.expansion)
        self.relu = nn.ReLU(inplace=True)
        self.downsample = downsample
        self.stride = stride

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        identity = x if self.downsample is None else self.downsample(x)
        out = self.relu(self.bn1(self.conv1(x)))
        out = self.relu(self.bn2(self.conv2(out)))
        out = self.bn3(self.conv3(out))
        return self.relu(out + identity)


class ResNet(nn.Module):
    """ResNet for ImageNet-sized inputs (224x224), as torchvision builds it."""

    def __init__(self, block: Type[Bottleneck], layers: List[int], num_classes: int = 1000):
        super().__init__()
        self.inplanes = 64
        self.conv1 = nn.Conv2d(3, 64, kernel_size=7, stride=2, padding=3, bias=False)
        self.bn1 = nn.BatchNorm2d(64)
        self.relu = nn.ReLU(inplace=True)
        self.maxpool = nn.MaxPool2d(kernel_size=3, stride=2, padding=1)
        self.layer1 = self._make_layer(block, 64, layers[0])
        self.layer2 = self._make_layer(block, 128, layers[1], stride=2)
        self.layer3 = self._make_layer(block, 256, layers[2], stride=2)
        self.layer4 = self._make_layer(block, 512, layers[3], stride=2)
        self.avgpool = nn.AdaptiveAvgPool2d((1, 1))
        self.fc = nn.Linear(512 * block.expansion, num_classes)
        for m in self.modules():
            if isinstance(m, nn.Conv2d):
                nn.init.kaiming_normal_(m.weight, mode="fan_out", nonlinearity="relu")
            elif isinstance(m, nn.BatchNorm2d):
                nn.init.ones_(m.weight)
                nn.init.zeros_(m.bias)

    def _make_layer(self, block: Type[Bottleneck], planes: int, blocks: int, stride: int = 1) -> nn.Sequential:
        downsample = None
        if stride != 1 or self.inplanes != planes * block.expansion:
            downsample = nn.Sequential(_conv1x1(self.inplanes, planes * block.expansion, stride),
                                       nn.BatchNorm2d(planes * block.expansion))
        layers = [block(self.inplanes, planes, stride, downsample)]
        self.inplanes = planes * block.expansion
        layers += [block(self.inplanes, planes) for _ in range(1, blocks)]
        return nn.Sequential(*layers)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.maxpool(self.relu(self.bn1(self.conv1(x))))
        x = self.layer4(self.layer3(self.layer2(self.layer1(x))))
        return self.fc(torch.flatten(self.avgpool(x), 1))


def resnet50(num_classes: int = 1000) -> ResNet:
    """Build ResNet-50: bottleneck blocks [3, 4, 6, 3], 25,557,032 parameters for 1000 classes."""
    return ResNet(Bottleneck, [3, 4, 6, 3], num_classes)


@dataclasses.dataclass
class Workload:
    """A model with one random batch and the loss to train it on."""

    name: str
    model: nn.Module
    inputs: torch.Tensor
    targets: torch.Tensor
    loss: Callable[[torch.Tensor, torch.Tensor], torch.Tensor]

    def describe(self) -> str:
        """Return e.g. ``edsr-baseline x2, input 4x3x48x48``."""
        shape = "x".join(str(d) for d in self.inputs.shape)
        return f"{self.name}, input {shape}"


def build_workload(name: str, batch_size: int, scale: int = 2, patch: int = 48, seed: int = 0,
                   image: Optional[Tuple[int, int]] = None) -> Workload:
    """Build the model ``name`` with a random batch: LR patches and HR targets (L1 loss) for
    the super-resolution models, 224x224 images and labels (cross-entropy) for ResNet-50;
    ``image`` (height, width) gives the input another size (the SR models' LR size)."""
    if batch_size < 1:
        raise ValueError(f"batch size must be >= 1, got {batch_size}")
    if image is not None and (len(image) != 2 or min(image) < 1):
        raise ValueError(f"image size must be two positive numbers (height, width), got {image}")
    gen = torch.Generator().manual_seed(seed)
    if name == "resnet50":
        height, width = image or (224, 224)
        inputs = torch.randn(batch_size, 3, height, width, generator=gen)
        targets = torch.randint(0, 1000, (batch_size,), generator=gen)
        return Workload(name, resnet50(), inputs, targets, F.cross_entropy)
    if name in sr_models():
        from hpdl.sr.models import build_model  # the application layer, loaded only when asked for

        if patch < 1:
            raise ValueError(f"patch size must be >= 1, got {patch}")
        height, width = image or (patch, patch)
        model = build_model(name, scale)
        inputs = torch.rand(batch_size, 3, height, width, generator=gen) * 255
        targets = torch.rand(batch_size, 3, height * scale, width * scale, generator=gen) * 255
        return Workload(f"{name} x{scale}", model, inputs, targets, F.l1_loss)
    raise ValueError(f"unknown model {name!r}; choose from {', '.join(benchmark_models())}")


def gradient_bytes(model: nn.Module) -> int:
    """Return the bytes of gradient a training step reduces: every trainable parameter's.

    (Their number is ``hpdl.sr.models.count_parameters``, one meaning for any model.)"""
    return sum(p.numel() * p.element_size() for p in model.parameters() if p.requires_grad)
