"""Tests of `hpdl run`'s command line: one-line errors, --dry-run, horovodrun's spellings, and
runs end to end under mpiexec, torchrun and Open MPI."""

import argparse
import os
import random
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from hpdl.cli import main
from hpdl.launch import detect, detect_launchers
from launch_texts import INTEL_TEXT, MPICH_TEXT, OPENMPI4_TEXT, info, run

ROOT = Path(__file__).resolve().parents[1]
# What the ranks of `hpdl run ... -- python train.py` run: the command under its watching parent.
TRAIN = f"{sys.executable} -m hpdl.launch.rank_watch -- python train.py"

# --- the command line ---------------------------------------------------------------------

@pytest.fixture
def clean_env(monkeypatch):
    for key in list(os.environ):
        if key.startswith(("HPDL_", "SLURM_")):
            monkeypatch.delenv(key)


def _one_line_error(capsys, fragment):
    err = capsys.readouterr().err
    assert "Traceback" not in err
    assert err.count("\n") == 1 and err.startswith("hpdl: error: ") and fragment in err, err


@pytest.mark.parametrize("args, fragment", [
    (["run", "-np", "2"], "no command to run"),
    (["run", "-np", "2", "--"], "no command to run"),
    (["run", "-np", "5", "-H", "a:2,b:2", "--", "python", "x.py"], "-np 5 is more than the 4 slots"),
    (["run", "-H", "a:0", "--", "python", "x.py"], "slot count must be at least 1"),
    (["run", "--mpi-args", "'unclosed", "--", "python"], "--mpi-args"),
    (["run", "--cycle-time-ms", "-3", "--", "python"], "--cycle-time-ms must be >= 0 ms, got -3"),
])
def test_cli_errors_are_one_line(args, fragment, capsys, clean_env):
    assert main(args) == 2
    _one_line_error(capsys, fragment)


@pytest.mark.parametrize("args, fragment", [
    (["--fusion-threshold-mb", "inf"], "--fusion-threshold-mb must be a finite number, got inf"),
    (["--fusion-threshold-mb", "nan"], "--fusion-threshold-mb must be a finite number, got nan"),
    (["--fusion-threshold-mb", "1e300"], "--fusion-threshold-mb must be at most 1048576 MB (1 TiB), got 1e+300"),
    (["--cycle-time-ms", "1e300"], "--cycle-time-ms must be at most 31536000000 ms (a year), got 1e+300"),
    (["--cycle-time-ms", "nan"], "--cycle-time-ms must be a finite number, got nan"),
    (["--stall-warning-s", "1e20"], "--stall-warning-s must be at most 31536000 seconds (a year), got 1e+20"),
    (["--stall-timeout-s", "inf"], "--stall-timeout-s must be a finite number, got inf"),
    (["--stall-check-shutdown-time-seconds", "1e300"], "--stall-check-shutdown-time-seconds must be at most"),
    (["--start-timeout", "nan"], "--start-timeout must be a finite number, got nan"),
    (["--start-timeout", "1e300"], "--start-timeout must be at most 31536000 seconds (a year), got 1e+300"),
    (["--start-timeout", "-1"], "--start-timeout must be >= 0 seconds, got -1"),
    (["--cache-capacity", "1" + "0" * 23], "--cache-capacity must be at most 2147483647 entries, got 1.000e+23"),
    (["-np", "1" + "0" * 23], "-np must be at most 2147483647 ranks, got 1.000e+23"),
    (["-H", "a:1,b:1", "--ssh-port", "99999"], "--ssh-port must be at most 65535, got 99999"),
    (["-H", "a:1,b:1", "--ssh-port", "0"], "--ssh-port must be >= 1, got 0"),
    (["--ranks-per-gpu", "0"], "--ranks-per-gpu must be >= 1 rank, got 0"),
    (["--ranks-per-gpu", "2", "--backend", "nccl"], "NCCL refuses two ranks on one GPU; use gloo or mpi"),
])
def test_cli_numbers_that_are_not_finite_or_absurd_are_one_line(args, fragment, monkeypatch, capsys, clean_env):
    monkeypatch.setattr(os, "execvpe", lambda file, argv, env: pytest.fail(f"started {' '.join(argv)}"))
    assert main(["run", *args, "--dry-run", "--", "true"]) == 2
    _one_line_error(capsys, fragment)


