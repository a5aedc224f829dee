"""OSU-style allreduce benchmark: latency and bandwidth per message size, per path.

Follows osu_allreduce's method: sizes doubling from 4 B, per-size warm-up and iteration counts
(more for small messages), each call timed on its own and followed by an untimed barrier, each
rank's average reduced to avg/min/max over ranks. Bandwidth columns follow nccl-tests:
algbw = size / time and busbw = algbw * 2 (p-1) / p.

Several paths can be measured in one run (the raw backend collective, the same done
hierarchically (within each node, across nodes, within again), mpi4py on numpy buffers, and the
hpdl engine); they alternate round by round and the median round is reported, so that
a shared machine's drifting load hits every path alike.
"""

from __future__ import annotations

import dataclasses
import os
import time
from typing import Any, Callable, Dict, List, Optional, Sequence

import torch

from hpdl.bench.stats import doubling_sizes, median
from hpdl.comm import dtypes
from hpdl.formatting import format_size, format_table

# The element types --dtype chooses among (of hpdl's, hpdl/comm/dtypes.py).
DTYPES = {name: dtypes.DTYPES[name]
          for name in ("float32", "float64", "float16", "bfloat16", "int32", "int64", "uint8")}
PATHS = ("backend", "hierarchical", "engine", "mpi4py")
# Buffers of the message size each path holds per tensor: the tensor, and for mpi4py its numpy
# send and receive buffers besides.
_BUFFERS = {"backend": 1, "hierarchical": 1, "engine": 1, "mpi4py": 3}


class MessageMemoryError(RuntimeError):
    """The messages of a size do not fit in memory; the message names the size, in one line."""


@dataclasses.dataclass(frozen=True)
class AllreduceOptions:
    """What to measure; defaults follow osu_allreduce."""

    min_bytes: int = 4
    max_bytes: int = 64 << 20
    dtype: str = "float32"
    iterations_small: int = 1000
    iterations_large: int = 100
    warmup_small: int = 100
    warmup_large: int = 10
    large_above: int = 8192  # OSU switches to the large-message counts above 8 KiB
    rounds: int = 1
    paths: Sequence[str] = ("backend",)
    tensors: int = 1  # tensors of the given size reduced per timed call (submitted together)

    def __post_init__(self) -> None:
        # Checked here, before any rank communicates, so a bad value ends every rank at once.
        if self.dtype not in DTYPES:
            raise ValueError(f"unknown --dtype {self.dtype!r}; choose from {', '.join(DTYPES)}")
        elem = DTYPES[self.dtype].itemsize
        if self.min_bytes > self.max_bytes:
            raise ValueError(f"--min-size ({self.min_bytes} B) is larger than --max-size ({self.max_bytes} B): "
                             "no message size to measure")
        if self.max_bytes < elem:
            raise ValueError(f"--max-size ({self.max_bytes} B) is smaller than one {self.dtype} element ({elem} B)")
        if self.min_bytes < elem:
            raise ValueError(f"--min-size ({self.min_bytes} B) is smaller than one {self.dtype} element ({elem} B); "
                             f"the smallest message is --min-size {elem}")
        if self.min_bytes % elem:
            raise ValueError(f"--min-size ({self.min_bytes} B) is not a whole number of {self.dtype} elements "
                             f"({elem} B each)")
        for flag, value, least in (("--iterations", self.iterations_small, 1),
                                   ("--iterations-large", self.iterations_large, 1),
                                   ("--warmup", self.warmup_small, 0), ("--warmup-large", self.warmup_large, 0),
                                   ("--rounds", self.rounds, 1), ("--tensors", self.tensors, 1)):
            if value < least:
                raise ValueError(f"{flag} must be at least {least}, got {value}")
        if not self.paths or any(p not in PATHS for p in self.paths) or len(set(self.paths)) != len(self.paths):
            raise ValueError(f"--paths takes distinct paths among {', '.join(PATHS)}, got {','.join(self.paths)!r}")
        if "mpi4py" in self.paths and _numpy_type(DTYPES[self.dtype]) is None:
            raise ValueError(f"the mpi4py path has no numpy type for --dtype {self.dtype}")


def _numpy_type(dtype: torch.dtype) -> Any:
    """numpy's type of ``dtype``, for the mpi4py path, or None (numpy has no bfloat16)."""
    import numpy as np

    return getattr(np, dtypes.dtype_name(dtype), None)


# A path maps the messages of one timed call (tensors of the given size) to a zero-argument
# call that reduces them all: one after the other for the raw paths, submitted together for
# the engine (which may fuse them).
PathFactory = Callable[[List[torch.Tensor]], Callable[[], None]]


