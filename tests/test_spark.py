"""hpdl.spark.run on a real Apache Spark (local[2], and local-cluster's separate executor JVMs),
hpdl scripts under Spark's own TorchDistributor, and the pure pieces of both.

Select them with ``-m spark``. They skip, saying why, only where pyspark or Java is missing.
"""

from __future__ import annotations

import importlib.util
import io
import json
import os
import shutil
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import cloudpickle
import pytest

import hpdl.spark
from hpdl.launch.rank_output import prefix_line
from hpdl.spark.driver import spark_failure
from hpdl.launch.detect import java_needed, spark_unusable_reason
from hpdl.launch.placement import place_ranks, rank_environment
from hpdl.spark.task import describe_exit

ROOT = Path(__file__).resolve().parents[1]
SPARK_UNUSABLE = spark_unusable_reason()
needs_spark = pytest.mark.skipif(SPARK_UNUSABLE is not None, reason=f"Spark cannot start here: {SPARK_UNUSABLE}")
pytestmark = pytest.mark.spark

# The functions the ranks run travel by value, as those of a driver script do (a test module is
# not importable on the executors).
cloudpickle.register_pickle_by_value(sys.modules[__name__])


# -- the pure pieces ---------------------------------------------------------------------------------

def test_ranks_are_grouped_by_node_with_partition_0_first():
    placement = place_ranks(["b", "a", "b", "a", "c"])
    assert placement.ranks == (0, 2, 1, 3, 4)
    assert placement.hosts == ("b", "b", "a", "a", "c")
    node_a = placement.topology(1)
    assert (node_a.rank, node_a.local_rank, node_a.local_size, node_a.cross_rank, node_a.cross_size) == (2, 0, 2, 1, 3)
    assert placement.topology(4).local_size == 1


def test_each_rank_sees_its_nodes_gpus_with_its_own_at_its_local_rank():
    placement = place_ranks(["a", "b", "a", "b"])  # ranks: partition 0 -> 0, 2 -> 1, 1 -> 2, 3 -> 3
    gpus = [["3"], ["0"], ["1"], ["2"]]
    assert placement.node_gpus(0, gpus) == ["3", "1"] == placement.node_gpus(2, gpus)
    assert placement.node_gpus(3, gpus) == ["0", "2"]
    for partition in range(4):
        local_rank = placement.topology(partition).local_rank
        assert placement.node_gpus(partition, gpus)[local_rank] == gpus[partition][0]
    # Fractional amounts: two tasks given one GPU see it once (and share it); none: nothing to set.
    assert place_ranks(["a", "a"]).node_gpus(1, [["0"], ["0"]]) == ["0"]
    assert place_ranks(["a", "a"]).node_gpus(0, [[], []]) == []


def test_rank_environment_layers_its_sources_and_keeps_the_rank_variables_last():
    topology = place_ranks(["n1", "n1"]).topology(1)
    env = rank_environment(
        {"PATH": "/bin", "RANK": "7", "OMP_NUM_THREADS": "9"}, topology, "10.0.0.1", 29500,
        driver_settings={"HPDL_CYCLE_TIME": "5"}, user_env={"MY_VAR": "1", "WORLD_SIZE": "99"},
        gpus=["2", "3"], cpus=4, interfaces={"GLOO_SOCKET_IFNAME": "eth1"},
    )
    assert env["PATH"] == "/bin" and env["HPDL_CYCLE_TIME"] == "5" and env["MY_VAR"] == "1"
    assert (env["RANK"], env["WORLD_SIZE"], env["LOCAL_RANK"], env["LOCAL_WORLD_SIZE"]) == ("1", "2", "1", "2")
    assert (env["MASTER_ADDR"], env["MASTER_PORT"], env["GROUP_RANK"]) == ("10.0.0.1", "29500", "0")
    assert env["CUDA_VISIBLE_DEVICES"] == "2,3"  # the task's GPUs alone
    assert env["OMP_NUM_THREADS"] == "9"  # a thread count already set is kept
    assert env["GLOO_SOCKET_IFNAME"] == "eth1" and env["PYTHONUNBUFFERED"] == "1"
    bare = rank_environment({}, topology, "h", 1, driver_settings={}, user_env={}, cpus=2, interfaces={})
    assert bare["OMP_NUM_THREADS"] == "2" and "CUDA_VISIBLE_DEVICES" not in bare