@pytest.mark.parametrize("args, fragment", [
    # The option and the value typed, in the option's unit: not the variable it would set.
    (["--fusion-threshold-mb", "-1"], "--fusion-threshold-mb must be >= 0 MB, got -1"),
    (["--fusion-threshold-mb", "-0.5"], "--fusion-threshold-mb must be >= 0 MB, got -0.5"),
    (["--cycle-time-ms", "-1"], "--cycle-time-ms must be >= 0 ms, got -1"),
    (["--cache-capacity", "-3"], "--cache-capacity must be >= 0 entries, got -3"),
    (["--stall-warning-s", "0"], "--stall-warning-s must be > 0 seconds, got 0"),
    (["--stall-check-warning-time-seconds", "-2"], "--stall-warning-s must be > 0 seconds, got -2"),
    (["--stall-timeout-s", "-5"], "--stall-timeout-s must be > 0 seconds, got -5"),
    (["--stall-check-shutdown-time-seconds", "-1"], "--stall-check-shutdown-time-seconds must be >= 0 seconds, got -1"),
    (["--autotune-warmup-samples", "-1"], "--autotune-warmup-samples must be >= 0 samples, got -1"),
    (["--autotune-steps-per-sample", "0"], "--autotune-steps-per-sample must be >= 1 step, got 0"),
    (["--autotune-bayes-opt-max-samples", "-4"], "--autotune-bayes-opt-max-samples must be >= 0 samples, got -4"),
    (["--autotune-gaussian-process-noise", "-0.1"], "--autotune-gaussian-process-noise must be >= 0, got -0.1"),
    (["-np", "0"], "-np must be >= 1 rank, got 0"),
    (["--num-nccl-streams", "0"], "--num-nccl-streams must be >= 1 stream, got 0"),
])
def test_cli_numbers_below_their_range_name_the_option_and_the_value_typed(args, fragment, monkeypatch, capsys,
                                                                             clean_env):
    monkeypatch.setattr(os, "execvpe", lambda file, argv, env: pytest.fail(f"started {' '.join(argv)}"))
    assert main(["run", *args, "--dry-run", "--", "true"]) == 2
    _one_line_error(capsys, fragment)
    assert "HPDL_" not in capsys.readouterr().err


def test_every_numeric_option_of_run_is_range_checked():
    from hpdl.cli import build_parser
    from hpdl.launch.limits import numeric_options

    parser = build_parser()
    run = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction)).choices["run"]
    numeric = {action.dest for action in run._actions if action.type in (int, float)}
    assert numeric == set(numeric_options()), numeric ^ set(numeric_options())


@pytest.mark.parametrize("text, fragment", [
    ("params:\n  fusion_threshold_mb: .inf\n", "params.fusion_threshold_mb must be a finite number, got inf"),
    ("params:\n  cycle_time_ms: .nan\n", "params.cycle_time_ms must be a finite number, got nan"),
    ("params:\n  fusion_threshold_mb: 1.0e+300\n", "params.fusion_threshold_mb must be at most 1048576 MB"),
    ("params:\n  cache_capacity: " + "9" * 400 + "\n", "params.cache_capacity must be at most 2147483647 entries"),
    ("params:\n  cache_capacity: " + "9" * 5000 + "\n", "unreadable value: Exceeds the limit (4300 digits)"),
    ("stall_check:\n  warning_time_seconds: 1.0e+12\n", "stall_check.warning_time_seconds must be at most 31536000"),
    ("stall_check:\n  shutdown_time_seconds: .inf\n", "stall_check.shutdown_time_seconds must be a finite number"),
    ("params:\n  fusion_threshold_mb: -1\n", "params.fusion_threshold_mb must be >= 0 MB, got -1"),
    ("params:\n  cache_capacity: -3\n", "params.cache_capacity must be >= 0 entries, got -3"),
    ("stall_check:\n  shutdown_time_seconds: -1\n", "stall_check.shutdown_time_seconds must be >= 0 seconds, got -1"),
], ids=["inf", "nan", "huge-float", "huge-int", "too-many-digits", "huge-warning", "inf-timeout", "negative-fusion",
        "negative-cache", "negative-timeout"])
def test_config_file_numbers_that_are_not_finite_or_absurd_name_file_and_key(text, fragment, capsys, clean_env,
                                                                             tmp_path):
    config = tmp_path / "horovod.yaml"
    config.write_text(text)
    assert main(["run", "-np", "2", "--config-file", str(config), "--dry-run", "--", "true"]) == 2
    _one_line_error(capsys, f"--config-file {config}: {fragment}")


def test_binary_hostfile_and_config_file_are_named_not_decoded(tmp_path, capsys, clean_env):
    image = tmp_path / "photo.png"
    image.write_bytes(b"\x89PNG\r\n\x1a\n" + bytes(range(256)))
    assert main(["run", "-np", "2", "--hostfile", str(image), "--dry-run", "--", "true"]) == 2
    _one_line_error(capsys, f"cannot read hostfile {image}: not a text file (UTF-8)")
    assert main(["run", "-np", "2", "--config-file", str(image), "--dry-run", "--", "true"]) == 2
    _one_line_error(capsys, f"--config-file {image}: not a text file (UTF-8)")


@pytest.mark.parametrize("option", ["--profile", "--timeline"])
def test_profile_and_timeline_files_rank_0_could_never_write_are_refused_before_the_job(option, tmp_path, capsys,
                                                                                        clean_env):
    (tmp_path / "dir").mkdir()
    (tmp_path / "file").write_text("x")
    assert main(["run", "-np", "2", option, str(tmp_path / "dir"), "--dry-run", "--", "true"]) == 2
    _one_line_error(capsys, f"{option} {tmp_path / 'dir'}: is a directory")
    assert main(["run", "-np", "2", option, str(tmp_path / "file" / "p.json"), "--dry-run", "--", "true"]) == 2
    _one_line_error(capsys, f"{option} {tmp_path / 'file' / 'p.json'}: {tmp_path / 'file'} is a file, not a directory")


