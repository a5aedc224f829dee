"""Bad input never costs data, never hangs, and ends in one clear line.

Every case runs through the real command line or a real multi-rank job and asserts what a user
would see: the exit code, at most one line on stderr for command-line errors and never a
"Traceback", input files unchanged (checksums), an earlier run left intact, and no process of
the job left running afterwards. Multi-rank hang cases use a stall timeout of a few seconds.

Sections: jobs that must end (hangs and slow failures); settings; benchmarks, profiles and
launching; hpdl run's horovodrun options; hpdl sr (train, upscale, eval, and the researchers'
layouts, weights, exports and grids). The shared helpers are in bad_input_support.py.
"""

from __future__ import annotations

import os
import pickle
import shutil
import socket
import subprocess
import sys
import time
from pathlib import Path
from typing import List, Sequence

import pytest

from ranks import ROOT, SCRIPTS, kill_tree
from bad_input_support import (
    _clean_env, assert_one_line_error, checksums, hpdl, launch, make_photo, profile_inputs, researcher_inputs, run_job,
)


# == Hangs and slow failures =====================================================================

@pytest.mark.multirank
def test_mismatch_error_exits_the_same_way_every_time_under_torchrun():
    # An uncaught mismatch error ends every rank with Python's exit status 1, never with a
    # C++ abort at interpreter exit (SIGABRT, "terminate called without an active exception").
    # Five jobs at once (the exit race was seen in 1 run of 3 before its fix): the load makes the
    # race likelier, not rarer.
    procs = [subprocess.Popen(launch("torchrun", 2, "bad_input_jobs.py", "mismatch"), env=_clean_env(),
                              cwd=str(ROOT), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                              start_new_session=True) for _ in range(5)]
    codes, errors = [], []
    for proc in procs:
        try:
            _, err = proc.communicate(timeout=120)
        except subprocess.TimeoutExpired:
            kill_tree(proc.pid)
            pytest.fail("a mismatch job did not end within 120 s")
        codes.append(proc.returncode)
        errors.append(err)
    assert all("terminate called" not in e for e in errors), next(e for e in errors if "terminate called" in e)
    assert codes == [1] * 5, codes
    assert all("Mismatched allreduce tensor shapes for tensor 'bad.shape'" in e for e in errors)


STALL_ENV = {"HPDL_STALL_WARNING": "1", "HPDL_STALL_TIMEOUT": "4"}
STALL_CASES = {
    "c-code-mpiexec": ("stall-c", "mpiexec", "os.read(read_end, 1)"),
    "c-code-torchrun": ("stall-c", "torchrun", "os.read(read_end, 1)"),
    "sleep-mpiexec": ("stall-sleep", "mpiexec", "time.sleep(90)"),
    "sleep-no-agent": ("stall-sleep", "plain", "time.sleep(90)"),
    "c-code-process-set": ("stall-set", "mpiexec", "os.read(read_end, 1)"),
}


@pytest.fixture(scope="module")
def stalled_jobs():
    # The jobs mostly wait (for the stall timeout): run them all at once, each checked alone below.
    from concurrent.futures import ThreadPoolExecutor

    with ThreadPoolExecutor(len(STALL_CASES)) as pool:
        futures = {name: pool.submit(run_job, launch(launcher, 2, "bad_input_jobs.py", case), STALL_ENV, 75)
                   for name, (case, launcher, _) in STALL_CASES.items()}
        return {name: future.result() for name, future in futures.items()}


@pytest.mark.multirank
@pytest.mark.parametrize("name", list(STALL_CASES))
def test_a_stalled_rank_ends_the_whole_job(stalled_jobs, name):
    # Rank 1 never submits: it sits in C code or sleeps far longer than the test allows. The
    # whole job must end after the stall timeout plus the abort grace period (run_job fails on
    # a job still running at its timeout, or on any process of it left behind), non-zero, with
    # the survivor's error printed and the stalled rank's stack showing where it was stuck.
    result, where = stalled_jobs[name], STALL_CASES[name][2]
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