def test_a_rank_topology_is_what_hvd_init_discovers_from_its_environment():
    from hpdl.comm.topology import discover_topology

    placement = place_ranks(["a", "b", "a", "b"])
    for partition in range(4):
        expected = placement.topology(partition)
        env = rank_environment({}, expected, "h", 1, driver_settings={}, user_env={}, interfaces={})
        seen = discover_topology(env)
        assert (seen.rank, seen.size, seen.local_rank, seen.local_size, seen.cross_rank, seen.cross_size) == \
            (expected.rank, expected.size, expected.local_rank, expected.local_size, expected.cross_rank,
             expected.cross_size)


def test_exit_descriptions_name_the_rank_and_the_last_lines():
    traceback = "Traceback (most recent call last):\n" + "".join(f"  line {i}\n" for i in range(20)) + "KeyError: 'x'\n"
    text = describe_exit("rank 1 (on n2)", 1, None, traceback, [], stopped=False, lines=3)
    assert text.splitlines() == ["rank 1 (on n2) raised an exception; last lines of its traceback:",
                                 "      line 18", "      line 19", "    KeyError: 'x'"]
    assert describe_exit("rank 0", None, 9, None, [], False) == \
        "rank 0 was killed by SIGKILL (it printed nothing on stderr)"
    assert describe_exit("rank 2", 3, None, None, ["fn called sys.exit(3)"], False).endswith(
        "exited with status 3; last lines of its stderr:\n    fn called sys.exit(3)")
    assert "could not start: cannot start /no/python" in describe_exit("rank 0", None, None,
                                                                      "cannot start /no/python", [], False)


def test_the_first_failure_is_a_ranks_own_not_the_error_hpdl_raises_on_the_others():
    from hpdl.engine import HorovodInternalError
    from hpdl.spark.driver import first_failures
    from hpdl.spark.rank import exception_record

    assert exception_record(HorovodInternalError("hpdl has been shut down"), "")["secondary"]
    own = exception_record(RuntimeError("step 3\nmore"), "Traceback ...")
    assert (own["type"], own["message"], own["secondary"]) == ("RuntimeError", "step 3\nmore", False)
    shut_down = {"rank": 0, "secondary": True, "at": 10.0}
    raised, killed = {"rank": 1, "secondary": False, "at": 11.0}, {"rank": 2, "secondary": False, "at": 12.0}
    assert [f["rank"] for f in first_failures([shut_down, killed, raised])] == [1, 2, 0]
    both = [{"rank": 1, "secondary": True, "at": 5.0}, {"rank": 0, "secondary": True, "at": 4.0}]
    assert [f["rank"] for f in first_failures(both)] == [0, 1]  # a stall raises on every rank: the earliest
    text = describe_exit("rank 1 (on n2)", None, 9, "Traceback ...\nRuntimeError: step 3\n", [], False,
                         exception="RuntimeError: step 3")
    assert text.splitlines()[0] == "rank 1 (on n2) raised RuntimeError: step 3; last lines of its traceback:"


def test_prefixed_lines_are_horovods():
    assert prefix_line(3, "stderr", "oops\n") == "[3]<stderr>:oops\n"
    stamped = prefix_line(0, "stdout", "hi\n", timestamp=True)
    assert stamped.endswith("[0]<stdout>:hi\n") and time.strptime(stamped.split("[")[0], "%a %b %d %H:%M:%S %Y")


def test_spark_failures_are_cut_to_what_went_wrong():
    jvm = ("An error occurred while calling o1.collect.\n: org.apache.spark.SparkException: Job aborted due to stage "
           "failure: PythonException: Traceback (most recent call last):\n  File \"x.py\", line 3, in f\n"
           "ModuleNotFoundError: No module named 'hpdl'\n\n\tat org.apache.spark.api.python.X(Y.scala:1)\n")
    assert spark_failure(RuntimeError(jvm)) == \
        "\n      File \"x.py\", line 3, in f\n    ModuleNotFoundError: No module named 'hpdl'"
    cancelled = ("An error occurred while calling z:org.apache.spark.api.python.PythonRDD.collectAndServe.\n: "
                 "org.apache.spark.SparkException: [SPARK_JOB_CANCELLED] Job 0 cancelled as part of cancellation of "
                 "all jobs SQLSTATE: XXKDA\n\tat org.apache.spark.errors.SparkCoreErrors$.sparkJobCancelled(x:1)\n")
    assert spark_failure(RuntimeError(cancelled)) == \
        "[SPARK_JOB_CANCELLED] Job 0 cancelled as part of cancellation of all jobs"