def test_profile_and_timeline_on_one_file_are_refused_before_the_job(tmp_path, capsys, clean_env):
    target = tmp_path / "trace.json"
    assert main(["run", "-np", "2", "--profile", str(target), "--timeline", str(target), "--dry-run",
                 "--", "true"]) == 2
    _one_line_error(capsys, f"--profile and --timeline name the same file, {target}")
    target.write_text("[]")
    (tmp_path / "link.json").symlink_to(target)
    assert main(["run", "-np", "2", "--profile", str(tmp_path / "link.json"), "--timeline", str(target),
                 "--dry-run", "--", "true"]) == 2
    _one_line_error(capsys, "--profile and --timeline name the same file")
    assert main(["run", "-np", "2", "--profile", str(tmp_path / "p.json"), "--timeline", str(target),
                 "--dry-run", "--", "true"]) == 0


@pytest.mark.parametrize("argv, unknown, prog", [
    (["run", "--bogus", "--", "true"], "--bogus", "hpdl run"),
    (["profile", "report", "p.json", "--frob"], "--frob", "hpdl profile report"),
    (["sr", "upscale", "a.png", "b.png", "--ckpt", "c.pt", "--tiles", "8"], "--tiles 8", "hpdl sr upscale"),
    (["--bogus"], "--bogus", "hpdl"),
])
def test_an_unknown_option_points_at_the_help_that_lists_the_right_ones(argv, unknown, prog, capsys, clean_env):
    with pytest.raises(SystemExit) as exit_:
        main(argv)
    assert exit_.value.code == 2
    _one_line_error(capsys, f"unrecognized arguments: {unknown} (see {prog} --help)")


@pytest.mark.parametrize("argv, summary", [
    (["--min-np", "1"], "on 2 worker(s) (--min-np 1, --max-np 2), hosts from the hosts given"),
    (["--max-np", "4", "-H", "localhost:2,127.0.0.1:2"], "on 2 worker(s) (--min-np 2, --max-np 4)"),
])
def test_horovodruns_elastic_options_start_an_elastic_job(argv, summary, capsys, clean_env):
    assert main(["run", "-np", "2", *argv, "--dry-run", "--", "python", "train.py"]) == 0
    out = capsys.readouterr().out
    assert out.startswith("elastic job: python train.py ") and summary in out, out


def test_cli_hostfile_error_names_file_and_line(tmp_path, capsys, clean_env):
    hostfile = tmp_path / "hosts"
    hostfile.write_text("node1 slots=2\n# spare\nnode2 = 3\n")
    assert main(["run", "--hostfile", str(hostfile), "--", "python", "x.py"]) == 2
    _one_line_error(capsys, f"{hostfile}:3: cannot parse 'node2 = 3'")


def test_cli_missing_launcher_is_named(monkeypatch, capsys, clean_env):
    monkeypatch.setattr(shutil, "which", lambda name, path=None: None)
    assert main(["run", "-np", "2", "--", "python", "x.py"]) == 2
    _one_line_error(capsys, "launcher mpiexec was not found on PATH")
    assert main(["run", "-np", "2", "--backend", "gloo", "--", "python", "x.py"]) == 2
    _one_line_error(capsys, "launcher torchrun was not found on PATH")


@pytest.mark.parametrize("program, fragment", [
    ("nosuchprog", "nosuchprog: no such program on PATH"),
    ("./nosuch.sh", "./nosuch.sh: no such file"),
    ("./plain.sh", "./plain.sh: not executable"),
    ("./adir", "./adir: is a directory"),
    ("{tmp}/plain.sh", "{tmp}/plain.sh: not executable"),
])
@pytest.mark.parametrize("launcher", ["mpiexec", "torchrun"])
def test_a_program_that_cannot_start_here_is_refused_before_the_launcher(program, fragment, launcher, monkeypatch,
                                                                         capsys, clean_env, tmp_path):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "plain.sh").write_text("echo hi\n")
    (tmp_path / "adir").mkdir()
    monkeypatch.setattr(os, "execvpe", lambda file, argv, env: pytest.fail(f"started {' '.join(argv)}"))
    assert main(["run", "-np", "2", "--launcher", launcher, "--", program.format(tmp=tmp_path), "arg"]) == 2
    _one_line_error(capsys, fragment.format(tmp=tmp_path))


def test_a_program_found_as_execvp_finds_it_is_started(monkeypatch, capsys, clean_env, tmp_path):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "job.sh").write_text("#!/bin/sh\n")
    (tmp_path / "job.sh").chmod(0o755)
    started = []
    monkeypatch.setattr(os, "execvpe", lambda file, argv, env: started.append(argv))
    for program in ("./job.sh", str(tmp_path / "job.sh"), "true"):
        main(["run", "-np", "2", "--", program])
        assert started and started[-1][-1] == program, capsys.readouterr().err
    # On other hosts it may be installed where this host lacks it: a warning, and the job starts.
    main(["run", "-np", "2", "-H", "localhost:1,elsewhere:1", "--", "nosuchprog"])
    assert started[-1][-1] == "nosuchprog"
    assert capsys.readouterr().err == "hpdl run: warning: nosuchprog: no such program on PATH on this host\n"


