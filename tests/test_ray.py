"""hpdl.ray.RayExecutor on a real local Ray (ray.init(num_cpus=4): logical CPUs, so four
one-CPU workers fit on 2 cores): results in rank order, ranks that meet, failures that end the
run naming the rank (no hang), an infeasible placement refused in one line, nothing left behind; elastic jobs grow into free
slots, and one node's failure ends the job naming the worker."""

import os
import time

import pytest

ray = pytest.importorskip("ray", reason='hpdl.ray needs Ray: pip install "hpdl[ray]"')

from hpdl.ray import PlacementError, RayExecutor, WorkerFailedError  # noqa: E402

pytestmark = [pytest.mark.multirank, pytest.mark.ray]


@pytest.fixture(scope="module", autouse=True)
def local_ray():
    # The workers import this module's functions by name, as a user's workers import the
    # driver script's modules: the tests' directory goes on their path.
    path = os.pathsep.join([os.path.dirname(__file__), os.path.dirname(os.path.dirname(__file__))])
    # Ray runs its workers at niceness 15: beside the other tests' ranks (at 0) they got no CPU
    # for minutes, and started past any timeout. A dedicated node has no such neighbours.
    ray.init(num_cpus=4, include_dashboard=False, log_to_driver=False, _system_config={"worker_niceness": 0},
             runtime_env={"env_vars": {"OMP_NUM_THREADS": "1", "PYTHONPATH": path}})
    yield
    ray.shutdown()


def _settings(**given):
    """The executor's settings for these tests: a worker (a process that imports torch) can take
    minutes to start beside the other test files' ranks, so 180 s where Horovod's default is 30 s."""
    return RayExecutor.create_settings(**{"timeout_s": 180, **given})


def _cpus_free():
    # Resources come back as Ray frees them, a moment after the actors end.
    deadline = time.monotonic() + 30
    while ray.available_resources().get("CPU", 0) < 4 and time.monotonic() < deadline:
        time.sleep(0.2)
    return ray.available_resources().get("CPU", 0)


def _meet():
    import torch

    import hpdl.torch as hvd

    hvd.init()
    total = hvd.allreduce(torch.tensor([float(hvd.rank())]), op=hvd.Sum).item()
    place = (hvd.rank(), hvd.size(), hvd.local_rank(), hvd.local_size(), hvd.cross_rank(), hvd.cross_size(), total)
    hvd.shutdown()
    return place


def test_run_returns_every_ranks_result_in_rank_order_and_the_ranks_meet():
    executor = RayExecutor(_settings(), num_workers=3)
    executor.start()
    try:
        places = executor.run(_meet)
        again = executor.run(lambda x, y=0: x + y + 0, args=[1], kwargs={"y": 2})  # the actors live on
    finally:
        executor.shutdown()
    # One Ray node: every rank is local to it.
    assert places == [(r, 3, r, 3, 0, 1, 3.0) for r in range(3)]
    assert again == [3, 3, 3]
    assert _cpus_free() == 4  # the actors and the placement group are gone


class _Counter:
    def __init__(self, start):
        self.value = start


def test_execute_passes_each_ranks_executable_and_execute_single_runs_on_rank_0():
    executor = RayExecutor(_settings(), num_workers=2)
    executor.start(executable_cls=_Counter, executable_args=[10])
    try:
        def bump(counter):
            counter.value += int(os.environ["RANK"])
            return counter.value

        assert executor.execute(bump) == [10, 11]
        assert executor.execute_single(lambda counter: counter.value) == 10
        refs = executor.run_remote(lambda: int(os.environ["RANK"]))
        assert [value for _, value in ray.get(refs)] == [0, 1]
    finally:
        executor.shutdown()


def _fails_on_rank_1():
    import torch

    import hpdl.torch as hvd

    hvd.init()
    if hvd.rank() == 1:
        raise ValueError("bad batch on rank 1")
    hvd.allreduce(torch.ones(1), name="never.complete")  # waits for rank 1, which raised
    return "unreachable"


def _dies_on_rank_2():
    import torch

    import hpdl.torch as hvd

    hvd.init()
    if hvd.rank() == 2:
        os._exit(3)  # the actor's process ends, as a killed worker's would
    hvd.allreduce(torch.ones(1), name="never.complete")
    return "unreachable"


