"""Elastic jobs (`hpdl run --min-np ...`, hpdl/launch/elastic/): real workers on this machine,
whose names of it (localhost, 127.0.0.1, 127.0.0.2) are hosts of their own, as Horovod's tests
treat them. The training script is tests/multirank/elastic_train.py (float64, deterministic
data): it logs one line per batch and rank, so each test follows the worlds the job went
through and checks the parameters agree on every rank after every reset."""

from __future__ import annotations

import json
import os
import stat
import subprocess
import sys

import pytest
import torch

from hpdl.cli import main
from ranks import ROOT, kill_tree

SCRIPT = ROOT / "tests" / "multirank" / "elastic_train.py"
pytestmark = pytest.mark.multirank


def _elastic(tmp_path, options, script_args=(), timeout=150, name="job"):
    """Run ``hpdl run OPTIONS -- python elastic_train.py``; return (the process, its log rows, the final state)."""
    log, out = tmp_path / f"{name}.jsonl", tmp_path / f"{name}.pt"
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=str(ROOT))
    for key in [k for k in env if k.startswith("HPDL_") and k not in ("HPDL_VENV", "HPDL_TORCH_SPEC")]:
        del env[key]
    argv = [sys.executable, "-m", "hpdl", "run", *options, "--", sys.executable, str(SCRIPT), "--log", str(log),
            "--out", str(out), *script_args]
    proc = subprocess.Popen(argv, env=env, cwd=str(tmp_path), stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True, start_new_session=True)
    try:
        stdout, stderr = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        kill_tree(proc.pid)
        stdout, stderr = proc.communicate()
        pytest.fail(f"the elastic job did not end within {timeout} s\n{stdout[-3000:]}\n{stderr[-3000:]}")
    rows = [json.loads(line) for line in log.read_text().splitlines()] if log.exists() else []
    final = torch.load(out) if out.exists() else None
    return subprocess.CompletedProcess(argv, proc.returncode, stdout, stderr), rows, final


def _assert_every_rank_agrees(rows):
    """Every batch's ranks logged the same parameters, and as many ranks as the world's size."""
    batches = {}
    for row in rows:
        batches.setdefault((row["size"], row["batch"], row["epoch"]), []).append(row)
    for row in rows:  # Horovod's launcher variables follow the world, and agree with hvd's
        rank, size, local_rank, local_size, cross_rank, cross_size, _host = row["layout"]
        assert (rank, size) == (str(row["rank"]), str(row["size"])), row
        assert [int(local_rank), int(local_size), int(cross_rank), int(cross_size)] == row["local"], row
    for (size, batch, _epoch), seen in batches.items():
        sums = {row["params"] for row in seen}
        assert len(sums) == 1, f"batch {batch}: ranks differ: {seen}"
        ranks = sorted(row["rank"] for row in seen)
        assert ranks == list(range(size)) or len(ranks) % size == 0, seen


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    """The job on 2 workers with no failure: its final parameters."""
    tmp = tmp_path_factory.mktemp("reference")
    done, rows, final = _elastic(tmp, ["-np", "2", "--min-np", "2", "-H", "localhost:1,127.0.0.1:1"],
                                 ["--commit-every", "3"])
    assert done.returncode == 0, done.stderr
    assert {row["size"] for row in rows} == {2}
    return final


@pytest.mark.parametrize("how, at", [("raise", 5), ("kill", 6)])
def test_a_failed_worker_is_replaced_and_training_ends_with_the_weights_of_a_run_without_failure(
        tmp_path, reference, how, at):
    # Worker 1 fails at batch 5, two batches after the last commit (raise), or at batch 6, just
    # after a commit (kill): the survivors restore that commit, the failed host is blacklisted,
    # a new worker starts on the free host and gets the state by broadcast, and the world of 2
    # does the batches since the commit again: the same arithmetic.
    done, rows, final = _elastic(tmp_path, ["-np", "2", "--min-np", "2", "--max-np", "2",
                                            "-H", "localhost:1,127.0.0.1:1,127.0.0.2:1"],
                                 ["--commit-every", "3", "--fail", f"1:{at}:{how}"])
    assert done.returncode == 0, done.stderr
    ending = "ended with exit code 1" if how == "raise" else "was killed by signal 9 (SIGKILL)"
    assert f"hpdl run: worker 1 (host 127.0.0.1, rank 1) {ending}; going on without it" in done.stderr
    assert "generation 1: 2 worker(s) on 127.0.0.2, localhost" in done.stderr, done.stderr
    _assert_every_rank_agrees(rows)
    workers = [row["worker"] for row in rows]
    assert 2 in workers and workers.index(2) > max(i for i, w in enumerate(workers) if w == 1)
    redone = [row["batch"] for row in rows if row["worker"] == 0]
    if at == 5:  # back to the commit at 3: batches 4 and 5 done twice
        assert redone.count(4) == 2 and redone.count(5) == 2 and redone.count(3) == 1
    else:  # the commit at 6 is where it failed: nothing done twice
        assert redone == list(range(1, len(redone) + 1))
    assert final["size"] == 2 and torch.equal(final["params"], reference["params"])


