"""hpdl.ray.RayExecutor on a two-node Ray cluster (ray.cluster_utils.Cluster: two raylets on
this machine, two Ray nodes): one bundle per node with num_hosts, ranks numbered by node (local
and cross ranks are the Ray node's), and a node removed during a run ends it, naming a rank,
within a bounded time; an elastic job (min_workers/max_workers) instead shrinks when a node is
removed and grows when one is added, its state kept."""

import os
import threading
import time

import pytest

ray = pytest.importorskip("ray", reason='hpdl.ray needs Ray: pip install "hpdl[ray]"')

from hpdl.ray import RayExecutor, WorkerFailedError  # noqa: E402

pytestmark = [pytest.mark.multirank, pytest.mark.ray]


@pytest.fixture(scope="module")
def cluster():
    from ray.cluster_utils import Cluster

    path = os.pathsep.join([os.path.dirname(__file__), os.path.dirname(os.path.dirname(__file__))])
    env = {"env_vars": {"OMP_NUM_THREADS": "1", "PYTHONPATH": path}}
    # At Ray's default niceness (15) the workers get no CPU beside the other tests' ranks (test_ray.py).
    two = Cluster(initialize_head=True, head_node_args={"num_cpus": 2, "include_dashboard": False,
                                                         "_system_config": {"worker_niceness": 0}})
    two.add_node(num_cpus=2)
    ray.init(address=two.address, runtime_env=env, log_to_driver=False)
    yield two
    ray.shutdown()
    two.shutdown()


def _place():
    import torch

    import hpdl.torch as hvd

    hvd.init()
    total = hvd.allreduce(torch.tensor([1.0]), op=hvd.Sum).item()
    place = (hvd.rank(), hvd.local_rank(), hvd.local_size(), hvd.cross_rank(), hvd.cross_size(), total,
             ray.get_runtime_context().get_node_id())
    hvd.shutdown()
    return place


def test_num_hosts_puts_a_bundle_on_each_node_and_ranks_follow_the_nodes(cluster):
    executor = RayExecutor(RayExecutor.create_settings(timeout_s=180), num_hosts=2, num_workers_per_host=2)
    executor.start()
    try:
        places = executor.run(_place)
    finally:
        executor.shutdown()
    assert [p[:6] for p in places] == [(0, 0, 2, 0, 2, 4.0), (1, 1, 2, 0, 2, 4.0), (2, 0, 2, 1, 2, 4.0),
                                       (3, 1, 2, 1, 2, 4.0)]
    nodes = [p[6] for p in places]
    assert nodes[0] == nodes[1] != nodes[2] == nodes[3]  # each node's ranks consecutive


def _train_until_stopped():
    import torch

    import hpdl.torch as hvd

    hvd.init()
    while True:  # ends only when a rank's node goes
        hvd.allreduce(torch.ones(1000), name="step")
        time.sleep(0.05)


def test_a_node_removed_during_a_run_ends_it_naming_a_rank(cluster):
    node = cluster.add_node(num_cpus=2)
    cluster.wait_for_nodes()
    executor = RayExecutor(RayExecutor.create_settings(timeout_s=180, failure_grace_s=15), num_hosts=3)
    executor.start()
    removing = threading.Timer(5.0, cluster.remove_node, args=(node,))
    removing.start()
    started = time.monotonic()
    try:
        with pytest.raises(WorkerFailedError, match=r"failed on rank \d") as info:
            executor.run(_train_until_stopped)
    finally:
        removing.join()
        executor.shutdown()
    assert info.value.rank is not None and time.monotonic() - started < 120


def test_elastic_a_node_removed_shrinks_the_world_and_a_node_added_grows_it(cluster, tmp_path):
    from ray_elastic_training import progress, train

    marks = str(tmp_path)
    steps_seen = []

    def when(condition, timeout_s=120.0):
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            now = progress(marks)
            if now is not None and condition(*now):
                steps_seen.append(now)
                return now
            time.sleep(0.1)
        raise AssertionError(f"the training did not get there within {timeout_s:g} s (last: {progress(marks)})")

    executor = RayExecutor(RayExecutor.create_settings(timeout_s=180), min_workers=2, max_workers=4, num_workers=4,
                           elastic_timeout=120)
    executor.start()
    outcome = {}

    def run():  # the driver's loop; the test's thread adds nodes (Ray's cluster_utils needs the main thread)
        try:
            outcome["results"] = executor.run(train, kwargs=dict(marks=marks))
        except BaseException as err:  # noqa: BLE001 - reported by the assertions below
            outcome["error"] = err

    running = threading.Thread(target=run)
    running.start()
    try:
        when(lambda step, size: size == 4 and step >= 5)
        cluster.remove_node(next(iter(cluster.worker_nodes)))  # 2 of the 4 workers go with it
        at = when(lambda step, size: size == 2)[0]
        when(lambda step, size: size == 2 and step >= at + 5)
        cluster.add_node(num_cpus=2)
        at = when(lambda step, size: size == 4)[0]
        when(lambda step, size: size == 4 and step >= at + 5)
    finally:
        open(os.path.join(marks, "stop"), "w").close()
        running.join(timeout=120)
        executor.shutdown()
    assert "error" not in outcome, outcome.get("error")
    results = outcome["results"]
    assert len(steps_seen) == 5, steps_seen
    assert len(results) == 4
    steps, sizes, parameters = results[0]
    assert sizes == [4, 2, 4]  # the survivors went on from their last commit; the new node's workers joined
    assert all(r[:2] == (steps, sizes) and r[2] == parameters for r in results)
