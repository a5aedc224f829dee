"""Tests of `hpdl run`: host parsing, MPI flavour detection, the pure builders and the CLI.

Everything but the last test is pure: launchers are described by a fake LauncherInfo, so
Open MPI, Intel MPI, MVAPICH2 and Slurm are covered without being installed.
"""

import dataclasses
import os
import random
import shlex
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from hpdl.cli import main
from hpdl.launch import (
    LaunchError,
    LauncherInfo,
    RunOptions,
    build_run,
    detect_launchers,
    format_command,
    mpi_default_from_config,
    mpi_flavour_from_version,
    mpi_version_from_version,
    parse_hostfile,
    parse_hosts,
    ranks_path,
    read_hostfile,
    srun_mpi_plugins_from_list,
)
from hpdl.launch import detect

ROOT = Path(__file__).resolve().parents[1]

# --- realistic `mpiexec --version` outputs ----------------------------------------------

MPICH_TEXT = """\
HYDRA build details:
    Version:                                 4.1.2
    Release Date:                            Wed Jun  7 15:22:45 CDT 2023
    CC:                              gcc    -Wdate-time -D_FORTIFY_SOURCE=2 -g -O2
    Configure options:                       '--disable-option-checking' '--prefix=/usr' '--with-device=ch4:ofi' '--with-pm=hydra'
    Process Manager:                         pmi
    Launchers available:                     ssh rsh fork slurm ll lsf sge manual persist
    Topology libraries available:            hwloc
    Resource management kernels available:   user slurm ll lsf sge pbs cobalt
    Demux engines available:                 poll select
"""
OPENMPI4_TEXT = """\
mpiexec (OpenRTE) 4.1.5

Report bugs to http://www.open-mpi.org/community/help/
"""
OPENMPI5_TEXT = """\
mpiexec (Open MPI) 5.0.3

Report bugs to https://www.open-mpi.org/community/help/
"""
MVAPICH2_TEXT = """\
HYDRA build details:
    Version:                                 3.2.1
    Release Date:                            General Availability Release
    CC:                              gcc    -DNDEBUG -DNVALGRIND -O2
    CXX:                             g++   -DNDEBUG -DNVALGRIND -O2
    Configure options:                       '--disable-option-checking' '--prefix=/opt/mvapich2/2.3.7' '--with-device=ch3:mrail' '--with-rdma=gen2' 'MPICHLIB_CFLAGS=-O2'
    Process Manager:                         pmi
    Launchers available:                     ssh rsh fork slurm ll lsf sge manual persist
    Topology libraries available:            hwloc
    Resource management kernels available:   user slurm ll lsf sge pbs cobalt
    Demux engines available:                 poll select
"""
INTEL_TEXT = """\
Intel(R) MPI Library for Linux* OS, Version 2021.10 Build 20230619 (id: c2e19c2f3e)
Copyright 2003-2023, Intel Corporation.
"""
INTEL2019_TEXT = "Intel(R) MPI Library for Linux* OS, Version 2019 Update 9 Build 20200923 (id: abd58e492)\n"


SRUN_LIST_22 = """\
MPI plugin types are...
\tpmix
\tnone
\tcray_shasta
\tpmi2
specific pmix plugin versions available: pmix_v4
"""
SRUN_LIST_OLD = "srun: MPI types are...\nsrun: none\nsrun: openmpi\nsrun: pmi2\n"
ALL_PLUGINS = srun_mpi_plugins_from_list(SRUN_LIST_22)


def info(flavour=detect.MPICH, mpiexec="mpiexec", torchrun="torchrun", srun=None, plugins=frozenset(),
         mpi_default="", python_bin=""):
    return LauncherInfo(
        mpiexec=mpiexec, mpi_flavour=flavour, torchrun=torchrun, srun=srun, srun_mpi_plugins=plugins,
        srun_mpi_default=mpi_default, hostnames=frozenset({"localhost", "127.0.0.1", "vm"}), cwd="/job",
        python_bin=python_bin,
    )