def _rank_workdir(tmp_path, fn, *args):
    from hpdl.spark import rank

    tmp_path.mkdir(exist_ok=True)
    (tmp_path / rank.PAYLOAD).write_bytes(cloudpickle.dumps((fn, args, {})))
    (tmp_path / rank.SYS_PATH).write_text(json.dumps(sys.path))
    return tmp_path


def _start_rank(workdir, parent_pid):
    return subprocess.run([sys.executable, "-m", "hpdl.spark.rank", str(workdir), str(parent_pid)],
                          capture_output=True, text=True, timeout=60)


def test_a_rank_process_writes_its_result_or_its_traceback(tmp_path):
    from hpdl.spark import rank

    done = _start_rank(_rank_workdir(tmp_path / "ok", divmod, 7, 2), os.getpid())
    assert done.returncode == 0 and cloudpickle.loads((tmp_path / "ok" / rank.RESULT).read_bytes()) == (3, 1)
    done = _start_rank(_rank_workdir(tmp_path / "bad", divmod, 1, 0), os.getpid())
    error = json.loads((tmp_path / "bad" / rank.ERROR).read_text())
    assert done.returncode == 1 and error["traceback"].rstrip().endswith(
        "ZeroDivisionError: integer division or modulo by zero")
    assert (error["type"], error["message"], error["secondary"]) == \
        ("ZeroDivisionError", "integer division or modulo by zero", False)
    assert error["traceback"] in done.stderr and not (tmp_path / "bad" / rank.RESULT).exists()


def test_a_rank_process_dies_with_the_task_that_started_it(tmp_path):
    workdir = _rank_workdir(tmp_path, time.sleep, 120)
    # A stand-in for the task: starts the rank, says its pid, then waits.
    task = subprocess.Popen([sys.executable, "-c", (
        "import os, subprocess, sys, time; "
        f"r = subprocess.Popen([sys.executable, '-m', 'hpdl.spark.rank', {str(workdir)!r}, str(os.getpid())]); "
        "print(r.pid, flush=True); time.sleep(120)")], stdout=subprocess.PIPE, text=True)
    rank_pid = int(task.stdout.readline())
    time.sleep(1)  # let it arm its watch: the kernel's signal, set as it starts
    assert _alive(rank_pid)
    task.kill()
    task.wait()
    deadline = time.monotonic() + 10
    while _alive(rank_pid) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not _alive(rank_pid)
    # A rank whose task is gone before it looked (its parent is another process) ends at once.
    assert _start_rank(workdir, 1).returncode == 1


def test_java_needed_by_each_pyspark():
    assert java_needed("4.3.0") == 17 and java_needed("3.5.1") == 8


@pytest.mark.parametrize("kwargs, fragment", [
    ({"use_mpi": True}, "use_mpi=True): MPI under Spark is not supported: mpiexec has to start every rank itself"),
    ({"use_gloo": False}, "use_gloo=False (MPI)): MPI under Spark is not supported"),
    ({"start_timeout": 0}, "start_timeout must be a number of seconds above 0"),
    ({"start_timeout": float("nan")}, "start_timeout must be a number of seconds above 0"),
    ({"verbose": 3}, "verbose must be 0, 1 or 2"),
    ({"num_proc": 0}, "num_proc must be a whole number of ranks, at least 1, got 0"),
    ({"num_proc": 2.0}, "num_proc must be a whole number of ranks, at least 1, got 2.0"),
    ({"env": {"OMP_NUM_THREADS": 4}}, "env['OMP_NUM_THREADS']: names and values must be strings"),
    ({"nics": ["eth0", ""]}, "nics must name network interfaces, such as ['eth0']"),
    ({"executable": ""}, "executable must name a Python interpreter"),
])
def test_arguments_that_cannot_work_are_refused_before_spark_is_asked(kwargs, fragment):
    with pytest.raises(ValueError) as raised:
        hpdl.spark.run(print, **kwargs)
    assert fragment in str(raised.value)


