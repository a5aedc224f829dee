"""Bad input never costs data, never hangs, and ends in one clear line.

Every case runs through the real command line or a real multi-rank job and asserts what a user
would see: the exit code, at most one line on stderr for command-line errors and never a
"Traceback", input files unchanged (checksums), an earlier run left intact, and no process of
the job left running afterwards. Multi-rank hang cases use a stall timeout of a few seconds.

Sections: jobs that must end (hangs and slow failures); nothing lost; bounded work; one clear
line. Each section is a parametrized test or a few tests over a shared helper below.
"""

from __future__ import annotations

import hashlib
import os
import subprocess
import sys
import time
import uuid
from pathlib import Path
from typing import Dict, Iterable, List, Optional, Sequence

import pytest

from ranks import ROOT, SCRIPTS, kill_tree

# -- helpers ------------------------------------------------------------------------------------

_JOB_TAG = "BAD_INPUT_JOB"  # set in every job's environment, so survivors can be found by it


def _clean_env(extra: Optional[Dict[str, str]] = None) -> Dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("HPDL_") or k in ("HPDL_VENV", "HPDL_TORCH_SPEC")}
    env.update({"OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1", "PYTHONPATH": str(ROOT)})
    env.update(extra or {})
    return env


def _tagged_processes(tag: str) -> List[int]:
    """Pids of live processes whose environment carries ``tag`` (a job's leftovers)."""
    needle = f"{_JOB_TAG}={tag}".encode()
    found = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit() or int(entry) == os.getpid():
            continue
        try:
            with open(f"/proc/{entry}/environ", "rb") as f:
                if needle in f.read().split(b"\0"):
                    with open(f"/proc/{entry}/stat") as s:
                        if s.read().rsplit(")", 1)[1].split()[0] != "Z":
                            found.append(int(entry))
        except OSError:
            continue
    return found


def run_job(argv: Sequence[str], env: Optional[Dict[str, str]] = None, timeout: float = 60,
            cwd: Optional[Path] = None) -> subprocess.CompletedProcess:
    """Run ``argv`` (a CLI call or a launcher) to its end; fail on timeout or on leftovers.

    Returns the completed process with ``.seconds`` set to its wall time.
    """
    tag = uuid.uuid4().hex
    full_env = _clean_env(env)
    full_env[_JOB_TAG] = tag
    start = time.monotonic()
    proc = subprocess.Popen(list(argv), env=full_env, cwd=str(cwd or ROOT), stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, start_new_session=True)
    try:
        out, err = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        kill_tree(proc.pid)
        for pid in _tagged_processes(tag):
            kill_tree(pid)
        out, err = proc.communicate()
        pytest.fail(f"{' '.join(argv)} did not end within {timeout}s\n{out[-2000:]}\n{err[-4000:]}")
    seconds = time.monotonic() - start
    # A rank the launcher failed to end would show up here; give exiting ones a moment.
    deadline = time.monotonic() + 5
    while _tagged_processes(tag) and time.monotonic() < deadline:
        time.sleep(0.1)
    left = _tagged_processes(tag)
    for pid in left:
        kill_tree(pid)
    assert not left, f"{' '.join(argv)} left processes running: {left}\n{err[-4000:]}"
    result = subprocess.CompletedProcess(list(argv), proc.returncode, out, err)
    result.seconds = seconds
    return result


def hpdl(*args: str, env: Optional[Dict[str, str]] = None, timeout: float = 120,
         cwd: Optional[Path] = None) -> subprocess.CompletedProcess:
    """Run ``hpdl ARGS`` as a user would (the installed entry point's module)."""
    return run_job([sys.executable, "-m", "hpdl", *args], env=env, timeout=timeout, cwd=cwd)


def assert_one_line_error(result: subprocess.CompletedProcess, *fragments: str, code: int = 2) -> str:
    """Assert a command-line error: exit ``code``, one stderr line naming ``fragments``, no traceback."""
    err = result.stderr
    lines = [line for line in err.splitlines() if line.strip()]
    assert result.returncode == code, f"exit {result.returncode}, expected {code}\n{err}"
    assert "Traceback" not in err, err
    assert len(lines) == 1, f"expected one line on stderr, got {len(lines)}:\n{err}"
    for fragment in fragments:
        assert fragment in lines[0], f"{fragment!r} not in {lines[0]!r}"
    return lines[0]


def checksums(paths: Iterable[Path]) -> Dict[str, str]:
    """sha256 of every file under ``paths`` (files or directories), by path."""
    out = {}
    for path in paths:
        path = Path(path)
        files = sorted(p for p in path.rglob("*") if p.is_file()) if path.is_dir() else [path]
        for f in files:
            out[str(f)] = hashlib.sha256(f.read_bytes()).hexdigest()
    return out


def launch(launcher: str, n: int, script: str, *args: str) -> List[str]:
    """argv running tests/multirank/``script`` on ``n`` ranks under ``launcher``."""
    path = str(SCRIPTS / script)
    if launcher == "mpiexec":
        return ["mpiexec", "-n", str(n), sys.executable, path, *args]
    return [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", str(n), "--standalone",
            "--no-python", sys.executable, path, *args]


# == Hangs and slow failures =====================================================================

@pytest.mark.multirank
def test_mismatch_error_exits_the_same_way_every_time_under_torchrun():
    # An uncaught mismatch error ends every rank with Python's exit status 1, never with a
    # C++ abort at interpreter exit (SIGABRT, "terminate called without an active exception").
    # Three waves of five jobs at once: the load makes the exit race likelier, not rarer.
    codes, errors = [], []
    for _ in range(3):
        tags, procs = [], []
        for _ in range(5):
            env = _clean_env()
            procs.append(subprocess.Popen(launch("torchrun", 2, "bad_input_jobs.py", "mismatch"), env=env,
                                          cwd=str(ROOT), stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                          text=True, start_new_session=True))
        for proc in procs:
            try:
                out, err = proc.communicate(timeout=120)
            except subprocess.TimeoutExpired:
                kill_tree(proc.pid)
                pytest.fail("a mismatch job did not end within 120 s")
            codes.append(proc.returncode)
            errors.append(err)
    assert all("terminate called" not in e for e in errors), next(e for e in errors if "terminate called" in e)
    assert codes == [1] * 15, codes
    assert all("Mismatched allreduce tensor shapes for tensor 'bad.shape'" in e for e in errors)


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
    from hpdl.sr.models import EDSRConfig, build_model_from_config

    torch.manual_seed(0)
    ckpt = save_checkpoint(tmp_path / "tiny.pt", make_checkpoint(build_model_from_config(EDSRConfig("tiny", 2, 1, 8, 1.0))))
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
