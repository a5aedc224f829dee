"""Horovod-compatible data-parallel API for PyTorch: ``import hpdl.torch as hvd``.

Names and semantics follow Horovod 0.28's ``horovod.torch``; see docs/api.md for what differs.
"""

from hpdl.engine import HorovodInternalError
from hpdl.torch import process_sets as _process_sets, runtime as _runtime
from hpdl.torch.compression import Compression, Compressor
from hpdl.torch.functions import broadcast_optimizer_state, broadcast_parameters
from hpdl.torch.object_ops import allgather_object, broadcast_object
from hpdl.torch.mpi_ops import (
    Adasum, Average, Max, Min, Product, Sum,
    allgather, allgather_async, allreduce, allreduce_, allreduce_async, allreduce_async_, alltoall, alltoall_async,
    barrier, broadcast, broadcast_, broadcast_async, broadcast_async_, grouped_allgather, grouped_allgather_async,
    grouped_allreduce, grouped_allreduce_, grouped_allreduce_async, grouped_allreduce_async_, grouped_reducescatter,
    grouped_reducescatter_async, join, poll, reducescatter, reducescatter_async, sparse_allreduce_async, synchronize,
)
from hpdl.torch.process_sets import ProcessSet, add_process_set, global_process_set, remove_process_set
from hpdl.torch.runtime import (
    ccl_built, cross_rank, cross_size, cuda_built, ddl_built, gloo_built, gloo_enabled, init, is_homogeneous,
    is_initialized, local_gpu, local_rank, local_size, mpi_built, mpi_enabled, mpi_threads_supported, nccl_built,
    profile_step, rank, rocm_built, shutdown, size, start_timeline, stop_timeline,
)
from hpdl.torch.profiler.session import start_profile, stop_profile  # and its HPDL_PROFILE start-up hook
from hpdl.torch.optimizer import DistributedOptimizer
from hpdl.torch.sync_batch_norm import SyncBatchNorm
from hpdl.torch import elastic  # noqa: E402 - after the functions it wraps

_process_sets.use_runtime(_runtime)  # process sets ask the runtime for rank, size and the engine

__all__ = [
    "Adasum", "Average", "Compression", "Compressor", "DistributedOptimizer", "HorovodInternalError", "Max", "Min",
    "Product", "ProcessSet", "Sum", "add_process_set", "allgather", "allgather_async", "allgather_object",
    "allreduce", "allreduce_", "allreduce_async", "allreduce_async_", "alltoall", "alltoall_async", "barrier",
    "broadcast", "broadcast_", "broadcast_async", "broadcast_async_", "broadcast_object",
    "broadcast_optimizer_state", "broadcast_parameters", "ccl_built", "cross_rank", "cross_size", "cuda_built",
    "ddl_built", "elastic", "gloo_built", "gloo_enabled", "global_process_set", "grouped_allgather", "grouped_allgather_async",
    "grouped_allreduce", "grouped_allreduce_", "grouped_allreduce_async", "grouped_allreduce_async_",
    "grouped_reducescatter", "grouped_reducescatter_async", "init", "is_homogeneous", "is_initialized", "join",
    "local_gpu", "local_rank", "local_size", "mpi_built", "mpi_enabled", "mpi_threads_supported", "nccl_built", "poll",
    "profile_step", "rank",
    "reducescatter", "reducescatter_async", "remove_process_set", "rocm_built", "shutdown", "size",
    "sparse_allreduce_async", "start_profile", "start_timeline", "stop_profile", "stop_timeline", "SyncBatchNorm",
    "synchronize",
]
