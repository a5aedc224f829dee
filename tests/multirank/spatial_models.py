"""The models the spatial tests split: the registry's super-resolution networks, ResNet-50, a
small ResNet with every kind of layer ResNet-50 has (BatchNorm, a stride-2 7x7 stem, max
pooling, stride-2 bottlenecks, global pooling and a Linear tail), narrow enough to be quick, and
the models users brought: a U-Net for odd sizes (transposed convolution and bilinear
upsampling, the skip padded to size as milesial's Pytorch-UNet does, or cropped to it), a
torchvision-style segmentation head (the output interpolated to the size read from the input),
DeepLabV3's ASPP head and PSPNet's pyramid pooling with an FPN's top-down path (sizes that
are not whole factors, align_corners=True, pooled branches brought back to a part), CBAM's
attention (global max pooling), nnU-Net's blocks (instance and group norm), normalization
written by hand (std and var_mean over the image), ConvNeXt's blocks (channels last between
two permutes: LayerNorm, Linear, a layer scale);
a model with what a forward does besides layers (quirks: a cumulative batch norm, a value read
as a number, a cache made at the first call); and two calling conventions: a model given further scattered inputs besides the image (a mask,
a keyword map), and convolutions of one sample, (C, H, W), as PyTorch's take them."""

from __future__ import annotations

import torch
import torch.nn.functional as F
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


def _conv(c_in: int, c_out: int) -> nn.Sequential:
    return nn.Sequential(nn.Conv2d(c_in, c_out, 3, padding=1, bias=False), nn.BatchNorm2d(c_out), nn.ReLU(inplace=True))


