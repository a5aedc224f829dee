"""The logic of hpdl's CUDA paths that runs without a GPU: which group carries a tensor under
nccl, the bytes MPI is handed, the pinned staging buffer, the stream ordering between the caller
and the engine, where a joined rank's zeros go, and whose CUDA generator a checkpoint keeps.
The GPU tests (tests/test_gpu.py, marked gpu) run the same paths on a device."""

import pytest
import torch

import hpdl.torch as hvd
from hpdl.engine.allreduce import zeros_device
from hpdl.torch import streams


# -- torch.distributed: CPU tensors under nccl go through gloo -------------------------------------

def _communicator(backend: str):
    from hpdl.comm.torch_dist import TorchCommunicator

    comm = object.__new__(TorchCommunicator)  # the routing alone: no process group is made
    comm.name, comm._group, comm._cpu = backend, "data group", "gloo beside it" if backend == "nccl" else "data group"
    return comm


@pytest.mark.parametrize("backend,device,group,gloo", [
    ("nccl", "meta", "data group", False),     # a device tensor: nccl
    ("nccl", "cpu", "gloo beside it", True),   # a metric, a step count: NCCL moves device memory only
    ("gloo", "cpu", "data group", True),
    ("gloo", "meta", "data group", True),      # gloo carries CUDA tensors through host memory
])
def test_the_group_that_carries_a_tensor(backend, device, group, gloo):
    comm, tensor = _communicator(backend), torch.empty(2, device=device)
    assert comm._data_group(tensor) == group and comm._gloo_for(tensor) is gloo
    # neither gloo nor NCCL has int16: moved as bytes, reduced widened, wherever it goes
    assert not comm._movable(torch.empty(2, dtype=torch.int16, device=device))
    assert comm._movable(torch.empty(2, dtype=torch.bfloat16, device=device))


# -- MPI: the bytes of any tensor, and one pinned buffer per dtype ---------------------------------

def test_mpi_is_handed_the_bytes_of_a_tensor_whatever_its_dtype():
    pytest.importorskip("mpi4py")
    from hpdl.comm.mpi import MPICommunicator

    comm = object.__new__(MPICommunicator)
    for dtype in (torch.bfloat16, torch.float16, torch.float32):
        tensor = torch.ones(3, dtype=dtype, requires_grad=True)  # torch refuses both on a CUDA array interface
        raw = comm._raw(tensor)
        assert raw.dtype.name == "uint8" and raw.size == 3 * tensor.element_size()
    assert comm._raw(torch.empty(0)).size == 0


def test_the_pinned_staging_buffer_grows_to_the_largest_batch_and_is_reused(monkeypatch):
    pytest.importorskip("mpi4py")
    import hpdl.comm.mpi as mpi

    made = []

    def empty(numel, dtype, pin_memory):  # page-locked memory needs CUDA: count the allocations instead
        made.append((numel, dtype, pin_memory))
        return torch.zeros(numel, dtype=dtype)

    monkeypatch.setattr(mpi.torch, "empty", empty)
    comm = object.__new__(mpi.MPICommunicator)
    comm._pinned = {}
    for numel in (100, 40, 150, 120, 310, 7):  # fused batches of every size
        assert comm._pinned_buffer(torch.float32, numel).numel() == numel
    comm._pinned_buffer(torch.float16, 10)
    assert made == [(100, torch.float32, True), (200, torch.float32, True), (400, torch.float32, True),
                    (10, torch.float16, True)]


# -- streams between the caller and the engine -----------------------------------------------------

class _Stream:
    def __init__(self, name):
        self.name, self.waited_for = name, []

    def wait_stream(self, other):
        self.waited_for.append(other.name)


class _CudaTensor(torch.Tensor):
    """A CPU tensor that says it is on cuda:0, to follow the ordering without a GPU."""

    __torch_function__ = torch._C._disabled_torch_function_impl
    recorded = []

    @property
    def is_cuda(self):
        return True

    @property
    def device(self):
        return torch.device("cuda", 0)

    def record_stream(self, stream):
        _CudaTensor.recorded.append(stream.name)


@pytest.fixture
def cuda_streams(monkeypatch):
    default, side = _Stream("default"), _Stream("side")
    current = [default]
    monkeypatch.setattr(torch.cuda, "current_stream", lambda device=None: current[0])
    monkeypatch.setattr(torch.cuda, "default_stream", lambda device=None: default)
    _CudaTensor.recorded = []
    return default, side, current