def test_a_function_that_cannot_be_pickled_is_refused_before_spark_is_asked():
    import threading as threads

    with pytest.raises(TypeError, match="fn and its arguments must be picklable by cloudpickle"):
        hpdl.spark.run(print, args=(threads.Lock(),))


def test_the_start_timeout_setting_is_checked(monkeypatch):
    from hpdl.config import SettingsError

    monkeypatch.setenv("HOROVOD_SPARK_START_TIMEOUT", "-5")
    with pytest.raises(SettingsError, match="HPDL_SPARK_START_TIMEOUT must be > 0 seconds, got -5"):
        hpdl.spark.run(print)


# -- on a real Spark ------------------------------------------------------------------------------------

def _spark_env():
    return {"SPARK_LOCAL_IP": "127.0.0.1", "PYSPARK_PYTHON": sys.executable}


# The tests' JVMs live a minute or two: the JIT's quick tier alone costs them less CPU than it
# loses, which counts on a machine of two cores.
QUICK_JIT = "-XX:TieredStopAtLevel=1"


@pytest.fixture(scope="module")
def spark():
    """local[2] with 2 attempts per task and barrier slot checks every second, on loopback."""
    if SPARK_UNUSABLE is not None:
        pytest.skip(f"Spark cannot start here: {SPARK_UNUSABLE}")
    os.environ.update(_spark_env())
    from pyspark.sql import SparkSession

    session = (SparkSession.builder.master("local[2,2]").appName("hpdl-tests")
               .config("spark.driver.host", "127.0.0.1").config("spark.driver.bindAddress", "127.0.0.1")
               .config("spark.ui.enabled", "false").config("spark.ui.showConsoleProgress", "false")
               .config("spark.scheduler.barrier.maxConcurrentTasksCheck.interval", "1s")
               .config("spark.driver.extraJavaOptions", QUICK_JIT).getOrCreate())
    session.sparkContext.setLogLevel("ERROR")
    yield session
    session.stop()


def _descendants(root: int):
    """Every process below ``root``: ``{pid: command line}``."""
    children = {}
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                with open(f"/proc/{entry}/stat") as stat:
                    ppid = int(stat.read().rsplit(")", 1)[1].split()[1])
                with open(f"/proc/{entry}/cmdline", "rb") as cmd:
                    line = cmd.read().replace(b"\0", b" ").decode(errors="replace")
            except (OSError, IndexError, ValueError):
                continue
            children.setdefault(ppid, []).append((int(entry), line))
    found, todo = {}, [root]
    while todo:
        for pid, line in children.get(todo.pop(), []):
            found[pid] = line
            todo.append(pid)
    return found


def _ranks_left():
    return {pid: line for pid, line in _descendants(os.getpid()).items() if "hpdl.spark.rank" in line}


@pytest.fixture
def no_rank_left():
    """After the test: no rank process of any run is left (polled briefly: a kill is not instant)."""
    yield
    deadline = time.monotonic() + 10
    while _ranks_left() and time.monotonic() < deadline:
        time.sleep(0.2)
    assert _ranks_left() == {}


def _alive(pid: int) -> bool:
    """Whether ``pid`` runs (a zombie, dead but not yet reaped by its new parent, does not)."""
    try:
        with open(f"/proc/{pid}/stat") as stat:
            return stat.read().rsplit(")", 1)[1].split()[0] not in ("Z", "X")
    except (OSError, IndexError):
        return False


