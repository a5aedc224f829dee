"""Tests of `hpdl check`: the report's content, and that missing pieces never crash it."""

import os
import subprocess
import sys
from pathlib import Path

import pytest

from hpdl import __version__
from hpdl.cli import main
from hpdl.launch import LauncherInfo, check_report
from hpdl.launch import detect

ROOT = Path(__file__).resolve().parents[1]
FAKE = LauncherInfo(
    mpiexec="mpirun", mpiexec_path="/opt/ompi/bin/mpirun", mpi_flavour=detect.OPENMPI,
    mpi_version_text="mpirun (Open MPI) 5.0.3\n", torchrun=None, srun="srun", srun_path="/usr/bin/srun",
)


def test_report_sections():
    text = "\n".join(check_report(env={}, info=FAKE))
    assert f"hpdl v{__version__}" in text
    assert "[X] PyTorch " in text
    assert "Gloo" in text and "NCCL" in text and "MPI" in text
    assert "[X] mpirun (Open MPI 5.0.3; /opt/ompi/bin/mpirun)" in text
    assert "[X] srun (/usr/bin/srun)" in text and "[ ] torchrun" in text
    assert "launcher: single" in text and "rank 0 of 1" in text


def test_report_shows_topology_of_a_launched_rank():
    env = {"PMI_RANK": "1", "PMI_SIZE": "4", "MPI_LOCALRANKID": "1", "MPI_LOCALNRANKS": "2"}
    text = "\n".join(check_report(env=env, info=FAKE))
    assert "launcher: mpi-pmi" in text and "rank 1 of 4 (local 1 of 2)" in text


def test_report_shows_the_settings_given():
    text = "\n".join(check_report(env={"HPDL_CYCLE_TIME": "5"}, info=FAKE))
    assert "Settings:\n    [X] HPDL_* settings (HPDL_CYCLE_TIME)" in text
    text = "\n".join(check_report(env={"HPDL_CYCLE_TIME": "nan"}, info=FAKE))
    assert "    [ ] HPDL_* settings (error: HPDL_CYCLE_TIME='nan': expected a finite number)" in text


def test_report_survives_a_failing_probe():
    text = "\n".join(check_report(env={"OMPI_COMM_WORLD_RANK": "x"}, info=FAKE))
    assert "[ ] topology (error: ValueError" in text


def test_report_without_mpi4py_in_process(monkeypatch):
    import hpdl.comm.mpi as mpi

    monkeypatch.setattr(mpi, "MPI", None)
    text = "\n".join(check_report(env={}, info=FAKE))
    assert "[ ] MPI (mpi4py is not installed" in text


def test_check_without_mpi4py_importable():
    # A fresh interpreter where `import mpi4py` fails, as on an install without the mpi extra.
    code = "import sys; sys.modules['mpi4py'] = None; from hpdl.cli import main; sys.exit(main(['check']))"
    done = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    assert "[ ] MPI" in done.stdout and "Traceback" not in done.stderr


def test_cli_check_exits_zero(capsys):
    assert main(["check"]) == 0
    out = capsys.readouterr().out
    assert "Available backends:" in out and "Available launchers:" in out


def test_report_shows_srun_mpi_plugins_and_site_default():
    info = LauncherInfo(srun="srun", srun_path="/usr/bin/srun", srun_mpi_plugins=frozenset({"pmi2", "none"}),
                        srun_mpi_default="none")
    text = "\n".join(check_report(env={}, info=info))
    assert "[X] srun (/usr/bin/srun; MPI plugins none, pmi2, default none)" in text


def test_report_lists_launchers_beside_the_interpreter_when_path_lacks_them():
    # As `.venv/bin/hpdl check` from cron or an IDE: the environment's bin directory is not on PATH.
    beside = os.path.join(os.path.dirname(os.path.abspath(sys.executable)), "mpiexec")
    if not os.access(beside, os.X_OK):
        pytest.skip("no mpiexec beside this interpreter (pip install 'hpdl[mpi]')")
    text = "\n".join(check_report(env={"PATH": "/nowhere"}))
    assert f"; {beside})" in text


