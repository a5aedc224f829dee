"""The models the spatial tests split: the registry's super-resolution networks, ResNet-50, and a
small ResNet with every kind of layer ResNet-50 has (BatchNorm, a stride-2 7x7 stem, max
pooling, stride-2 bottlenecks, global pooling and a Linear tail), narrow enough to be quick."""

from __future__ import annotations

import torch
from torch import nn

from hpdl.bench.models import Bottleneck, ResNet, resnet50
from hpdl.sr.models import build_model

CLASSIFIERS = ("resnet50", "resnet-small")


def classifies(name: str) -> bool:
    return name in CLASSIFIERS


class SmallResNet(ResNet):
    """ResNet's layers at a quarter of its widths, one bottleneck per stage."""

    def __init__(self, num_classes: int = 10):
        nn.Module.__init__(self)
        self.inplanes = 8
        self.conv1 = nn.Conv2d(3, 8, kernel_size=7, stride=2, padding=3, bias=False)
        self.bn1 = nn.BatchNorm2d(8)
        self.relu = nn.ReLU(inplace=True)
        self.maxpool = nn.MaxPool2d(kernel_size=3, stride=2, padding=1)
        self.layer1 = self._make_layer(Bottleneck, 4, 1)
        self.layer2 = self._make_layer(Bottleneck, 8, 1, stride=2)
        self.layer3 = self._make_layer(Bottleneck, 8, 1, stride=2)
        self.layer4 = nn.Sequential()
        self.avgpool = nn.AdaptiveAvgPool2d((1, 1))
        self.fc = nn.Linear(32, num_classes)
        gen = torch.Generator().manual_seed(7)
        with torch.no_grad():  # not BatchNorm's identity: the test must see its affine map
            for m in self.modules():
                if isinstance(m, nn.BatchNorm2d):
                    m.weight.copy_(torch.rand(m.weight.shape, generator=gen) + 0.5)
                    m.bias.copy_(torch.rand(m.bias.shape, generator=gen) - 0.5)


def build(name: str) -> nn.Module:
    if name == "resnet50":
        return resnet50(num_classes=10)
    if name == "resnet-small":
        return SmallResNet()
    return build_model(name, 2)
