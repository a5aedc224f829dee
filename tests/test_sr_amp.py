"""`hpdl sr train ... amp=bf16|fp16` on the CPU: training learns, the loss scale is checkpointed and
resumed, and a setting that cannot be met is one line before anything is written."""

import csv
import json

import torch

from hpdl.sr.checkpoint import load_checkpoint, save_checkpoint
from test_sr_train import tiny_data, tiny_run


def losses(out):
    with open(out / "train_log.csv", newline="") as f:
        return [float(r["loss"]) for r in csv.DictReader(f)]


def test_a_short_bf16_training_learns_with_its_own_rounding(tmp_path):
    data = tiny_data(tmp_path)
    runs = {}
    for amp in ("none", "bf16"):
        proc = tiny_run(data, tmp_path / amp, "total_updates=30", "log_every=10", f"amp={amp}", "--json")
        assert proc.returncode == 0, proc.stderr
        runs[amp] = json.loads(proc.stdout)
    assert runs["bf16"]["amp"] == "bf16" and "amp bf16" in proc.stdout + proc.stderr
    curve = losses(tmp_path / "bf16")
    assert len(curve) == 3 and curve[-1] < 0.8 * curve[0], curve
    # The forward really ran in bfloat16: the same seed and batches end in other weights.
    ours = load_checkpoint(tmp_path / "bf16" / "model.pt")["model"]
    theirs = load_checkpoint(tmp_path / "none" / "model.pt")["model"]
    assert any(not torch.equal(ours[k], theirs[k]) for k in ours)


def test_fp16_checkpoints_keep_the_loss_scale_and_a_resume_continues_from_it(tmp_path):
    data, out = tiny_data(tmp_path), tmp_path / "run"
    proc = tiny_run(data, out, "total_updates=4", "ckpt_every=2", "val_at_end=false", "amp=fp16")
    assert proc.returncode == 0, proc.stderr
    ckpt = load_checkpoint(out / "last.pt")
    assert ckpt["config"]["amp"] == "fp16" and ckpt["scaler"]["scale"] > 0
    # As if the run had met overflows: a resume goes on from the checkpoint's scale, not a fresh one.
    ckpt["scaler"]["scale"] = 8.0
    save_checkpoint(out / "last.pt", ckpt)
    resumed = tiny_run(data, out, "total_updates=6", "val_at_end=false", "amp=fp16", "resume=auto")
    assert resumed.returncode == 0, resumed.stderr
    assert load_checkpoint(out / "last.pt")["scaler"]["scale"] <= 8.0  # halved on overflow, never grown in 2 updates
    # A run without loss scaling writes none, and resuming it with amp=fp16 starts a fresh scale.
    plain = tmp_path / "plain"
    assert tiny_run(data, plain, "total_updates=2", "val_at_end=false").returncode == 0
    assert load_checkpoint(plain / "last.pt")["scaler"] is None
    switched = tiny_run(data, plain, "total_updates=4", "val_at_end=false", "amp=fp16", "resume=auto")
    assert switched.returncode == 0, switched.stderr
    assert "changed: amp ('none' -> 'fp16')" in switched.stdout + switched.stderr


def test_fp16_with_overlap_forward_is_one_line_and_writes_nothing(tmp_path):
    out = tmp_path / "run"
    proc = tiny_run(tiny_data(tmp_path), out, "amp=fp16", "overlap_forward=true")
    assert proc.returncode == 2
    assert proc.stderr.strip().splitlines() == [
        "hpdl: error: command line: overlap_forward: must be false with amp=fp16 (loss scaling checks the averaged "
        "gradients before each update; amp=bf16 needs no scaling), got True"]
    assert not out.exists()
