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


STALL_ENV = {"HPDL_STALL_WARNING": "1", "HPDL_STALL_TIMEOUT": "4"}


@pytest.mark.multirank
@pytest.mark.parametrize("case,launcher,where", [
    ("stall-c", "mpiexec", "os.read(read_end, 1)"),
    ("stall-c", "torchrun", "os.read(read_end, 1)"),
    ("stall-sleep", "mpiexec", "time.sleep(90)"),
    ("stall-sleep", "plain", "time.sleep(90)"),
    ("stall-set", "mpiexec", "os.read(read_end, 1)"),
], ids=["c-code-mpiexec", "c-code-torchrun", "sleep-mpiexec", "sleep-no-agent", "c-code-process-set"])
def test_a_stalled_rank_ends_the_whole_job(case, launcher, where):
    # Rank 1 never submits: it sits in C code or sleeps far longer than the test allows. The
    # whole job must end after the stall timeout plus the abort grace period (run_job fails on
    # a job still running at its timeout, or on any process of it left behind), non-zero, with
    # the survivor's error printed and the stalled rank's stack showing where it was stuck.
    result = run_job(launch(launcher, 2, "bad_input_jobs.py", case), env=STALL_ENV, timeout=75)
    assert result.returncode != 0, result.stderr
    assert "collectives stalled for more than 4 s (HPDL_STALL_TIMEOUT)" in result.stderr
    assert "HorovodInternalError" in result.stderr  # the survivor's own error, printed before the end
    assert "hpdl: rank 1 stopped submitting collectives" in result.stderr
    assert where in result.stderr, result.stderr  # the stalled rank's stack, at the line it was stuck on
    assert "went on" not in result.stdout


# == One clear line, exit 2, no traceback: settings ================================================

COMMANDS = {
    "run": ["run", "-np", "1", "--dry-run", "--", "true"],
    "sr-train": ["sr", "train", "--config", "demo", "total_updates=1"],
    "bench-allreduce": ["bench", "allreduce", "--max-size", "8"],
    "bench-synthetic": ["bench", "synthetic", "--model", "edsr-baseline"],
}
# Each command once, each kind of bad value once (the parsing is shared: one place decides).
BAD_SETTINGS = [
    ("sr-train", {"HPDL_FUSION_TRESHOLD": "1"}, "unknown setting HPDL_FUSION_TRESHOLD (did you mean HPDL_FUSION_THRESHOLD?)"),
    ("bench-synthetic", {"HPDL_CYCLE_TIME": "inf"}, "HPDL_CYCLE_TIME='inf': expected a finite number"),
    ("bench-allreduce", {"HPDL_CYCLE_TIME": "nan"}, "HPDL_CYCLE_TIME='nan': expected a finite number"),
    ("run", {"HPDL_FUSION_THRESHOLD": "inf"}, "HPDL_FUSION_THRESHOLD='inf': expected a finite number"),
    ("sr-train", {"HPDL_STALL_TIMEOUT": "-inf"}, "HPDL_STALL_TIMEOUT='-inf': expected a finite number"),
]


@pytest.mark.parametrize("command,env,message", BAD_SETTINGS,
                         ids=[f"{c}-{next(iter(e))}={next(iter(e.values()))}" for c, e, _ in BAD_SETTINGS])
def test_a_bad_setting_is_one_line_under_every_command(command, env, message, tmp_path):
    args = COMMANDS[command] + ([f"out_dir={tmp_path / 'run'}"] if command == "sr-train" else [])
    assert_one_line_error(hpdl(*args, env=env), message)
    assert not (tmp_path / "run").exists()


@pytest.mark.multirank
def test_a_bad_setting_is_reported_once_by_a_job_of_two_ranks():
    result = run_job(["mpiexec", "-n", "2", sys.executable, "-m", "hpdl", "bench", "allreduce", "--max-size", "8"],
                     env={"HPDL_CYCLE_TIME": "inf"})
    assert_one_line_error(result, "HPDL_CYCLE_TIME='inf'")


def test_a_bad_setting_in_a_user_script_is_one_exception_with_a_one_line_message():
    result = run_job([sys.executable, "-c", "import hpdl.torch as hvd; hvd.init()"], env={"HPDL_CYCLE_TIME": "inf"})
    assert result.returncode == 1
    assert result.stderr.count("Traceback") == 1 and "During handling" not in result.stderr, result.stderr
    assert result.stderr.strip().splitlines()[-1] == \
        "hpdl.config.SettingsError: HPDL_CYCLE_TIME='inf': expected a finite number"


# == hpdl profile: files that are not (readable) profiles ==========================================

def _profile_inputs(tmp_path: Path) -> Dict[str, Path]:
    """A valid profile and damaged or foreign files beside it, by name."""
    import json

    from test_profile_units import make_profile

    text = json.dumps(make_profile())
    newer = make_profile()
    newer["version"] = 99
    bad_table = make_profile()
    bad_table["ranks"][1]["steps"]["columns"] = ["step"]
    files = {
        "good.json": text,
        "truncated.json": text[: len(text) // 2],
        "foreign.json": json.dumps({"traceEvents": []}),
        "list.json": "[1, 2, 3]",
        "newer.json": json.dumps(newer),
        "bad_table.json": json.dumps(bad_table),
        "bench_foreign.json": json.dumps({"benchmark": "synthetic", "records": []}),
    }
    for name, content in files.items():
        (tmp_path / name).write_text(content)
    (tmp_path / "binary.json").write_bytes(bytes(range(256)))
    return {name: tmp_path / name for name in [*files, "binary.json"]}


@pytest.mark.parametrize("args,fragments", [
    (["report", "{truncated}"], ["truncated.json", "not complete JSON", "truncated"]),
    (["report", "{foreign}"], ["foreign.json", "is not an hpdl profile"]),
    (["report", "{list}"], ["list.json", "is not an hpdl profile"]),
    (["report", "{binary}"], ["binary.json", "not"]),
    (["report", "{newer}"], ["newer.json", "schema version 99", "upgrade hpdl"]),
    (["report", "{bad_table}"], ["bad_table.json", "ranks[1].steps"]),
    (["report", "{dir}/absent.json"], ["absent.json", "cannot read profile"]),
    (["report", "{good}", "--buckets", "16M,1M"], ["--buckets", "16M,1M"]),
    (["report", "{good}", "--bench", "{truncated}"], ["--bench", "truncated.json"]),
    (["report", "{good}", "--bench", "{bench_foreign}"], ["--bench", "bench_foreign.json"]),
    (["report", "{good}", "--html", "{dir}/no/such/dir/r.html"], ["cannot write", "r.html"]),
    (["compare", "{good}", "{truncated}"], ["truncated.json", "not complete JSON"]),
    (["timeline", "{newer}", "-o", "{dir}/t.json"], ["newer.json", "schema version 99"]),
    (["timeline", "{good}", "-o", "{dir}/no/such/dir/t.json"], ["cannot write", "t.json"]),
], ids=["truncated", "foreign", "list", "binary", "newer-version", "bad-table", "missing", "buckets",
        "bench-truncated", "bench-foreign", "html-unwritable", "compare-truncated", "timeline-newer",
        "timeline-unwritable"])
def test_profile_command_bad_input_is_one_line(tmp_path, args, fragments):
    files = _profile_inputs(tmp_path)
    before = checksums(files.values())
    argv = [arg.format(dir=tmp_path, **{path.stem: path for path in files.values()}) for arg in args]
    assert_one_line_error(hpdl("profile", *argv, timeout=60), *fragments)
    assert checksums(files.values()) == before