def test_cli_dry_run_prints_the_command(monkeypatch, capsys, clean_env, tmp_path):
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("PATH", os.pathsep.join([os.path.dirname(os.path.abspath(sys.executable)), "/usr/bin"]))
    monkeypatch.setattr(shutil, "which", lambda name, path=None: f"/usr/bin/{name}" if name != "srun" else None)
    monkeypatch.setattr(detect, "_version_text", lambda exe: OPENMPI4_TEXT)
    code = main(["run", "-np", "2", "-H", "a,b", "--timeline", "t.json", "--dry-run",
                 "--mpi-args=--oversubscribe", "--", "python", "train.py", "--lr", "0.1"])
    out = capsys.readouterr().out.strip()
    assert code == 0
    timeline = os.path.join(str(tmp_path), "t.json")
    assert out == (
        f"HPDL_TIMELINE={timeline} mpiexec --allow-run-as-root --tag-output -np 2 -H a:1,b:1 --bind-to none "
        f"-x HPDL_TIMELINE={timeline} -x PATH --oversubscribe {TRAIN} --lr 0.1"
    )


def test_openmpi_gets_horovodruns_options():
    from hpdl.launch.cli import with_openmpi_defaults

    openmpi = info(flavour=detect.OPENMPI)
    argv, _ = run(launchers=openmpi, np=2)
    assert with_openmpi_defaults(argv, openmpi)[:3] == ["mpiexec", "--allow-run-as-root", "--tag-output"]
    assert with_openmpi_defaults(argv, openmpi)[3:] == argv[1:]
    argv, _ = run(launchers=openmpi, np=2, mpi_args=("--tag-output",))
    assert with_openmpi_defaults(argv, openmpi).count("--tag-output") == 1
    mpich = info()
    argv, _ = run(launchers=mpich, np=2)
    assert with_openmpi_defaults(argv, mpich) == argv
    argv, _ = run(launchers=openmpi, np=2, backend="gloo")  # torchrun: no Open MPI options
    assert argv[0] == "torchrun" and with_openmpi_defaults(argv, openmpi) == argv


def test_cli_profile_sets_an_absolute_hpdl_profile_for_every_rank(monkeypatch, capsys, clean_env, tmp_path):
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(shutil, "which", lambda name, path=None: f"/usr/bin/{name}" if name != "srun" else None)
    monkeypatch.setattr(detect, "_version_text", lambda exe: MPICH_TEXT)
    assert main(["run", "-np", "2", "--profile", "out/p.json", "--dry-run", "--", "python", "train.py"]) == 0
    profile = os.path.join(str(tmp_path), "out", "p.json")
    assert capsys.readouterr().out.strip() == (
        f"HPDL_PROFILE={profile} mpiexec -genv HPDL_PROFILE {profile} -n 2 {TRAIN}")


# --- horovodrun's spellings ---------------------------------------------------------------

def _dry_run(monkeypatch, capsys, *args, version_text=MPICH_TEXT):
    """`hpdl run ARGS --dry-run` with every launcher on PATH and the MPI of ``version_text``."""
    monkeypatch.setattr(shutil, "which", lambda name, path=None: f"/usr/bin/{name}" if name != "srun" else None)
    monkeypatch.setattr(detect, "_version_text", lambda exe: version_text)
    # An option argparse does not know would put --dry-run into the command, which would then run.
    monkeypatch.setattr(os, "execvpe", lambda file, argv, env: pytest.fail(f"started {' '.join(argv)}"))
    code = main(["run", *args, "--dry-run", "--", "python", "train.py"])
    out, err = capsys.readouterr()
    assert code == 0, err
    return out.strip(), err


@pytest.mark.parametrize("horovodrun, own", [
    (["--gloo"], ["--backend", "gloo"]),
    (["--mpi"], ["--backend", "mpi"]),
    (["--timeline-filename", "t.json"], ["--timeline", "t.json"]),
    (["--stall-check-warning-time-seconds", "5"], ["--stall-warning-s", "5"]),
    (["--stall-check-shutdown-time-seconds", "50"], ["--stall-timeout-s", "50"]),
    (["--stall-check-shutdown-time-seconds", "0"], []),  # horovodrun's 0: never; hpdl keeps its timeout
])
def test_horovodrun_spellings_mean_the_same(horovodrun, own, monkeypatch, capsys, clean_env, tmp_path):
    monkeypatch.chdir(tmp_path)
    assert _dry_run(monkeypatch, capsys, "-np", "2", *horovodrun) == _dry_run(monkeypatch, capsys, "-np", "2", *own)


