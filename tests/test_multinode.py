"""Jobs across emulated nodes, started by `hpdl run` through real launchers: MPI (Hydra over the
remote shell) and torchrun (one per node, static rendezvous on the first), with the topology
discovered inside each node and hierarchical allreduce checked against the reference."""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys

import pytest

from hpdl.launch.emulate import ClusterSpec, EmulatedCluster, leftovers
from ranks import ROOT, SCRIPTS

pytestmark = [
    pytest.mark.multirank,
    pytest.mark.skipif(os.geteuid() != 0 or shutil.which("ip") is None or shutil.which("tc") is None,
                       reason="emulated nodes need root and iproute2 (ip, tc)"),
]

# One write per record: mpiexec forwards the ranks' output in chunks that may interleave.
TOPOLOGY = ("import os, socket, hpdl.torch as hvd; hvd.init(); "
            "os.write(1, ('RANK %d %d %d %d %d %d %s\\n' % (hvd.rank(), hvd.size(), hvd.local_rank(), hvd.local_size(), "
            "hvd.cross_rank(), hvd.cross_size(), socket.gethostname())).encode()); hvd.shutdown()")


@pytest.fixture(scope="module")
def cluster():
    with EmulatedCluster(ClusterSpec(nodes=2, slots=2, rate="1gbit")) as c:
        yield c
    assert leftovers(os.getpid()) == []


def on_first_node(cluster, *command, timeout=240):
    env = cluster.env({k: v for k, v in os.environ.items() if not k.startswith("HPDL_") or k == "HPDL_VENV"})
    env.update(OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1", PYTHONPATH=str(ROOT))
    done = subprocess.run(cluster.nodes[0].argv(list(command)), env=env, cwd=str(ROOT), capture_output=True,
                          text=True, timeout=timeout)
    assert done.returncode == 0, f"{command} exited {done.returncode}\n{done.stdout[-3000:]}\n{done.stderr[-5000:]}"
    return done.stdout


def ranks(out):
    rows = re.findall(r"RANK (\d+) (\d+) (\d+) (\d+) (\d+) (\d+) (\S+)\n", out)
    return sorted(tuple(int(x) for x in row[:6]) + (row[6],) for row in rows)


def test_emulate_runs_a_two_rank_job_with_one_rank_per_node():
    # The documented command, end to end: a cluster of its own, hpdl run inside it.
    done = subprocess.run([sys.executable, "-m", "hpdl", "emulate", "--nodes", "2", "--rate", "1gbit", "--",
                           sys.executable, "-m", "hpdl", "run", "-np", "2", "--", sys.executable, "-c", TOPOLOGY],
                          env=dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=str(ROOT)), cwd=str(ROOT),
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    # rank, size, local rank, local size, cross rank, cross size, host
    assert ranks(done.stdout) == [(0, 2, 0, 1, 0, 2, "n1"), (1, 2, 0, 1, 1, 2, "n2")]


@pytest.mark.parametrize("launch", [[], ["--launcher", "torchrun", "--backend", "gloo"]], ids=["mpiexec", "torchrun"])
def test_four_ranks_on_two_nodes_discover_their_places(cluster, launch):
    out = on_first_node(cluster, sys.executable, "-m", "hpdl", "run", "-np", "4", "-H", "n1:2,n2:2", *launch, "--",
                        sys.executable, "-c", TOPOLOGY)
    assert ranks(out) == [(0, 4, 0, 2, 0, 2, "n1"), (1, 4, 1, 2, 0, 2, "n1"),
                          (2, 4, 0, 2, 1, 2, "n2"), (3, 4, 1, 2, 1, 2, "n2")]


@pytest.mark.parametrize("launch", [[], ["--launcher", "torchrun", "--backend", "gloo"]], ids=["mpiexec", "torchrun"])
def test_hierarchical_allreduce_across_nodes_equals_the_reference(cluster, launch):
    # Every dtype and op, alone and fused, 2 nodes x 2 ranks (hosts from the hostfile).
    out = on_first_node(cluster, sys.executable, "-m", "hpdl", "run", "-np", "4", "--hierarchical-allreduce", *launch,
                        "--", sys.executable, str(SCRIPTS / "hierarchical_nodes.py"))
    assert "topology: ['n1', 'n1', 'n2', 'n2']" in out
    assert "OK hierarchical nodes: size=4" in out
