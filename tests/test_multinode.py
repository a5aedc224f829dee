"""Jobs across emulated nodes, started by `hpdl run` through real launchers: MPI (Hydra over the
remote shell) and torchrun (one per node, static rendezvous on the first), with the topology
discovered inside each node and hierarchical allreduce checked against the reference."""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
import time

import pytest
import torch

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
    assert "background collectives: True" in out
    assert "OK hierarchical nodes: size=4" in out


# -- a node lost mid-training ------------------------------------------------------------------

def _photos(root):
    import numpy as np
    from PIL import Image

    root.mkdir()
    rng = np.random.default_rng(0)
    for i in range(3):
        small = rng.integers(0, 256, (8, 8, 3), dtype=np.uint8)
        Image.fromarray(small).resize((48, 40), Image.BICUBIC).save(root / f"p{i}.png")
    return root


def _train(data, out, *extra):
    return [sys.executable, "-m", "hpdl", "sr", "train", "--config", "demo", f"data={data}", f"val_data={data}",
            "n_resblocks=1", "n_feats=8", "patch_size=8", "batch_size=2", "repeat=20", "ckpt_every=3", "log_every=3",
            "val_every=0", "val_at_end=false", "progress=false", "threads=1", f"cache_dir={out.parent / 'cache'}",
            f"out_dir={out}", *extra]


def _updates(out):
    """The last update logged in ``out``'s train_log.csv (0 before the first line)."""
    lines = (out / "train_log.csv").read_text().splitlines() if (out / "train_log.csv").exists() else []
    return int(lines[-1].split(",")[0]) if len(lines) > 1 else 0


def _pids(namespace):
    done = subprocess.run(["ip", "netns", "pids", namespace], capture_output=True, text=True)
    return done.stdout.split()