def test_java_versions_are_read_as_java_prints_them():
    assert detect.java_version_from_text('openjdk version "17.0.15" 2025-04-15\nOpenJDK Runtime ...') == "17.0.15"
    assert detect.java_version_from_text('java version "1.8.0_392"\n') == "1.8.0_392"
    assert detect.java_version_from_text("bash: java: command not found") == ""
    assert (detect.java_major("17.0.15"), detect.java_major("1.8.0_392"), detect.java_major("21")) == (17, 8, 21)


def _fake_java(tmp_path, version_line):
    home = tmp_path / "jdk"
    (home / "bin").mkdir(parents=True)
    java = home / "bin" / "java"
    java.write_text(f"#!/bin/sh\necho '{version_line}' >&2\n")
    java.chmod(0o755)
    return home, java


def test_report_says_whether_pyspark_and_its_java_are_usable(tmp_path):
    pytest.importorskip("pyspark", reason="pyspark is not installed (pip install 'hpdl[spark]')")
    from hpdl.launch.detect import java_needed, pyspark_version

    version = pyspark_version()
    needed = java_needed(version)
    home, java = _fake_java(tmp_path, f'openjdk version "{needed}.0.2" 2024-01-16')
    text = "\n".join(check_report(env={"JAVA_HOME": str(home)}, info=FAKE))
    assert f"Spark (hpdl.spark.run):\n    [X] pyspark {version}\n    [X] Java {needed}.0.2 ({java})" in text
    old_home, old_java = _fake_java(tmp_path / "old", 'java version "1.7.0_80"')
    text = "\n".join(check_report(env={"JAVA_HOME": str(old_home)}, info=FAKE))
    assert f"    [ ] Java 1.7.0_80 ({old_java}; pyspark {version} needs Java {needed} or later)" in text
    text = "\n".join(check_report(env={"JAVA_HOME": str(tmp_path / "none")}, info=FAKE))
    assert f"    [ ] Java (no $JAVA_HOME/bin/java; Spark {version} needs Java {needed} or later)" in text


def test_report_without_pyspark_says_how_to_install_it():
    code = ("import sys; sys.modules['pyspark'] = None; import importlib.util as u; f = u.find_spec; "
            "u.find_spec = lambda n, *a: None if n == 'pyspark' else f(n, *a); "
            "from hpdl.cli import main; sys.exit(main(['check']))")
    done = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    assert "    [ ] pyspark (not installed: pip install 'hpdl[spark]')" in done.stdout


def test_mpi4py_without_an_mpi_library_leaves_hpdl_usable():
    # mpi4py 4's wheels load the MPI library when MPI is imported and raise RuntimeError where
    # none is installed (machines that train over nccl alone): hpdl imports, runs a one-rank job
    # over gloo, and `hpdl check` names the reason.
    pytest.importorskip("mpi4py._mpiabi", reason="an mpi4py that loads its MPI library through _mpiabi (4.x)")
    code = ("import sys, mpi4py._mpiabi as abi; abi.LIBMPI_PATH = ['/nonexistent']; "
            "abi._dlopen_rpath = lambda: ['/nonexistent']\n"
            "import torch, hpdl.torch as hvd\n"
            "hvd.init(); assert hvd.allreduce(torch.ones(2), name='x').tolist() == [1.0, 1.0]; "
            "print('backend', hvd.mpi_enabled(), hvd.gloo_enabled()); hvd.shutdown()\n"
            "from hpdl.cli import main; sys.exit(main(['check']))")
    done = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=120,
                          env={k: v for k, v in os.environ.items() if not k.startswith("HPDL_")})
    assert done.returncode == 0, done.stderr
    assert "backend False True" in done.stdout
    assert "[ ] MPI (mpi4py is installed but found no MPI library (cannot load MPI library): pip install mpich)" \
        in done.stdout, done.stdout