@pytest.mark.parametrize("env,message", [
    ({"HPDL_CYCLE_TIME": "inf"}, "HPDL_CYCLE_TIME='inf': expected a finite number"),
    ({"HPDL_BOGUS": "1"}, "unknown setting HPDL_BOGUS"),
], ids=["HPDL_CYCLE_TIME=inf", "HPDL_BOGUS=1"])
def test_check_reports_a_bad_setting_as_a_failed_line(env, message):
    result = hpdl("check", env=env)
    assert result.returncode == 2, result.stdout + result.stderr
    assert "Traceback" not in result.stderr and result.stderr == "", result.stderr
    failed = [line for line in result.stdout.splitlines() if line.startswith("    [ ] HPDL_* settings")]
    assert len(failed) == 1 and message in failed[0], result.stdout


def _nccl_runs_here() -> bool:
    import torch
    import torch.distributed as dist

    return dist.is_available() and dist.is_nccl_available() and torch.cuda.is_available()


NCCL_REFUSED = "backend nccl: this PyTorch"
NCCL_CASES = {
    "bench --backend nccl": (["bench", "allreduce", "--min-size", "8", "--max-size", "8", "--backend", "nccl"], {}),
    "sr train": (["sr", "train", "--config", "demo", "n_resblocks=1", "n_feats=8", "total_updates=1"],
                 {"HPDL_BACKEND": "nccl"}),
    "run --backend nccl": (["run", "-np", "1", "--backend", "nccl", "--", "true"], {}),
    "run, HPDL_BACKEND=nccl": (["run", "-np", "1", "--", sys.executable, "-c", "import hpdl.torch as hvd; hvd.init()"],
                               {"HPDL_BACKEND": "nccl"}),
}


@pytest.mark.skipif(_nccl_runs_here(), reason="this PyTorch has NCCL and a CUDA device")
@pytest.mark.parametrize("case", list(NCCL_CASES))
def test_nccl_without_nccl_or_cuda_is_one_line(case, tmp_path):
    args, env = NCCL_CASES[case]
    if args[:2] == ["sr", "train"]:
        args = args + [f"out_dir={tmp_path / 'run'}"]
    assert_one_line_error(hpdl(*args, env=env), NCCL_REFUSED, "use gloo or mpi")
    assert not (tmp_path / "run").exists()


@pytest.mark.skipif(_nccl_runs_here(), reason="this PyTorch has NCCL and a CUDA device")
def test_nccl_without_nccl_or_cuda_in_a_user_script_is_one_exception():
    result = run_job([sys.executable, "-c", "import hpdl.torch as hvd; hvd.init()"], env={"HPDL_BACKEND": "nccl"})
    assert result.returncode == 1
    assert result.stderr.count("Traceback") == 1 and "During handling" not in result.stderr, result.stderr
    last = result.stderr.strip().splitlines()[-1]
    assert last.startswith("hpdl.comm.select.BackendUnavailableError: " + NCCL_REFUSED), last
    assert last.endswith("use gloo or mpi"), last


# == hpdl bench scaling: a study that cannot be run ==================================================

@pytest.mark.parametrize("args,message", [
    (["--ranks", "1,x"], "--ranks takes comma-separated integers, got '1,x'"),
    (["--ranks", "0,2"], "--ranks takes distinct rank counts of at least 1, got 0,2"),
    (["--systems", "hpdl,horovod"], "--systems takes distinct systems among hpdl, hpdl-fp16, hpdl-hier, hpdl-overlap, ddp, ddp-fp16, got hpdl,horovod"),
    (["--ranks", "1,4", "-H", "localhost:2"], "4 ranks do not fit the 2 slots of the hosts"),
    (["--json", "/nonexistent/dir/s.json"], "/nonexistent/dir/s.json: its directory does not exist"),
    (["--model", "vgg", "--ranks", "1", "--repeats", "1"], "the default job on 1 rank(s) failed (exit 2): hpdl: error: unknown model 'vgg'"),
], ids=["ranks-not-integers", "zero-ranks", "unknown-system", "too-few-slots", "json-dir", "failing-job"])
def test_bench_scaling_bad_requests_are_one_line(args, message, tmp_path):
    result = hpdl("bench", "scaling", *args, cwd=tmp_path)
    assert_one_line_error(result, message)
    assert list(tmp_path.iterdir()) == []  # no record, no plot