def run(command=("python", "train.py"), env=None, launchers=None, **options):
    """``(argv, env)`` of a launch that is one command (every launch but torchrun across hosts)."""
    commands, out_env = build_run(RunOptions(command=tuple(command), **options), env or {}, launchers or info())
    assert len(commands) == 1, commands
    return commands[0], out_env


# --- hosts -------------------------------------------------------------------------------

def test_parse_hosts_with_and_without_slots():
    hosts = parse_hosts("node1:2, node2,10.0.0.3:4")
    assert [(h.name, h.slots) for h in hosts.hosts] == [("node1", 2), ("node2", 1), ("10.0.0.3", 4)]
    assert hosts.total_slots == 7 and hosts.path is None
    assert hosts.colon_form() == "node1:2,node2:1,10.0.0.3:4"


@pytest.mark.parametrize("text, fragment", [
    ("node1:2,,node2", "-H entry 2 is empty"),
    ("node1:x", "slot count 'x' is not an integer"),
    ("node1:0", "at least 1"),
    ("node 1", "cannot parse"),
])
def test_parse_hosts_errors(text, fragment):
    with pytest.raises(LaunchError, match=fragment):
        parse_hosts(text)


def test_parse_hostfile_mixed_forms_and_comments():
    text = "# cluster\nnode1 slots=4\n\nnode2:2   # fast one\nnode3\nnode4 slots=2 max_slots=8\n"
    hosts = parse_hostfile(text, "hosts.txt")
    assert [(h.name, h.slots) for h in hosts.hosts] == [("node1", 4), ("node2", 2), ("node3", 1), ("node4", 2)]
    assert hosts.styles == {"slots", "colon", "bare"}
    assert hosts.path == "hosts.txt"


@pytest.mark.parametrize("text, fragment", [
    ("node1 slots=2\nnode2 cpus=4\n", r"hosts\.txt:2: cannot parse 'node2 cpus=4'"),
    ("# a\n\nnode1:two\n", r"hosts\.txt:3: slot count 'two'"),
    ("node1 slots=0\n", r"hosts\.txt:1: slot count must be at least 1"),
    ("# only comments\n\n", r"hosts\.txt: lists no hosts"),
])
def test_parse_hostfile_errors_name_file_and_line(text, fragment):
    with pytest.raises(LaunchError, match=fragment):
        parse_hostfile(text, "hosts.txt")


def test_read_hostfile(tmp_path):
    path = tmp_path / "hosts"
    path.write_text("a:2\nb:2\n")
    assert read_hostfile(str(path)).total_slots == 4
    with pytest.raises(LaunchError, match="cannot read hostfile"):
        read_hostfile(str(tmp_path / "missing"))


# --- flavour detection --------------------------------------------------------------------

@pytest.mark.parametrize("text, flavour, version", [
    (MPICH_TEXT, detect.MPICH, "4.1.2"),
    (OPENMPI4_TEXT, detect.OPENMPI, "4.1.5"),
    (OPENMPI5_TEXT, detect.OPENMPI, "5.0.3"),
    (MVAPICH2_TEXT, detect.MVAPICH2, "3.2.1"),
    (INTEL_TEXT, detect.INTELMPI, "2021.10"),
    (INTEL2019_TEXT, detect.INTELMPI, "2019 Update 9"),
    ("", detect.UNKNOWN, ""),
    ("mpiexec: some vendor launcher 1.0\n", detect.UNKNOWN, ""),
])
def test_flavour_from_version_text(text, flavour, version):
    assert mpi_flavour_from_version(text) == flavour
    assert mpi_version_from_version(text) == version


def test_detect_launchers_with_nothing_on_path(monkeypatch):
    monkeypatch.setattr(shutil, "which", lambda name, path=None: None)
    found = detect_launchers({"PATH": "/nowhere"})
    assert (found.mpiexec, found.srun, found.torchrun) == (None, None, None)