def test_start_timeout_and_verbose(monkeypatch, capsys, clean_env):
    out, _ = _dry_run(monkeypatch, capsys, "-np", "2", "--start-timeout", "30")
    assert out == f"HPDL_START_TIMEOUT=30 mpiexec -genv HPDL_START_TIMEOUT 30 -n 2 {TRAIN}"
    monkeypatch.setattr(os, "execvpe", lambda *a: (_ for _ in ()).throw(OSError(2, "stopped here")))
    assert main(["run", "-np", "2", "--verbose", "--", "python", "train.py"]) == 2
    out, err = capsys.readouterr()
    assert out == "" and err.splitlines()[0] == f"mpiexec -n 2 {TRAIN}", err


@pytest.mark.parametrize("version_text, expected", [
    (MPICH_TEXT, "GLOO_SOCKET_IFNAME=eth1 HYDRA_IFACE=eth1 HYDRA_LAUNCHER_EXTRA_ARGS='-p 2222 -i {key}' "
                 f"NCCL_SOCKET_IFNAME=eth1 mpiexec -n 2 -hosts a:1,b:1 {TRAIN}"),
    (INTEL_TEXT, "GLOO_SOCKET_IFNAME=eth1 I_MPI_HYDRA_BOOTSTRAP_EXEC_EXTRA_ARGS='-p 2222 -i {key}' "
                 f"I_MPI_HYDRA_IFACE=eth1 NCCL_SOCKET_IFNAME=eth1 mpiexec -n 2 -ppn 1 -hosts a,b {TRAIN}"),
    (OPENMPI4_TEXT, "GLOO_SOCKET_IFNAME=eth1 NCCL_SOCKET_IFNAME=eth1 OMPI_MCA_btl_tcp_if_include=eth1 "
                    "OMPI_MCA_oob_tcp_if_include=eth1 OMPI_MCA_plm_rsh_args='-p 2222 -i {key}' mpiexec "
                    "--allow-run-as-root --tag-output -x GLOO_SOCKET_IFNAME -x NCCL_SOCKET_IFNAME -np 2 "
                    f"-H a:1,b:1 --bind-to none -x PATH {TRAIN}"),
], ids=["mpich", "intel", "openmpi"])
def test_ssh_and_network_options_reach_each_mpi(version_text, expected, monkeypatch, capsys, clean_env, tmp_path):
    key = tmp_path / "id_test"
    key.write_text("key")
    out, _ = _dry_run(monkeypatch, capsys, "-np", "2", "-H", "a,b", "-p", "2222", "-i", str(key),
                      "--network-interfaces", "eth1", version_text=version_text)
    assert out == expected.format(key=key)


def test_ssh_options_reach_the_ssh_that_starts_torchrun_on_each_host(monkeypatch, capsys, clean_env, tmp_path):
    monkeypatch.setattr(random, "randint", lambda a, b: 29500)
    out, _ = _dry_run(monkeypatch, capsys, "-np", "2", "-H", "a,b", "--gloo", "--launcher", "torchrun", "-p", "2222",
                      "--network-interfaces", "eth1")
    lines = out.splitlines()
    assert [line.split(" '")[0] for line in lines] == [
        f"GLOO_SOCKET_IFNAME=eth1 HPDL_BACKEND=gloo NCCL_SOCKET_IFNAME=eth1 ssh -p 2222 {host}" for host in "ab"]
    assert all("GLOO_SOCKET_IFNAME=eth1" in line for line in lines)  # passed on to every host's torchrun


def test_config_file_fills_what_the_command_line_leaves(monkeypatch, capsys, clean_env, tmp_path):
    monkeypatch.chdir(tmp_path)
    config = tmp_path / "horovod.yaml"
    config.write_text("params:\n  fusion_threshold_mb: 32\n  cycle_time_ms: 2\n  cache_capacity: 64\n"
                      "  hierarchical_allreduce: true\n  hierarchical_allgather: false\n"
                      "timeline:\n  filename: tl.json\n  mark_cycles: true\n"
                      "stall_check:\n  enabled: false\n  shutdown_time_seconds: 120\n"
                      "autotune:\n  enabled: true\n  log_file: at.csv\n  warmup_samples: 5\n  steps_per_sample: 4\n"
                      "  bayes_opt_max_samples: 8\n  gaussian_process_noise: 0.5\n")
    out, err = _dry_run(monkeypatch, capsys, "-np", "2", "--config-file", str(config), "--cycle-time-ms", "7",
                        "--autotune-steps-per-sample", "6")
    timeline = tmp_path / "tl.json"
    expected = {"HPDL_FUSION_THRESHOLD": str(32 * 1024 * 1024), "HPDL_CYCLE_TIME": "7",  # the command line wins
                "HPDL_CACHE_CAPACITY": "64", "HPDL_HIERARCHICAL_ALLREDUCE": "1", "HPDL_TIMELINE": str(timeline),
                "HPDL_TIMELINE_MARK_CYCLES": "1", "HPDL_STALL_TIMEOUT": "120",
                "HPDL_STALL_WARNING": "120",  # stall check off: no warning before the timeout
                "HPDL_AUTOTUNE": "1", "HPDL_AUTOTUNE_LOG": str(tmp_path / "at.csv"),
                "HPDL_AUTOTUNE_WARMUP_SAMPLES": "5", "HPDL_AUTOTUNE_STEPS_PER_SAMPLE": "6",
                "HPDL_AUTOTUNE_BAYES_OPT_MAX_SAMPLES": "8", "HPDL_AUTOTUNE_GAUSSIAN_PROCESS_NOISE": "0.5"}
    assert {k: v for k, v in (w.split("=", 1) for w in out.split(" mpiexec ")[0].split())} == expected
    # hierarchical_allgather: false asks for what hpdl does: no warning for it.
    assert err == ""