def train_two_ranks():
    """Three DistributedOptimizer steps of a linear model, each rank on data of its own."""
    import os

    import torch

    import hpdl.torch as hvd

    hvd.init()
    torch.manual_seed(0)
    model = torch.nn.Linear(4, 1)
    optimizer = hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1),
                                         named_parameters=model.named_parameters())
    hvd.broadcast_parameters(model.state_dict(), root_rank=0)
    generator = torch.Generator().manual_seed(100 + hvd.rank())
    x, y = torch.randn(8, 4, generator=generator), torch.randn(8, 1, generator=generator)
    for _ in range(3):
        optimizer.zero_grad()
        torch.nn.functional.mse_loss(model(x), y).backward()
        optimizer.step()
    print(f"rank {hvd.rank()} trained")
    print(f"rank {hvd.rank()} says so on stderr", file=sys.stderr)
    return {"rank": hvd.rank(), "size": hvd.size(), "local": (hvd.local_rank(), hvd.local_size()),
            "cross": (hvd.cross_rank(), hvd.cross_size()), "pid": os.getpid(),
            "env": {k: os.environ.get(k) for k in ("RUN_MARK", "GLOO_SOCKET_IFNAME", "OMP_NUM_THREADS")},
            "weights": torch.cat([p.detach().flatten() for p in model.parameters()]).tolist()}


def _expected_weights():
    """The same three steps in this process, with the average of both ranks' gradients."""
    import torch

    torch.manual_seed(0)
    model = torch.nn.Linear(4, 1)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    data = []
    for rank in range(2):
        generator = torch.Generator().manual_seed(100 + rank)
        data.append((torch.randn(8, 4, generator=generator), torch.randn(8, 1, generator=generator)))
    for _ in range(3):
        optimizer.zero_grad()
        sum(torch.nn.functional.mse_loss(model(x), y) / 2 for x, y in data).backward()
        optimizer.step()
    return torch.cat([p.detach().flatten() for p in model.parameters()]).tolist()


@needs_spark
def test_two_runs_each_give_every_rank_in_order_with_equal_weights(spark, no_rank_left):
    expected = _expected_weights()
    pids = []
    for run in range(2):  # Spark reuses its Python workers: the second run must not see the first's world
        out, err = io.StringIO(), io.StringIO()
        # The first run's ranks keep to the loopback interface (gloo's variable) and get a variable of ours.
        options = {"nics": ["lo"], "env": {"RUN_MARK": "first"}} if run == 0 else {}
        results = hpdl.spark.run(train_two_ranks, stdout=out, stderr=err, **options)
        expected_env = {"RUN_MARK": "first", "GLOO_SOCKET_IFNAME": "lo"} if run == 0 else \
            {"RUN_MARK": None, "GLOO_SOCKET_IFNAME": None}
        # Threads: the CPUs of a task (spark.task.cpus, 1), unless the executors' environment sets them.
        threads = os.environ.get("OMP_NUM_THREADS", "1")
        assert all(r["env"] == dict(expected_env, OMP_NUM_THREADS=threads) for r in results)
        assert [r["rank"] for r in results] == [0, 1]
        assert all(r["size"] == 2 and r["local"] == (r["rank"], 2) and r["cross"] == (0, 1) for r in results)
        assert results[0]["weights"] == results[1]["weights"]
        assert results[0]["weights"] == pytest.approx(expected, rel=1e-5, abs=1e-6)
        assert "[0]<stdout>:rank 0 trained\n" in out.getvalue() and "[1]<stdout>:rank 1 trained\n" in out.getvalue()
        assert "[1]<stderr>:rank 1 says so on stderr\n" in err.getvalue()
        assert "hpdl.spark: running 2 ranks in a barrier stage" in err.getvalue()
        pids.append({r["pid"] for r in results})
    assert not pids[0] & pids[1]


def sleep_then_return(seconds):
    import time

    time.sleep(seconds)
    return seconds


@needs_spark
def test_more_ranks_than_slots_fail_within_the_start_timeout_naming_both(spark, no_rank_left):
    with pytest.raises(hpdl.spark.SlotsUnavailableError) as raised:
        hpdl.spark.run(sleep_then_return, args=(0,), num_proc=3, start_timeout=2, verbose=0)
    assert (raised.value.wanted, raised.value.found, raised.value.total) == (3, 2, 2)
    assert "wanted 3 task slots, found 2 free within the start timeout of 2 s" in str(raised.value)