def test_detect_launchers_reads_flavour(monkeypatch):
    monkeypatch.setattr(shutil, "which", lambda name, path=None: f"/opt/bin/{name}" if name == "mpirun" else None)
    monkeypatch.setattr(detect, "_version_text", lambda exe: OPENMPI5_TEXT)
    found = detect_launchers({"PATH": "/opt/bin"})
    assert found.mpiexec == "mpirun" and found.mpiexec_path == "/opt/bin/mpirun"
    assert found.mpi_flavour == detect.OPENMPI and found.mpi_version == "5.0.3"


# --- builders: mpiexec in each flavour ----------------------------------------------------

def test_mpich_local_needs_no_hosts():
    argv, env = run(np=2, env={"PATH": "/bin"})
    assert argv == ["mpiexec", "-n", "2", "python", "train.py"]
    assert env == {"PATH": "/bin"}


def test_mpich_hosts_settings_and_mpi_args():
    argv, env = run(
        np=3, hosts=parse_hosts("n1:2,n2:2"), fusion_threshold_mb=32, cycle_time_ms=2.5,
        timeline="out/t.json", hierarchical_allreduce=True, mpi_args=("-bind-to", "core"),
    )
    assert argv == [
        "mpiexec",
        "-genv", "HPDL_TIMELINE", "/job/out/t.json",
        "-genv", "HPDL_FUSION_THRESHOLD", str(32 * 1024 * 1024),
        "-genv", "HPDL_CYCLE_TIME", "2.5",
        "-genv", "HPDL_HIERARCHICAL_ALLREDUCE", "1",
        "-bind-to", "core",
        "-n", "3", "-hosts", "n1:2,n2:2",
        "python", "train.py",
    ]
    assert env["HPDL_TIMELINE"] == "/job/out/t.json" and env["HPDL_CYCLE_TIME"] == "2.5"


def test_mpich_hostfile_passed_when_native_else_translated():
    native = parse_hostfile("n1:2\nn2\n", "hf")
    argv, _ = run(hosts=native)
    assert argv == ["mpiexec", "-n", "3", "-f", "hf", "python", "train.py"]
    foreign = parse_hostfile("n1 slots=2\nn2\n", "hf")
    argv, _ = run(hosts=foreign)
    assert argv == ["mpiexec", "-n", "3", "-hosts", "n1:2,n2:1", "python", "train.py"]


@pytest.mark.parametrize("text", [OPENMPI4_TEXT, OPENMPI5_TEXT])
def test_openmpi(text):
    launchers = info(flavour=mpi_flavour_from_version(text), mpiexec="mpirun")
    env = {"PATH": "/venv/bin", "HOME": "/root"}
    argv, out = run(np=4, hosts=parse_hosts("n1:2,n2:2"), backend="mpi", cache_capacity=0,
                    env=env, launchers=launchers)
    assert argv == [
        "mpirun", "-np", "4", "-H", "n1:2,n2:2", "--bind-to", "none",
        "-x", "HPDL_BACKEND=mpi", "-x", "HPDL_CACHE_CAPACITY=0", "-x", "PATH",
        "python", "train.py",
    ]
    assert out["HPDL_BACKEND"] == "mpi" and out["HOME"] == "/root"


def test_openmpi_local_and_hostfile():
    launchers = info(flavour=detect.OPENMPI)
    argv, _ = run(np=2, launchers=launchers, env={"PATH": "/bin"})
    assert argv == ["mpiexec", "-np", "2", "--bind-to", "none", "python", "train.py"]
    argv, _ = run(hosts=parse_hostfile("n1 slots=2\nn2\n", "hf"), launchers=launchers)
    assert argv[:6] == ["mpiexec", "-np", "3", "--hostfile", "hf", "--bind-to"]
    argv, _ = run(hosts=parse_hostfile("n1:2\n", "hf"), launchers=launchers)
    assert argv[3:5] == ["-H", "n1:2"]


def test_mvapich2_disables_affinity_unless_set():
    launchers = info(flavour=detect.MVAPICH2)
    argv, _ = run(np=2, launchers=launchers)
    assert argv == ["mpiexec", "-genv", "MV2_ENABLE_AFFINITY", "0", "-n", "2", "python", "train.py"]
    argv, _ = run(np=2, launchers=launchers, env={"MV2_ENABLE_AFFINITY": "1"})
    assert argv == ["mpiexec", "-n", "2", "python", "train.py"]


