"""Smoke test of the pipeline / model throughput measurements, and of hpdl.sr's lazy imports."""

import subprocess
import sys

import numpy as np
from PIL import Image

import hpdl.sr
from hpdl.sr.throughput import measure_model, measure_pipeline


def test_measurements_return_records(tmp_path):
    for i in range(2):
        rgb = np.random.default_rng(i).integers(0, 256, (40, 40, 3), dtype=np.uint8)
        Image.fromarray(rgb).save(tmp_path / f"{i}.png")
    pipe = measure_pipeline(str(tmp_path), 2, patch_size=8, batch_size=4, num_workers=0, batches=3,
                            repeats=2, cache_dir=str(tmp_path / "cache"))
    assert pipe["unit"] == "patches/s" and 0 < pipe["min"] <= pipe["median"] <= pipe["max"]
    model = measure_model(patch_size=8, batch_size=1, steps=1, repeats=1)
    assert model["unit"] == "images/s" and model["median"] > 0


def test_public_api_is_lazy_and_complete():
    for name in hpdl.sr.__all__:
        assert getattr(hpdl.sr, name) is not None
    # `hpdl --help` imports hpdl.sr.cli to build its parser: that must not import torch
    code = (
        "import argparse, sys, hpdl.sr, hpdl.sr.cli\n"
        "hpdl.sr.cli.register(argparse.ArgumentParser().add_subparsers())\n"
        "assert 'torch' not in sys.modules"
    )
    subprocess.run([sys.executable, "-c", code], check=True)