@needs_spark
def test_slots_held_by_another_job_fail_within_the_start_timeout_and_that_job_goes_on(spark, tmp_path,
                                                                                     no_rank_left):
    sc = spark.sparkContext
    release = tmp_path / "release"
    other = {}

    def hold(value, release=str(release)):  # one slot, until the test releases it (two minutes at most)
        import os
        import time

        end = time.monotonic() + 120
        while not os.path.exists(release) and time.monotonic() < end:
            time.sleep(0.1)
        return value

    # In a thread of its own, as another user's job; pyspark pickles a function of this module by
    # value only when it is nested, as this one is.
    holder = threading.Thread(target=lambda: other.update(result=sc.parallelize([6], 1).map(hold).collect()))
    holder.start()
    try:
        while holder.is_alive() and not any(info.numActiveTasks for info in map(
                sc.statusTracker().getStageInfo, sc.statusTracker().getActiveStageIds()) if info):
            time.sleep(0.1)
        with pytest.raises(hpdl.spark.SlotsUnavailableError) as raised:
            hpdl.spark.run(sleep_then_return, args=(0,), num_proc=2, start_timeout=2, verbose=0)
    finally:
        release.touch()
        holder.join()
    assert (raised.value.wanted, raised.value.found, raised.value.total) == (2, 1, 2)
    assert "found 1 free" in str(raised.value) and "1 of them busy with other jobs" in str(raised.value)
    assert other["result"] == [6]  # only this run's stage was cancelled


def train_until_rank_1_raises_at_step_3():
    """Rank 1 raises at step 3 of DistributedOptimizer steps, then is slow to exit; rank 0 is told so
    (hpdl shuts down as rank 1 exits) and raises HorovodInternalError, so its report comes first."""
    import atexit
    import os
    import time

    import torch

    import hpdl.torch as hvd

    if os.environ["RANK"] == "1":
        atexit.register(time.sleep, 5)  # runs after hpdl's own exit handler, registered by init()
    hvd.init()
    model = torch.nn.Linear(4, 1)
    optimizer = hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1),
                                         named_parameters=model.named_parameters())
    for step in range(1, 1000):
        if step == 3 and hvd.rank() == 1:
            raise RuntimeError("rank 1 cannot go on at step 3")
        optimizer.zero_grad()
        model(torch.ones(2, 4)).sum().backward()
        optimizer.step()  # rank 0 waits here for rank 1's gradients: the run must end it


@needs_spark
def test_an_exception_in_rank_1_raises_on_the_driver_with_its_traceback(spark, no_rank_left):
    # Named though rank 0's secondary error (hpdl shut down by rank 1's exit) reached the driver first.
    stderr = io.StringIO()
    with pytest.raises(hpdl.spark.RankFailedError) as raised:
        hpdl.spark.run(train_until_rank_1_raises_at_step_3, stderr=stderr)
    failure = raised.value
    assert failure.rank == 1, str(failure)
    assert (failure.exception_type, failure.exception_message) == ("RuntimeError", "rank 1 cannot go on at step 3")
    lines = str(failure).splitlines()
    assert lines[0].startswith("hpdl.spark.run: rank 1 (on ") and \
        lines[0].endswith(") raised RuntimeError: rank 1 cannot go on at step 3; last lines of its traceback:")
    assert lines[-2] == "    RuntimeError: rank 1 cannot go on at step 3"
    assert lines[-1].startswith("(then rank 0 failed too: hpdl.engine.errors.HorovodInternalError: hpdl has been "
                                "shut down (rank 1"), lines[-1]
    assert "in train_until_rank_1_raises_at_step_3" in failure.traceback
    assert failure.traceback.rstrip().endswith("RuntimeError: rank 1 cannot go on at step 3")
    assert "[1]<stderr>:RuntimeError: rank 1 cannot go on at step 3\n" in stderr.getvalue()


def write_pid_then_loop(folder):
    import os
    import time

    import torch

    import hpdl.torch as hvd

    hvd.init()
    with open(os.path.join(folder, str(hvd.rank())), "w") as out:
        out.write(str(os.getpid()))
    end = time.monotonic() + 120
    while time.monotonic() < end:
        hvd.allreduce(torch.ones(4), name="beat")
        time.sleep(0.05)


def _pids_when_both_started(folder: Path):
    while len(list(folder.iterdir())) < 2:
        time.sleep(0.1)
    time.sleep(0.2)  # the files are written whole: a short line each
    return {int(f.name): int(f.read_text()) for f in folder.iterdir()}