# == hpdl profile: files that are not (readable) profiles ==========================================

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
    (["report", "{good}", "--html", "{dir}/no/such/dir/r.html"], ["--html", "r.html: its directory does not exist"]),
    (["compare", "{good}", "{truncated}"], ["truncated.json", "not complete JSON"]),
    (["timeline", "{newer}", "-o", "{dir}/t.json"], ["newer.json", "schema version 99"]),
    (["timeline", "{good}", "-o", "{dir}/no/such/dir/t.json"], ["-o", "t.json: its directory does not exist"]),
    (["report", "{settings_null}"], ["settings_null.json", "job.settings must be an object", "null"]),
    (["timeline", "{settings_null}", "-o", "{dir}/t.json"], ["settings_null.json", "job.settings"]),
    (["report", "{hosts_number}"], ["hosts_number.json", "job.hosts must be a list of host names, got 5"]),
    (["report", "{names_text}"], ["names_text.json", "ranks[0].collectives row 2: 'names' must be a list of integers"]),
    (["timeline", "{names_text}", "-o", "{dir}/t.json"], ["names_text.json", "'names'"]),
    (["report", "{threshold_nan}"], ["threshold_nan.json", "unusable value"]),
    (["compare", "{good}", "{threshold_nan}"], ["threshold_nan.json", "unusable value"]),
], ids=["truncated", "foreign", "list", "binary", "newer-version", "bad-table", "missing", "buckets",
        "bench-truncated", "bench-foreign", "html-unwritable", "compare-truncated", "timeline-newer",
        "timeline-unwritable", "settings-null", "timeline-settings-null", "hosts-number", "names-text",
        "timeline-names-text", "nan-threshold", "compare-nan-threshold"])
def test_profile_command_bad_input_is_one_line(tmp_path, args, fragments):
    files = profile_inputs(tmp_path)
    before = checksums(files.values())
    argv = [arg.format(dir=tmp_path, **{path.stem: path for path in files.values()}) for arg in args]
    assert_one_line_error(hpdl("profile", *argv, timeout=60), *fragments)
    assert checksums(files.values()) == before


def test_truncated_profile_message_says_where_once(tmp_path):
    from hpdl.profile.schema import ProfileError, load

    path = tmp_path / "p.json"
    path.write_text('{"format": "hpdl-profile", "version": 1, "job": {"started": "2026-')
    with pytest.raises(ProfileError) as raised:
        load(str(path))
    message = str(raised.value)
    assert "Unterminated string starting at: line 1 column 61" in message and "at at" not in message, message


def test_profile_report_into_a_closed_pipe_ends_quietly(tmp_path):
    # `hpdl profile report p.json | head -2`: the reader is gone before the report is printed.
    good = profile_inputs(tmp_path)["good.json"]
    proc = subprocess.Popen([sys.executable, "-m", "hpdl", "profile", "report", str(good)], cwd=str(ROOT),
                            env=_clean_env(), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    proc.stdout.close()
    err = proc.stderr.read()
    assert proc.wait(timeout=60) == 141, err
    assert err == ""
# == Launching: hpdl run, hpdl check, hpdl bench allreduce, and worlds of the wrong size ==========

def _exit_code(args: Sequence[str]) -> int:
    """``hpdl ARGS`` in this process; argparse's usage errors end in SystemExit."""
    from hpdl.cli import main

    try:
        return main(list(args))
    except SystemExit as stop:
        return stop.code


def test_bench_allreduce_min_above_max_ends_before_any_rank_communicates():
    # Rank 0 of a two-rank gloo job whose rank 1 never comes: forming the world would wait for
    # it, so ending at once shows the sizes were refused before any communication.
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    env = {"RANK": "0", "WORLD_SIZE": "2", "LOCAL_RANK": "0", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port),
           "HPDL_BACKEND": "gloo"}
    result = hpdl("bench", "allreduce", "--min-size", "64", "--max-size", "8", env=env, timeout=40)
    assert_one_line_error(result, "hpdl: error: --min-size (64 B) is larger than --max-size (8 B)")
    assert result.stdout == ""