def test_hosts_added_then_removed_by_discovery_grow_and_shrink_the_world_without_rollback(tmp_path):
    # 1 host of 1 slot, then a second host of 2 slots joins (its workers slow to start), then
    # goes: the world is 1, 3, then 1 again; the removal rolls nothing back.
    script = tmp_path / "discover.sh"
    progress = tmp_path / "progress"
    script.write_text("#!/bin/sh\n"
                      f"p=$(cat {progress} 2>/dev/null || echo 0)\n"
                      "echo localhost:1\n"
                      'if [ "$p" -ge 3 ] && [ "$p" -lt 6 ]; then echo 127.0.0.1:2; fi\n')
    script.chmod(script.stat().st_mode | stat.S_IEXEC)
    done, rows, final = _elastic(tmp_path, ["-np", "1", "--min-np", "1", "--host-discovery-script", str(script)],
                                 ["--progress", str(progress), "--slow-start", "1.5", "--epochs", "3",
                                  "--samples", "36", "--hold", "3:3", "--hold", "6:1"])
    assert done.returncode == 0, done.stderr
    _assert_every_rank_agrees(rows)
    sizes = []
    for row in rows:
        if row["rank"] == 0 and (not sizes or sizes[-1] != row["size"]):
            sizes.append(row["size"])
    assert sizes == [1, 3, 1], (sizes, done.stderr)
    zero = [row["batch"] for row in rows if row["worker"] == 0]
    assert zero == list(range(1, len(zero) + 1))  # never rolled back: no batch done twice
    assert {row["rank"] for row in rows if row["worker"] == 0} == {0}  # the oldest worker stays rank 0
    assert "host(s) 127.0.0.1 removed by --host-discovery-script" in done.stderr
    assert "is not in the job's new world" in done.stderr
    assert final["size"] == 1
    # While the world was 3: local ranks count within a host, cross ranks across the hosts.
    three = {(row["layout"][6], tuple(row["local"])) for row in rows if row["size"] == 3}
    assert three == {("localhost", (0, 1, 0, 2)), ("127.0.0.1", (0, 2, 1, 2)), ("127.0.0.1", (1, 2, 0, 1))}, three


@pytest.mark.parametrize("case", ["every worker", "every host", "reset limit", "min-np timeout"])
def test_a_job_that_cannot_go_on_ends_with_one_line(tmp_path, case):
    options, fail = {
        "every worker": (["-np", "2", "--min-np", "1", "-H", "localhost:1,127.0.0.1:1,127.0.0.2:1"],
                         ["--fail", "0:3:kill", "--fail", "1:3:kill"]),
        "every host": (["-np", "2", "--min-np", "1", "-H", "localhost:2"], ["--fail", "1:3:exit"]),
        "reset limit": (["-np", "2", "--min-np", "1", "--reset-limit", "0", "-H", "localhost:1,127.0.0.1:1"],
                        ["--fail", "1:3:raise"]),
        "min-np timeout": (["-np", "2", "--min-np", "2", "--elastic-timeout", "2", "-H", "localhost:1,127.0.0.1:1"],
                           ["--fail", "1:3:exit"]),
    }[case]
    done, _rows, final = _elastic(tmp_path, options, fail + ["--batch-sleep", "0.1"], timeout=90)  # else a hang
    assert done.returncode == 1 and final is None, done.stderr
    errors = [line for line in done.stderr.splitlines() if line.startswith("hpdl run: error:")]
    assert len(errors) == 1, done.stderr
    expected = {"every worker": "every worker that held the training state failed",
                "every host": "every host is blacklisted",
                "reset limit": "past --reset-limit 0",
                "min-np timeout": "fewer than --min-np 2 workers for --elastic-timeout 2 s"}[case]
    assert expected in errors[0], errors
    leftover = subprocess.run(["pgrep", "-f", str(tmp_path)], capture_output=True, text=True).stdout.split()
    assert not leftover, leftover  # no worker outlives the job


