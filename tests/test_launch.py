"""Tests of `hpdl run`'s pure parts: host parsing, MPI flavour detection and the builders.

Launchers are described by a fake LauncherInfo (tests/launch_texts.py), so Open MPI, Intel
MPI, MVAPICH2 and Slurm are covered without being installed. The command line and the end-to-end
runs are in test_launch_cli.py.
"""

import dataclasses
import shlex
import shutil

import pytest

from hpdl.launch import (
    LaunchError,
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
from launch_texts import (
    ALL_PLUGINS, INTEL2019_TEXT, INTEL_TEXT, MPICH_TEXT, MVAPICH2_TEXT, OPENMPI4_TEXT, OPENMPI5_TEXT, SRUN_LIST_22,
    SRUN_LIST_OLD, info, run,
)

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
    assert argv == ["mpiexec", "-np", "2", "-H", "localhost:2", "--bind-to", "none", "python", "train.py"]
    argv, _ = run(hosts=parse_hostfile("n1 slots=2\nn2\n", "hf"), launchers=launchers)
    assert argv[:6] == ["mpiexec", "-np", "3", "--hostfile", "hf", "--bind-to"]
    argv, _ = run(hosts=parse_hostfile("n1:2\n", "hf"), launchers=launchers)
    assert argv[3:5] == ["-H", "n1:2"]


def test_openmpi_gets_a_slot_per_rank_on_this_host_as_horovodrun_gives():
    # Without hosts Open MPI gives this host one slot per core: -np 3 on two cores would fail.
    launchers = info(flavour=detect.OPENMPI)
    argv, _ = run(np=3, launchers=launchers)
    assert argv[:5] == ["mpiexec", "-np", "3", "-H", "localhost:3"]
    for env in ({"SLURM_JOB_ID": "7"}, {"PBS_JOBID": "7.pbs"}, {"LSB_JOBID": "7"}):  # the allocation's hosts
        argv, _ = run(np=3, launcher="mpiexec", launchers=launchers, env=env)
        assert "-H" not in argv, env
    for mpi_args in (("--host", "a:3"), ("--hostfile=hf",), ("-H", "a:3")):  # the user's hosts
        argv, _ = run(np=3, launchers=launchers, mpi_args=mpi_args)
        assert argv.count("-H") == mpi_args.count("-H"), mpi_args
    argv, _ = run(np=3, launchers=launchers, binding_args=("--bind-to", "core"))
    assert argv[5:7] == ["--bind-to", "core"] and argv.count("--bind-to") == 1


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

KILL = "--kill-on-bad-exit=1"  # srun ends the other tasks when one fails, as mpiexec does


def test_srun_inside_slurm_allocation():
    launchers = info(srun="srun")
    env = {"SLURM_JOB_ID": "42", "SLURM_NTASKS": "8"}
    argv, _ = run(env=env, launchers=launchers)
    assert argv == ["srun", "--ntasks", "8", KILL, "python", "train.py"]
    argv, out = run(np=4, hosts=parse_hosts("c1:2,c2:2"), mpi_args=("--mpi=pmix",), env=env, launchers=launchers)
    assert argv == ["srun", "--ntasks", "4", "--nodelist", "c1,c2", KILL, "--mpi=pmix", "python", "train.py"]
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
    assert argv == ["srun", "--ntasks", "2", KILL] + ([f"--mpi={plugin}"] if plugin else []) + ["python", "train.py"]


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
    assert argv == ["srun", "--ntasks", "2", KILL] + expected + ["python", "train.py"]


@pytest.mark.parametrize("mpi_args, env", [
    (("-K0",), {}), (("--kill-on-bad-exit=0",), {}), (("--kill-on-bad-exit",), {}), ((), {"SLURM_KILL_BAD_EXIT": "0"}),
])
def test_srun_kill_on_bad_exit_chosen_by_user_is_left_alone(mpi_args, env):
    argv, _ = run(np=2, mpi_args=mpi_args, env={"SLURM_JOB_ID": "42", **env}, launchers=info(srun="srun"))
    assert argv == ["srun", "--ntasks", "2", *mpi_args, "python", "train.py"]


def test_slurm_with_gloo_uses_torchrun_on_one_host():
    argv, env = run(np=2, backend="gloo", env={"SLURM_JOB_ID": "42"}, launchers=info(srun="srun"))
    assert argv[0] == "torchrun" and env["HPDL_BACKEND"] == "gloo"


@pytest.mark.parametrize("launcher, backend", [("auto", "gloo"), ("mpiexec", None), ("torchrun", None)])
def test_every_launcher_in_an_allocation_defaults_to_its_task_count(launcher, backend):
    env = {"SLURM_JOB_ID": "42", "SLURM_NTASKS": "2", "SLURM_JOB_NUM_NODES": "1"}
    argv, _ = run(launcher=launcher, backend=backend, env=env, launchers=info(srun="srun"))
    assert argv[argv.index("-n" if argv[0] == "mpiexec" else "--nproc-per-node") + 1] == "2", argv


def test_torchrun_refuses_to_put_a_multinode_allocation_on_this_host():
    env = {"SLURM_JOB_ID": "42", "SLURM_NTASKS": "4", "SLURM_JOB_NUM_NODES": "2"}
    with pytest.raises(LaunchError, match="allocation spans 2 nodes; give -np"):
        run(backend="gloo", env=env, launchers=info(srun="srun"))
    assert run(np=2, backend="gloo", env=env, launchers=info(srun="srun"))[0][0] == "torchrun"


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


def test_ranks_per_gpu_reaches_every_rank_and_keeps_nccl_out():
    argv, env = run(np=4, ranks_per_gpu=2, launchers=info(mpiexec=None))
    assert argv[:3] == ["torchrun", "--nproc-per-node", "4"] and env["HPDL_RANKS_PER_GPU"] == "2"
    argv, env = run(np=4, ranks_per_gpu=4)
    assert argv[:5] == ["mpiexec", "-genv", "HPDL_RANKS_PER_GPU", "4", "-n"]
    for given in ({"backend": "nccl"}, {"env": {"HPDL_BACKEND": "nccl"}}):
        with pytest.raises(LaunchError, match="NCCL refuses two ranks on one GPU"):
            run(np=2, ranks_per_gpu=2, **given)
    assert run(np=2, ranks_per_gpu=1, backend="nccl")[1]["HPDL_RANKS_PER_GPU"] == "1"


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
    # An option is named as given, in its unit; a variable already set, as the variable.
    with pytest.raises(LaunchError, match="--cycle-time-ms must be >= 0 ms, got -1$"):
        run(cycle_time_ms=-1.0)
    with pytest.raises(LaunchError, match="--fusion-threshold-mb must be >= 0 MB, got -1$"):
        run(fusion_threshold_mb=-1.0)
    with pytest.raises(LaunchError, match="HPDL_CYCLE_TIME must be >= 0 ms, got -1$"):
        run(env={"HPDL_CYCLE_TIME": "-1"})
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