def test_intel_mpi_uniform_uneven_and_machinefile():
    launchers = info(flavour=detect.INTELMPI, mpiexec="mpiexec.hydra")
    argv, _ = run(np=3, hosts=parse_hosts("n1:2,n2:2"), launchers=launchers)
    assert argv == ["mpiexec.hydra", "-n", "3", "-ppn", "2", "-hosts", "n1,n2", "python", "train.py"]
    argv, _ = run(np=3, hosts=parse_hosts("n1:1,n2:4"), backend="mpi", launchers=launchers)
    assert argv == [
        "mpiexec.hydra", "-genv", "HPDL_BACKEND", "mpi",
        "-n", "1", "-host", "n1", "python", "train.py", ":",
        "-n", "2", "-host", "n2", "python", "train.py",
    ]
    argv, _ = run(hosts=parse_hostfile("n1:2\n", "hf"), launchers=launchers)
    assert argv == ["mpiexec.hydra", "-n", "2", "-machinefile", "hf", "python", "train.py"]


def test_unknown_mpiexec_local_only():
    launchers = info(flavour=detect.UNKNOWN)
    argv, env = run(np=2, backend="mpi", launchers=launchers)
    assert argv == ["mpiexec", "-n", "2", "python", "train.py"]
    assert env["HPDL_BACKEND"] == "mpi"
    with pytest.raises(LaunchError, match="cannot tell how to pass hosts"):
        run(hosts=parse_hosts("n1,n2"), launchers=launchers)


# --- builders: srun and torchrun ----------------------------------------------------------

def test_srun_inside_slurm_allocation():
    launchers = info(srun="srun")
    env = {"SLURM_JOB_ID": "42", "SLURM_NTASKS": "8"}
    argv, _ = run(env=env, launchers=launchers)
    assert argv == ["srun", "--ntasks", "8", "python", "train.py"]
    argv, out = run(np=4, hosts=parse_hosts("c1:2,c2:2"), mpi_args=("--mpi=pmix",), env=env, launchers=launchers)
    assert argv == ["srun", "--ntasks", "4", "--nodelist", "c1,c2", "--mpi=pmix", "python", "train.py"]
    assert out["SLURM_JOB_ID"] == "42"


def test_srun_list_and_site_default_are_parsed():
    assert ALL_PLUGINS == {"pmix", "none", "cray_shasta", "pmi2", "pmix_v4"}
    assert srun_mpi_plugins_from_list(SRUN_LIST_OLD) == {"none", "openmpi", "pmi2"}
    assert srun_mpi_plugins_from_list("srun: fatal: Could not establish a configuration source\n") == frozenset()
    config = "Configuration data as of 2026-01-01T00:00:00\nMpiDefault              = none\nMpiParams = (null)\n"
    assert mpi_default_from_config(config) == "none"
    assert mpi_default_from_config("") == ""


@pytest.mark.parametrize("flavour, plugins, plugin", [
    (detect.MPICH, ALL_PLUGINS, "pmi2"),
    (detect.INTELMPI, ALL_PLUGINS, "pmi2"),
    (detect.MVAPICH2, ALL_PLUGINS, "pmi2"),
    (detect.OPENMPI, ALL_PLUGINS, "pmix"),
    (detect.OPENMPI, frozenset({"none", "pmi2"}), None),  # srun without PMIx: leave its default
    (detect.MPICH, frozenset(), None),  # srun could not be asked
    (detect.UNKNOWN, ALL_PLUGINS, None),
])
def test_srun_gets_the_mpi_plugin_of_the_mpi_found(flavour, plugins, plugin):
    env = {"SLURM_JOB_ID": "42", "SLURM_NTASKS": "2"}
    argv, _ = run(env=env, launchers=info(flavour=flavour, srun="srun", plugins=plugins))
    assert argv == ["srun", "--ntasks", "2"] + ([f"--mpi={plugin}"] if plugin else []) + ["python", "train.py"]