def test_on_the_default_stream_nothing_is_waited_for(cuda_streams):
    default, side, _ = cuda_streams
    tensor = torch.Tensor._make_subclass(_CudaTensor, torch.zeros(2))
    streams.before_engine(tensor)
    assert streams.after_engine([tensor, (tensor, 3)]) == [tensor, (tensor, 3)]
    assert default.waited_for == side.waited_for == _CudaTensor.recorded == []


def test_a_side_stream_is_ordered_before_and_after_the_engine(cuda_streams):
    default, side, current = cuda_streams
    current[0] = side
    tensor = torch.Tensor._make_subclass(_CudaTensor, torch.zeros(2))
    streams.before_engine(tensor, None)
    assert default.waited_for == ["side"] and side.waited_for == []  # the engine reads after the caller's work
    streams.after_engine((tensor, [torch.zeros(1), tensor]))
    assert side.waited_for == ["default", "default"]  # the caller reads after the engine's writes
    assert _CudaTensor.recorded == ["side", "side"]  # and its memory stays the caller's until then
    streams.before_engine(torch.zeros(1))  # CPU tensors: nothing
    assert default.waited_for == ["side"]


# -- a joined rank's zeros, and the CUDA generator a checkpoint keeps ------------------------------

def test_a_joined_ranks_zeros_go_to_its_own_gpu():
    assert zeros_device("cuda", 3) == torch.device("cuda", 3)
    assert zeros_device("cuda", -1) == torch.device("cuda")
    assert zeros_device("cpu", 3) == torch.device("cpu")


def test_join_records_the_callers_gpu_for_the_engine(monkeypatch):
    hvd.init()
    try:
        assert hvd.join() == 0 and hvd.runtime.engine().executor.join_device == -1  # no CUDA in use
        monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
        monkeypatch.setattr(torch.cuda, "is_initialized", lambda: True)
        monkeypatch.setattr(torch.cuda, "current_device", lambda: 1)
        assert hvd.join() == 0 and hvd.runtime.engine().executor.join_device == 1
        assert hvd.join(device=2) == 0 and hvd.runtime.engine().executor.join_device == 2
    finally:
        hvd.shutdown()


def test_a_checkpoint_keeps_the_generator_of_the_ranks_gpu_only():
    from hpdl.sr.checkpoint import capture_rng_state, restore_rng_state

    state = capture_rng_state(torch.device("cpu"))
    assert set(state) == {"python", "numpy", "torch"}  # a CPU run touches no GPU
    restore_rng_state({**state, "cuda": [torch.zeros(8, dtype=torch.uint8)]}, torch.device("cpu"))


# -- the gpu marker --------------------------------------------------------------------------------

@pytest.mark.skipif(torch.cuda.is_available(), reason="a CUDA device is here: the gpu tests run instead")
def test_tests_marked_gpu_skip_saying_why_without_cuda():
    import re
    import subprocess
    import sys
    from pathlib import Path

    root = Path(__file__).resolve().parents[1]
    proc = subprocess.run([sys.executable, "-m", "pytest", "-q", "-rs", "-m", "gpu", "-p", "no:cacheprovider",
                           "tests/test_gpu.py"], cwd=root, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout[-3000:]
    skipped = re.findall(r"^SKIPPED \[(\d+)\] .*: needs a CUDA device: this PyTorch \S+ (?:is a CPU-only build|"
                         r"\(CUDA \S+\) sees no CUDA device)$", proc.stdout, re.M)
    assert sum(map(int, skipped)) == 11 and re.search(r"^11 skipped", proc.stdout, re.M), proc.stdout[-3000:]


def test_the_skip_reason_names_what_is_missing(monkeypatch):
    import hpdl.comm.select as select
    from conftest import gpu_skip_reason

    monkeypatch.setattr(torch.version, "cuda", None)
    monkeypatch.setattr(torch.version, "hip", None, raising=False)
    assert gpu_skip_reason() == f"needs a CUDA device: this PyTorch {torch.__version__} is a CPU-only build"
    monkeypatch.setattr(torch.version, "cuda", "13.0")
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert select.cuda_unavailable_reason() == f"this PyTorch {torch.__version__} (CUDA 13.0) sees no CUDA device"
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    assert gpu_skip_reason() is None
