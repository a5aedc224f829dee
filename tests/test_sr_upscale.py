"""Exact tiled inference, self-ensemble, uint8 assembly, and the dihedral transforms."""

import subprocess
import sys

import numpy as np
import pytest
import torch
import tqdm.std

from hpdl.sr.models import build_model_from_config, receptive_field_radius
from hpdl.sr.registry import ModelConfig
from hpdl.sr.transforms import dihedral_array, dihedral_tensor, inverse_dihedral_tensor
from hpdl.sr.metrics import quantize
from hpdl.sr.inference import PROGRESS_DELAY, forward_tiled, self_ensemble, upscale, upscale_image


def small_baseline(scale, seed=0):
    torch.manual_seed(seed)
    return build_model_from_config(ModelConfig("edsr_baseline_small", scale, 3, 16, 1.0)).eval()


@pytest.mark.parametrize("scale", [2, 3, 4])
def test_tiled_equals_whole_image_pass(scale):
    model = small_baseline(scale)
    lr = torch.rand(1, 3, 45, 67, generator=torch.Generator().manual_seed(scale)) * 255  # odd size
    with torch.no_grad():
        whole = model(lr)
        tiled = forward_tiled(model, lr, tile=16)
        too_little = forward_tiled(model, lr, tile=16, overlap=receptive_field_radius(model) - 1)
    assert tiled.shape == whole.shape == (1, 3, 45 * scale, 67 * scale)
    assert (tiled - whole).abs().max().item() < 1e-4
    # one pixel less overlap than the receptive-field radius is no longer exact
    assert (too_little - whole).abs().max().item() > 1e-3


def test_tile_larger_than_image_and_batches():
    model = small_baseline(2)
    lr = torch.rand(2, 3, 9, 11) * 255
    with torch.no_grad():
        assert torch.equal(forward_tiled(model, lr, tile=64), model(lr))
        assert (forward_tiled(model, lr, tile=4) - model(lr)).abs().max() < 1e-4
    with pytest.raises(ValueError, match="tile must be >= 1"):
        forward_tiled(model, lr, tile=0)


def test_dihedral_transforms_agree_and_invert():
    img = np.arange(2 * 3 * 3).reshape(2, 3, 3)
    t = torch.from_numpy(img.transpose(2, 0, 1).copy())
    results = set()
    for k in range(8):
        a = dihedral_array(img, k)
        b = dihedral_tensor(t, k)
        assert torch.equal(torch.from_numpy(np.ascontiguousarray(a.transpose(2, 0, 1))), b)
        assert torch.equal(inverse_dihedral_tensor(b, k), t)
        results.add(tuple(b.flatten().tolist()) + tuple(b.shape))
    assert len(results) == 8
    with pytest.raises(ValueError):
        dihedral_tensor(t, 8)


def test_self_ensemble_of_an_equivariant_model_is_the_model():
    up = torch.nn.Upsample(scale_factor=2, mode="nearest")
    x = torch.rand(1, 3, 5, 7)
    assert torch.allclose(self_ensemble(up, x), up(x))
    calls = []
    self_ensemble(lambda z: calls.append(z.shape) or up(z), x)
    assert len(calls) == 8 and (1, 3, 7, 5) in calls


def test_upscale_with_ensemble_and_tiles_and_uint8_images():
    model = small_baseline(3)
    lr = torch.rand(3, 13, 10) * 255
    plain = upscale(model, lr)
    assert plain.shape == (3, 39, 30)
    ens = upscale(model, lr, ensemble=True)
    assert (upscale(model, lr, ensemble=True, tile=5) - ens).abs().max() < 1e-4
    assert not torch.allclose(ens, plain)
    img = (np.random.default_rng(0).random((13, 10, 3)) * 255).astype(np.uint8)
    out = upscale_image(model, img, tile=4)
    assert out.dtype == np.uint8 and out.shape == (39, 30, 3)


@pytest.mark.parametrize("tile,ensemble", [(None, False), (7, False), (7, True)])
def test_upscale_image_is_the_quantised_float_upscale(tile, ensemble):
    model = small_baseline(2)
    img = (np.random.default_rng(1).random((19, 23, 3)) * 255).astype(np.uint8)
    expected = quantize(upscale(model, torch.from_numpy(img).permute(2, 0, 1).float(), ensemble=ensemble))
    out = upscale_image(model, img, tile=tile, ensemble=ensemble)
    assert out.dtype == np.uint8 and out.shape == (38, 46, 3)
    # Float rounding in other tile shapes may move a value across a rounding boundary: one level.
    assert np.abs(out.astype(int) - expected.permute(1, 2, 0).numpy().astype(int)).max() <= 1


_PEAK = """
import resource, sys, numpy as np, torch
from hpdl.sr.models import build_model_from_config
from hpdl.sr.registry import ModelConfig
from hpdl.sr.inference import upscale_image

torch.set_num_threads(1)
model = build_model_from_config(ModelConfig("tiny", 2, 1, 8, 1.0)).eval()
upscale_image(model, np.zeros((300, 300, 3), np.uint8), tile=128)  # warm-up: allocator, thread pools
image = np.random.default_rng(0).integers(0, 256, (2000, 2000, 3), dtype=np.uint8)
before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
out = upscale_image(model, image, tile=128)
print((resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - before) * 1024, out.nbytes)
"""


def test_upscale_image_assembles_the_output_in_uint8():
    # Peak memory of a fresh process: the output as float32 (the old assembly) would add 4x its
    # uint8 size; tile by tile, little more than the uint8 output is added.
    proc = subprocess.run([sys.executable, "-c", _PEAK], capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr
    grown, out_bytes = map(int, proc.stdout.split())
    assert out_bytes == 4000 * 4000 * 3
    assert grown < 2 * out_bytes, f"peak memory grew by {grown / 2**20:.0f} MiB for a {out_bytes / 2**20:.0f} MiB output"


class _Clock:
    """Stands in for tqdm's clock: each reading is ``step`` seconds after the previous one."""

    def __init__(self, step):
        self.now, self.step = 1000.0, step

    def __call__(self):
        self.now += self.step
        return self.now


@pytest.mark.parametrize("seconds_per_reading,shown", [(0.0, False), (PROGRESS_DELAY, True)])
def test_progress_bar_over_tiles_appears_only_for_long_upscales(monkeypatch, capsys, seconds_per_reading, shown):
    monkeypatch.setattr(tqdm.std, "time", _Clock(seconds_per_reading))
    img = np.zeros((20, 20, 3), np.uint8)
    upscale_image(small_baseline(2), img, tile=5, progress=True)
    err = capsys.readouterr().err
    assert ("upscale" in err and "16/16" in err) == shown, err
    upscale_image(small_baseline(2), img, tile=5)  # progress off: never a bar
    assert capsys.readouterr().err == ""


def test_the_help_and_the_docs_say_what_exact_tiles_mean(capsys):
    from pathlib import Path

    from hpdl.cli import main

    for argv in (["sr", "upscale", "--help"], ["sr", "eval", "--help"]):
        with pytest.raises(SystemExit):
            main(argv)
        text = " ".join(capsys.readouterr().out.split())
        assert "float rounding" in text and "few 8-bit values by one level" in text, text
    docs = " ".join((Path(__file__).resolve().parents[1] / "docs" / "sr.md").read_text().split())
    assert "so every output pixel is computed from exactly the input pixels, zero padding included, that a " \
           "whole-image pass uses for it" in docs
    assert "It is not bit-identical" in docs
