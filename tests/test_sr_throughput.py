"""Smoke test of the pipeline / model throughput measurements, and of hpdl.sr's lazy imports."""

import importlib
import subprocess
import sys

import numpy as np
from cli_in_process import run_hpdl
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
    # Each public name is the object its submodule defines (the lazy table names the right one).
    for name, module in hpdl.sr._EXPORTS.items():
        assert getattr(hpdl.sr, name) is getattr(importlib.import_module(f"hpdl.sr.{module}"), name), name
    # `hpdl --help` imports hpdl.sr.cli to build its parser: that must not import torch
    code = (
        "import argparse, sys, hpdl.sr, hpdl.sr.cli\n"
        "hpdl.sr.cli.register(argparse.ArgumentParser().add_subparsers())\n"
        "assert 'torch' not in sys.modules"
    )
    subprocess.run([sys.executable, "-c", code], check=True)


def _photos(folder):
    folder.mkdir()
    for i in range(2):
        rgb = np.random.default_rng(i).integers(0, 256, (40, 40, 3), dtype=np.uint8)
        Image.fromarray(rgb).save(folder / f"{i}.png")
    return folder


def test_bench_pipeline_prints_both_records(tmp_path):
    import json

    data = _photos(tmp_path / "photos")
    run = run_hpdl(["bench", "pipeline", "--data", str(data), "--patch", "8", "--batch-size", "4",
                    "--model-batch-size", "1", "--workers", "0", "--batches", "3", "--repeats", "1",
                    "--cache-dir", str(tmp_path / "cache"), "--json"])
    assert run.returncode == 0, run.stderr
    pipeline, model = json.loads(run.stdout)
    assert pipeline["unit"] == "patches/s" and pipeline["median"] > 0
    assert model["unit"] == "images/s" and model["what"].startswith("edsr_baseline x2")


def test_bench_pipeline_bad_input_is_one_line(tmp_path):
    for args, names in ((["--data", str(tmp_path / "missing")], "missing"),
                        (["--model", "nosuchnet"], "nosuchnet"),
                        (["--batches", "0"], "--batches")):
        run = run_hpdl(["bench", "pipeline", *args])
        assert run.returncode == 2, (args, run.stderr)
        lines = run.stderr.strip().splitlines()
        assert len(lines) == 1 and lines[0].startswith("hpdl: error:") and names in lines[0], (args, run.stderr)