@pytest.mark.parametrize("launch,breaking", [
    (["--launcher", "torchrun", "--backend", "gloo"], "kill"),
    ([], "link-down"),
], ids=["torchrun-node-killed", "mpiexec-link-down"])
def test_a_lost_node_ends_the_job_with_the_lost_ranks_named_and_training_resumes(cluster, tmp_path, launch, breaking):
    # Node 2's processes killed (torchrun, gloo) or its link cut (mpiexec): the rank on node 1
    # raises within the stall timeout naming rank 1, the job exits non-zero, nothing is left on
    # either node, and the training restarted with resume=auto continues from its checkpoint.
    data, out = _photos(tmp_path / "photos"), tmp_path / "run"
    env = cluster.env({k: v for k, v in os.environ.items() if not k.startswith("HPDL_") or k == "HPDL_VENV"})
    env.update(OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1", PYTHONPATH=str(ROOT), HPDL_STALL_WARNING="2",
               HPDL_STALL_TIMEOUT="6")
    run = [sys.executable, "-m", "hpdl", "run", "-np", "2", "-H", "n1:1,n2:1", *launch, "--"]
    job = subprocess.Popen(cluster.nodes[0].argv(run + _train(data, out, "total_updates=100000")), env=env,
                           cwd=str(ROOT), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    switch_port = ["ip", "-n", cluster.switch, "link", "set", "p2"]
    try:
        deadline = time.monotonic() + 120
        while _updates(out) < 6 and job.poll() is None and time.monotonic() < deadline:
            time.sleep(0.5)
        assert job.poll() is None and _updates(out) >= 6, "training did not get going"
        if breaking == "kill":
            subprocess.run(["kill", "-9", *_pids(cluster.nodes[1].netns)], check=False)
        else:
            subprocess.run(switch_port + ["down"], check=True)
        _, err = job.communicate(timeout=60)  # stall timeout + liveness check + abort grace, with room
    finally:
        if job.poll() is None:
            job.kill()
        subprocess.run(switch_port + ["up"], check=False)
    assert job.returncode != 0
    assert "(lost: rank 1 does not answer)" in err, err[-3000:]
    time.sleep(1)
    assert _pids(cluster.nodes[0].netns) == [] and _pids(cluster.nodes[1].netns) == [], "processes left on a node"

    # Restarted, the run continues from its last checkpoint.
    saved = int(torch.load(out / "last.pt", weights_only=True)["update"])
    again = on_first_node(cluster, *run, *_train(data, out, f"total_updates={saved + 3}", "resume=auto"))
    assert f"resumed from {out / 'last.pt'} at update {saved}" in again
    assert _updates(out) == saved + 3


def test_torchrun_on_several_hosts_ends_every_host_when_one_fails(cluster):
    # Rank 1's command fails; the torchrun of the other host (its worker sleeping on) is ended
    # too, and the job reports the failure instead of waiting.
    env = cluster.env({k: v for k, v in os.environ.items() if not k.startswith("HPDL_") or k == "HPDL_VENV"})
    argv = [sys.executable, "-m", "hpdl", "run", "-np", "2", "-H", "n1:1,n2:1", "--launcher", "torchrun", "--backend",
            "gloo", "--", "sh", "-c", 'if [ "$RANK" = 1 ]; then exit 3; fi; exec sleep 300']
    done = subprocess.run(cluster.nodes[0].argv(argv), env=env, capture_output=True, text=True, timeout=120)
    assert done.returncode != 0
    time.sleep(1)
    assert _pids(cluster.nodes[0].netns) == [] and _pids(cluster.nodes[1].netns) == []


# -- one image split over the ranks of two nodes ---------------------------------------------------

def test_spatial_upscale_across_nodes_writes_the_bytes_of_one_process(cluster, tmp_path):
    # Ranks 0-1 on n1, 2-3 on n2; 5 rows of tiles (the last partial) in bands of 2, 1, 1 and 1.
    import numpy as np
    from PIL import Image

    from hpdl.cli import main
    from hpdl.sr.checkpoint import make_checkpoint, save_checkpoint
    from hpdl.sr.models import build_model_from_config
    from hpdl.sr.registry import ModelConfig

    torch.manual_seed(0)
    save_checkpoint(tmp_path / "tiny.pt", make_checkpoint(build_model_from_config(ModelConfig("tiny", 2, 2, 8, 1.0))))
    small = np.random.default_rng(0).integers(0, 256, (14, 13, 3), dtype=np.uint8)
    Image.fromarray(small).resize((70, 75), Image.BICUBIC).save(tmp_path / "in.png")
    options = ["--ckpt", str(tmp_path / "tiny.pt"), "--tile", "16"]
    assert main(["sr", "upscale", str(tmp_path / "in.png"), str(tmp_path / "one.png"), *options]) == 0
    out = on_first_node(cluster, sys.executable, "-m", "hpdl", "run", "-np", "4", "-H", "n1:2,n2:2", "--",
                        sys.executable, "-m", "hpdl", "sr", "upscale", str(tmp_path / "in.png"),
                        str(tmp_path / "four.png"), *options, "--spatial")
    assert out.count("wrote ") == 1  # rank 0 reports
    assert (tmp_path / "four.png").read_bytes() == (tmp_path / "one.png").read_bytes()


def test_an_elastic_job_goes_on_when_a_nodes_namespace_is_killed(cluster, tmp_path):
    # Every process of node n2 killed at once, as a lost host: its two workers' ends blacklist
    # it, and the job finishes on n1's two workers.
    log = tmp_path / "log.jsonl"
    env = cluster.env({k: v for k, v in os.environ.items() if not k.startswith("HPDL_") or k == "HPDL_VENV"})
    env.update(OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1", PYTHONPATH=str(ROOT))
    command = [sys.executable, "-m", "hpdl", "run", "-np", "4", "--min-np", "2", "-H", "n1:2,n2:2", "--",
               sys.executable, str(SCRIPTS / "elastic_train.py"), "--log", str(log), "--batch-sleep", "0.2",
               "--epochs", "3"]
    proc = subprocess.Popen(cluster.nodes[0].argv(command), env=env, cwd=str(ROOT), stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)
    deadline = time.monotonic() + 150
    while time.monotonic() < deadline and proc.poll() is None:
        if log.exists() and log.read_text().count('"size": 4') >= 8:
            break
        time.sleep(0.2)
    pids = subprocess.run(["ip", "netns", "pids", cluster.nodes[1].netns], capture_output=True, text=True).stdout.split()
    assert pids, "node n2 runs no worker"
    subprocess.run(["kill", "-9", *pids], check=False)
    out, err = proc.communicate(timeout=150)
    assert proc.returncode == 0, err[-4000:]
    assert "(host n2, rank" in err and "was killed by signal 9 (SIGKILL)" in err, err[-4000:]
    assert "generation 1: 2 worker(s) on n1" in err
    rows = [json.loads(line) for line in log.read_text().splitlines()]
    last = rows[-1]
    assert last["size"] == 2 and {row["worker"] for row in rows if row["size"] == 2} == {0, 1}
    assert "done:" in out and "world of 2" in out