@pytest.mark.parametrize("mpi_args, env, mpi_default, expected", [
    (("--mpi=none",), {}, "none", ["--mpi=none"]),
    (("--mpi", "pmix"), {}, "none", ["--mpi", "pmix"]),
    (("--exclusive",), {}, "none", ["--mpi=pmi2", "--exclusive"]),
    ((), {"SLURM_MPI_TYPE": "pmix"}, "none", []),  # srun reads the user's choice itself
    ((), {"SLURM_MPI_TYPE": "none"}, "", ["--mpi=pmi2"]),
    ((), {}, "pmix", []),  # the site's MpiDefault
])
def test_srun_plugin_chosen_by_user_or_site_is_left_alone(mpi_args, env, mpi_default, expected):
    launchers = info(srun="srun", plugins=ALL_PLUGINS, mpi_default=mpi_default)
    argv, _ = run(np=2, mpi_args=mpi_args, env={"SLURM_JOB_ID": "42", **env}, launchers=launchers)
    assert argv == ["srun", "--ntasks", "2"] + expected + ["python", "train.py"]


def test_slurm_with_gloo_uses_torchrun_on_one_host():
    argv, env = run(np=2, backend="gloo", env={"SLURM_JOB_ID": "42"}, launchers=info(srun="srun"))
    assert argv[0] == "torchrun" and env["HPDL_BACKEND"] == "gloo"


def test_srun_missing():
    with pytest.raises(LaunchError, match="launcher srun was not found"):
        run(env={"SLURM_JOB_ID": "42"})


def test_torchrun_single_host():
    argv, env = run(np=2, backend="nccl", stall_warning_s=30.0)
    assert argv == ["torchrun", "--nproc-per-node", "2", "--standalone", "--no-python", "python", "train.py"]
    assert env["HPDL_BACKEND"] == "nccl" and env["HPDL_STALL_WARNING"] == "30"
    argv, _ = run(hosts=parse_hosts("localhost:2"), backend="gloo")
    assert argv[:3] == ["torchrun", "--nproc-per-node", "2"]


def test_torch_backend_on_several_hosts_starts_through_mpiexec():
    argv, env = run(hosts=parse_hosts("n1:2,n2:2"), backend="gloo")
    assert argv == [
        "mpiexec", "-genv", "HPDL_BACKEND", "gloo", "-n", "4", "-hosts", "n1:2,n2:2", "python", "train.py",
    ]
    with pytest.raises(LaunchError, match="needs mpiexec to start the ranks"):
        run(hosts=parse_hosts("n1:2,n2:2"), backend="gloo", launchers=info(mpiexec=None))


def test_backend_from_environment_picks_the_launcher():
    argv, env = run(np=2, env={"HPDL_BACKEND": "gloo"})
    assert argv[0] == "torchrun" and env["HPDL_BACKEND"] == "gloo"


def test_auto_without_mpiexec_falls_back_to_torchrun_on_one_host():
    argv, _ = run(np=2, launchers=info(mpiexec=None))
    assert argv[0] == "torchrun"
    with pytest.raises(LaunchError, match="launcher mpiexec was not found"):
        run(np=2, launchers=info(mpiexec=None, torchrun=None))


def test_forced_launcher_and_its_limits():
    argv, _ = run(np=2, launcher="torchrun")
    assert argv[0] == "torchrun"
    argv, _ = run(np=2, backend="gloo", launcher="mpiexec")
    assert argv == ["mpiexec", "-genv", "HPDL_BACKEND", "gloo", "-n", "2", "python", "train.py"]
    with pytest.raises(LaunchError, match="backend mpi cannot run under torchrun"):
        run(backend="mpi", launcher="torchrun")
    with pytest.raises(LaunchError, match="--mpi-args applies to mpiexec and srun"):
        run(backend="gloo", mpi_args=("-x",))
    with pytest.raises(LaunchError, match="launcher torchrun was not found"):
        run(backend="gloo", launchers=info(torchrun=None))


# --- several hosts: the remote shell ------------------------------------------------------