@needs_spark
def test_a_rank_killed_mid_run_ends_the_job(spark, tmp_path, no_rank_left):
    pids = {}

    def kill_rank_1():
        pids.update(_pids_when_both_started(tmp_path))
        os.kill(pids[1], signal.SIGKILL)

    killer = threading.Thread(target=kill_rank_1, daemon=True)
    killer.start()
    with pytest.raises(hpdl.spark.RankFailedError) as raised:
        hpdl.spark.run(write_pid_then_loop, args=(str(tmp_path),), stderr=io.StringIO())
    killer.join()
    assert raised.value.rank == 1 and raised.value.signal == signal.SIGKILL
    assert "rank 1 (on " in str(raised.value) and "was killed by SIGKILL" in str(raised.value)
    assert not _alive(pids[0]) and not _alive(pids[1])


def write_pid_then_sleep(folder):
    import os
    import time

    with open(os.path.join(folder, os.environ["RANK"]), "w") as out:
        out.write(str(os.getpid()))
    time.sleep(120)


@needs_spark
def test_ctrl_c_in_the_driver_ends_every_rank(spark, tmp_path, no_rank_left):
    pids = {}

    def press_ctrl_c():
        pids.update(_pids_when_both_started(tmp_path))
        signal.pthread_kill(threading.main_thread().ident, signal.SIGINT)

    presser = threading.Thread(target=press_ctrl_c, daemon=True)
    presser.start()
    with pytest.raises(KeyboardInterrupt):
        hpdl.spark.run(write_pid_then_sleep, args=(str(tmp_path),), stderr=io.StringIO())
    presser.join()
    assert not _alive(pids[0]) and not _alive(pids[1])
    assert hpdl.spark.run(sleep_then_return, args=(0,), verbose=0) == [0, 0]  # the session still works


@needs_spark
def test_cancelling_the_job_elsewhere_ends_every_rank(spark, tmp_path, no_rank_left):
    # As a notebook's cancel button: run() learns it from Spark's failure of the stage.
    pids = {}

    def cancel():
        pids.update(_pids_when_both_started(tmp_path))
        spark.sparkContext.cancelAllJobs()

    canceller = threading.Thread(target=cancel, daemon=True)
    canceller.start()
    with pytest.raises(hpdl.spark.SparkRunError, match=r"Spark failed the barrier stage: .*Job \d+ cancelled"):
        hpdl.spark.run(write_pid_then_sleep, args=(str(tmp_path),), stderr=io.StringIO())
    canceller.join()
    assert not _alive(pids[0]) and not _alive(pids[1])


HPDL_SCRIPT = """
import json, os, sys
import torch
import hpdl.torch as hvd

hvd.init()
torch.manual_seed(0)
model = torch.nn.Linear(3, 1)
optimizer = hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1),
                                     named_parameters=model.named_parameters())
hvd.broadcast_parameters(model.state_dict(), root_rank=0)
x = torch.full((4, 3), float(hvd.rank() + 1))
for _ in range(2):
    optimizer.zero_grad()
    model(x).sum().backward()
    optimizer.step()
with open(os.path.join(sys.argv[1], f"rank{hvd.rank()}.json"), "w") as out:
    json.dump({"rank": hvd.rank(), "size": hvd.size(), "local_size": hvd.local_size(),
               "weights": [p.detach().flatten().tolist() for p in model.parameters()]}, out)
"""


@needs_spark
def test_an_hpdl_script_runs_unchanged_under_torch_distributor(spark, tmp_path, no_rank_left):
    from pyspark.ml.torch.distributor import TorchDistributor

    script = tmp_path / "train.py"
    script.write_text(HPDL_SCRIPT)
    out = tmp_path / "out"
    out.mkdir()
    TorchDistributor(num_processes=2, local_mode=False, use_gpu=False).run(str(script), str(out))
    ranks = [json.loads((out / f"rank{r}.json").read_text()) for r in range(2)]
    assert [(r["rank"], r["size"], r["local_size"]) for r in ranks] == [(0, 2, 2), (1, 2, 2)]
    assert ranks[0]["weights"] == ranks[1]["weights"]


