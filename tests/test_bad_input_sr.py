"""Bad input to the hpdl sr commands never costs data and ends in one clear line.

The sr half of test_bad_input.py (same rules, same helpers in bad_input_support.py): hpdl sr
train, upscale and eval with bad input, and the researchers' dataset layouts, several sets,
foreign weights, exports and grids. The one-rank commands run in the test's process
(cli_in_process.py), the multi-rank ones under a real launcher.
"""

from __future__ import annotations

import os
import pickle
import shutil
import subprocess
import sys
import time
from pathlib import Path
from typing import List, Sequence

import pytest

from bad_input_support import assert_one_line_error, checksums, hpdl, make_photo, researcher_inputs, run_job


# == hpdl sr: train, upscale and eval with bad input =============================================

@pytest.fixture
def sr_files(tmp_path):
    """A tiny x2 checkpoint and a small photo, in tmp_path."""
    import torch

    from hpdl.sr.checkpoint import make_checkpoint, save_checkpoint
    from hpdl.sr.models import build_model_from_config
    from hpdl.sr.registry import ModelConfig

    torch.manual_seed(0)
    ckpt = save_checkpoint(tmp_path / "tiny.pt", make_checkpoint(build_model_from_config(ModelConfig("tiny", 2, 1, 8, 1.0))))
    return ckpt, make_photo(tmp_path / "photo.png")


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
    """A real 2-rank training run with more torch threads than cores: (data dir, out_dir, its job).

    Each rank asks for as many threads as the node has cores: either alone would fit, the two
    together do not.
    """
    root = tmp_path_factory.mktemp("sr_earlier_run")
    for split in ("train", "val"):
        (root / split).mkdir()
        for i in range(2):
            make_photo(root / split / f"{i}.png", 36 + 4 * i, 32)
    threads = len(os.sched_getaffinity(0))
    job = run_job(_per_rank_mpiexec(2, _tiny_training(root, root / "run", threads)), timeout=120)
    assert job.returncode == 0, job.stderr
    return root, root / "run", job


@pytest.mark.multirank
def test_sr_train_warns_once_on_rank_0_of_threads_beyond_the_cores(earlier_run):
    _, _, job = earlier_run
    warnings = [line for line in job.stderr.splitlines() if "threads=" in line]
    assert len(warnings) == 1, job.stderr
    assert warnings[0].startswith("hpdl: warning: threads=") and "more than the" in warnings[0]
    assert f"on each of the 2 ranks of this node is {2 * len(os.sched_getaffinity(0))} threads" in warnings[0]


@pytest.mark.multirank
def test_sr_train_into_an_earlier_run_is_refused_on_every_rank(earlier_run):
    data, out_dir, _ = earlier_run
    before = checksums([out_dir])
    assert {"last.pt", "model.pt", "train_log.csv"} <= {Path(p).name for p in before}
    job = run_job(_per_rank_mpiexec(2, _tiny_training(data, out_dir, 1)), timeout=120)
    assert_one_line_error(job, f"out_dir={out_dir} holds an earlier run", "resume=auto", "overwrite=true")
    assert sorted(job.stdout.split("\n")) == ["", "rank 0 exit 2", "rank 1 exit 2"], job.stdout
    assert checksums([out_dir]) == before


@pytest.mark.multirank
@pytest.mark.parametrize("case", ["resume=auto without last.pt", "missing/.. before the directory"])
def test_sr_train_cannot_slip_into_an_earlier_run(tmp_path, earlier_run, case):
    # A run killed before its first checkpoint leaves its logs but no last.pt: resume=auto has
    # nothing to continue, and starting afresh would replace them. "none/../run" is "run" only
    # once "none" is made.
    data, out_dir, _ = earlier_run
    if case.startswith("resume"):
        shutil.copytree(out_dir, tmp_path / "run")
        (tmp_path / "run" / "last.pt").unlink()
        target, given, extra = tmp_path / "run", tmp_path / "run", ["resume=auto"]
    else:
        target, given, extra = out_dir, out_dir.parent / "none" / ".." / out_dir.name, []
    before = checksums([target])
    result = hpdl(*_tiny_training(data, given, 1), *extra)
    assert_one_line_error(result, f"out_dir={given} holds an earlier run", "overwrite=true")
    assert checksums([target]) == before


