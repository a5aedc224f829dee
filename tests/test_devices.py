"""Which GPU a rank uses (hpdl/comm/devices.py), and the backend for ranks that share one: pure logic."""

import pytest

from hpdl.comm import discover_topology
from hpdl.comm.devices import DeviceError, check_gpu_index, gpu_index, ranks_share_gpus
from hpdl.comm.select import BackendUnavailableError, choose_backend


@pytest.mark.parametrize("ranks_per_gpu,expected", [
    (1, [0, 1, 2, 3, 4, 5, 6, 7]),   # Horovod's layout: local rank i on GPU i
    (2, [0, 0, 1, 1, 2, 2, 3, 3]),
    (4, [0, 0, 0, 0, 1, 1, 1, 1]),
    (3, [0, 0, 0, 1, 1, 1, 2, 2]),   # the last GPU may hold fewer
])
def test_local_ranks_fill_each_gpu_in_turn(ranks_per_gpu, expected):
    assert [gpu_index(local, ranks_per_gpu) for local in range(8)] == expected


def test_every_gpu_holds_at_most_k_ranks_and_none_is_skipped():
    for k in range(1, 6):
        for gpus in range(1, 5):
            used = [check_gpu_index(local, k, gpus) for local in range(k * gpus)]
            assert sorted(set(used)) == list(range(gpus))
            assert max(used.count(g) for g in range(gpus)) == k


def test_a_rank_past_the_gpus_is_refused_naming_what_to_change():
    with pytest.raises(DeviceError, match=r"local rank 4 with 2 ranks per GPU \(HPDL_RANKS_PER_GPU\) needs GPU 2, "
                                          r"but this node has 2 GPU\(s\); start at most 4 ranks per node"):
        check_gpu_index(4, 2, 2)
    with pytest.raises(DeviceError, match="local rank 1 with one rank per GPU needs GPU 1, but this node has 1 GPU"):
        check_gpu_index(1, 1, 1)
    assert isinstance(DeviceError("x"), ValueError)  # callers' ValueError handling catches it


@pytest.mark.parametrize("bad", [(0, 0), (-1, 1)])
def test_nonsense_numbers_are_refused(bad):
    local_rank, k = bad
    with pytest.raises(DeviceError):
        gpu_index(local_rank, k)


@pytest.mark.parametrize("ranks_per_gpu,local_size,gpus,shared", [
    (1, 4, 4, False), (1, 1, 1, False), (2, 2, 1, True), (1, 2, 1, True),  # more ranks than GPUs
    (1, 4, None, False), (1, 4, 0, False),  # unknown, or no GPU: nothing to share
])
def test_ranks_share_gpus(ranks_per_gpu, local_size, gpus, shared):
    assert ranks_share_gpus(ranks_per_gpu, local_size, gpus) is shared


TORCHRUN = {"RANK": "0", "WORLD_SIZE": "2", "LOCAL_RANK": "0", "LOCAL_WORLD_SIZE": "2"}


@pytest.mark.parametrize("requested,env,shared,expected", [
    ("auto", TORCHRUN, False, "nccl"),
    ("auto", TORCHRUN, True, "gloo"),     # nccl cannot put two ranks on one GPU
    ("torch", {}, False, "nccl"),
    ("torch", {}, True, "gloo"),
    ("auto", {"PMI_RANK": "0", "PMI_SIZE": "2"}, True, "mpi"),
    ("gloo", TORCHRUN, True, "gloo"),
    ("auto", {}, False, "nccl"),          # one process on a GPU: nccl's allreduce stays on the device
])
def test_backend_of_ranks_on_gpus(requested, env, shared, expected):
    assert choose_backend(requested, discover_topology(env), True, cuda=True, shared_gpus=shared) == expected


def test_nccl_asked_for_ranks_that_share_a_gpu_is_refused_in_one_line():
    with pytest.raises(BackendUnavailableError, match="NCCL refuses two ranks on one GPU; use gloo or mpi"):
        choose_backend("nccl", discover_topology(TORCHRUN), True, cuda=True, shared_gpus=True)


def test_local_gpu_of_a_single_process(monkeypatch):
    import hpdl.torch as hvd

    monkeypatch.setenv("HPDL_RANKS_PER_GPU", "3")
    hvd.init()
    try:
        assert hvd.local_rank() == 0 and hvd.local_gpu() == 0
    finally:
        hvd.shutdown()


def test_sr_device_names_map_to_this_ranks_gpu(monkeypatch):
    import torch

    from hpdl.sr.config import ConfigError, resolve_device

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    assert resolve_device("auto", "device", lambda: 1) == torch.device("cuda", 1)
    assert resolve_device("cuda", "device", lambda: gpu_index(3, 2)) == torch.device("cuda", 1)
    assert resolve_device("cuda:0", "device", lambda: 1) == torch.device("cuda", 0)
    assert resolve_device("cpu", "device", lambda: check_gpu_index(9, 1, 2)) == torch.device("cpu")  # never asked
    with pytest.raises(ConfigError, match=r"^device=auto: local rank 4 with 2 ranks per GPU .* needs GPU 2"):
        resolve_device("auto", "device", lambda: check_gpu_index(4, 2, 2))
    with pytest.raises(ConfigError, match="cuda:2 requested but this node has 2 GPU"):
        resolve_device("cuda:2", "device")