@pytest.mark.parametrize("args, fragment", [
    (["--min-size", "1K", "--max-size", "512"], "--min-size (1024 B) is larger than --max-size (512 B)"),
    (["--max-size", "2"], "is larger than --max-size (2 B)"),
    (["--max-size", "1", "--min-size", "0"], "--max-size (1 B) is smaller than one float32 element (4 B)"),
    (["--min-size", "6"], "--min-size (6 B) is not a whole number of float32 elements"),
    (["--max-size", "infM"], "--max-size: not a size: 'infM'"),
    (["--min-size", "-4"], "--min-size: not a size: '-4'"),
    (["--min-size", "4X"], "--min-size: not a size: '4X'"),
    (["--dtype", "float8"], "unknown --dtype 'float8'"),
    (["--iterations", "0"], "--iterations must be at least 1, got 0"),
    (["--iterations-large", "-2"], "--iterations-large must be at least 1, got -2"),
    (["--warmup", "-1"], "--warmup must be at least 0, got -1"),
    (["--warmup-large", "-1"], "--warmup-large must be at least 0, got -1"),
    (["--rounds", "0"], "--rounds must be at least 1, got 0"),
    (["--tensors", "0"], "--tensors must be at least 1, got 0"),
    (["--paths", ","], "--paths takes distinct paths among backend, hierarchical, engine, mpi4py, got ''"),
    (["--paths", "backend,nccl"], "got 'backend,nccl'"),
    (["--paths", "backend,backend"], "got 'backend,backend'"),
    (["--paths", "mpi4py", "--dtype", "bfloat16"], "the mpi4py path has no numpy type for --dtype bfloat16"),
    (["--paths", "mpi4py", "--backend", "gloo"], "the mpi4py path needs the MPI backend, not gloo"),
    (["--backend", "carrier-pigeon"], "backend must be one of"),
    (["--iterations", "many"], "argument --iterations: invalid int value: 'many'"),
])
def test_bench_allreduce_invalid_values_are_one_line(args, fragment, capsys, monkeypatch):
    from hpdl.torch import runtime

    monkeypatch.setattr(runtime, "job_communicator", lambda *a: pytest.fail("a communicator was created"))
    assert _exit_code(["bench", "allreduce", *args]) == 2
    err = capsys.readouterr().err
    assert err.startswith("hpdl: error: ") and err.count("\n") == 1 and fragment in err, err


def test_run_takes_horovodrun_single_dash_hostfile(tmp_path):
    hostfile = tmp_path / "hosts"
    hostfile.write_text("localhost slots=2\n")
    result = hpdl("run", "-hostfile", str(hostfile), "--backend", "gloo", "--dry-run", "--", "python", "train.py")
    assert result.returncode == 0, result.stderr
    assert result.stdout.rstrip().endswith("torchrun --nproc-per-node 2 --standalone --no-python "
                                           f"{sys.executable} -m hpdl.launch.rank_watch -- python train.py")
    bad = tmp_path / "bad"
    bad.write_text("node1 = 2\n")
    assert_one_line_error(hpdl("run", "-hostfile", str(bad), "--", "python", "x.py"), f"{bad}:1: cannot parse")


def test_run_from_an_environment_that_is_not_activated(tmp_path):
    # As `.venv/bin/hpdl run` from cron, a batch script or an IDE: PATH lacks the environment.
    bin_dir = os.path.dirname(os.path.abspath(sys.executable))
    if not os.access(os.path.join(bin_dir, "mpiexec"), os.X_OK):
        pytest.skip("no mpiexec beside this interpreter (pip install 'hpdl[mpi]')")
    env = {"PATH": "/usr/bin:/bin"}
    dry = hpdl("run", "-np", "2", "--dry-run", "--", "python", "train.py", env=env)
    assert dry.returncode == 0 and dry.stdout.startswith(f"PATH={bin_dir}:/usr/bin:/bin "), dry.stdout + dry.stderr
    record = ("import os, sys, hpdl; rank = os.environ.get('PMI_RANK') or os.environ['OMPI_COMM_WORLD_RANK']; "
              f"open(os.path.join({str(tmp_path)!r}, rank), 'w').write(sys.executable)")
    result = hpdl("run", "-np", "2", "--", "python", "-c", record, env=env, timeout=60)
    assert result.returncode == 0, result.stderr
    assert sorted(p.name for p in tmp_path.iterdir()) == ["0", "1"]
    assert {os.path.dirname(p.read_text()) for p in tmp_path.iterdir()} == {bin_dir}


# What each task of `srun --mpi=none` sees: srun's variables, and no PMI for MPI to meet through.
_SRUN_STEP = {"SLURM_JOB_ID": "1", "SLURM_NTASKS": "2", "SLURM_STEP_ID": "0", "SLURM_STEP_NUM_TASKS": "2",
              "SLURM_STEP_NUM_NODES": "1", "SLURM_STEP_TASKS_PER_NODE": "2", "SLURM_NODEID": "0"}