class UNet(nn.Module):
    """Two levels down and up. The lower level upsamples by a transposed convolution, the upper
    by bilinear interpolation; on odd sizes the upsampled map is one row or column short of the
    skip: ``pad`` pads it by the difference of the two sizes (F.pad, milesial's recipe), else
    the skip is cropped to the upsampled map's size (``e[..., :u.shape[-2], :u.shape[-1]]``)."""

    def __init__(self, pad: bool = True):
        super().__init__()
        self.pad = pad
        self.enc1, self.enc2, self.bottom = _conv(3, 8), _conv(8, 16), _conv(16, 16)
        self.pool = nn.MaxPool2d(2)
        self.up2 = nn.ConvTranspose2d(16, 16, 2, stride=2)
        self.dec2 = _conv(32, 8)
        self.up1 = nn.Upsample(scale_factor=2, mode="bilinear")
        self.dec1 = _conv(16, 8)
        self.head = nn.Conv2d(8, 3, 1)

    def _join(self, up: torch.Tensor, skip: torch.Tensor) -> torch.Tensor:
        if self.pad:
            dy, dx = skip.size(2) - up.size(2), skip.size(3) - up.size(3)
            up = F.pad(up, [dx // 2, dx - dx // 2, dy // 2, dy - dy // 2])
        else:
            skip = skip[..., :up.shape[-2], :up.shape[-1]]
        return torch.cat([skip, up], dim=1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        e1 = self.enc1(x)
        e2 = self.enc2(self.pool(e1))
        b = self.bottom(self.pool(e2))
        d2 = self.dec2(self._join(self.up2(b), e2))
        d1 = self.dec1(self._join(self.up1(d2), e1))
        return self.head(d1)


class SegmentationHead(nn.Module):
    """torchvision's segmentation models' shape: the input's size read at the top of forward, a
    backbone of stride-2 convolutions, a 1x1 classifier, and the logits interpolated back to
    that size."""

    def __init__(self, classes: int = 3):
        super().__init__()
        self.backbone = nn.Sequential(nn.Conv2d(3, 8, 3, 2, 1), nn.ReLU(), nn.Conv2d(8, 16, 3, 2, 1), nn.ReLU(),
                                      nn.Conv2d(16, 16, 3, 2, 1), nn.ReLU())
        self.classifier = nn.Conv2d(16, classes, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        size = x.shape[-2:]
        return F.interpolate(self.classifier(self.backbone(x)), size=size, mode="bilinear", align_corners=False)


class Masked(nn.Module):
    """An image, its mask and a keyword map, all three scattered: the mask and the map take the
    image's rows (:func:`extra_inputs`)."""

    def __init__(self):
        super().__init__()
        self.conv1 = nn.Conv2d(3, 4, 3, padding=1)
        self.conv2 = nn.Conv2d(4, 3, 3, padding=1)

    def forward(self, x: torch.Tensor, mask: torch.Tensor, *, scale: torch.Tensor) -> torch.Tensor:
        return self.conv2(torch.relu(self.conv1(x * mask)) * scale)


class Unbatched(nn.Module):
    """Convolutions of the batch's second sample alone, (C, H, W): a convolution and a stride-2
    transposed one. The output is unbatched too."""

    def __init__(self):
        super().__init__()
        self.conv = nn.Conv2d(3, 4, 3, padding=1)
        self.up = nn.ConvTranspose2d(4, 3, 4, stride=2, padding=1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.up(torch.relu(self.conv(x[1])))


class Quirks(nn.Module):
    """What a forward does besides layers, that the first forward's dry run (shapes only, on
    the meta device) must get through: batch norm's cumulative average (momentum=None reads
    its batch count as a float), a value read as a number to take a branch (``.item()``),
    a tensor cached on the module at the first call, tensors the forward makes on the CPU
    (an image mean subtracted, a floor for torch.where), which meet the meta parts there, and
    tensors made to the lengths read off a part (``b, c, h, w = y.shape``): a partial
    convolution's mask of ones and its window counts, the image's mean spread by ``expand`` and
    ``repeat``."""

    def __init__(self):
        super().__init__()
        self.conv1 = nn.Conv2d(3, 4, 3, padding=1, bias=False)  # batch norm follows (a bias's gradient: 0)
        self.bn = nn.BatchNorm2d(4, momentum=None)
        self.conv2 = nn.Conv2d(4, 3, 3, padding=1)
        self.scale = None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x - torch.tensor([0.4488, 0.4371, 0.4040], dtype=x.dtype).view(1, 3, 1, 1)  # EDSR's RGB mean
        y = self.bn(self.conv1(x))
        y = torch.where(y > -1, y, torch.full((1,), -1.0, dtype=y.dtype))
        if y.abs().mean().item() > 0.5:
            y = torch.relu(y)
        if self.scale is None:
            self.scale = torch.linspace(0.5, 1.5, 4, dtype=x.dtype, device=x.device).view(1, 4, 1, 1)
        b, c, h, w = y.shape
        mask = torch.ones(b, 1, h, w, dtype=y.dtype, device=y.device)
        windows = F.conv2d(mask, torch.ones(1, 1, 3, 3, dtype=y.dtype, device=y.device), padding=1)
        y = y * (9.0 / windows)  # fewer pixels in a window at the image's border, none at a band's
        y = y + 0.1 * y.mean((2, 3), keepdim=True).expand(b, c, h, w) \
            + 0.01 * F.adaptive_avg_pool2d(y, 1).repeat(1, 1, h, w) + torch.zeros(y.shape, dtype=y.dtype)
        return self.conv2(y * self.scale)


class Borders(nn.Module):
    """Padding that copies the image's own rows: a reflection pad (uneven), convolutions
    padding by reflection, replication and wrapping around (periodic, as for longitude), and
    an uneven circular pad."""

    def __init__(self):
        super().__init__()
        self.pad = nn.ReflectionPad2d((1, 2, 2, 1))  # left, right, top, bottom
        self.conv1 = nn.Conv2d(3, 4, 3)
        self.conv2 = nn.Conv2d(4, 4, 5, padding=2, padding_mode="reflect")
        self.conv3 = nn.Conv2d(4, 4, 3, padding=1, padding_mode="replicate")
        self.conv4 = nn.Conv2d(4, 4, 3, padding=1, padding_mode="circular")
        self.conv5 = nn.Conv2d(4, 3, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = torch.relu(self.conv1(self.pad(x)))
        y = torch.tanh(self.conv4(self.conv3(torch.tanh(self.conv2(y)))))
        return self.conv5(F.pad(y, (2, 0, 1, 2), mode="circular"))


class Unshuffled(nn.Module):
    """Convolutions at half resolution between a pixel unshuffle and a pixel shuffle (as
    Real-ESRGAN's x2 network starts): the unshuffle's blocks of rows straddle the bands."""

    def __init__(self):
        super().__init__()
        self.down = nn.PixelUnshuffle(2)
        self.conv1 = nn.Conv2d(12, 12, 3, padding=1)
        self.conv2 = nn.Conv2d(12, 12, 3, padding=1)
        self.up = nn.PixelShuffle(2)
        self.conv3 = nn.Conv2d(3, 3, 3, padding=1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.conv3(self.up(self.conv2(torch.relu(self.conv1(self.down(x))))) + x)


class Pooled(nn.Module):
    """Average pooling whose last window hangs over the image's end (``ceil_mode=True``):
    counting the padding it covers, and counting the image's pixels alone."""

    def __init__(self):
        super().__init__()
        self.conv1 = nn.Conv2d(3, 4, 3, padding=1)
        self.pool1 = nn.AvgPool2d(3, 2, 1, ceil_mode=True)
        self.conv2 = nn.Conv2d(4, 4, 3, padding=1)
        self.pool2 = nn.AvgPool2d(2, ceil_mode=True, count_include_pad=False)
        self.conv3 = nn.Conv2d(4, 3, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.conv3(self.pool2(torch.relu(self.conv2(self.pool1(torch.relu(self.conv1(x)))))))


class MultiScale(nn.Module):
    """A branch at half and at a third of the resolution (downscaling by interpolation,
    bilinear, bicubic, nearest and area), brought back up (bilinear, nearest, area) and added to
    the full-resolution path."""

    def __init__(self):
        super().__init__()
        self.conv1 = nn.Conv2d(3, 4, 3, padding=1)
        self.at_half = nn.Conv2d(4, 4, 3, padding=1)
        self.at_third = nn.Conv2d(4, 4, 1)
        self.conv2 = nn.Conv2d(4, 3, 3, padding=1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = torch.relu(self.conv1(x))
        half = self.at_half(F.interpolate(y, scale_factor=0.5, mode="bilinear"))
        third = self.at_third(F.interpolate(y, scale_factor=1 / 3, mode="bicubic"))
        down = F.interpolate(y, size=(y.shape[-2] // 2, y.shape[-1] // 2), mode="nearest")
        area = F.interpolate(y, scale_factor=0.5, mode="area")
        up = F.interpolate(half + down + area, scale_factor=2, mode="bilinear") + \
            F.interpolate(third, scale_factor=3, mode="nearest") + 0.5 * F.interpolate(third, scale_factor=3, mode="area")
        return self.conv2(y + up)


class DeepLab(nn.Module):
    """torchvision's DeepLabV3 head on a small strided backbone: ASPP (atrous convolutions and
    a pooled 1 x 1 branch with batch norm, brought back to the map's size), and the logits
    interpolated to the input's size, which on odd sizes is not a whole factor (17 rows: 5 at
    stride 4, back to 17)."""

    def __init__(self, classes: int = 3, c: int = 8):
        super().__init__()
        self.backbone = nn.Sequential(nn.Conv2d(3, c, 3, 2, 1, bias=False), nn.BatchNorm2d(c), nn.ReLU(),
                                      nn.Conv2d(c, c, 3, 2, 1, bias=False), nn.BatchNorm2d(c), nn.ReLU())
        self.atrous = nn.ModuleList([nn.Conv2d(c, c, 1, bias=False)] +
                                    [nn.Conv2d(c, c, 3, padding=d, dilation=d, bias=False) for d in (1, 2)])
        self.pooling = nn.Sequential(nn.AdaptiveAvgPool2d(1), nn.Conv2d(c, c, 1, bias=False), nn.BatchNorm2d(c),
                                     nn.ReLU())
        self.project = nn.Sequential(nn.Conv2d(4 * c, c, 1, bias=False), nn.BatchNorm2d(c), nn.ReLU())
        self.classifier = nn.Conv2d(c, classes, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        size = x.shape[-2:]
        f = self.backbone(x)
        branches = [conv(f) for conv in self.atrous]
        branches.append(F.interpolate(self.pooling(f), size=f.shape[-2:], mode="bilinear", align_corners=False))
        logits = self.classifier(self.project(torch.cat(branches, 1)))
        return F.interpolate(logits, size=size, mode="bilinear", align_corners=False)


class Pyramid(nn.Module):
    """PSPNet's pyramid pooling (adaptive average pooling to 1, 2, 3 and 6, each brought back
    with align_corners=True) and an FPN's top-down path (a coarser map brought to the lateral's
    odd size, nearest)."""

    def __init__(self, c: int = 6):
        super().__init__()
        self.stem = nn.Conv2d(3, c, 3, padding=1)
        self.down = nn.Conv2d(c, c, 3, stride=2, padding=1)
        self.lateral = nn.Conv2d(c, c, 1)
        self.stages = nn.ModuleList([nn.Sequential(nn.AdaptiveAvgPool2d(k), nn.Conv2d(c, 2, 1)) for k in (1, 2, 3, 6)])
        self.fuse = nn.Conv2d(c + 8, 3, 3, padding=1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        f = torch.relu(self.stem(x))
        top = torch.relu(self.down(f))
        f = self.lateral(f) + F.interpolate(top, size=f.shape[-2:], mode="nearest")
        pooled = [F.interpolate(stage(f), size=f.shape[-2:], mode="bilinear", align_corners=True)
                  for stage in self.stages]
        return self.fuse(torch.cat([f] + pooled, 1))


class Cbam(nn.Module):
    """CBAM's attention on a convolutional block: channel attention from global average and max
    pooling through a shared MLP (1x1 convolutions), spatial attention from the channels' mean
    and max through a 7x7 convolution; and a global maximum as amax over the image."""

    def __init__(self, c: int = 8):
        super().__init__()
        self.conv = nn.Conv2d(3, c, 3, padding=1)
        self.mlp = nn.Sequential(nn.Conv2d(c, 2, 1, bias=False), nn.ReLU(), nn.Conv2d(2, c, 1, bias=False))
        self.spatial = nn.Conv2d(2, 1, 7, padding=3, bias=False)
        self.out = nn.Conv2d(c, 3, 3, padding=1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        f = torch.relu(self.conv(x))
        f = f * torch.sigmoid(self.mlp(F.adaptive_avg_pool2d(f, 1)) + self.mlp(F.adaptive_max_pool2d(f, 1)))
        f = f * torch.sigmoid(self.spatial(torch.cat([f.mean(1, keepdim=True), f.amax(1, keepdim=True)], 1)))
        return self.out(f / f.amax((2, 3), keepdim=True).clamp_min(1e-3))


class _Permute(nn.Module):
    """torchvision's ops.misc.Permute, which its ConvNeXt uses."""

    def __init__(self, dims):
        super().__init__()
        self.dims = list(dims)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.permute(x, self.dims)


class _LayerNorm2d(nn.LayerNorm):
    """torchvision's LayerNorm2d: a LayerNorm over the channels, through a channels-last permute."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x.permute(0, 2, 3, 1)
        x = F.layer_norm(x, self.normalized_shape, self.weight, self.bias, self.eps)
        return x.permute(0, 3, 1, 2)


class _ConvNeXtBlock(nn.Module):
    """torchvision's CNBlock: a 7x7 depthwise convolution, then channels last (LayerNorm, an
    inverted MLP, a layer scale of C numbers), channels first again, and the residual."""

    def __init__(self, c: int):
        super().__init__()
        self.block = nn.Sequential(nn.Conv2d(c, c, 7, padding=3, groups=c), _Permute([0, 2, 3, 1]), nn.LayerNorm(c),
                                   nn.Linear(c, 4 * c), nn.GELU(), nn.Linear(4 * c, c), _Permute([0, 3, 1, 2]))
        self.layer_scale = nn.Parameter(torch.linspace(0.5, 1.5, c).view(c, 1, 1))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.layer_scale * self.block(x)


class ConvNeXt(nn.Module):
    """ConvNeXt's blocks for a dense output: a stem and a downsampling step through LayerNorm2d,
    CNBlocks, and a block written as timm's (x.permute, a LayerNorm by hand over the channels,
    x @ w, ConvNeXt V2's global response norm over the image, a layer scale of C numbers,
    channels-last all of it), upsampled back."""

    def __init__(self, c: int = 8):
        super().__init__()
        self.stem = nn.Sequential(nn.Conv2d(3, c, 3, padding=1), _LayerNorm2d(c))
        self.stage1 = _ConvNeXtBlock(c)
        self.down = nn.Sequential(_LayerNorm2d(c), nn.Conv2d(c, c, 2, stride=2))
        self.stage2 = _ConvNeXtBlock(c)
        self.mix = nn.Parameter(torch.randn(c, c) / c ** 0.5)
        self.grn_gamma = nn.Parameter(torch.linspace(-0.5, 0.5, c))
        self.grn_beta = nn.Parameter(torch.linspace(0.1, 0.2, c))
        self.gamma = nn.Parameter(torch.linspace(1.5, 0.5, c))
        self.out = nn.ConvTranspose2d(c, 3, 2, stride=2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.stage2(self.down(self.stage1(self.stem(x))))
        z = y.permute(0, 2, 3, 1)
        mean = z.mean(-1, keepdim=True)
        z = (z - mean) / (z.var(-1, keepdim=True, unbiased=False) + 1e-6).sqrt()
        z = F.gelu(z @ self.mix)
        gx = torch.norm(z, p=2, dim=(1, 2), keepdim=True)  # GRN: each channel's norm over the whole image
        z = self.grn_gamma * (z * (gx / (gx.mean(dim=-1, keepdim=True) + 1e-6))) + self.grn_beta + z
        return self.out(y + (z * self.gamma).permute(0, 3, 1, 2))


class NnUNet(nn.Module):
    """nnU-Net's 2-D building blocks (convolution, instance norm with affine parameters,
    leaky ReLU; a strided convolution down, a transposed one up, the skip concatenated), with
    group norm in the bottleneck and one instance norm keeping running statistics."""

    def __init__(self, c: int = 8):
        super().__init__()

        def block(c_in: int, c_out: int, stride: int = 1) -> nn.Sequential:
            # No bias before a norm: its gradient is 0 (to rounding), which no relative error measures.
            return nn.Sequential(nn.Conv2d(c_in, c_out, 3, stride, 1, bias=False), nn.InstanceNorm2d(c_out, affine=True),
                                 nn.LeakyReLU(0.01))

        self.enc = block(3, c)
        self.down = block(c, 2 * c, stride=2)
        self.bottleneck = nn.Sequential(nn.Conv2d(2 * c, 2 * c, 3, padding=1, bias=False), nn.GroupNorm(4, 2 * c),
                                        nn.LeakyReLU(0.01))
        self.up = nn.ConvTranspose2d(2 * c, c, 2, stride=2)
        self.dec = nn.Sequential(nn.Conv2d(2 * c, c, 3, padding=1, bias=False),
                                 nn.InstanceNorm2d(c, affine=True, track_running_stats=True), nn.LeakyReLU(0.01))
        self.head = nn.Conv2d(c, 3, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        skip = self.enc(x)
        up = self.up(self.bottleneck(self.down(skip)))
        return self.head(self.dec(torch.cat([skip, up[..., :skip.shape[-2], :skip.shape[-1]]], 1)))


class HandNorm(nn.Module):
    """Normalization written by hand, as AdaIN and style-transfer networks write it: each
    sample's channels over the image (mean and std over (2, 3)) with learned scale and shift,
    then each sample over its channels and image (var_mean over (1, 2, 3))."""

    def __init__(self, c: int = 6):
        super().__init__()
        self.conv1 = nn.Conv2d(3, c, 3, padding=1, bias=False)  # a bias before a norm has no gradient
        self.gamma, self.beta = nn.Parameter(torch.linspace(0.5, 1.5, c)), nn.Parameter(torch.linspace(-0.5, 0.5, c))
        self.conv2 = nn.Conv2d(c, 3, 3, padding=1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        f = self.conv1(x)
        f = (f - f.mean((2, 3), keepdim=True)) / (f.std((2, 3), keepdim=True) + 1e-5)
        f = f * self.gamma.view(1, -1, 1, 1) + self.beta.view(1, -1, 1, 1)
        var, mean = torch.var_mean(f, (1, 2, 3), keepdim=True)
        return self.conv2(torch.relu((f - mean) / (var + 1e-5).sqrt()))


class RowGate(nn.Module):
    """Attention from each row's statistics (strip pooling, IMDN-style gates): the row means and
    maxima (adaptive pooling to ``(None, 1)``, ``x.mean(3, keepdim=True)``) through convolutions
    along the rows, gating the map by broadcasting back along its columns. Exact on row bands,
    where each rank holds whole rows; refused where the columns are split."""

    def __init__(self, c: int = 6):
        super().__init__()
        self.conv = nn.Conv2d(3, c, 3, padding=1)
        self.along = nn.Conv2d(2 * c, c, (3, 1), padding=(1, 0))
        self.out = nn.Conv2d(c, 3, 3, padding=1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        f = torch.relu(self.conv(x))
        rows = torch.cat([F.adaptive_avg_pool2d(f, (None, 1)), F.adaptive_max_pool2d(f, (None, 1))], 1)
        f = f * torch.sigmoid(self.along(rows)) + (f - f.mean(3, keepdim=True)) * 0.5
        return self.out(f)


class MinMaxScaled(nn.Module):
    """The map rescaled by its whole range (``torch.aminmax``, min-max normalization) and a gate
    from the product of every value (``x.prod()``, a geometric-mean-like statistic), both over the
    whole batch and image: the same on every rank."""

    def __init__(self, c: int = 4):
        super().__init__()
        self.conv = nn.Conv2d(3, c, 3, padding=1)
        self.out = nn.Conv2d(c, 3, 3, padding=1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        f = self.conv(x)
        low, high = torch.aminmax(f)
        gate = (1 + 0.01 * torch.tanh(f)).prod()
        return self.out((f - low) / (high - low) * gate)


class _FusedLeakyReLU(torch.autograd.Function):
    """StyleGAN2's fused bias and leaky ReLU, its own backward: the bias's gradient a sum over
    the batch and image."""

    @staticmethod
    def forward(ctx, x, bias, slope, scale):
        y = x + bias.view(1, -1, 1, 1)
        ctx.save_for_backward(y)
        ctx.slope, ctx.scale = slope, scale
        return torch.where(y >= 0, y, y * slope) * scale

    @staticmethod
    def backward(ctx, grad):
        (y,) = ctx.saved_tensors
        grad_x = grad * torch.where(y >= 0, torch.ones_like(y), torch.full_like(y, ctx.slope)) * ctx.scale
        return grad_x, grad_x.sum(dim=(0, 2, 3)), None, None


class _LearnedSwish(torch.autograd.Function):
    """``x * sigmoid(beta * x)`` with its own backward (a memory-efficient Swish with a learned beta)."""

    @staticmethod
    def forward(ctx, x, beta):
        s = torch.sigmoid(beta * x)
        ctx.save_for_backward(x, beta, s)
        return x * s

    @staticmethod
    def backward(ctx, grad):
        x, beta, s = ctx.saved_tensors
        ds = s * (1 - s)
        return grad * (s + x * ds * beta), (grad * x * x * ds).sum().reshape(beta.shape)


class CustomFunctions(nn.Module):
    """Activations written as torch.autograd.Functions of the model's own, their parameters
    passed to them (a bias, a learned beta): their backward's sums over the image are each
    rank's share."""

    def __init__(self, c: int = 4):
        super().__init__()
        self.conv = nn.Conv2d(3, c, 3, padding=1, bias=False)
        self.bias = nn.Parameter(torch.randn(c) * 0.1)
        self.mid = nn.Conv2d(c, c, 3, padding=1)
        self.beta = nn.Parameter(torch.tensor([1.3]))
        self.out = nn.Conv2d(c, 3, 3, padding=1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        f = _FusedLeakyReLU.apply(self.conv(x), self.bias, 0.2, 2 ** 0.5)
        return self.out(_LearnedSwish.apply(self.mid(f), self.beta))


class Focus(nn.Module):
    """YOLOv5's Focus stem (each 2x2 block's four pixels as channels, by slicing with a step),
    then every third row of a feature map from the second (even sizes: the slices must
    concatenate)."""

    def __init__(self, c: int = 4):
        super().__init__()
        self.conv = nn.Conv2d(12, c, 3, padding=1)
        self.mid = nn.Conv2d(c, c, 3, padding=1)
        self.out = nn.Conv2d(c, 3, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        blocks = torch.cat([x[..., ::2, ::2], x[..., 1::2, ::2], x[..., ::2, 1::2], x[..., 1::2, 1::2]], 1)
        return self.out(self.mid(self.conv(blocks))[..., 1::3, :])


def extra_inputs(name: str, x: torch.Tensor):
    """The whole inputs a model takes besides ``x``, as (args, kwargs): the same on every rank."""
    if name != "masked":
        return (), {}
    gen = torch.Generator().manual_seed(x.shape[-2] * 1000 + x.shape[-1])
    shape = (x.shape[0], 1, *x.shape[-2:])
    mask = (torch.rand(shape, generator=gen) > 0.5).to(x.dtype)
    scale = torch.rand(shape, generator=gen, dtype=x.dtype) + 0.5
    return (mask.to(x.device),), {"scale": scale.to(x.device)}


_MODELS = {
    "resnet50": lambda: resnet50(num_classes=10), "resnet-small": SmallResNet, "unet": lambda: UNet(pad=True),
    "unet-crop": lambda: UNet(pad=False), "seghead": SegmentationHead, "masked": Masked, "unbatched": Unbatched,
    "quirks": Quirks, "borders": Borders, "unshuffle": Unshuffled, "pooled": Pooled, "multiscale": MultiScale,
    "deeplab": DeepLab, "pyramid": Pyramid, "cbam": Cbam, "nnunet": NnUNet, "handnorm": HandNorm,
    "convnext": ConvNeXt, "rowgate": RowGate, "minmax": MinMaxScaled, "customfn": CustomFunctions,
    "focus": Focus,
}


def build(name: str) -> nn.Module:
    """A model of this file's by name, else hpdl.sr's (edsr-baseline, edsr, srresnet) at x2."""
    make = _MODELS.get(name)
    return make() if make is not None else build_model(name, 2)


def output_shape(name: str, batch: int, height: int, width: int):
    """The output's shape for a batch of ``batch`` images of ``height`` x ``width`` (shapes only)."""
    args, kwargs = extra_inputs(name, torch.zeros(batch, 3, height, width))
    with torch.no_grad():
        try:
            model = build(name).to("meta")
            x = torch.empty(batch, 3, height, width, device="meta")
            return tuple(model(x, *(a.to("meta") for a in args), **{k: v.to("meta") for k, v in kwargs.items()}).shape)
        except RuntimeError:  # a forward reading values (quirks): on real zeros
            return tuple(build(name)(torch.zeros(batch, 3, height, width), *args, **kwargs).shape)
