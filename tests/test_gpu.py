"""hpdl on a real GPU: the engine's collectives, DistributedOptimizer, SyncBatchNorm, mixed
precision, `hpdl sr` and the synthetic benchmark on CUDA tensors.

Marked gpu: without a CUDA device each skips, saying why (conftest.py); scripts/gpu-check.sh
runs every test marked gpu. Two layouts under torchrun: one rank over nccl, and two ranks
sharing the one GPU over gloo (HPDL_RANKS_PER_GPU=2, as NCCL refuses two ranks on one GPU).
"""

import json
import subprocess
import sys

import numpy as np
import pytest
from PIL import Image

from ranks import ROOT, run_ranks
from test_sr_train import tiny_data, tiny_run_argv

pytestmark = [pytest.mark.gpu, pytest.mark.multirank]

# (ranks, environment, backend the engine must have chosen)
LAYOUTS = [(1, {"HPDL_BACKEND": "nccl"}, "nccl"), (2, {"HPDL_RANKS_PER_GPU": "2"}, "gloo")]
LAYOUT_IDS = ["nccl-1", "gloo-2-on-one-gpu"]


@pytest.mark.parametrize("n,env,backend", LAYOUTS, ids=LAYOUT_IDS)
def test_engine_collectives_on_cuda_tensors(n, env, backend):
    # every dtype, fusion in the CUDA buffer, a CPU tensor beside, a caller on a side stream, join
    out = run_ranks("gpu_engine.py", n, "torchrun", env=env, timeout=120).stdout
    assert f"OK gpu engine: backend={backend} size={n} device=cuda:0" in out, out


@pytest.mark.parametrize("n,env,backend", LAYOUTS, ids=LAYOUT_IDS)
def test_distributed_optimizer_on_cuda_equals_one_process(n, env, backend):
    # every scenario, fp16 and bf16 compression among them, on the GPU
    out = run_ranks("optimizer_equivalence.py", n, "torchrun", args=["--device", "cuda"], env=env, timeout=120).stdout
    assert "OK sgd-fp16" in out and "OK adam-bf16" in out and "OK adam-overlap-scheduler" in out, out


@pytest.mark.parametrize("n,env,backend", LAYOUTS, ids=LAYOUT_IDS)
def test_sync_batch_norm_on_cuda(n, env, backend):
    out = run_ranks("sync_batch_norm.py", n, "torchrun", args=["--device", "cuda"], env=env, timeout=120).stdout
    assert f"OK sync batch norm: size={n} device=cuda" in out, out


@pytest.mark.parametrize("n,env,backend", LAYOUTS, ids=LAYOUT_IDS)
def test_mixed_precision_on_cuda_equals_one_process(n, env, backend):
    out = run_ranks("mixed_precision.py", n, "torchrun", args=["--device", "cuda"], env=env, timeout=120).stdout
    assert "OK amp bf16" in out and "OK amp fp16" in out, out


def _hpdl(*argv, timeout=120):
    proc = subprocess.run([sys.executable, "-m", "hpdl", *argv], capture_output=True, text=True, timeout=timeout,
                          cwd=ROOT)
    assert proc.returncode == 0, f"hpdl {' '.join(argv)} exited {proc.returncode}\n{proc.stderr[-3000:]}"
    return proc.stdout


@pytest.mark.parametrize("amp", ["none", "fp16"])  # bf16's autocast alone: mixed_precision.py above
def test_sr_train_eval_and_upscale_on_cuda(tmp_path, amp):
    data, out = tiny_data(tmp_path), tmp_path / "run"
    summary = json.loads(_hpdl(*tiny_run_argv(data, out, "device=cuda", f"amp={amp}", "total_updates=6",
                                              "ckpt_every=3", "--json")))
    assert summary["updates"] == 6 and summary["amp"] == amp and summary["psnr"] is not None
    # resumed on the GPU: optimizer state, loss scale and the GPU's generator come back
    resumed = json.loads(_hpdl(*tiny_run_argv(data, out, "device=cuda", f"amp={amp}", "total_updates=8",
                                              "resume=auto", "--json")))
    assert resumed["updates_this_run"] == 2
    scores = json.loads(_hpdl("sr", "eval", "--ckpt", str(out / "model.pt"), "--data", str(data / "val"),
                              "--device", "cuda", "--cache-dir", str(data / "cache"), "--json"))
    (scored,) = scores["sets"]
    assert np.isfinite(scored["mean"]["psnr"]) and len(scored["images"]) == 2
    Image.open(data / "val" / "0.png").save(tmp_path / "in.png")
    _hpdl("sr", "upscale", str(tmp_path / "in.png"), str(tmp_path / "x2.png"), "--ckpt", str(out / "model.pt"),
          "--device", "cuda", "--tile", "8")
    assert Image.open(tmp_path / "x2.png").size == tuple(2 * s for s in Image.open(tmp_path / "in.png").size)


def test_synthetic_benchmark_on_cuda_with_its_phases():
    # (scripts/gpu-check.sh times the benchmark itself; here the breakdown's device waits run too)
    record = json.loads(_hpdl("bench", "synthetic", "--model", "edsr-baseline", "--batch-size", "2", "--patch", "16",
                              "--num-iters", "2", "--num-batches-per-iter", "2", "--num-warmup", "1",
                              "--device", "cuda", "--amp", "fp16", "--breakdown", "--json"))
    assert record["device"] == "cuda:0" and record["gpu"] and record["amp"] == "fp16" and record["total_img_sec"] > 0
    assert record["phases_ms"]["hpdl"][0]["step"]["median_ms"] > 0