def _settings_of(out):
    """The HPDL_* variables of a dry run's (MPICH) command line."""
    return {k: v for k, v in (w.split("=", 1) for w in out.split(" mpiexec ")[0].split()) if k.startswith("HPDL_")}


@pytest.mark.parametrize("file, args, warning", [
    ("stall_check:\n  enabled: false\n  warning_time_seconds: 3\n", [], "1800"),  # off beats the file's time
    ("stall_check:\n  enabled: false\n  warning_time_seconds: 3\n  shutdown_time_seconds: 240\n", [], "240"),
    ("stall_check:\n  enabled: false\n", ["--stall-check-warning-time-seconds", "5"], "5"),  # the command line wins
    ("stall_check:\n  enabled: true\n  warning_time_seconds: 3\n", ["--no-stall-check"], "1800"),
    ("", ["--no-stall-check", "--stall-check-warning-time-seconds", "5"], "1800"),  # off wins, as in horovodrun
    ("", ["--no-stall-check", "--stall-check-shutdown-time-seconds", "300"], "300"),
])
def test_stall_check_off_beats_the_warning_time(file, args, warning, monkeypatch, capsys, clean_env, tmp_path):
    config = tmp_path / "horovod.yaml"
    config.write_text(file or "params:\n  cycle_time_ms: 1\n")
    out, _ = _dry_run(monkeypatch, capsys, "-np", "2", "--config-file", str(config), *args)
    assert _settings_of(out)["HPDL_STALL_WARNING"] == warning


def test_no_stall_check_puts_the_warning_at_the_environments_timeout(monkeypatch, capsys, clean_env):
    monkeypatch.setenv("HPDL_STALL_TIMEOUT", "200")
    out, _ = _dry_run(monkeypatch, capsys, "-np", "2", "--no-stall-check")
    assert _settings_of(out)["HPDL_STALL_WARNING"] == "200"


def test_horovods_own_config_file_runs_with_a_warning_per_unhonoured_setting(monkeypatch, capsys, clean_env,
                                                                               tmp_path):
    # The sections of the config file in Horovod's tests, elastic among them.
    monkeypatch.chdir(tmp_path)
    config = tmp_path / "horovod.yaml"
    config.write_text("controller: gloo\n"
                      "params:\n  fusion_threshold_mb: 32\n  hierarchical_allgather: true\n  torus_allreduce: false\n"
                      "autotune:\n  enabled: true\n  log_file: at.csv\n  warmup_samples: 5\n"
                      "elastic:\n  timeout: 600\n  reset_limit: 3\n  cooldown_range: [10, 100]\n"
                      "timeline:\n  filename: tl.json\n"
                      "stall_check:\n  enabled: false\n  warning_time_seconds: 120\n  shutdown_time_seconds: 240\n"
                      "library_options:\n  mpi_threads_disable: true\n  num_nccl_streams: 2\n"
                      "logging:\n  level: INFO\n")
    out, err = _dry_run(monkeypatch, capsys, "-np", "2", "--config-file", str(config))
    assert out.startswith("HPDL_AUTOTUNE=1 ") and "HPDL_BACKEND=gloo " in out and " torchrun " in out
    assert "HPDL_STALL_WARNING=240" in out and "HPDL_FUSION_THRESHOLD=33554432" in out
    assert f"HPDL_AUTOTUNE_LOG={tmp_path / 'at.csv'} " in out and "HPDL_AUTOTUNE_WARMUP_SAMPLES=5 " in out
    assert err.splitlines() == [f"hpdl run: warning: {config}: {line}; ignoring it" for line in (
        "params.hierarchical_allgather is not honoured by hpdl",
        "the elastic section is not honoured: give them as options (--min-np, --elastic-timeout, ...)",
        "library_options.mpi_threads_disable is not honoured by hpdl",
        "library_options.num_nccl_streams is not honoured by hpdl", "logging.level is not honoured by hpdl")]


def test_config_file_settings_that_ask_for_what_hpdl_does_are_silent(monkeypatch, capsys, clean_env, tmp_path):
    config = tmp_path / "horovod.yaml"
    config.write_text("params:\n  hierarchical_allgather: false\n  torus_allreduce: false\n"
                      "autotune:\n  enabled: false\n  warmup_samples: 5\nelastic:\n"
                      "library_options:\n  mpi_threads_disable: false\n")
    _, err = _dry_run(monkeypatch, capsys, "-np", "2", "--config-file", str(config))
    assert err == ""