@pytest.mark.parametrize("case, env, refused", [
    ("world", {**_SRUN_STEP, "SLURM_PROCID": "0", "SLURM_LOCALID": "0"}, True),
    ("world", {**_SRUN_STEP, "SLURM_PROCID": "1", "SLURM_LOCALID": "1"}, True),
    # A user's own communicator is not the launcher's world.
    ("self-world", {**_SRUN_STEP, "SLURM_PROCID": "1", "SLURM_LOCALID": "1"}, False),
    # `python job.py` in an salloc shell or batch script: SLURM_NTASKS is the allocation's.
    ("world", {"SLURM_JOB_ID": "1", "SLURM_NTASKS": "2", "SLURM_PROCID": "0"}, False),
], ids=["srun-none-rank0", "srun-none-rank1", "own-communicator", "allocation-shell"])
def test_init_refuses_a_world_of_another_size_than_the_launcher_announced(case, env, refused):
    result = run_job([sys.executable, str(SCRIPTS / "bad_input_jobs.py"), case], env={**env, "HPDL_BACKEND": "mpi"})
    if not refused:
        assert result.returncode == 0 and result.stdout == "rank 0 of 1\n", result.stderr
        return
    assert result.returncode == 1 and result.stdout == ""
    assert ("WorldSizeError: this process is in a world of 1 rank, but the launcher announced 2 "
            "(SLURM_STEP_NUM_TASKS=2); likely cause: srun started the tasks without an MPI plugin") in result.stderr
    assert "`srun --mpi=pmi2`" in result.stderr


# == hpdl run: horovodrun's options ===============================================================
# In this process (as the bench cases above): each case is a parse, no launcher starts.

_CONFIGS = {
    "not-yaml": "params: [\n",
    "a-list": "- params\n",
    "unknown-section": "parms:\n  cycle_time_ms: 2\n",
    "unknown-key": "params:\n  cycle_time: 2\n",
    "bad-type": "params:\n  cycle_time_ms: fast\n",
    "not-a-section": "timeline: t.json\n",
}


@pytest.mark.parametrize("case, fragment", [
    ("not-yaml", "not YAML"),
    ("a-list", "expected sections such as 'params:'"),
    ("unknown-section", "unknown section 'parms'"),
    ("unknown-key", "unknown key params.cycle_time (known in params: fusion_threshold_mb, cycle_time_ms"),
    ("bad-type", "params.cycle_time_ms must be a number, got 'fast'"),
    ("not-a-section", "section timeline must hold keys"),
    ("missing", "No such file or directory"),
])
def test_run_config_file_errors_name_file_and_key(case, fragment, tmp_path, capsys):
    config = tmp_path / "horovod.yaml"
    if case != "missing":
        config.write_text(_CONFIGS[case])
    before = checksums([tmp_path])
    assert _exit_code(["run", "-np", "2", "--config-file", str(config), "--dry-run", "--", "python", "x.py"]) == 2
    err = capsys.readouterr().err
    assert err.startswith(f"hpdl: error: --config-file {config}: ") and err.count("\n") == 1 and fragment in err, err
    assert checksums([tmp_path]) == before


@pytest.mark.parametrize("args, fragment", [
    (["--start-timeout", "-1"], "--start-timeout must be >= 0 seconds"),
    # ssh options matter only where ranks start on other hosts (on this one they are ignored)
    (["-H", "n1:1,n2:1", "--ssh-identity-file", "{tmp}/no-key"], "--ssh-identity-file {tmp}/no-key: no such file"),
    (["--network-interfaces", ","], "--network-interfaces ',': expected names"),
    (["--gloo", "--backend", "mpi"], "not allowed with argument --gloo"),
    (["--stall-timeout-s", "5", "--stall-check-shutdown-time-seconds", "6"], "not allowed with argument"),
])
def test_run_horovodrun_option_errors_are_one_line(args, fragment, tmp_path, capsys):
    args = [a.format(tmp=tmp_path) for a in args]
    assert _exit_code(["run", "-np", "2", *args, "--dry-run", "--", "python", "x.py"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("hpdl: error: ") and err.count("\n") == 1 and fragment.format(tmp=tmp_path) in err, err


def test_run_output_filename_on_a_file_leaves_it_alone(tmp_path):
    taken = tmp_path / "results.txt"
    taken.write_text("an earlier run's results\n")
    before = checksums([taken])
    result = hpdl("run", "-np", "2", "--output-filename", str(taken), "--", "python", "-c", "print(1)")
    assert_one_line_error(result, f"--output-filename {taken}")
    assert checksums([taken]) == before


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