def test_mpiexec_reaches_the_hosts_through_the_remote_shell():
    hosts = parse_hosts("n1:2,n2:2")
    argv, _ = run(np=4, hosts=hosts, remote_shell="/x/node-shell")
    assert argv == ["mpiexec", "-launcher", "ssh", "-launcher-exec", "/x/node-shell", "-n", "4", "-hosts",
                    "n1:2,n2:2", "python", "train.py"]
    argv, _ = run(np=4, hosts=hosts, remote_shell="/x/node-shell", launchers=info(flavour=detect.OPENMPI))
    assert argv[:5] == ["mpiexec", "-np", "4", "--mca", "plm_rsh_agent"] and argv[5] == "/x/node-shell"
    argv, _ = run(np=4, hosts=hosts, remote_shell="/x/rsh", launchers=info(flavour=detect.INTELMPI))
    assert argv[1:5] == ["-bootstrap", "ssh", "-bootstrap-exec", "/x/rsh"]


def test_torchrun_on_several_hosts_starts_one_torchrun_per_host_with_a_static_rendezvous():
    options = RunOptions(command=("python", "train.py"), np=3, hosts=parse_hosts("n1:2,n2:2,n3:2"),
                         launcher="torchrun", remote_shell="/x/rsh", rendezvous_port=29555)
    env = {"PATH": "/venv/bin:/usr/bin", "HPDL_CYCLE_TIME": "2", "SECRET": "not forwarded", "GLOO_SOCKET_IFNAME": "eth0"}
    commands, _ = build_run(options, env, info(python_bin="/venv/bin"))
    assert len(commands) == 2  # 3 ranks fill n1, then one slot of n2; n3 gets none
    for node_rank, (argv, host, count) in enumerate(zip(commands, ["n1", "n2"], [2, 1])):
        assert argv[:2] == ["/x/rsh", host] and len(argv) == 3
        words = shlex.split(argv[2])
        assert words[:5] == ["cd", "/job", "&&", "exec", "env"]
        assert {"GLOO_SOCKET_IFNAME=eth0", "HPDL_CYCLE_TIME=2", "PATH=/venv/bin:/usr/bin"} <= set(words)
        assert not any(w.startswith("SECRET=") for w in words)
        line = words[words.index("torchrun"):]
        assert line == ["torchrun", "--nnodes", "2", "--node-rank", str(node_rank), "--nproc-per-node", str(count),
                        "--master-addr", "n1", "--master-port", "29555", "--no-python", "python", "train.py"]
    commands, _ = build_run(dataclasses.replace(options, remote_shell=None), env, info())
    assert commands[0][0] == "ssh"


# --- the interpreter's directory on the ranks' PATH ----------------------------------------

@pytest.mark.parametrize("path, expected", [
    ("/usr/bin:/bin", "/venv/bin:/usr/bin:/bin"),
    ("", "/venv/bin"),
    ("/venv/bin:/usr/bin", "/venv/bin:/usr/bin"),
    ("/usr/bin:/venv/bin/", "/usr/bin:/venv/bin/"),  # on PATH already: its order is the user's
])
def test_ranks_path(path, expected):
    assert ranks_path(path, "/venv/bin") == expected
    assert ranks_path(path, "") == path


@pytest.mark.parametrize("flavour, launcher", [(detect.MPICH, "mpiexec"), (detect.OPENMPI, "mpiexec"),
                                               (detect.MPICH, "srun"), (detect.MPICH, "torchrun")])
def test_ranks_get_the_interpreter_directory_first_on_path(flavour, launcher):
    launchers = info(flavour=flavour, srun="srun", python_bin="/venv/bin")
    base = {"PATH": "/usr/bin:/bin", "HOME": "/root"}
    argv, env = run(np=2, launcher=launcher, env=base, launchers=launchers)
    assert env["PATH"] == "/venv/bin:/usr/bin:/bin" and env["HOME"] == "/root"
    assert argv[-2:] == ["python", "train.py"]
    assert format_command(argv, env, base).startswith("PATH=/venv/bin:/usr/bin:/bin ")