@pytest.mark.parametrize("link", ["same path", "symlink", "hard link", "missing/..", "missing/.. without --overwrite"])
def test_sr_upscale_never_writes_over_its_input(tmp_path, sr_files, link):
    # "none/../photo.png" is the photo only once "none" exists, which writing it would create.
    ckpt, photo = sr_files
    output = {"same path": photo, "symlink": tmp_path / "sym.png", "hard link": tmp_path / "hard.png"}.get(
        link, tmp_path / "none" / ".." / photo.name)
    if link == "symlink":
        output.symlink_to(photo)
    elif link == "hard link":
        os.link(photo, output)
    before = checksums([photo])
    overwrite = [] if link.endswith("without --overwrite") else ["--overwrite"]
    result = hpdl("sr", "upscale", str(photo), str(output), "--ckpt", str(ckpt), *overwrite)
    assert_one_line_error(result, f"{output}: is the input image {photo}")
    assert checksums([photo]) == before
    assert not (tmp_path / "none").exists()


@pytest.mark.parametrize("spelling", ["as is", "missing/.."])
def test_sr_upscale_refuses_an_existing_output_without_overwrite(tmp_path, sr_files, spelling):
    ckpt, photo = sr_files
    earlier = make_photo(tmp_path / "earlier.png", 8, 8)
    output = earlier if spelling == "as is" else tmp_path / "none" / ".." / earlier.name
    before = checksums([photo, earlier])
    result = hpdl("sr", "upscale", str(photo), str(output), "--ckpt", str(ckpt))
    assert_one_line_error(result, f"{output}: already exists", "--overwrite")
    assert checksums([photo, earlier]) == before


def test_sr_upscale_removes_temp_files_of_dead_writers_only(tmp_path, sr_files):
    from hpdl.atomic_file import _temp_path

    ckpt, photo = sr_files
    output = tmp_path / "out" / "x2.png"
    output.parent.mkdir()
    finished = subprocess.Popen(["true"])
    finished.wait()  # its pid is now free: a writer that died
    dead = _temp_path(output, pid=finished.pid)
    alive = _temp_path(output, pid=os.getpid())
    other_host = output.parent / f".{output.name}.{finished.pid}@elsewhere.0123abcd.tmp"
    # Earlier versions named them without the host: an hour without a write tells a dead writer
    # (its pid may be alive on another host, or reused here).
    hostless_dead = output.parent / f".{output.name}.{finished.pid}.0123abcd.tmp"
    hostless_recent = output.parent / f".{output.name}.{finished.pid}.89abcdef.tmp"
    hostless_alive = output.parent / f".{output.name}.{os.getpid()}.0123abcd.tmp"
    for tmp in (dead, alive, other_host, hostless_dead, hostless_recent, hostless_alive):
        tmp.write_bytes(b"half an image")
    two_hours_ago = time.time() - 7200
    for tmp in (hostless_dead, hostless_alive):
        os.utime(tmp, (two_hours_ago, two_hours_ago))
    result = hpdl("sr", "upscale", str(photo), str(output), "--ckpt", str(ckpt))
    assert result.returncode == 0, result.stderr
    assert sorted(p.name for p in output.parent.iterdir()) == sorted(
        p.name for p in (output, alive, other_host, hostless_recent, hostless_alive))


def test_sr_writer_checks_the_resolved_target_again_right_before_the_rename(tmp_path):
    # The commands check their output before any work; the writer checks again the file its
    # rename would replace: resolved once "none" exists, and after the write, when a file may
    # have appeared there meanwhile (another job's).
    from hpdl.atomic_file import atomic_write

    class Refused(Exception):
        pass

    target = Path(os.path.realpath(tmp_path)) / "out.png"
    checked = []

    def check(path: str) -> None:
        checked.append(path)
        if os.path.lexists(path):
            raise Refused(path)

    def write(f) -> None:
        f.write(b"new")
        target.write_bytes(b"another job's")

    with pytest.raises(Refused):
        atomic_write(tmp_path / "none" / ".." / "out.png", write, check_target=check)
    assert checked == [str(target), str(target)]
    assert target.read_bytes() == b"another job's"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["none", "out.png"]  # no temp file left


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


