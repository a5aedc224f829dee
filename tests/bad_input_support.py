"""What the bad-input tests share: running a job that must end by itself (and finding what it left
running), the one-line error check, checksums of inputs, and launch command lines."""

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
from cli_in_process import run_hpdl

from hpdl.launch.process_tree import kill_tree, processes_with_env
from ranks import ROOT, SCRIPTS


_JOB_TAG = "BAD_INPUT_JOB"  # set in every job's environment, so survivors can be found by it


def _clean_env(extra: Optional[Dict[str, str]] = None) -> Dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("HPDL_") or k in ("HPDL_VENV", "HPDL_TORCH_SPEC")}
    env.update({"OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1", "PYTHONPATH": str(ROOT)})
    env.update(extra or {})
    return env


def _tagged_processes(tag: str) -> List[int]:
    """Pids of live processes whose environment carries ``tag`` (a job's leftovers)."""
    return processes_with_env(f"{_JOB_TAG}={tag}")


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
    """Run ``hpdl ARGS`` as a user would (the installed entry point's module).

    The sr commands in this process's environment run in this process (cli_in_process.py): one
    of their own spends seconds importing torch for each of the many cases; a traceback still
    reaches stderr and exit status 1 as it would.
    """
    if args[0] == "sr" and env is None and cwd is None:
        return run_hpdl(args)
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
    """argv running tests/multirank/``script`` on ``n`` ranks under ``launcher``.

    ``plain`` starts the ranks with torchrun's variables and no agent that would end the
    others when one fails: the job must end by itself.
    """
    path = str(SCRIPTS / script)
    if launcher == "mpiexec":
        return ["mpiexec", "-n", str(n), sys.executable, path, *args]
    if launcher == "plain":
        return [sys.executable, str(Path(__file__).parent / "plain_ranks.py"), str(n), path, *args]
    return [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", str(n), "--standalone",
            "--no-python", sys.executable, path, *args]


# == inputs the cases spoil: made in a test's tmp_path ===========================================

def make_photo(path: Path, width: int = 30, height: int = 20) -> Path:
    import numpy as np
    from PIL import Image

    pixels = np.random.default_rng(width * height).integers(0, 256, (height, width, 3), dtype=np.uint8)
    Image.fromarray(pixels).save(path)
    return path


def profile_inputs(tmp_path: Path) -> Dict[str, Path]:
    """A valid profile and damaged or foreign files beside it, by name."""
    import json

    from hpdl.profile.schema import COLLECTIVE_COLUMNS
    from test_profile_units import make_profile

    text = json.dumps(make_profile())
    newer = make_profile()
    newer["version"] = 99
    bad_table = make_profile()
    bad_table["ranks"][1]["steps"]["columns"] = ["step"]
    # Valid JSON of the right shape with cells of the wrong type.
    settings_null, hosts_number, names_text, threshold_nan = (make_profile() for _ in range(4))
    settings_null["job"]["settings"] = None
    hosts_number["job"]["hosts"] = 5
    names_text["ranks"][0]["collectives"]["rows"][2][COLLECTIVE_COLUMNS.index("names")] = "abc"
    threshold_nan["job"]["settings"]["inplace_threshold"] = float("nan")  # a number to the schema, not to a size
    files = {
        "good.json": text,
        "truncated.json": text[: len(text) // 2],
        "foreign.json": json.dumps({"traceEvents": []}),
        "list.json": "[1, 2, 3]",
        "newer.json": json.dumps(newer),
        "bad_table.json": json.dumps(bad_table),
        "bench_foreign.json": json.dumps({"benchmark": "synthetic", "records": []}),
        "settings_null.json": json.dumps(settings_null),
        "hosts_number.json": json.dumps(hosts_number),
        "names_text.json": json.dumps(names_text),
        "threshold_nan.json": json.dumps(threshold_nan),
    }
    for name, content in files.items():
        (tmp_path / name).write_text(content)
    (tmp_path / "binary.json").write_bytes(bytes(range(256)))
    return {name: tmp_path / name for name in [*files, "binary.json"]}


def researcher_inputs(tmp_path: Path) -> Dict[str, Path]:
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
        make_photo(tmp_path / hr_dir / "baby.png", 24, 24)
        lr_name = "babyx2.png" if "LR_bicubic" in lr_dir else "baby.png"
        make_photo(tmp_path / lr_dir / lr_name, 12, 12)
    (tmp_path / "lr_only" / "LRbicx2").mkdir()
    make_photo(tmp_path / "lr_only" / "LRbicx2" / "baby.png", 12, 12)
    (tmp_path / "results" / "Set5").mkdir(parents=True)
    make_photo(tmp_path / "results" / "Set5" / "baby_x2_SR.png", 24, 24)
    return paths
