"""Bad input never costs data, never hangs, and ends in one clear line.

Every case runs through the real command line or a real multi-rank job and asserts what a user
would see: the exit code, at most one line on stderr for command-line errors and never a
"Traceback", input files unchanged (checksums), an earlier run left intact, and no process of
the job left running afterwards. Multi-rank hang cases use a stall timeout of a few seconds.

Sections: jobs that must end (hangs and slow failures); settings; benchmarks, profiles and
launching; hpdl run's horovodrun options. The hpdl sr commands' cases are in
test_bad_input_sr.py; the shared helpers in bad_input_support.py.
"""

from __future__ import annotations

import os
import socket
import subprocess
import sys
from typing import Sequence

import pytest

from hpdl.launch.process_tree import kill_tree
from ranks import ROOT, SCRIPTS
from bad_input_support import (
    _clean_env, assert_one_line_error, checksums, hpdl, launch, profile_inputs, run_job,
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