@pytest.mark.parametrize("bad", ["huge training image", "max_pixels below a training image", "missing val_data"])
def test_sr_train_checks_image_sizes_and_val_data_before_decoding_the_training_set(tmp_path, bad):
    from PIL import Image

    (tmp_path / "train").mkdir()
    (tmp_path / "val").mkdir()
    make_photo(tmp_path / "train" / "0.png", 36, 32)
    make_photo(tmp_path / "val" / "0.png", 30, 20)  # within max_pixels=1000 below, which 36x32 is not
    huge = tmp_path / "train" / "huge.png"
    Image.new("1", (12000, 12000)).save(huge)  # a few KB on disk, 432 MB decoded
    args = _tiny_training(tmp_path, tmp_path / "run", 1)
    if bad == "huge training image":
        fragments = (str(huge), "12000x12000", "20,000,000", "max_pixels")
    elif bad == "max_pixels below a training image":
        huge.unlink()
        args.append("max_pixels=1000")
        fragments = (str(tmp_path / "train" / "0.png"), "36x32", "1,000", "max_pixels")
    else:
        # The training set's huge image would be refused too, but only once the set is read.
        args = [a for a in args if not a.startswith("val_data=")] + [f"val_data={tmp_path / 'none'}", "val_at_end=true"]
        fragments = (str(tmp_path / "none"), "no such directory")
    start = time.monotonic()
    result = hpdl(*args)
    assert_one_line_error(result, *fragments)
    assert time.monotonic() - start < 30  # nothing of the huge image was decoded
    assert not list((tmp_path / "cache").rglob("huge*"))
    assert not (tmp_path / "run").exists()


@pytest.mark.parametrize("suffix,fmt", [(".psd", "PSD"), (".blp", "BLP"), (".xbm", "XBM"), (".bufr", "BUFR")],
                         ids=["read only", "no RGB mode", "one-bit only", "save handler a stub"])
def test_sr_upscale_to_a_format_pillow_cannot_write_fails_before_any_work(tmp_path, sr_files, suffix, fmt):
    _, photo = sr_files
    output = tmp_path / f"out{suffix}"
    # The checkpoint does not exist: an error about the output means nothing else was done first.
    result = hpdl("sr", "upscale", str(photo), str(output), "--ckpt", str(tmp_path / "none.pt"))
    assert_one_line_error(result, f"{output}: ", "cannot write", fmt)
    assert not output.exists()


@pytest.mark.parametrize("suffix,fmt", [(".ico", "ICO"), (".icns", "ICNS")])
def test_sr_upscale_to_a_format_that_resizes_the_image_fails_before_any_work(tmp_path, sr_files, suffix, fmt):
    # Pillow's icon writers succeed by writing icon sizes, which would throw the result away.
    _, photo = sr_files
    output = tmp_path / f"out{suffix}"
    result = hpdl("sr", "upscale", str(photo), str(output), "--ckpt", str(tmp_path / "none.pt"))
    assert_one_line_error(result, f"{output}: ", f"{fmt} writer does not keep the image's size")
    assert not output.exists()


def test_sr_upscale_output_pillow_fails_to_write_is_one_line_naming_it(tmp_path, sr_files):
    # WebP takes RGB but not this size (at most 16383 pixels a side): known only when writing.
    ckpt, _ = sr_files
    wide = make_photo(tmp_path / "wide.png", 8200, 2)
    output = tmp_path / "out" / "x2.webp"
    result = hpdl("sr", "upscale", str(wide), str(output), "--ckpt", str(ckpt))
    line = assert_one_line_error(result, f"{output}: ", "WEBP")
    assert ".tmp" not in line
    assert list(output.parent.iterdir()) == []  # neither the image nor its temp file


