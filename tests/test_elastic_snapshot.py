"""hvd.elastic under torchrun's own elastic agent: ``commit()`` also keeps the state on disk
(hpdl/torch/elastic/snapshot.py), and a job whose workers the agent restarted goes on from its
last commit. The jobs run tests/multirank/elastic_snapshot.py."""

from __future__ import annotations

import os
import re
import socket
import subprocess
import sys
import threading
import uuid

import pytest
import torch

from hpdl.torch import elastic
from hpdl.torch.elastic import snapshot
from ranks import ROOT, SCRIPTS, kill_tree, run_plain_ranks


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def _torchrun(tmp_path, run_id, script_args, timeout=300):
    """Run elastic_snapshot.py on 2 workers under torchrun's elastic agent (c10d rendezvous,
    1 to 2 nodes, 2 restarts), snapshots under tmp_path; return the CompletedProcess."""
    env = {k: v for k, v in os.environ.items() if not k.startswith(("HPDL_", "TORCHELASTIC_", "PMI_", "OMPI_"))}
    env.update(OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1", PYTHONPATH=str(ROOT), HPDL_ELASTIC_SNAPSHOT_DIR=str(tmp_path))
    for key in ("HPDL_VENV", "HPDL_TORCH_SPEC"):
        if key in os.environ:
            env[key] = os.environ[key]
    argv = [sys.executable, "-m", "torch.distributed.run", "--nnodes=1:2", "--nproc-per-node=2",
            "--rdzv-backend=c10d", f"--rdzv-endpoint=127.0.0.1:{_free_port()}", f"--rdzv-id={run_id}",
            "--max-restarts=2", "--monitor-interval=0.1", "--rdzv-conf=last_call_timeout=1",
            str(SCRIPTS / "elastic_snapshot.py"), *script_args]
    proc = subprocess.Popen(argv, env=env, cwd=str(tmp_path), stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True, start_new_session=True)
    try:
        out, err = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        kill_tree(proc.pid)
        out, err = proc.communicate()
        pytest.fail(f"the torchrun job did not end within {timeout} s\n{out[-3000:]}\n{err[-3000:]}")
    done = subprocess.CompletedProcess(argv, proc.returncode, out, err)
    assert done.returncode == 0, f"{out[-3000:]}\n{err[-6000:]}"
    return done


def _starts(out):
    """(restart, rank, step, epoch) of each start of the training function."""
    return sorted((int(m["restart"]), int(m["rank"]), int(m["step"]), int(m["epoch"]))
                  for m in re.finditer(r"start rank=(?P<rank>\d+) restart=(?P<restart>\d+) step=(?P<step>\d+) "
                                       r"epoch=(?P<epoch>\d+)", out))


def _final(out):
    found = re.findall(r"final (step=\d+ params=\[\[.*?\]\])", out)
    assert len(found) == 1, out
    return found[0]


@pytest.mark.multirank
def test_workers_restarted_by_torchrun_go_on_from_the_last_commit(tmp_path):
    marker = tmp_path / "killed"
    reference = _torchrun(tmp_path, f"ref-{uuid.uuid4().hex[:8]}", ["train", str(marker)])
    assert _starts(reference.stdout) == [(0, 0, 0, 0), (0, 1, 0, 0)], reference.stdout
    assert "snapshot kept" in reference.stdout, reference.stdout
    assert _final(reference.stdout).startswith("step=8 "), reference.stdout

    run_id = f"kill-{uuid.uuid4().hex[:8]}"
    failed = _torchrun(tmp_path, run_id, ["train", str(marker), "--kill-at", "7"])
    assert marker.exists()
    # Rank 1 died after step 7; step 6 was the last commit: both restarted workers start there
    # (epoch 1, its first half done), not from step 0.
    assert _starts(failed.stdout) == [(0, 0, 0, 0), (0, 1, 0, 0), (1, 0, 6, 1), (1, 1, 6, 1)], failed.stdout
    # Steps 7 and 8 done again from the committed weights, momentum and sampler position: the
    # weights of the run that never failed, to the last bit (float64 reprs).
    assert _final(failed.stdout) == _final(reference.stdout)
    # The function returned: the snapshots are gone, with the jobs' directories.
    assert sorted(p.name for p in tmp_path.iterdir()) == ["killed"], list(tmp_path.iterdir())


@pytest.mark.multirank
def test_the_rank_holding_the_newest_commit_sends_it_to_every_rank(tmp_path):
    results = run_plain_ranks("elastic_snapshot.py", 2, args=["holder", str(tmp_path)], timeout=240)
    for rank, result in enumerate(results):
        assert result.returncode == 0 and f"OK elastic snapshot holder: rank={rank}" in result.stdout, \
            result.stdout + result.stderr[-5000:]


# One process, three jobs of one rank: no torchrun, torchrun's run id with HPDL_ELASTIC_SNAPSHOT=0,
# and with it on. Each commits twice inside run() and says what the snapshot directory holds.
_ONE_RANK = """\
import os, sys
import torch
import hpdl.torch as hvd

base = sys.argv[1]
for case, env in (("plain", {}), ("off", {"TORCHELASTIC_RUN_ID": "one", "HPDL_ELASTIC_SNAPSHOT": "0"}),
                  ("on", {"TORCHELASTIC_RUN_ID": "one"})):
    for key in ("TORCHELASTIC_RUN_ID", "HPDL_ELASTIC_SNAPSHOT"):
        os.environ.pop(key, None)
    os.environ.update(env)
    hvd.init()
    state = hvd.elastic.TorchState(torch.nn.Linear(2, 1), batch=0)

    @hvd.elastic.run
    def train(state):
        for state.batch in range(1, 3):
            state.commit()
            print(case, "during", sorted(os.path.relpath(os.path.join(d, f), base)
                                         for d, _, files in os.walk(base) for f in files), flush=True)

    train(state)
    print(case, "after", sorted(os.listdir(base)), flush=True)
    hvd.shutdown()
"""


def test_only_torchrun_jobs_write_snapshots_and_a_finished_one_removes_them(tmp_path):
    env = {k: v for k, v in os.environ.items() if not k.startswith(("HPDL_", "TORCHELASTIC_", "PMI_", "OMPI_"))}
    env.update(PYTHONPATH=str(ROOT), HPDL_ELASTIC_SNAPSHOT_DIR=str(tmp_path), OMP_NUM_THREADS="1")
    for key in [k for k in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT") if k in env]:
        del env[key]
    done = subprocess.run([sys.executable, "-c", _ONE_RANK, str(tmp_path)], env=env, capture_output=True, text=True,
                          timeout=180)
    assert done.returncode == 0, done.stdout + done.stderr
    host = re.sub(r"[^A-Za-z0-9._-]", "_", socket.gethostname())
    kept = f"hpdl-elastic-one/{host}.__main__.train.pt"
    assert done.stdout.splitlines() == [
        "plain during []", "plain during []", "plain after []",
        "off during []", "off during []", "off after []",
        f"on during ['{kept}']", f"on during ['{kept}']", "on after []",
    ], done.stdout + done.stderr


def _files(tmp_path, agent="1:1", run_id="job", function="m.train", writer=True):
    return snapshot.JobSnapshots(snapshot.job_directory(run_id, str(tmp_path)), run_id, agent, writer=writer,
                                 function=function, host="h")


def test_a_snapshot_is_read_back_by_its_own_job_alone(tmp_path, capsys):
    payload = {"objects": {"epoch": 3}, "handlers": {"model": {"w": torch.arange(3.0)}}}
    _files(tmp_path).write(7, payload)
    directory = tmp_path / "hpdl-elastic-job"
    assert sorted(p.name for p in directory.iterdir()) == ["h.m.train.pt"]
    assert directory.stat().st_mode & 0o777 == 0o700  # pickles: readable and writable by this user alone
    found = _files(tmp_path).read()
    assert found.commits == 7 and found.payload["objects"] == {"epoch": 3}
    assert torch.equal(found.payload["handlers"]["model"]["w"], torch.arange(3.0))
    assert snapshot.JobSnapshots.parse(found.data).commits == 7
    # Another torchrun agent's (an earlier job with the same --rdzv-id), another function's:
    # not this job's, said once by the writer.
    assert _files(tmp_path, agent="2:2").read() is None
    assert "written under another torchrun agent" in capsys.readouterr().err
    assert _files(tmp_path, function="m.other").read() is None
    assert _files(tmp_path, agent=None).read().commits == 7  # no /proc: any agent's
    # A non-writer (local rank > 0) writes and removes nothing.
    _files(tmp_path, writer=False).write(8, payload)
    _files(tmp_path, writer=False).remove()
    assert _files(tmp_path).read().commits == 7
    _files(tmp_path).remove()
    assert list(tmp_path.iterdir()) == []


def test_a_directory_others_can_write_is_not_read(tmp_path, capsys):
    _files(tmp_path).write(1, {"objects": {}})
    (tmp_path / "hpdl-elastic-job").chmod(0o777)
    assert _files(tmp_path).read() is None
    assert "only it can write" in capsys.readouterr().err
    with pytest.raises(PermissionError):
        _files(tmp_path).write(2, {"objects": {}})


def test_the_torchrun_agent_is_the_first_ancestor_started_without_its_run_id():
    if not os.path.exists(f"/proc/{os.getpid()}/environ"):
        pytest.skip("no /proc")
    # This process plays the agent: its child, started with the run id, is a wrapper (as hpdl
    # run's rank_watch.py is) of the worker, which finds this process above both.
    show = "from hpdl.torch.elastic import snapshot; print(snapshot.agent_identity())"
    wrapper = f"import subprocess, sys; subprocess.run([sys.executable, '-c', {show!r}], check=True)"
    for argv in ([sys.executable, "-c", show], [sys.executable, "-c", wrapper]):
        worker = subprocess.run(argv, env=dict(os.environ, TORCHELASTIC_RUN_ID="x", PYTHONPATH=str(ROOT)),
                                capture_output=True, text=True, timeout=120)
        assert worker.stdout.strip() == f"{os.getpid()}:{_start_time(os.getpid())}", worker.stdout + worker.stderr


def _start_time(pid):
    with open(f"/proc/{pid}/stat") as f:
        return f.read().rsplit(")", 1)[1].split()[19]


def test_a_second_restore_brings_back_the_committed_momentum():
    # An optimizer's load_state_dict keeps the tensors it is given: restore must give it a copy,
    # or the steps after it change the committed momentum in place.
    model = torch.nn.Linear(2, 1).double()
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)

    def step():
        opt.zero_grad()
        model(torch.ones(1, 2, dtype=torch.float64)).sum().backward()
        opt.step()

    step()
    state = elastic.TorchState(model, opt)
    state.commit()
    committed = [s["momentum_buffer"].clone() for s in opt.state.values()]
    for _ in range(2):
        step()
        state.restore()
        assert all(torch.equal(s["momentum_buffer"], c) for s, c in zip(opt.state.values(), committed))


def test_restarted_workers_meet_under_keys_of_their_own_in_a_store_that_kept_the_last_worlds():
    # torchrun's agent keeps its store across restarts (torch >= 2.5): the keys a world meets
    # under must be its own, whatever the earlier worlds left there.
    from torch.distributed import TCPStore

    from hpdl.comm import torch_dist

    server = TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
    clients = [TCPStore("127.0.0.1", server.port, is_master=False) for _ in range(3)]
    seen = []
    for world in range(2):  # the second meets where the first left its keys
        prefixes = [None] * 3

        def join(rank, prefixes=prefixes):
            prefixes[rank] = torch_dist._world_prefix(clients[rank], rank, 3, 30.0)

        threads = [threading.Thread(target=join, args=(rank,)) for rank in (2, 1, 0)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(60)
        assert len(set(prefixes)) == 1 and prefixes[0] is not None, prefixes
        seen.append(prefixes[0])
    assert seen[0] != seen[1]