def _backend_path(comm) -> PathFactory:
    from hpdl.comm import ReduceOp

    def make(tensors: List[torch.Tensor]) -> Callable[[], None]:
        if len(tensors) == 1:
            tensor = tensors[0]
            return lambda: comm.allreduce(tensor, ReduceOp.SUM)
        return lambda: [comm.allreduce(t, ReduceOp.SUM) for t in tensors]

    return make


def _mpi4py_path(mpi_comm) -> PathFactory:
    from mpi4py import MPI

    def make(tensors: List[torch.Tensor]) -> Callable[[], None]:
        import numpy as np

        pairs = []
        for t in tensors:
            send = np.ones(t.numel(), dtype=_numpy_type(t.dtype))
            pairs.append((send, np.empty_like(send)))
        if len(pairs) == 1:
            send, recv = pairs[0]
            return lambda: mpi_comm.Allreduce(send, recv, op=MPI.SUM)
        return lambda: [mpi_comm.Allreduce(send, recv, op=MPI.SUM) for send, recv in pairs]

    return make


def _engine_path() -> PathFactory:
    import hpdl.torch as hvd
    from hpdl.torch.mpi_ops import wait_done

    def make(tensors: List[torch.Tensor]) -> Callable[[], None]:
        names = [f"bench.allreduce.{t.numel()}.{i}" for i, t in enumerate(tensors)]
        if len(tensors) == 1:
            tensor, name = tensors[0], names[0]
            return lambda: hvd.allreduce_(tensor, op=hvd.Sum, name=name)

        def call() -> None:
            handles = [hvd.allreduce_async_(t, op=hvd.Sum, name=n) for t, n in zip(tensors, names)]
            wait_done(handles[-1])  # the last first, as DistributedOptimizer waits
            for handle in handles:
                hvd.synchronize(handle)

        return call

    return make


def _time_calls(call: Callable[[], None], barrier: Callable[[], None], warmup: int, iterations: int) -> float:
    """Return this rank's average seconds per call, timing each call alone (OSU's method)."""
    for _ in range(warmup):
        call()
        barrier()
    total = 0.0
    for _ in range(iterations):
        start = time.perf_counter()
        call()
        total += time.perf_counter() - start
        barrier()
    return total / iterations


def run_allreduce(opts: AllreduceOptions, comm, paths: Optional[Dict[str, PathFactory]] = None) -> List[dict]:
    """Measure every path at every size; return one record per (path, size), same on all ranks.

    Args:
        opts: sizes, counts and paths.
        comm: the hpdl communicator used for barriers and to gather timings.
        paths: path factories by name (default: built from ``opts.paths``).
    """
    dtype = DTYPES[opts.dtype]
    elem = torch.empty(0, dtype=dtype).element_size()
    paths = paths if paths is not None else build_paths(opts.paths, comm)
    p = comm.size
    records: List[dict] = []
    sizes = doubling_sizes(opts.min_bytes, opts.max_bytes)
    _refuse_together(comm, _beyond_memory(opts, sizes[-1], comm))
    for size in sizes:
        count = size // elem
        large = size > opts.large_above
        warmup = opts.warmup_large if large else opts.warmup_small
        iterations = opts.iterations_large if large else opts.iterations_small
        try:
            calls = {name: factory([torch.ones(count, dtype=dtype) for _ in range(opts.tensors)])
                     for name, factory in paths.items()}
            failed = None
        except (MemoryError, RuntimeError) as err:
            if not isinstance(err, MemoryError) and "allocate" not in str(err):
                raise
            failed = (f"cannot allocate the messages of {format_size(size)} ({_buffers(opts)} x {size} B on each "
                      f"rank): out of memory; lower --max-size")
        _refuse_together(comm, failed)
        rounds: Dict[str, List[float]] = {name: [] for name in paths}
        names = list(paths)
        for r in range(opts.rounds):
            # Alternate the order so that neither path always runs right after the other.
            for name in names if r % 2 == 0 else names[::-1]:
                rounds[name].append(_time_calls(calls[name], comm.barrier, warmup, iterations))
        for name in names:
            mine = median(rounds[name])
            everyone = comm.allgather_object(mine)
            avg = sum(everyone) / p
            algbw = size * opts.tensors / avg / 1e9
            records.append({
                "path": name, "size": size, "tensors": opts.tensors, "avg_us": avg * 1e6, "min_us": min(everyone) * 1e6,
                "max_us": max(everyone) * 1e6, "algbw_GBps": algbw, "busbw_GBps": algbw * 2 * (p - 1) / p,
                "iterations": iterations, "rounds": opts.rounds,
            })
    return records


