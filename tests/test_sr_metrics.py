"""PSNR / SSIM conventions and the bicubic baseline."""

import math

import numpy as np
import pytest
import torch
from skimage.metrics import structural_similarity

from hpdl.sr.metrics import bicubic_upscale, default_shave, psnr, quantize, rgb_to_y, ssim


def rand(h, w, seed=0):
    return torch.randint(0, 256, (3, h, w), generator=torch.Generator().manual_seed(seed)).double()


def test_identical_images():
    hr = rand(40, 30)
    for space in ("y", "rgb"):
        assert psnr(hr, hr, 2, space) == math.inf
        assert ssim(hr, hr, 2, space) == pytest.approx(1.0, abs=1e-12)


def test_known_mse_gives_expected_psnr():
    hr = torch.full((3, 20, 20), 100.0)
    sr = hr + 10  # MSE 100 on RGB
    assert psnr(sr, hr, 2, "rgb") == pytest.approx(10 * math.log10(255**2 / 100))
    # Y difference of a uniform +10 on RGB is 10 * (65.738 + 129.057 + 25.064) / 256
    dy = 10 * (65.738 + 129.057 + 25.064) / 256
    assert psnr(sr, hr, 2, "y") == pytest.approx(10 * math.log10(255**2 / dy**2))


def test_output_is_quantised_before_measuring():
    hr = rand(20, 20)
    assert psnr(hr + 0.4, hr, 2, "rgb") == math.inf  # rounds back to hr
    assert torch.equal(quantize(torch.tensor([-3.0, 12.5001, 300.0])), torch.tensor([0.0, 13.0, 255.0]))


def test_shave_only_looks_inside_the_border():
    hr = rand(30, 30)
    sr = hr.clone()
    sr[:, :5, :] = 0
    sr[:, :, -5:] = 0
    assert default_shave(4, "y") == 4 and default_shave(4, "rgb") == 10
    assert psnr(sr, hr, 5, "y") == math.inf  # shaves 5
    assert psnr(sr, hr, 4, "y") < 40  # shaves 4: sees the damage
    assert psnr(sr, hr, 2, "rgb") == math.inf  # shaves 2 + 6
    assert psnr(sr, hr, 2, "rgb", shave=0) < 20


def test_rgb_to_y_bt601():
    white, black = torch.full((3, 1, 1), 255.0), torch.zeros(3, 1, 1)
    assert rgb_to_y(black).item() == pytest.approx(16.0)
    assert rgb_to_y(white).item() == pytest.approx(16 + 255 * (65.738 + 129.057 + 25.064) / 256)  # ~235
    px = torch.tensor([10.0, 200.0, 40.0]).view(3, 1, 1)
    assert rgb_to_y(px).item() == pytest.approx(16 + (65.738 * 10 + 129.057 * 200 + 25.064 * 40) / 256)


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_ssim_agrees_with_scikit_image(seed):
    hr = rand(48, 37, seed)
    noise = torch.randn(3, 48, 37, generator=torch.Generator().manual_seed(seed + 10)) * (10 + 15 * seed)
    sr = (hr + noise).clamp(0, 255).round()
    kw = dict(gaussian_weights=True, sigma=1.5, use_sample_covariance=False, data_range=255)
    b = default_shave(2, "rgb")
    ref = structural_similarity(sr.numpy()[:, b:-b, b:-b], hr.numpy()[:, b:-b, b:-b], channel_axis=0, **kw)
    assert ssim(sr, hr, 2, "rgb") == pytest.approx(ref, abs=1e-9)
    y_sr, y_hr = rgb_to_y(sr)[0].numpy()[2:-2, 2:-2], rgb_to_y(hr)[0].numpy()[2:-2, 2:-2]
    assert ssim(sr, hr, 2, "y") == pytest.approx(structural_similarity(y_sr, y_hr, **kw), abs=1e-9)


def test_bad_arguments():
    with pytest.raises(ValueError, match="'y' or 'rgb'"):
        psnr(rand(20, 20), rand(20, 20), 2, "ycbcr")
    with pytest.raises(ValueError, match="one size"):
        psnr(rand(20, 20), rand(20, 22), 2)
    with pytest.raises(ValueError, match="smaller than the 11x11"):
        ssim(rand(14, 14), rand(14, 14), 2)


def test_bicubic_upscale():
    lr = rand(5, 7)
    up = bicubic_upscale(lr, 3)
    assert up.shape == (3, 15, 21)
    assert bicubic_upscale(lr[None], 2).shape == (1, 3, 10, 14)
    flat = torch.full((3, 4, 4), 50.0)
    assert torch.allclose(bicubic_upscale(flat, 4), torch.full((3, 16, 16), 50.0))
    # smooth content is reproduced well: bicubic of a downscaled gradient is close
    ramp = torch.linspace(0, 255, 64).repeat(3, 64, 1)
    small = ramp[:, ::2, ::2]
    assert psnr(bicubic_upscale(small, 2), ramp, 2, "y") > 35
    assert np.isfinite(psnr(bicubic_upscale(small, 2), ramp, 2, "rgb"))


def test_bicubic_upscale_uses_the_matlab_kernel():
    # Keys cubic with a = -0.5 (MATLAB imresize, PIL) rather than PyTorch's default a = -0.75;
    # PIL's float mode computes it without intermediate rounding.
    from PIL import Image

    lr = np.random.default_rng(0).integers(0, 256, (12, 9)).astype(np.float32)
    ref = np.asarray(Image.fromarray(lr, mode="F").resize((18, 24), Image.BICUBIC))
    ours = bicubic_upscale(torch.from_numpy(lr).expand(3, 12, 9), 2)[0].numpy()
    assert np.abs(ours - ref).max() < 1e-3