@pytest.mark.parametrize("fn, rank, message, grace_s", [
    (_fails_on_rank_1, 1, r"_fails_on_rank_1 failed on rank 1: ValueError: bad batch on rank 1", 20),
    (_dies_on_rank_2, 2, r"_dies_on_rank_2 failed on rank 2: its actor died", 10),
], ids=["raises", "actor-dies"])
def test_a_failed_rank_ends_the_run_naming_it_within_a_bounded_time(fn, rank, message, grace_s):
    executor = RayExecutor(_settings(failure_grace_s=grace_s), num_workers=3)
    executor.start()
    started = time.monotonic()
    with pytest.raises(WorkerFailedError, match=message) as info:
        executor.run(fn)
    # The others ended with hpdl's error (or the grace), not a stall timeout (HPDL_STALL_TIMEOUT,
    # 1800 s): the bound leaves room for three workers' start on a loaded machine.
    assert info.value.rank == rank and time.monotonic() - started < 240
    with pytest.raises(RuntimeError, match="not started"):  # a failed run ends the executor
        executor.run(_meet)
    assert _cpus_free() == 4


@pytest.mark.parametrize("elastic", [False, True], ids=["fixed", "elastic"])
def test_ctrl_c_in_the_driver_ends_every_rank(tmp_path, elastic):
    """SIGINT reaches the driver, as the terminal's Ctrl-C does, while the ranks train a loop
    that never ends: run() raises KeyboardInterrupt and no actor is left holding a CPU."""
    import signal
    import threading

    from ray_elastic_training import progress, train

    executor = (RayExecutor(_settings(), min_workers=2, max_workers=3, num_workers=3) if elastic
                else RayExecutor(_settings(), num_workers=3))
    executor.start()
    in_run = threading.Event()
    sent = []

    def interrupt_once_the_ranks_train():
        # Until the ranks have trained 3 steps (the run itself fails should a worker not start).
        while (progress(str(tmp_path)) or (0, 0))[0] < 3 and in_run.is_set():
            time.sleep(0.2)
        if in_run.is_set():
            sent.append((progress(str(tmp_path)), time.monotonic()))
            os.kill(os.getpid(), signal.SIGINT)

    def on_sigint(signum, frame):  # Python's own handler, but never outside run()
        if in_run.is_set():
            raise KeyboardInterrupt

    previous = signal.signal(signal.SIGINT, on_sigint)
    sender = threading.Thread(target=interrupt_once_the_ranks_train, daemon=True)
    try:
        in_run.set()
        sender.start()
        with pytest.raises(KeyboardInterrupt):
            executor.run(train, kwargs=dict(marks=str(tmp_path)))
        in_run.clear()
        took = time.monotonic() - sent[0][1]
        free = _cpus_free()  # run() itself ended the actors: no shutdown() of the test's yet
    finally:
        in_run.clear()
        (tmp_path / "stop").touch()  # whatever happened, the ranks' loop ends
        sender.join(timeout=130)
        signal.signal(signal.SIGINT, previous)
        executor.shutdown()
    assert sent[0][0][0] >= 3, sent
    assert took < 60 and free == 4  # ended soon after the interrupt; every actor (and the placement group) gone


def test_a_placement_the_cluster_cannot_hold_is_refused_naming_what_was_asked_and_what_it_has():
    executor = RayExecutor(RayExecutor.create_settings(placement_group_timeout_s=2), num_workers=8)
    with pytest.raises(PlacementError) as info:
        executor.start()
    message = str(info.value)
    assert "8 bundle(s) of {CPU: 1} (PACK)" in message and "within 2 s" in message
    assert "1 node(s), {CPU: 4} in all" in message and "\n" not in message
    assert _cpus_free() == 4  # the pending group was removed


@pytest.mark.parametrize("kwargs, message", [
    (dict(), "num_workers or num_hosts"),
    (dict(num_workers=2, num_hosts=1), "num_workers or num_hosts"),
    (dict(num_workers=0), "num_workers must be a whole number of at least 1"),
    (dict(num_hosts=1, min_workers=1), "hosts are the Ray cluster's alive nodes"),
    (dict(min_workers=3, max_workers=2), "min_workers 3 is above max_workers 2"),
    (dict(num_workers=5, min_workers=1, max_workers=4), "num_workers 5 is outside min_workers 1 and max_workers 4"),
    (dict(min_workers=0), "min_workers must be a whole number of at least 1"),
    (dict(min_workers=1, cooldown_range=(5, 1)), "cooldown_range must be"),
    (dict(num_workers=2, gpus_per_worker=1), "use_gpu is False"),
])
def test_bad_arguments_are_refused_in_one_line(kwargs, message):
    with pytest.raises(ValueError, match=message):
        RayExecutor(**kwargs)


