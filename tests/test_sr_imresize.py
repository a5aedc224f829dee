"""MATLAB-compatible bicubic resizing: hand-computed values, exact properties, and the torch cross-check."""

import numpy as np
import pytest
import torch

from hpdl.sr.images import bicubic_downscale
from hpdl.sr.imresize import contributions, cubic, imresize, matlab_downscale, resize_matrix


def test_cubic_kernel_is_keys_with_a_minus_half():
    x = np.array([0.0, 0.25, 0.75, 1.0, 1.25, 1.75, 2.0, 2.5])
    # worked out by hand from (a+2)|x|^3 - (a+3)|x|^2 + 1 and a|x|^3 - 5a|x|^2 + 8a|x| - 4a, a = -0.5
    expected = [1.0, 0.8671875, 0.2265625, 0.0, -0.0703125, -0.0234375, 0.0, 0.0]
    np.testing.assert_allclose(cubic(x), expected, atol=1e-15)


def test_halving_four_pixels_matches_the_hand_computed_weights():
    # u = 2x - 0.5, a kernel 8 pixels wide, weights cubic(d / 2) / 2 normalised; the taps past the
    # ends mirror back ([1 2 3 4 4 3 2 1]): pixel 1 gets 0.11328125 + 0.43359375 and so on.
    weights, indices = contributions(4, 2, 0.5)
    first = np.zeros(4)
    np.add.at(first, indices[0], weights[0])
    np.testing.assert_allclose(first, [0.546875, 0.3984375, 0.1015625, -0.046875], atol=1e-12)
    column = np.array([10.0, 20.0, 30.0, 40.0])
    out = imresize(np.tile(column[:, None], (1, 4)), 0.5)
    np.testing.assert_allclose(out, [[14.609375] * 2, [35.390625] * 2], atol=1e-12)


@pytest.mark.parametrize("scale", [2, 3, 4])
def test_a_constant_image_stays_constant(scale):
    flat = np.full((12 * scale, 7 * scale, 3), 77, np.uint8)
    out = matlab_downscale(flat, scale)
    assert out.shape == (12, 7, 3) and out.dtype == np.uint8 and (out == 77).all()


@pytest.mark.parametrize("scale", [2, 3, 4])
def test_a_linear_ramp_is_reproduced_away_from_the_borders(scale):
    # Output pixel o (1-based) samples input position u = o * s - (s - 1) / 2; the cubic kernel
    # reproduces linear functions, so a ramp of the 1-based column number gives u exactly
    # wherever the kernel does not reach past the border (2 * s input pixels).
    width = 40 * scale
    ramp = np.tile(np.arange(1, width + 1, dtype=np.float64), (8 * scale, 1))
    out = imresize(ramp, 1 / scale)
    o = np.arange(1, out.shape[1] + 1)
    inner = slice(3, -3)
    np.testing.assert_allclose(out[:, inner], np.tile(o * scale - (scale - 1) / 2, (out.shape[0], 1))[:, inner],
                               atol=1e-9)
    # at the border the mirror bends it: not the ramp any more
    assert abs(out[0, 0] - (scale - (scale - 1) / 2)) > 1e-3


def test_interior_agrees_with_torchs_antialiased_bicubic_and_the_border_does_not():
    rng = np.random.default_rng(0)
    hr = rng.random((64, 48, 3)) * 255
    ours = imresize(hr, 1 / 4)
    x = torch.from_numpy(hr).permute(2, 0, 1)[None]
    theirs = torch.nn.functional.interpolate(x, size=(16, 12), mode="bicubic", antialias=True)[0].permute(1, 2, 0)
    theirs = theirs.numpy()
    np.testing.assert_allclose(ours[2:-2, 2:-2], theirs[2:-2, 2:-2], atol=1e-6)
    assert np.abs(ours[0] - theirs[0]).max() > 0.5


def test_uint8_images_are_rounded_after_each_pass_as_matlab_does():
    rng = np.random.default_rng(1)
    hr = rng.integers(0, 256, (24, 18, 3), dtype=np.uint8)
    out = imresize(hr, 1 / 3)
    step1 = np.clip(np.floor(np.tensordot(resize_matrix(24, 8, 1 / 3), hr.astype(np.float64), axes=(1, 0)) + 0.5),
                    0, 255)
    step2 = np.clip(np.floor(np.tensordot(resize_matrix(18, 6, 1 / 3), step1, axes=(1, 1)).transpose(1, 0, 2) + 0.5),
                    0, 255)
    assert out.dtype == np.uint8 and np.array_equal(out, step2.astype(np.uint8))


def test_bicubic_downscale_defaults_to_matlab_and_crops_to_a_multiple():
    rng = np.random.default_rng(2)
    hr = rng.integers(0, 256, (26, 19, 3), dtype=np.uint8)
    lr = bicubic_downscale(hr, 3)
    assert lr.shape == (8, 6, 3) and np.array_equal(lr, imresize(hr[:24, :18], 1 / 3))
    assert not np.array_equal(lr, bicubic_downscale(hr, 3, "torch"))
    with pytest.raises(ValueError, match="downscaler"):
        bicubic_downscale(hr, 3, "pil")