def test_open_mpi_forwards_the_ranks_path_to_remote_hosts():
    launchers = info(flavour=detect.OPENMPI, python_bin="/venv/bin")
    argv, env = run(hosts=parse_hosts("n1,n2"), env={}, launchers=launchers)
    assert ["-x", "PATH"] == argv[-4:-2] and env["PATH"].startswith("/venv/bin:")


def test_detect_launchers_looks_beside_the_interpreter(tmp_path, monkeypatch):
    for name in ("mpiexec", "torchrun"):
        (tmp_path / name).write_text("#!/bin/sh\n")
        (tmp_path / name).chmod(0o755)
    monkeypatch.setattr(detect, "_version_text", lambda exe: MPICH_TEXT)
    found = detect_launchers({"PATH": "/nowhere"}, python_bin=str(tmp_path))
    assert found.mpiexec_path == str(tmp_path / "mpiexec") and found.mpi_flavour == detect.MPICH
    assert found.torchrun_path == str(tmp_path / "torchrun") and found.python_bin == str(tmp_path)
    assert detect_launchers({"PATH": "/nowhere"}, python_bin="").mpiexec is None


def test_detect_launchers_asks_srun_inside_an_allocation_only(tmp_path, monkeypatch):
    for name in ("srun", "scontrol"):
        (tmp_path / name).write_text("#!/bin/sh\n")
        (tmp_path / name).chmod(0o755)
    asked = []
    answers = {"--mpi=list": SRUN_LIST_22, "show": "MpiDefault = pmi2\n"}
    monkeypatch.setattr(detect, "_output", lambda argv: asked.append(argv[1]) or answers[argv[1]])
    env = {"PATH": str(tmp_path)}
    assert detect_launchers(env, python_bin="").srun_mpi_plugins == frozenset() and asked == []
    found = detect_launchers({**env, "SLURM_JOB_ID": "42"}, python_bin="")
    assert found.srun_mpi_plugins == ALL_PLUGINS and found.srun_mpi_default == "pmi2"
    assert detect_launchers(env, probe_srun=True, python_bin="").srun_mpi_plugins == ALL_PLUGINS


# --- builders: ranks and settings ---------------------------------------------------------

def test_np_defaults_and_limits():
    assert run(hosts=parse_hosts("n1:2,n2:3"))[0][1:3] == ["-n", "5"]
    assert run()[0][1:3] == ["-n", "1"]
    with pytest.raises(LaunchError, match="-np 5 is more than the 4 slots that -H lists"):
        run(np=5, hosts=parse_hosts("n1:2,n2:2"))
    with pytest.raises(LaunchError, match="hostfile hf"):
        run(np=3, hosts=parse_hostfile("n1:2\n", "hf"))
    with pytest.raises(LaunchError, match="at least 1"):
        run(np=0)


def test_settings_are_validated_before_launch():
    with pytest.raises(LaunchError, match="HPDL_CYCLE_TIME must be >= 0"):
        run(cycle_time_ms=-1.0)
    with pytest.raises(LaunchError, match="unknown setting HPDL_FUSION_TRESHOLD"):
        run(env={"HPDL_FUSION_TRESHOLD": "1"})
    with pytest.raises(LaunchError, match="unknown backend"):
        run(env={"HPDL_BACKEND": "carrier-pigeon"})
    with pytest.raises(LaunchError, match="no command"):
        run(command=())


def test_existing_hpdl_variables_are_passed_on_and_overridden():
    argv, env = run(np=2, cache_capacity=8, env={"HPDL_STALL_WARNING": "30", "HPDL_CACHE_CAPACITY": "4"})
    assert argv[:7] == ["mpiexec", "-genv", "HPDL_STALL_WARNING", "30", "-genv", "HPDL_CACHE_CAPACITY", "8"]
    assert env["HPDL_CACHE_CAPACITY"] == "8"