def test_ranks_go_host_by_host_oldest_first_with_horovods_local_and_cross_ranks():
    from hpdl.comm.rendezvous import assign_slots

    slots = assign_slots([(5, "b"), (2, "a"), (7, "b"), (3, "c"), (4, "a")])
    assert [(s.worker, s.hostname, s.rank, s.local_rank, s.local_size, s.cross_rank, s.cross_size) for s in slots] == [
        (2, "a", 0, 0, 2, 0, 3), (4, "a", 1, 1, 2, 0, 2), (3, "c", 2, 0, 1, 1, 3),
        (5, "b", 3, 0, 2, 2, 3), (7, "b", 4, 1, 2, 1, 2)]
    assert {s.size for s in slots} == {5}


@pytest.mark.parametrize("argv, expected", [
    (["--host-discovery-script", "missing.sh"], "--host-discovery-script missing.sh: no such file"),
    (["--host-discovery-script", "plain.txt"], "not an executable file"),
    (["--host-discovery-script", "fails.sh"], "failed with exit code 3: the cluster is down"),
    (["--host-discovery-script", "garbled.sh"], "output line 2 ('node-2:x')"),
    (["--host-discovery-script", "empty.sh"], "printed no host"),
    (["--host-discovery-script", "hangs.sh"], "did not finish within 1 s (HPDL_ELASTIC_DISCOVERY_TIMEOUT)"),
    (["-np", "2", "--min-np", "3", "--max-np", "2"], "--min-np 3 is above --max-np 2"),
    (["-np", "5", "--min-np", "1", "--max-np", "4"], "-np 5 is outside --min-np 1 and --max-np 4"),
    (["--min-np", "1", "--backend", "mpi"], "an MPI world cannot change its size"),
    (["--min-np", "1", "--launcher", "srun"], "--launcher srun: srun cannot change a running world"),
    (["--min-np", "3", "-H", "localhost:1,127.0.0.1:1"], "--min-np 3 is above --max-np 2"),
    (["--host-discovery-script", "empty.sh", "-H", "localhost:1"], "give one or the other"),
])
def test_bad_elastic_input_is_one_line_and_exit_2_with_nothing_started(tmp_path, monkeypatch, capsys, argv, expected):
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("HPDL_ELASTIC_DISCOVERY_TIMEOUT", "1")
    for name, body in (("fails.sh", "echo 'the cluster is down' >&2; exit 3"), ("garbled.sh", "echo node-1:2; echo node-2:x"),
                       ("empty.sh", "true"), ("hangs.sh", "sleep 20"), ("plain.txt", "echo localhost")):
        (tmp_path / name).write_text(f"#!/bin/sh\n{body}\n")
        if name.endswith(".sh"):
            (tmp_path / name).chmod(0o755)
    marker = tmp_path / "started"
    assert main(["run", *argv, "--", "touch", str(marker)]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and expected in err[0], err
    assert not marker.exists()


def test_a_blacklisted_host_is_admitted_again_after_its_cooldown_and_the_world_grows_back(tmp_path):
    done, rows, final = _elastic(tmp_path, ["-np", "2", "--min-np", "1", "-H", "localhost:1,127.0.0.1:1",
                                            "--blacklist-cooldown-range", "1", "2"],
                                 ["--fail", "1:3:raise", "--hold", "5:2"])
    assert done.returncode == 0, done.stderr
    _assert_every_rank_agrees(rows)
    sizes = []
    for row in rows:
        if row["rank"] == 0 and (not sizes or sizes[-1] != row["size"]):
            sizes.append(row["size"])
    assert sizes == [2, 1, 2], (sizes, done.stderr)
    assert "host 127.0.0.1 is admitted again after its cooldown" in done.stderr
    assert {row["worker"] for row in rows if row["size"] == 2 and row["rank"] == 1} == {1, 2}
    assert final["size"] == 2


def test_a_failed_worker_of_a_discovered_host_is_blacklisted_though_the_script_still_lists_it(tmp_path):
    script = tmp_path / "discover.sh"
    script.write_text("#!/bin/sh\necho localhost\necho 127.0.0.1\n")
    script.chmod(script.stat().st_mode | stat.S_IEXEC)
    done, rows, final = _elastic(tmp_path, ["-np", "2", "--min-np", "1", "--host-discovery-script", str(script)],
                                 ["--fail", "1:3:raise", "--batch-sleep", "0.1"])
    assert done.returncode == 0, done.stderr
    assert "worker 1 (host 127.0.0.1, rank 1) ended with exit code 1; going on without it" in done.stderr
    _assert_every_rank_agrees(rows)
    assert {row["worker"] for row in rows if row["size"] == 1} == {0}  # never re-admitted: no cooldown
    assert rows[-1]["size"] == 1 and final["size"] == 1
