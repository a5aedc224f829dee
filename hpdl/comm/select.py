"""Choose and create the world communicator: the one place that decides the backend."""

from __future__ import annotations

from typing import Optional

from hpdl.comm.base import CommError, Communicator
from hpdl.comm.devices import nccl_refusal
from hpdl.comm.topology import Topology
from hpdl.config import SettingsError


class BackendUnavailableError(CommError, SettingsError):
    """The backend asked for (``backend=``, ``HPDL_BACKEND``) cannot run with this installation.

    A setting error too, so that hpdl's commands and ``hpdl run`` report it in one line as they
    do any bad setting; a CommError still, for callers that catch the backend's errors.
    """


def cuda_unavailable_reason() -> Optional[str]:
    """Why this PyTorch cannot compute on a GPU here, or None when it can."""
    import torch

    if torch.version.cuda is None and getattr(torch.version, "hip", None) is None:
        return f"this PyTorch {torch.__version__} is a CPU-only build"
    if not torch.cuda.is_available():
        return f"this PyTorch {torch.__version__} (CUDA {torch.version.cuda}) sees no CUDA device"
    return None


def nccl_unavailable_reason() -> Optional[str]:
    """Why this PyTorch cannot run the nccl backend here, or None when it can."""
    import torch
    import torch.distributed as dist

    if not dist.is_available() or not dist.is_nccl_available():
        build = " (a CPU-only build)" if torch.version.cuda is None else ""
        return f"this PyTorch {torch.__version__} has no NCCL{build}"
    return cuda_unavailable_reason()


def check_nccl_available() -> None:
    """Raise :class:`BackendUnavailableError` unless this PyTorch can run the nccl backend.

    Checked before torch.distributed is asked, whose own failure is a long traceback that
    does not say what to use instead.
    """
    reason = nccl_unavailable_reason()
    if reason is not None:
        raise BackendUnavailableError(f"backend nccl: {reason}, use gloo or mpi")


def choose_backend(requested: str, topology: Topology, mpi_present: bool, cuda: bool = False,
                   shared_gpus: bool = False) -> str:
    """Return "mpi", "gloo" or "nccl" for a job launched as ``topology`` describes.

    Args:
        requested: "auto", "mpi", "gloo", "nccl" or "torch" (gloo on CPU, nccl with CUDA),
            from the ``backend`` argument or ``HPDL_BACKEND``.
        topology: how the job was launched.
        mpi_present: whether mpi4py imports.
        cuda: whether this job trains on CUDA devices (picks nccl over gloo for "torch").
        shared_gpus: whether ranks of a node share a GPU (hpdl/comm/devices.py): NCCL refuses
            two ranks of one communicator on one GPU, so gloo stands in for it.
    """
    nccl_or_gloo = "nccl" if cuda and not shared_gpus else "gloo"
    if requested == "torch":
        return nccl_or_gloo
    refusal = nccl_refusal(requested, shared_gpus)
    if refusal is not None:
        raise BackendUnavailableError(refusal)
    if requested in ("mpi", "gloo", "nccl"):
        if requested == "mpi" and not mpi_present:
            from hpdl.comm.mpi import NOT_INSTALLED, mpi_missing_reason

            raise BackendUnavailableError(f"backend 'mpi' requested but {mpi_missing_reason() or NOT_INSTALLED}")
        if requested == "nccl":
            check_nccl_available()
        return requested
    if requested != "auto":
        raise CommError(f"unknown backend {requested!r}; use auto, mpi, gloo, nccl or torch")
    if topology.launcher == "torchrun":
        return nccl_or_gloo
    if topology.is_mpi_launch and mpi_present:
        return "mpi"
    if topology.launcher == "single":
        # A single process needs no transport; MPI (if present) starts as a singleton. With a
        # GPU, nccl: its allreduce of one rank stays on the device, where MPI's and gloo's copy
        # every gradient through host memory and back.
        return "nccl" if cuda else "mpi" if mpi_present else "gloo"
    return nccl_or_gloo


def create_world(backend: str, topology: Topology, timeout_s: float = 1800.0, mpi_comm=None,
                 cuda_aware: Optional[bool] = None, store=None) -> Communicator:
    """Create the communicator of all ranks for ``backend``.

    Args:
        mpi_comm: an mpi4py communicator to use instead of COMM_WORLD (MPI backend only).
        cuda_aware: force the MPI CUDA-awareness decision (None: ask the library).
        store: the torch.distributed store the ranks meet through (an elastic job's generation).
    """
    if backend == "mpi":
        from hpdl.comm.mpi import MPICommunicator

        return MPICommunicator(mpi_comm, cuda_aware=cuda_aware)
    if backend in ("gloo", "nccl"):
        if backend == "nccl":
            check_nccl_available()
        from hpdl.comm.torch_dist import TorchCommunicator, init_process_group

        init_process_group(backend, topology.rank, topology.size, timeout_s, store=store)
        return TorchCommunicator(backend)
    raise CommError(f"unknown backend {backend!r}")