def _example():
    spec = importlib.util.spec_from_file_location("spark_sr_example", ROOT / "examples" / "spark_sr.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@needs_spark
def test_the_example_trains_each_rank_on_its_shard_and_the_driver_scores_it(spark, tmp_path, no_rank_left):
    from hpdl.sr.config import load_config

    example = _example()
    cfg = load_config("demo", {"total_updates": 2})
    checkpoint = tmp_path / "model.pt"
    paths, ranks = example.train_on_spark(spark, checkpoint, cfg, tmp_path / "cache")
    assert len(paths) == 7 and all(Path(p).parent == tmp_path / "cache" / "embedded" / "train" for p in paths)
    assert [(r["rank"], r["size"], r["updates"]) for r in ranks] == [(0, 2, 2), (1, 2, 2)]
    shards = [set(r["images"]) for r in ranks]
    assert not shards[0] & shards[1] and shards[0] | shards[1] == {Path(p).name for p in paths}
    # The driver reads rank 0's checkpoint and scores it beside bicubic (one photo: the smallest).
    result = example.score(checkpoint, cfg, tmp_path / "cache", ["chelsea"])
    (record,) = result.records
    assert record.name == "chelsea" and record.bicubic_psnr > 30 and 0 < record.psnr < 100


LOCAL_CLUSTER_DRIVER = """
import json, sys
from pyspark.sql import SparkSession
import hpdl.spark

def fn():
    import os
    import torch
    import hpdl.torch as hvd
    hvd.init()
    total = hvd.allreduce(torch.tensor([float(hvd.rank() + 1)]), op=hvd.Sum).item()
    return {"rank": hvd.rank(), "size": hvd.size(), "local": hvd.local_size(), "sum": total,
            "cwd": os.getcwd(), "pid": os.getpid()}

spark = (SparkSession.builder.master("local-cluster[2,1,1024]").config("spark.driver.host", "127.0.0.1")
         .config("spark.driver.bindAddress", "127.0.0.1").config("spark.ui.enabled", "false")
         .config("spark.ui.showConsoleProgress", "false").config("spark.driver.extraJavaOptions", sys.argv[1])
         .config("spark.executor.extraJavaOptions", sys.argv[1]).getOrCreate())
spark.sparkContext.setLogLevel("ERROR")
try:
    print("RESULT " + json.dumps(hpdl.spark.run(fn, num_proc=2)))
finally:
    spark.stop()
"""


@pytest.fixture
def pyspark_work_cleaned():
    """local-cluster writes its executors' logs under the installed pyspark's work/: remove what it adds."""
    import pyspark

    work = Path(pyspark.__file__).parent / "work"
    before = set(work.iterdir()) if work.exists() else None
    yield
    if before is None:
        shutil.rmtree(work, ignore_errors=True)
    elif work.exists():
        for entry in set(work.iterdir()) - before:
            shutil.rmtree(entry, ignore_errors=True)


@needs_spark
@pytest.mark.slow
def test_ranks_on_separate_executor_jvms_of_local_cluster(tmp_path, no_rank_left, pyspark_work_cleaned):
    # A driver process of its own (one SparkContext per process), whose local-cluster master
    # starts two executor JVMs with one core each: one rank in each.
    driver = tmp_path / "driver.py"
    driver.write_text(LOCAL_CLUSTER_DRIVER)
    done = subprocess.run([sys.executable, str(driver), QUICK_JIT], cwd=tmp_path, env=dict(os.environ, **_spark_env()),
                          capture_output=True, text=True, timeout=240)
    assert done.returncode == 0, done.stderr[-3000:]
    ranks = json.loads(done.stdout.split("RESULT ", 1)[1])
    assert [(r["rank"], r["size"], r["local"], r["sum"]) for r in ranks] == [(0, 2, 2, 3.0), (1, 2, 2, 3.0)]
    # Each rank ran in the work directory of its own executor (0 and 1 of one application).
    executors = [Path(r["cwd"]) for r in ranks]
    assert sorted(e.name for e in executors) == ["0", "1"] and executors[0].parent == executors[1].parent
    assert not any(_alive(r["pid"]) for r in ranks)
