"""Which GPU a rank uses: the local rank's device, with one or several ranks per GPU.

With one rank per GPU (Horovod's layout) local rank i uses GPU i. Small models leave most of a
GPU idle, and several processes sharing one (under NVIDIA MPS, whose server runs their
kernels side by side) can fill it: with ``HPDL_RANKS_PER_GPU=K`` (``hpdl run --ranks-per-gpu
K``) local ranks 0..K-1 share GPU 0, K..2K-1 GPU 1, and so on, so that a node of G GPUs runs
up to K x G ranks. ``hvd.local_rank()`` still names the process; ``hvd.local_gpu()`` names its
GPU. NCCL refuses two ranks of one communicator on the same GPU, so ranks that share one
communicate over gloo or MPI (:func:`ranks_share_gpus`).

Pure functions of numbers (the GPU count is an argument), so every layout is tested without
a GPU.
"""

from __future__ import annotations

from typing import Optional

__all__ = ["DeviceError", "check_gpu_index", "gpu_index", "nccl_refusal", "ranks_share_gpus"]


class DeviceError(ValueError):
    """A rank's GPU does not exist on its node; the message says which and what to change."""


def gpu_index(local_rank: int, ranks_per_gpu: int = 1) -> int:
    """Return the index of the GPU that local rank ``local_rank`` uses on its node."""
    if ranks_per_gpu < 1:
        raise DeviceError(f"ranks per GPU must be at least 1, got {ranks_per_gpu}")
    if local_rank < 0:
        raise DeviceError(f"local rank must be >= 0, got {local_rank}")
    return local_rank // ranks_per_gpu


def check_gpu_index(local_rank: int, ranks_per_gpu: int, gpu_count: int) -> int:
    """Return :func:`gpu_index`, or raise :class:`DeviceError` when the node has no such GPU."""
    index = gpu_index(local_rank, ranks_per_gpu)
    if index >= gpu_count:
        per_gpu = f"{ranks_per_gpu} ranks per GPU (HPDL_RANKS_PER_GPU)" if ranks_per_gpu > 1 else "one rank per GPU"
        raise DeviceError(
            f"local rank {local_rank} with {per_gpu} needs GPU {index}, but this node has {gpu_count} GPU(s); "
            f"start at most {gpu_count * ranks_per_gpu} ranks per node, or give more ranks per GPU "
            "(hpdl run --ranks-per-gpu K)")
    return index


def ranks_share_gpus(ranks_per_gpu: int, local_size: int, gpu_count: Optional[int]) -> bool:
    """Whether some ranks of a node use the same GPU: several ranks per GPU were asked for, or
    the node runs more ranks than it has GPUs (``gpu_count`` None: not known)."""
    return ranks_per_gpu > 1 or (gpu_count is not None and 0 < gpu_count < local_size)


def nccl_refusal(backend: str, shared_gpus: bool) -> Optional[str]:
    """Why ``backend`` cannot connect ranks that share GPUs (nccl: NCCL refuses two ranks of
    one communicator on one device, "Duplicate GPU detected"), or None when it can."""
    if backend == "nccl" and shared_gpus:
        return ("backend nccl: ranks of this node share a GPU (HPDL_RANKS_PER_GPU above 1, or more ranks than "
                "GPUs), and NCCL refuses two ranks on one GPU; use gloo or mpi")
    return None