@pytest.mark.parametrize("horovodrun, expected", [
    (["--disable-cache"], f"mpiexec -n 2 {TRAIN}"),  # horovodrun's cache of launcher checks; hpdl has none
    (["--tcp"], f"NCCL_IB_DISABLE=1 mpiexec -n 2 {TRAIN}"),
    (["--timeline-mark-cycles"],
     f"HPDL_TIMELINE_MARK_CYCLES=1 mpiexec -genv HPDL_TIMELINE_MARK_CYCLES 1 -n 2 {TRAIN}"),
    (["--timeline-filename", "DYNAMIC"], f"mpiexec -n 2 {TRAIN}"),  # Horovod's: none until start_timeline()
])
def test_horovodrun_options_that_hpdl_honours(horovodrun, expected, monkeypatch, capsys, clean_env, tmp_path):
    monkeypatch.chdir(tmp_path)
    assert _dry_run(monkeypatch, capsys, "-np", "2", *horovodrun) == (expected, "")


@pytest.mark.parametrize("option", [["--hierarchical-allgather"], ["--mpi-threads-disable"],
                                    ["--num-nccl-streams", "2"], ["--log-level", "debug"]])
def test_horovodrun_options_hpdl_has_no_counterpart_for_warn_once(option, monkeypatch, capsys, clean_env):
    out, err = _dry_run(monkeypatch, capsys, "-np", "2", *option)
    assert out == f"mpiexec -n 2 {TRAIN}"
    assert err == f"hpdl run: warning: {option[0]} is not honoured by hpdl; ignoring it\n"


def test_binding_and_timestamps_reach_open_mpi_and_warn_elsewhere(monkeypatch, capsys, clean_env):
    args = ("-np", "2", "--binding-args=--bind-to core", "--prefix-output-with-timestamp")
    out, err = _dry_run(monkeypatch, capsys, *args, version_text=OPENMPI4_TEXT)
    assert out == ("mpiexec --allow-run-as-root --tag-output --timestamp-output -np 2 -H localhost:2 --bind-to core "
                   f"{TRAIN}") and err == ""
    out, err = _dry_run(monkeypatch, capsys, *args)
    assert out == f"mpiexec -n 2 {TRAIN}"
    assert err.splitlines() == [
        f"hpdl run: warning: {option} is not honoured under the mpiexec of MPICH (Hydra); ignoring it"
        for option in ("--binding-args", "--prefix-output-with-timestamp")]


def test_open_mpi_gets_a_slot_per_rank_on_this_host(monkeypatch, capsys, clean_env):
    out, _ = _dry_run(monkeypatch, capsys, "-np", "3", version_text=OPENMPI4_TEXT)
    assert out == f"mpiexec --allow-run-as-root --tag-output -np 3 -H localhost:3 --bind-to none {TRAIN}"


def test_ssh_options_are_ignored_with_a_note_when_every_rank_is_here(monkeypatch, capsys, clean_env, tmp_path):
    monkeypatch.setattr(random, "randint", lambda a, b: 29500)
    for args in (["--gloo"], ["-H", "localhost:2"], []):
        plain, _ = _dry_run(monkeypatch, capsys, "-np", "2", *args)
        out, err = _dry_run(monkeypatch, capsys, "-np", "2", *args, "-p", "2222", "-i", str(tmp_path / "no-key"))
        assert out == plain and "2222" not in out
        assert err == "hpdl run: note: every rank runs on this host; ignoring --ssh-port and --ssh-identity-file\n"


def test_check_build_prints_the_check_report(monkeypatch, capsys, clean_env):
    from hpdl.launch import check

    monkeypatch.setattr(check, "print_check", lambda: print("the report") or 0)
    monkeypatch.setattr(os, "execvpe", lambda file, argv, env: pytest.fail(f"started {' '.join(argv)}"))
    assert main(["run", "--check-build"]) == 0 and main(["run", "-cb", "-np", "2", "--", "python", "x.py"]) == 0
    assert capsys.readouterr().out == "the report\nthe report\n"


def test_cli_run_help_explains_options(capsys):
    with pytest.raises(SystemExit) as stop:
        main(["run", "--help"])
    assert stop.value.code == 0
    text = capsys.readouterr().out
    for option in ("-np", "--hostfile", "-H", "--backend", "--launcher", "--mpi-args", "--dry-run",
                   "--timeline", "--fusion-threshold-mb", "--cycle-time-ms", "--cache-capacity",
                   "--stall-warning-s", "--stall-timeout-s", "--hierarchical-allreduce", "--profile", "examples:",
                   "--gloo", "--mpi", "--timeline-filename", "--stall-check-warning-time-seconds",
                   "--stall-check-shutdown-time-seconds", "--output-filename", "--verbose", "--start-timeout",
                   "--ssh-port", "--ssh-identity-file", "--network-interfaces", "--config-file", "--no-stall-check",
                   "--disable-cache", "--check-build", "--tcp", "--binding-args", "--prefix-output-with-timestamp",
                   "--log-level", "--autotune", "--autotune-log-file", "--autotune-warmup-samples",
                   "--autotune-steps-per-sample", "--autotune-bayes-opt-max-samples",
                   "--autotune-gaussian-process-noise", "--hierarchical-allgather", "--mpi-threads-disable",
                   "--num-nccl-streams", "--timeline-mark-cycles"):
        assert option in text