def _buffers(opts: AllreduceOptions) -> int:
    """How many buffers of the message size each rank holds: every path's, for every tensor."""
    return opts.tensors * sum(_BUFFERS[name] for name in opts.paths)


def _beyond_memory(opts: AllreduceOptions, largest: int, comm) -> Optional[str]:
    """Why the messages of the ``largest`` size cannot fit in this host's memory, or None.

    The ranks on this host hold theirs at once; swap would only measure the disk. A collective
    over ``comm`` (it counts the ranks of each host).
    """
    hosts = comm.host_names()
    host_ranks = hosts.count(hosts[comm.rank])
    need = largest * _buffers(opts) * host_ranks
    try:
        memory = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (ValueError, OSError, AttributeError):  # not a POSIX system: the allocation will tell
        return None
    if need <= memory:
        return None
    return (f"--max-size: messages of {format_size(largest)} need {format_size(need)} on this host "
            f"({_buffers(opts)} x {largest} B on each of its {host_ranks} rank(s)), more than its "
            f"{format_size(memory)} of memory")


def _refuse_together(comm, problem: Optional[str]) -> None:
    """Raise :class:`MessageMemoryError` on every rank if ``problem`` is set on any (a collective).

    One rank out of memory must not leave the others waiting for it in the next collective;
    rank 0 reports what the first rank with a problem found.
    """
    problems = [p for p in comm.allgather_object(problem) if p is not None]
    if problems:
        raise MessageMemoryError(problems[0])


def build_paths(names: Sequence[str], comm) -> Dict[str, PathFactory]:
    """Create the named paths (``PATHS``); collective over ``comm`` (hierarchical builds groups)."""
    factories: Dict[str, PathFactory] = {}
    for name in names:
        if name == "backend":
            factories[name] = _backend_path(comm)
        elif name == "mpi4py":
            mpi_comm = getattr(comm, "mpi_comm", None)
            if mpi_comm is None:
                raise ValueError("the mpi4py path needs the MPI backend (launch with mpiexec)")
            factories[name] = _mpi4py_path(mpi_comm)
        elif name == "engine":
            factories[name] = _engine_path()
        elif name == "hierarchical":
            from hpdl.comm.hierarchical import HierarchicalCommunicator

            # The backend's allreduce, node-aware: within each node, across nodes, within again.
            factories[name] = _backend_path(HierarchicalCommunicator(comm, comm.host_names()))
        else:
            raise ValueError(f"unknown path {name!r}; choose from {', '.join(PATHS)}")
    return factories


def format_records(records: List[dict], ranks: int, backend: str, dtype: str) -> str:
    """Render records as OSU-style tables, one per path, plus ratios when paths were compared."""
    out = []
    paths = list(dict.fromkeys(r["path"] for r in records))
    for path in paths:
        rows = [
            (r["size"], f"{r['avg_us']:.2f}", f"{r['min_us']:.2f}", f"{r['max_us']:.2f}",
             f"{r['algbw_GBps']:.3f}", f"{r['busbw_GBps']:.3f}")
            for r in records if r["path"] == path
        ]
        many = records[0].get("tensors", 1)
        per_call = f" tensors_per_call={many} (Size per tensor, time per call)" if many > 1 else ""
        out.append(f"# hpdl allreduce benchmark: path={path} backend={backend} ranks={ranks} dtype={dtype}{per_call}")
        out.append(format_table(["Size", "Avg(us)", "Min(us)", "Max(us)", "algbw(GB/s)", "busbw(GB/s)"], rows))
        out.append("")
    ratios = bandwidth_ratios(records)
    if ratios:
        columns = [name for name in ratios[0] if name != "size"]
        rows = [[entry["size"]] + [f"{entry[name]:.3f}" for name in columns] for entry in ratios]
        out.append(f"# bandwidth ratio against {paths[-1]} (median of {records[0]['rounds']} alternating rounds)")
        out.append(format_table(["Size", *columns], rows))
    return "\n".join(out).rstrip()


def bandwidth_ratios(records: List[dict]) -> List[dict]:
    """Per size, each path's bandwidth against the last path's (``{"size": 4, "backend/mpi4py": 1.02}``);
    empty with one path."""
    paths = list(dict.fromkeys(r["path"] for r in records))
    if len(paths) < 2:
        return []
    base = paths[-1]
    by_key = {(r["path"], r["size"]): r for r in records}
    return [{"size": r["size"], **{f"{p}/{base}": by_key[(p, r["size"])]["algbw_GBps"] / r["algbw_GBps"]
                                   for p in paths[:-1]}}
            for r in records if r["path"] == base]