@pytest.mark.parametrize("args,setting", [
    (["train", "--config", "demo", "device=cpu:abc"], "device: must be"),
    (["upscale", "{photo}", "{tmp}/out.png", "--ckpt", "{ckpt}", "--device", "meta"], "--device: must be"),
    (["eval", "--ckpt", "{ckpt}", "--data", "{tmp}", "--device", "cpu:abc"], "--device: must be"),
], ids=["train", "upscale", "eval"])
def test_sr_bad_device_names_the_setting(tmp_path, sr_files, args, setting):
    ckpt, photo = sr_files
    argv = [a.format(photo=photo, tmp=tmp_path, ckpt=ckpt) for a in args]
    assert_one_line_error(hpdl("sr", *argv), setting, "cpu, cuda or cuda:N")


class _RunsCode:
    def __reduce__(self):  # unpickling would call os.system("true")
        return (os.system, ("true",))


CHECKPOINTS_THAT_ARE_NOT = {
    # kind: (file content, or of the good checkpoint's, or None for the photo or a directory;
    # what the line says)
    "png": (None, "not a checkpoint (neither a zip nor a pickle file)"),
    "directory": (None, "is a directory, not a checkpoint file"),
    "pickle with code": (b"\x80\x02cposix\nsystem\nq\x00X\x04\x00\x00\x00trueq\x01\x85q\x02Rq\x03.",
                         "holds Python objects (posix.system)"),
    # Python's default protocols: torch's safe loader warns of them, then stops at their first
    # frame; the code they hold is found by reading their instructions.
    "pickle with code, protocol 4": (lambda _: pickle.dumps({"model": _RunsCode()}, protocol=4),
                                     "holds Python objects (posix.system)"),
    "pickle with code, protocol 5": (lambda _: pickle.dumps([_RunsCode()], protocol=5),
                                     "holds Python objects (posix.system)"),
    "plain pickle, protocol 5": (lambda _: pickle.dumps({"a": 1}, protocol=5), "not a checkpoint hpdl can read"),
    "plain pickle, protocol 2": (lambda _: pickle.dumps({"a": 1}, protocol=2), "not a checkpoint hpdl can read"),
    "zip cut in the middle": (lambda good: good[:len(good) // 2], "the zip archive is truncated or damaged"),
    "zip cut 10 bytes short": (lambda good: good[:-10], "the zip archive is truncated or damaged"),
}


@pytest.mark.parametrize("kind", list(CHECKPOINTS_THAT_ARE_NOT))
def test_sr_checkpoint_that_is_not_one_is_named_for_what_it_is(tmp_path, sr_files, kind):
    # "could run code" only where the safe loader refused a global: elsewhere it would alarm for nothing.
    ckpt, photo = sr_files
    content, expected = CHECKPOINTS_THAT_ARE_NOT[kind]
    bad = {"png": photo, "directory": tmp_path}.get(kind, tmp_path / "bad.pt")
    if content is not None:
        bad.write_bytes(content(ckpt.read_bytes()) if callable(content) else content)
    before = checksums([bad])
    result = hpdl("sr", "upscale", str(photo), str(tmp_path / "out.png"), "--ckpt", str(bad))
    line = assert_one_line_error(result, f"{bad}: ", expected)
    assert ("could run code" in line) == kind.startswith("pickle with code")
    assert "Errno" not in line
    assert checksums([bad]) == before


@pytest.mark.parametrize("output", ["{tmp}/afile/out.png", "/proc/hpdl-out.png"], ids=["parent is a file", "proc"])
def test_sr_unwritable_output_is_named(tmp_path, sr_files, output):
    ckpt, photo = sr_files
    (tmp_path / "afile").write_text("not a directory")
    output = output.format(tmp=tmp_path)
    line = assert_one_line_error(hpdl("sr", "upscale", str(photo), output, "--ckpt", str(ckpt)), f"{output}: ")
    assert ".tmp" not in line


@pytest.mark.parametrize("args,fragments", [
    (["--grid", "{tmp}/afile/g.png"], ["{tmp}/afile/g.png: {tmp}/afile is a file, not a directory"]),
    (["--save-results", "{tmp}/afile/res"], ["{tmp}/afile/res: {tmp}/afile is a file, not a directory"]),
], ids=["grid", "save-results"])
def test_sr_eval_output_under_a_file_is_refused_before_the_evaluation(tmp_path, sr_files, args, fragments):
    _, photo = sr_files
    (tmp_path / "afile").write_text("not a directory")
    # The checkpoint does not exist: an error about the output means nothing else was done first.
    argv = [a.format(tmp=tmp_path) for a in args]
    result = hpdl("sr", "eval", "--ckpt", str(tmp_path / "none.pt"), "--data", str(tmp_path), *argv)
    assert_one_line_error(result, *[f.format(tmp=tmp_path) for f in fragments])


@pytest.mark.parametrize("args,fragments", [
    (["--grid", "{tmp}/none/../data/photo.png"], ["{tmp}/none/../data/photo.png: already exists", "--overwrite"]),
    (["--grid", "{tmp}/none/../data/photo.png", "--overwrite"],
     ["{tmp}/none/../data/photo.png: is the input image {tmp}/data/photo.png"]),
    (["--save-results", "{tmp}/none/../results"], ["results/data/photo_x2_SR.png", "would replace earlier results"]),
], ids=["grid over an input", "grid over an input with --overwrite", "results over earlier ones"])
def test_sr_eval_never_writes_over_its_inputs_or_earlier_results(tmp_path, sr_files, args, fragments):
    # "none/../data" is "data" only once "none" exists, which writing the output would create.
    ckpt, photo = sr_files
    (tmp_path / "data").mkdir()
    shutil.copy(photo, tmp_path / "data" / "photo.png")
    (tmp_path / "results" / "data").mkdir(parents=True)
    make_photo(tmp_path / "results" / "data" / "photo_x2_SR.png", 60, 40)
    before = checksums([tmp_path])
    argv = [a.format(tmp=tmp_path) for a in args]
    result = hpdl("sr", "eval", "--ckpt", str(ckpt), "--data", str(tmp_path / "data"),
                  "--cache-dir", str(tmp_path / "cache"), *argv)
    assert_one_line_error(result, *[f.format(tmp=tmp_path) for f in fragments])
    assert {k: v for k, v in checksums([tmp_path]).items() if "/cache/" not in k} == before


# == hpdl sr for researchers: dataset layouts, several sets, foreign weights, export, grids ========

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
    ("export", "{tmp}/none/../tiny.pt --ckpt {ckpt} --to basicsr --overwrite", ["none/../tiny.pt: is the checkpoint"]),
    ("train", "--config demo model=rcan", ["model: must be edsr_baseline or edsr or srresnet"]),
    ("train", "--config demo model=srresnet scale=8", ["scale: must be 2 or 3 or 4"]),
    ("train", "--config demo downscaler=pil", ["downscaler: must be matlab or torch"]),
]


@pytest.mark.parametrize("command,args,fragments", RESEARCHER_CASES, ids=[
    "ambiguous layout", "LR without HR folder", "parent of sets", "missing set", "two sets of one name",
    "unknown grid image", "grid format", "earlier results", "unknown BasicSR key", "unknown architecture",
    "params not a dict", "srresnet to edsr-pytorch", "mean not DIV2K's", "over the checkpoint",
    "over the checkpoint through missing/..", "unknown model",
    "scale of the model", "train downscaler"])
def test_sr_researcher_bad_input_is_one_line_and_changes_nothing(tmp_path, command, args, fragments):
    paths = researcher_inputs(tmp_path)
    before = checksums([tmp_path])
    argv = [a.format(tmp=tmp_path, **paths) for a in args.split()]
    assert_one_line_error(hpdl("sr", command, *argv), *fragments)
    assert checksums([tmp_path]) == before
