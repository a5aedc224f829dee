"""Bad input to hpdl sr (train, upscale, eval, and the researchers' layouts, weights, exports and
grids): one clear line, nothing of the user's lost. The rules and helpers are test_bad_input.py's
(bad_input_support.py)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path
from typing import Dict, List, Sequence

import pytest

from bad_input_support import assert_one_line_error, checksums, hpdl, run_job


# == hpdl sr: train, upscale and eval with bad input =============================================

def _photo(path: Path, width: int = 30, height: int = 20) -> Path:
    import numpy as np
    from PIL import Image

    pixels = np.random.default_rng(width * height).integers(0, 256, (height, width, 3), dtype=np.uint8)
    Image.fromarray(pixels).save(path)
    return path


@pytest.fixture
def sr_files(tmp_path):
    """A tiny x2 checkpoint and a small photo, in tmp_path."""
    import torch

    from hpdl.sr.checkpoint import make_checkpoint, save_checkpoint
    from hpdl.sr.models import build_model_from_config
    from hpdl.sr.registry import ModelConfig

    torch.manual_seed(0)
    ckpt = save_checkpoint(tmp_path / "tiny.pt", make_checkpoint(build_model_from_config(ModelConfig("tiny", 2, 1, 8, 1.0))))
    return ckpt, _photo(tmp_path / "photo.png")


def _tiny_training(data: Path, out_dir: Path, threads: int) -> List[str]:
    return ["sr", "train", "--config", "demo", f"data={data / 'train'}", f"val_data={data / 'val'}",
            f"cache_dir={data / 'cache'}", f"out_dir={out_dir}", "n_resblocks=1", "n_feats=8", "patch_size=8",
            "batch_size=2", "repeat=2", "workers=0", "total_updates=1", "val_at_end=false", "progress=false",
            f"threads={threads}"]


def _per_rank_mpiexec(n: int, args: Sequence[str]) -> List[str]:
    """mpiexec running ``hpdl ARGS`` on ``n`` ranks; each rank prints 'rank R exit S' when it ends."""
    script = 'python -m hpdl "$@"; s=$?; echo "rank $PMI_RANK exit $s"; exit $s'
    return ["mpiexec", "-n", str(n), "sh", "-c", script.replace("python", sys.executable), "sh", *args]


@pytest.fixture(scope="module")
def earlier_run(tmp_path_factory):
    """A real 2-rank training run with more torch threads than cores: (data dir, out_dir, its job)."""
    root = tmp_path_factory.mktemp("sr_earlier_run")
    for split in ("train", "val"):
        (root / split).mkdir()
        for i in range(2):
            _photo(root / split / f"{i}.png", 36 + 4 * i, 32)
    threads = len(os.sched_getaffinity(0)) + 1
    job = run_job(_per_rank_mpiexec(2, _tiny_training(root, root / "run", threads)), timeout=120)
    assert job.returncode == 0, job.stderr
    return root, root / "run", job


@pytest.mark.multirank
def test_sr_train_warns_once_on_rank_0_of_threads_beyond_the_cores(earlier_run):
    _, _, job = earlier_run
    warnings = [line for line in job.stderr.splitlines() if "threads=" in line]
    assert len(warnings) == 1, job.stderr
    assert warnings[0].startswith("hpdl: warning: threads=") and "more than the" in warnings[0]


@pytest.mark.multirank
def test_sr_train_into_an_earlier_run_is_refused_on_every_rank(earlier_run):
    data, out_dir, _ = earlier_run
    before = checksums([out_dir])
    assert {"last.pt", "model.pt", "train_log.csv"} <= {Path(p).name for p in before}
    job = run_job(_per_rank_mpiexec(2, _tiny_training(data, out_dir, 1)), timeout=120)
    assert_one_line_error(job, f"out_dir={out_dir} holds an earlier run", "resume=auto", "overwrite=true")
    assert sorted(job.stdout.split("\n")) == ["", "rank 0 exit 2", "rank 1 exit 2"], job.stdout
    assert checksums([out_dir]) == before


@pytest.mark.parametrize("link", ["same path", "symlink", "hard link"])
def test_sr_upscale_never_writes_over_its_input(tmp_path, sr_files, link):
    ckpt, photo = sr_files
    output = {"same path": photo, "symlink": tmp_path / "sym.png", "hard link": tmp_path / "hard.png"}[link]
    if link == "symlink":
        output.symlink_to(photo)
    elif link == "hard link":
        os.link(photo, output)
    before = checksums([photo])
    result = hpdl("sr", "upscale", str(photo), str(output), "--ckpt", str(ckpt), "--overwrite")
    assert_one_line_error(result, f"{output}: is the input image {photo}")
    assert checksums([photo]) == before


def test_sr_upscale_refuses_an_existing_output_without_overwrite(tmp_path, sr_files):
    ckpt, photo = sr_files
    output = _photo(tmp_path / "earlier.png", 8, 8)
    before = checksums([photo, output])
    result = hpdl("sr", "upscale", str(photo), str(output), "--ckpt", str(ckpt))
    assert_one_line_error(result, f"{output}: already exists", "--overwrite")
    assert checksums([photo, output]) == before


def test_sr_upscale_removes_temp_files_of_dead_writers_only(tmp_path, sr_files):
    from hpdl.sr._atomic import _temp_path

    ckpt, photo = sr_files
    output = tmp_path / "out" / "x2.png"
    output.parent.mkdir()
    finished = subprocess.Popen(["true"])
    finished.wait()  # its pid is now free: a writer that died
    dead = _temp_path(output, pid=finished.pid)
    alive = _temp_path(output, pid=os.getpid())
    other_host = output.parent / f".{output.name}.{finished.pid}@elsewhere.0123abcd.tmp"
    for tmp in (dead, alive, other_host):
        tmp.write_bytes(b"half an image")
    result = hpdl("sr", "upscale", str(photo), str(output), "--ckpt", str(ckpt))
    assert result.returncode == 0, result.stderr
    assert sorted(p.name for p in output.parent.iterdir()) == sorted([output.name, alive.name, other_host.name])


@pytest.mark.parametrize("command", ["upscale", "eval"])
def test_sr_image_declaring_too_many_pixels_is_refused_before_decoding(tmp_path, sr_files, command):
    from PIL import Image

    ckpt, photo = sr_files
    (tmp_path / "data").mkdir()
    huge = tmp_path / "data" / "huge.png"
    Image.new("1", (12000, 12000)).save(huge)  # a few KB on disk, 432 MB as RGB, 1.7 GB as float
    assert huge.stat().st_size < 100_000
    if command == "upscale":
        result = hpdl("sr", "upscale", str(huge), str(tmp_path / "out.png"), "--ckpt", str(ckpt))
    else:
        result = hpdl("sr", "eval", "--ckpt", str(ckpt), "--data", str(tmp_path / "data"),
                      "--cache-dir", str(tmp_path / "cache"))
    assert_one_line_error(result, str(huge), "12000x12000", "20,000,000", "--max-pixels")
    assert not (tmp_path / "out.png").exists()


def test_sr_upscale_to_a_format_pillow_cannot_write_fails_before_any_work(tmp_path, sr_files):
    _, photo = sr_files
    # The checkpoint does not exist: an error about the output means nothing else was done first.
    result = hpdl("sr", "upscale", str(photo), str(tmp_path / "out.psd"), "--ckpt", str(tmp_path / "none.pt"))
    assert_one_line_error(result, "out.psd", "cannot write", "PSD")
    assert not (tmp_path / "out.psd").exists()


@pytest.mark.parametrize("args,setting", [
    (["train", "--config", "demo", "device=cpu:abc"], "device: must be"),
    (["upscale", "{photo}", "{tmp}/out.png", "--ckpt", "{ckpt}", "--device", "meta"], "--device: must be"),
    (["eval", "--ckpt", "{ckpt}", "--data", "{tmp}", "--device", "cpu:abc"], "--device: must be"),
], ids=["train", "upscale", "eval"])
def test_sr_bad_device_names_the_setting(tmp_path, sr_files, args, setting):
    ckpt, photo = sr_files
    argv = [a.format(photo=photo, tmp=tmp_path, ckpt=ckpt) for a in args]
    assert_one_line_error(hpdl("sr", *argv), setting, "cpu, cuda or cuda:N")


@pytest.mark.parametrize("kind", ["png", "pickle with code"])
def test_sr_checkpoint_that_is_not_one_is_named_for_what_it_is(tmp_path, sr_files, kind):
    ckpt, photo = sr_files
    if kind == "png":
        bad, expected = photo, "not a checkpoint (neither a zip nor a pickle file)"
    else:
        bad, expected = tmp_path / "evil.pt", "holds Python objects"
        bad.write_bytes(b"\x80\x02cposix\nsystem\nq\x00X\x04\x00\x00\x00trueq\x01\x85q\x02Rq\x03.")
    before = checksums([bad])
    result = hpdl("sr", "upscale", str(photo), str(tmp_path / "out.png"), "--ckpt", str(bad))
    line = assert_one_line_error(result, f"{bad}: ", expected)
    assert ("could run code" in line) == (kind != "png")
    assert checksums([bad]) == before


@pytest.mark.parametrize("output", ["{tmp}/afile/out.png", "/proc/hpdl-out.png"], ids=["parent is a file", "proc"])
def test_sr_unwritable_output_is_named(tmp_path, sr_files, output):
    ckpt, photo = sr_files
    (tmp_path / "afile").write_text("not a directory")
    output = output.format(tmp=tmp_path)
    line = assert_one_line_error(hpdl("sr", "upscale", str(photo), output, "--ckpt", str(ckpt)), f"{output}: ")
    assert ".tmp" not in line


# == hpdl sr for researchers: dataset layouts, several sets, foreign weights, export, grids ========

def _researcher_inputs(tmp_path: Path) -> Dict[str, Path]:
    """Checkpoints, weight files and dataset folders, each wrong in one way (or right, to compare)."""
    import torch

    from hpdl.sr.checkpoint import make_checkpoint, save_checkpoint
    from hpdl.sr.models import build_model_from_config
    from hpdl.sr.registry import ModelConfig, make_config

    torch.manual_seed(0)
    edsr = build_model_from_config(ModelConfig("tiny", 2, 1, 8, 1.0))
    paths = {"ckpt": save_checkpoint(tmp_path / "tiny.pt", make_checkpoint(edsr)),
             "srresnet": save_checkpoint(tmp_path / "srresnet.pt", make_checkpoint(
                 build_model_from_config(make_config("srresnet", 2, 1, 8))))}
    with torch.no_grad():
        edsr.add_mean.bias.add_(1.0)
    paths["other_mean"] = save_checkpoint(tmp_path / "other_mean.pt", make_checkpoint(edsr))
    weird = {k: torch.zeros(1) for k in ("conv_first.weight", "conv_after_body.weight", "attention.weight")}
    torch.save({"params": weird}, tmp_path / "rcan_like.pth")
    torch.save({"fc.weight": torch.zeros(2, 2)}, tmp_path / "classifier.pt")
    torch.save({"params": [1, 2, 3]}, tmp_path / "params_list.pth")
    for name in ("Set5", "mixed/Set5", "lr_only", "benchmark/Set14"):
        (tmp_path / name).mkdir(parents=True)
    for hr_dir, lr_dir in (("Set5/GTmod12", "Set5/LRbicx2"), ("mixed/Set5/GTmod12", "mixed/Set5/LRbicx2"),
                           ("mixed/Set5/HR", "mixed/Set5/LR_bicubic/X2"), ("benchmark/Set14/HR",
                                                                         "benchmark/Set14/LR_bicubic/X2")):
        (tmp_path / hr_dir).mkdir(parents=True)
        (tmp_path / lr_dir).mkdir(parents=True)
        _photo(tmp_path / hr_dir / "baby.png", 24, 24)
        lr_name = "babyx2.png" if "LR_bicubic" in lr_dir else "baby.png"
        _photo(tmp_path / lr_dir / lr_name, 12, 12)
    (tmp_path / "lr_only" / "LRbicx2").mkdir()
    _photo(tmp_path / "lr_only" / "LRbicx2" / "baby.png", 12, 12)
    (tmp_path / "results" / "Set5").mkdir(parents=True)
    _photo(tmp_path / "results" / "Set5" / "baby_x2_SR.png", 24, 24)
    return paths


RESEARCHER_CASES = [
    ("eval", "--ckpt {ckpt} --data {tmp}/mixed/Set5", ["mixed/Set5: ambiguous layout", "GTmod12/", "LR_bicubic/"]),
    ("eval", "--ckpt {ckpt} --data {tmp}/lr_only", ["lr_only: found LRbicx2/ but no GTmod12/"]),
    ("eval", "--ckpt {ckpt} --data {tmp}/benchmark", ["benchmark: not a dataset layout", "LR_bicubic/"]),
    ("eval", "--ckpt {ckpt} --data Set5+Nope --data-root {tmp}", ["Nope: no such directory"]),
    ("eval", "--ckpt {ckpt} --data Set5+mixed/Set5 --data-root {tmp}", ["two sets named Set5"]),
    ("eval", "--ckpt {ckpt} --data {tmp}/Set5 --grid {tmp}/g.png --grid-images zebra", ["--grid-images", "'zebra'"]),
    ("eval", "--ckpt {ckpt} --data {tmp}/Set5 --grid {tmp}/g.psd", ["g.psd", "cannot write"]),
    ("eval", "--ckpt {ckpt} --data Set5 --data-root {tmp} --save-results {tmp}/results",
     ["results/Set5/baby_x2_SR.png", "would replace earlier results"]),
    ("eval", "--ckpt {tmp}/rcan_like.pth --data {tmp}/Set5", ["rcan_like.pth", "'attention.weight'"]),
    ("eval", "--ckpt {tmp}/classifier.pt --data {tmp}/Set5", ["classifier.pt: state dict is not a model hpdl knows"]),
    ("eval", "--ckpt {tmp}/params_list.pth --data {tmp}/Set5", ["params_list.pth: neither an hpdl checkpoint"]),
    ("export", "{tmp}/out.pt --ckpt {srresnet} --to edsr-pytorch", ["EDSR-PyTorch has no srresnet"]),
    ("export", "{tmp}/out.pth --ckpt {other_mean} --to basicsr", ["other_mean.pt", "mean is not DIV2K's"]),
    ("export", "{ckpt} --ckpt {ckpt} --to basicsr", ["is the checkpoint"]),
    ("train", "--config demo model=rcan", ["model: must be edsr_baseline or edsr or srresnet"]),
    ("train", "--config demo model=srresnet scale=8", ["scale: must be 2 or 3 or 4"]),
    ("train", "--config demo downscaler=pil", ["downscaler: must be matlab or torch"]),
]


@pytest.mark.parametrize("command,args,fragments", RESEARCHER_CASES, ids=[
    "ambiguous layout", "LR without HR folder", "parent of sets", "missing set", "two sets of one name",
    "unknown grid image", "grid format", "earlier results", "unknown BasicSR key", "unknown architecture",
    "params not a dict", "srresnet to edsr-pytorch", "mean not DIV2K's", "over the checkpoint", "unknown model",
    "scale of the model", "train downscaler"])
def test_sr_researcher_bad_input_is_one_line_and_changes_nothing(tmp_path, command, args, fragments):
    paths = _researcher_inputs(tmp_path)
    before = checksums([tmp_path])
    argv = [a.format(tmp=tmp_path, **paths) for a in args.split()]
    assert_one_line_error(hpdl("sr", command, *argv), *fragments)
    assert checksums([tmp_path]) == before