# --- end to end ---------------------------------------------------------------------------

@pytest.mark.multirank
@pytest.mark.timeout(90)
@pytest.mark.skipif(shutil.which("mpiexec") is None, reason="needs mpiexec on PATH")
def test_run_two_ranks_through_mpiexec():
    if detect_launchers().mpi_flavour not in detect.HYDRA_FLAVOURS:
        pytest.skip("PMI_RANK is set by Hydra-based mpiexec (MPICH, MVAPICH2, Intel MPI)")
    env = {k: v for k, v in os.environ.items() if not k.startswith(("HPDL_", "SLURM_"))}
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(ROOT), env.get("PYTHONPATH")]))
    done = subprocess.run(
        [sys.executable, "-m", "hpdl", "run", "-np", "2", "--",
         sys.executable, "-c", "import os; print(os.environ['PMI_RANK'])"],
        cwd=ROOT, env=env, capture_output=True, text=True, timeout=60,
    )
    assert done.returncode == 0, done.stderr
    # mpiexec forwards the ranks' output in chunks that may interleave ("01\n\n"): compare digits.
    assert sorted(c for c in done.stdout if c.isdigit()) == ["0", "1"], done.stdout


@pytest.mark.multirank
@pytest.mark.timeout(120)
@pytest.mark.parametrize("backend", ["--mpi", "--gloo"])
def test_output_filename_writes_each_ranks_output_to_its_files(backend, tmp_path):
    if backend == "--mpi" and shutil.which("mpiexec") is None:
        pytest.skip("needs mpiexec on PATH")
    env = {k: v for k, v in os.environ.items() if not k.startswith(("HPDL_", "SLURM_"))}
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(ROOT), env.get("PYTHONPATH")]))
    script = ("import sys, hpdl.torch as hvd; hvd.init(); sys.stdout.write(f'out {hvd.rank()}\\n'); "
              "sys.stderr.write(f'err {hvd.rank()} of {hvd.size()}\\n')")
    done = subprocess.run([sys.executable, "-m", "hpdl", "run", "-np", "2", backend, "--verbose",
                           "--output-filename", "logs", "--", sys.executable, "-c", script],
                          cwd=tmp_path, env=env, capture_output=True, text=True, timeout=90)
    assert done.returncode == 0, done.stderr
    assert "hpdl.launch.rank_output" in done.stderr.splitlines()[0]  # --verbose: the command, first
    assert "out 0" not in done.stdout  # the ranks' output went to the files only
    for rank in (0, 1):
        assert (tmp_path / "logs" / f"rank.{rank}" / "stdout").read_text() == f"out {rank}\n"
        assert (tmp_path / "logs" / f"rank.{rank}" / "stderr").read_text() == f"err {rank} of 2\n"


@pytest.mark.multirank
@pytest.mark.timeout(120)
def test_run_and_check_under_openmpi(tmp_path):
    """Open MPI with mpi4py built against it: `hpdl check` names it, and `hpdl run` works even as root."""
    from ranks import OPENMPI_VENV, openmpi_missing

    if openmpi_missing():
        pytest.skip(openmpi_missing())
    (tmp_path / "mpiexec").symlink_to(shutil.which("mpiexec.openmpi"))
    venv_bin = OPENMPI_VENV / "bin"
    env = {k: v for k, v in os.environ.items() if not k.startswith(("HPDL_", "SLURM_", "VIRTUAL_ENV"))}
    env.update(PATH=os.pathsep.join([str(tmp_path), str(venv_bin), "/usr/bin", "/bin"]), PYTHONPATH=str(ROOT))
    check = subprocess.run([str(venv_bin / "hpdl"), "check"], env=env, capture_output=True, text=True, timeout=60)
    assert "MPI (Open MPI: Open MPI v" in check.stdout and "mpiexec (Open MPI " in check.stdout, check.stdout
    # One write per line: --tag-output tags every chunk a rank writes.
    script = ("import sys, hpdl.torch as hvd; hvd.init(); "
              "sys.stdout.write(f'rank {hvd.rank()} of {hvd.size()} {hvd.mpi_enabled()}\\n')")
    done = subprocess.run([str(venv_bin / "hpdl"), "run", "-np", "2", "--", str(venv_bin / "python"), "-c", script],
                          cwd=tmp_path, env=env, capture_output=True, text=True, timeout=90)
    assert done.returncode == 0, done.stderr[-3000:]
    # --tag-output: each line says which rank printed it.
    assert sorted(done.stdout.split("\n"))[1:] == ["[1,0]<stdout>:rank 0 of 2 True",
                                                   "[1,1]<stdout>:rank 1 of 2 True"], done.stdout
