"""Why tiled upscaling differs from a whole-image pass by float rounding, and what removing it costs.

Three measurements, on CPU, with EDSR-baseline x2 (a checkpoint, or PyTorch's default
initialisation) and a 300 x 200 photo:
  1. the whole image against tiles: float values and 8-bit values that differ;
  2. which convolutions give a pixel another value when the input around it has another extent
     (the whole image cut to the tile extents ``hpdl sr upscale`` hands the model), with
     PyTorch's oneDNN kernels and with its own im2col + matrix product;
  3. the time of a whole-image pass with each, and in float64, in alternating repeats.

Usage (docs/perf-notes/upscale.md quotes the figures):
    python scripts/measure_tile_rounding.py [--ckpt model.pt] [--threads 1] [--repeats 5]
"""

from __future__ import annotations

import argparse
import statistics
import time
import warnings

import numpy as np
import torch


def photo() -> np.ndarray:
    import skimage.data
    from PIL import Image

    return np.asarray(Image.fromarray(skimage.data.astronaut()).resize((300, 200), Image.BICUBIC)).copy()


def whole_against_tiles(model: torch.nn.Module, image: np.ndarray, tiles) -> None:
    from hpdl.sr.models import receptive_field_radius
    from hpdl.sr.inference import _on_device, _tiles

    forward = _on_device(model)
    lr = torch.from_numpy(image).permute(2, 0, 1).unsqueeze(0).float()
    whole = forward(lr)
    for tile in tiles:
        out = torch.empty_like(whole)
        for s, (y0, y1, x0, x1), piece in _tiles(forward, lr, tile, receptive_field_radius(model)):
            out[..., y0 * s:y1 * s, x0 * s:x1 * s] = piece
        differ = (out != whole).sum().item()
        levels = (out.clamp(0, 255).round() != whole.clamp(0, 255).round()).sum().item()
        print(f"tile {tile:3d}: {differ} of {whole.numel()} float values differ (largest "
              f"{(out - whole).abs().max().item():.1e}), {levels} 8-bit values")


def extents(heights=range(4, 201, 4), widths=(44, 80, 100, 136, 300)) -> None:
    torch.manual_seed(0)
    for cin, cout in ((3, 64), (64, 64), (64, 256), (64, 3)):
        conv = torch.nn.Conv2d(cin, cout, 3, padding=1)
        x = torch.randn(1, cin, 200, 300) * 50
        for onednn in (True, False):
            with torch.backends.mkldnn.flags(enabled=onednn):
                whole = conv(x)
                moved = [f"{h}x{w}" for h in heights for w in widths
                         if not torch.equal(conv(x[..., 200 - h:, :w].contiguous())[..., 1:, :-1],
                                            whole[..., 200 - h + 1:, :w - 1])]
            print(f"conv {cin}->{cout} {'oneDNN' if onednn else 'im2col + matmul'}: {len(moved)} of "
                  f"{len(heights) * len(widths)} extents give other values ({' '.join(moved[:6])}"
                  f"{' ...' if len(moved) > 6 else ''})")


def timings(model: torch.nn.Module, repeats: int) -> None:
    x = torch.rand(1, 3, 200, 300) * 255
    ways = {"oneDNN float32": (True, torch.float32), "im2col + matmul float32": (False, torch.float32),
            "float64": (True, torch.float64)}
    seconds = {name: [] for name in ways}
    for _ in range(repeats):
        for name, (onednn, dtype) in ways.items():
            with torch.backends.mkldnn.flags(enabled=onednn):
                net, data = model.to(dtype), x.to(dtype)
                start = time.perf_counter()
                net(data)
                seconds[name].append(time.perf_counter() - start)
    model.float()
    base = seconds["oneDNN float32"]
    for name, times in seconds.items():
        ratios = [t / b for t, b in zip(times, base)]
        print(f"{name:24s} median {statistics.median(times):6.2f} s, against oneDNN per repeat: median "
              f"{statistics.median(ratios):.2f}x (range {min(ratios):.2f}-{max(ratios):.2f})")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--ckpt", help="an EDSR-baseline x2 checkpoint (default: PyTorch's initialisation)")
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--repeats", type=int, default=5)
    args = parser.parse_args()
    warnings.filterwarnings("ignore", message="TF32 acceleration")  # what mkldnn.flags() says on CPU
    torch.set_num_threads(args.threads)
    if args.ckpt:
        from hpdl.sr.checkpoint import load_model

        model = load_model(args.ckpt)[0]
    else:
        from hpdl.sr.models import build_model_from_config
        from hpdl.sr.registry import ModelConfig

        torch.manual_seed(0)
        model = build_model_from_config(ModelConfig("edsr_baseline", 2, 16, 64, 1.0))
    model.eval()
    with torch.no_grad():
        whole_against_tiles(model, photo(), (32, 64, 100, 128))
        extents()
        timings(model, args.repeats)


if __name__ == "__main__":
    main()