def test_format_command_shows_changed_variables():
    line = format_command(["torchrun", "python", "a b.py"], {"A": "1", "B": "x y"}, {"A": "1"})
    assert line == "B='x y' torchrun python 'a b.py'"


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
    (["run", "--cycle-time-ms", "-3", "--", "python"], "HPDL_CYCLE_TIME"),
])
def test_cli_errors_are_one_line(args, fragment, capsys, clean_env):
    assert main(args) == 2
    _one_line_error(capsys, fragment)


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
        f"-x HPDL_TIMELINE={timeline} -x PATH --oversubscribe python train.py --lr 0.1"
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
        f"HPDL_PROFILE={profile} mpiexec -genv HPDL_PROFILE {profile} -n 2 python train.py")


# --- horovodrun's spellings ---------------------------------------------------------------

def _dry_run(monkeypatch, capsys, *args, version_text=MPICH_TEXT):
    """`hpdl run ARGS --dry-run` with every launcher on PATH and the MPI of ``version_text``."""
    monkeypatch.setattr(shutil, "which", lambda name, path=None: f"/usr/bin/{name}" if name != "srun" else None)
    monkeypatch.setattr(detect, "_version_text", lambda exe: version_text)
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
    assert out == "HPDL_START_TIMEOUT=30.0 mpiexec -genv HPDL_START_TIMEOUT 30.0 -n 2 python train.py"
    monkeypatch.setattr(os, "execvpe", lambda *a: (_ for _ in ()).throw(OSError(2, "stopped here")))
    assert main(["run", "-np", "2", "--verbose", "--", "python", "train.py"]) == 2
    out, err = capsys.readouterr()
    assert out == "" and err.splitlines()[0] == "mpiexec -n 2 python train.py", err


@pytest.mark.parametrize("version_text, expected", [
    (MPICH_TEXT, "GLOO_SOCKET_IFNAME=eth1 HYDRA_IFACE=eth1 HYDRA_LAUNCHER_EXTRA_ARGS='-p 2222 -i {key}' "
                 "NCCL_SOCKET_IFNAME=eth1 mpiexec -n 2 -hosts a:1,b:1 python train.py"),
    (INTEL_TEXT, "GLOO_SOCKET_IFNAME=eth1 I_MPI_HYDRA_BOOTSTRAP_EXEC_EXTRA_ARGS='-p 2222 -i {key}' "
                 "I_MPI_HYDRA_IFACE=eth1 NCCL_SOCKET_IFNAME=eth1 mpiexec -n 2 -ppn 1 -hosts a,b python train.py"),
    (OPENMPI4_TEXT, "GLOO_SOCKET_IFNAME=eth1 NCCL_SOCKET_IFNAME=eth1 OMPI_MCA_btl_tcp_if_include=eth1 "
                    "OMPI_MCA_oob_tcp_if_include=eth1 OMPI_MCA_plm_rsh_args='-p 2222 -i {key}' mpiexec "
                    "--allow-run-as-root --tag-output -x GLOO_SOCKET_IFNAME -x NCCL_SOCKET_IFNAME -np 2 "
                    "-H a:1,b:1 --bind-to none -x PATH python train.py"),
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
                      "autotune:\n  enabled: true\n")
    out, err = _dry_run(monkeypatch, capsys, "-np", "2", "--config-file", str(config), "--cycle-time-ms", "7")
    timeline = tmp_path / "tl.json"
    expected = {"HPDL_FUSION_THRESHOLD": str(32 * 1024 * 1024), "HPDL_CYCLE_TIME": "7",  # the command line wins
                "HPDL_CACHE_CAPACITY": "64", "HPDL_HIERARCHICAL_ALLREDUCE": "1", "HPDL_TIMELINE": str(timeline),
                "HPDL_TIMELINE_MARK_CYCLES": "1", "HPDL_STALL_TIMEOUT": "120",
                "HPDL_STALL_WARNING": "120"}  # stall check off: no warning before the timeout
    assert {k: v for k, v in (w.split("=", 1) for w in out.split(" mpiexec ")[0].split())} == expected
    assert err.splitlines() == [
        f"hpdl run: warning: {config}: params.hierarchical_allgather is not honoured by hpdl; ignoring it",
        f"hpdl run: warning: {config}: autotune is not honoured by hpdl; ignoring it"]


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
                   "--ssh-port", "--ssh-identity-file", "--network-interfaces", "--config-file"):
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