def test_an_elastic_job_grows_into_the_free_slots_and_returns_the_last_worlds_results(tmp_path, capfd):
    from ray_elastic_training import train

    executor = RayExecutor(_settings(), min_workers=2, max_workers=4, num_workers=2)
    executor.start()
    with pytest.raises(RuntimeError, match=r"execute\(\) with min_workers/max_workers.*use run\(\)"):
        executor.execute(lambda state: state)
    try:
        results = executor.run(train, kwargs=dict(marks=str(tmp_path), stop_at_size=4))
    finally:
        executor.shutdown()
    assert len(results) == 4
    steps, sizes, parameters = results[0]
    # Started with 2; the next look at the nodes found 4 slots (the 2 may not have trained yet).
    assert "hpdl.ray: hosts added: 2 -> 4 worker(s) at the next commit" in capfd.readouterr().err
    assert sizes[-1] == 4 and sizes in ([4], [2, 4])
    assert all(r[:2] == (steps, sizes) and r[2] == parameters for r in results)  # one state on every rank
    assert _cpus_free() == 4


def test_an_elastic_worker_that_raises_on_a_one_node_cluster_ends_the_job_naming_it(tmp_path):
    from ray_elastic_training import train

    executor = RayExecutor(_settings(), min_workers=2, max_workers=3, num_workers=3)
    executor.start()
    try:
        with pytest.raises(WorkerFailedError) as info:
            executor.run(train, kwargs=dict(marks=str(tmp_path), fail_on_rank=1))
        ended = time.time()
    finally:
        executor.shutdown()
    message = str(info.value)
    # Its node is blacklisted (Horovod's rule), and it is the only one: nothing is left to go on with.
    assert message.startswith("train: every host is blacklisted (worker ") and "\n" not in message
    assert "rank 1) raised ValueError: rank 1 fails at step 3" in message
    # Bounded from the failure itself, so that a slow start on a loaded machine does not count.
    failed_at = float((tmp_path / "failed").read_text())
    assert ended - failed_at < 60 and _cpus_free() == 4


def _train_loop(config):
    import json

    import torch

    import hpdl.torch as hvd

    hvd.init()  # takes the process group Ray Train set up
    total = hvd.allreduce(torch.tensor([float(hvd.rank())]), op=hvd.Sum).item()
    seen = {"rank": hvd.rank(), "size": hvd.size(), "local_rank": hvd.local_rank(), "sum": total}
    with open(os.path.join(config["out"], f"rank{hvd.rank()}.json"), "w") as f:
        json.dump(seen, f)
    hvd.shutdown()


def test_an_unchanged_hpdl_loop_trains_under_ray_trains_torch_trainer(tmp_path):
    import json

    train = pytest.importorskip("ray.train.torch", reason="Ray Train: pip install 'ray[train]'")
    from ray.train import RunConfig, ScalingConfig

    trainer = train.TorchTrainer(_train_loop, train_loop_config={"out": str(tmp_path)},
                                 scaling_config=ScalingConfig(num_workers=2),
                                 run_config=RunConfig(storage_path=str(tmp_path / "ray")))
    trainer.fit()
    seen = sorted((json.loads(p.read_text()) for p in tmp_path.glob("rank*.json")), key=lambda s: s["rank"])
    assert seen == [{"rank": r, "size": 2, "local_rank": r, "sum": 1.0} for r in range(2)]


def test_the_example_trains_each_rank_on_its_shard_and_the_driver_scores_it(tmp_path):
    import importlib.util
    from pathlib import Path

    from hpdl.sr.config import load_config

    root = Path(__file__).resolve().parents[1]
    spec = importlib.util.spec_from_file_location("ray_sr_example", root / "examples" / "ray_sr.py")
    example = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(example)
    cfg = load_config("demo", {"total_updates": 2})
    checkpoint = tmp_path / "model.pt"
    paths, ranks = example.train_on_ray(checkpoint, cfg, tmp_path / "cache", ranks=2)
    assert len(paths) == 7
    assert [(r["rank"], r["size"], r["updates"]) for r in ranks] == [(0, 2, 2), (1, 2, 2)]
    shards = [set(r["images"]) for r in ranks]
    assert not shards[0] & shards[1] and shards[0] | shards[1] == {Path(p).name for p in paths}
    result = example.spark_sr.score(checkpoint, cfg, tmp_path / "cache", ["chelsea"])
    (record,) = result.records
    assert record.name == "chelsea" and record.bicubic_psnr > 30 and 0 < record.psnr < 100
