"""`hpdl check`: what this installation can do, in the manner of ``horovodrun --check-build``.

Every probe is guarded: a missing or broken piece (no mpi4py, an MPI library that fails to
load, no torch.distributed) shows as ``[ ]`` with the reason instead of stopping the report,
because the report is what a user runs to find out what is missing.
"""

from __future__ import annotations

import importlib
import os
import sys
from typing import Callable, List, Mapping, Optional, Tuple

from hpdl import __version__
from hpdl.launch.detect import FLAVOUR_NAMES, LauncherInfo, detect_launchers, spark_status


def _box(ok: bool) -> str:
    return "[X]" if ok else "[ ]"


def _guard(probe: Callable[[], List[str]], what: str) -> List[str]:
    try:
        return probe()
    except Exception as err:  # a report line, not a crash: see the module docstring
        return [f"    [ ] {what} (error: {type(err).__name__}: {err})"]


def _torch_lines() -> List[str]:
    import torch

    count = torch.cuda.device_count() if torch.cuda.is_available() else 0
    cuda = f"CUDA {torch.version.cuda}, {count} device(s)" if count else "CUDA not available"
    return [f"    [X] PyTorch {torch.__version__} ({cuda})"]


def _mpi_line() -> List[str]:
    try:
        mpi = importlib.import_module("hpdl.comm.mpi")
    except ImportError as err:
        return [f"    [ ] MPI (cannot import: {err})"]
    if not mpi.mpi_available():
        return [f"    [ ] MPI ({mpi.mpi_missing_reason()})"]
    aware = "CUDA-aware" if mpi.mpi_cuda_aware() else "not CUDA-aware"
    return [f"    [X] MPI ({mpi.mpi_flavour()}: {mpi.mpi_library_version()}; {aware})"]


def _torch_backend_lines() -> List[str]:
    import torch.distributed as dist

    if not dist.is_available():
        return ["    [ ] Gloo (torch.distributed is not available in this build)", "    [ ] NCCL"]
    return [
        f"    {_box(dist.is_gloo_available())} Gloo",
        f"    {_box(dist.is_nccl_available())} NCCL",
    ]


def _launcher_lines(info: LauncherInfo) -> List[str]:
    lines = []
    if info.mpiexec:
        version = f" {info.mpi_version}" if info.mpi_version else ""
        lines.append(f"    [X] {info.mpiexec} ({FLAVOUR_NAMES[info.mpi_flavour]}{version}; {info.mpiexec_path})")
    else:
        lines.append("    [ ] mpiexec")
    lines.append(f"    [X] srun ({info.srun_path}{_srun_mpi_note(info)})" if info.srun else "    [ ] srun")
    lines.append(f"    [X] torchrun ({info.torchrun_path})" if info.torchrun else "    [ ] torchrun")
    return lines


def _srun_mpi_note(info: LauncherInfo) -> str:
    if not info.srun_mpi_plugins:
        return ""
    default = f", default {info.srun_mpi_default}" if info.srun_mpi_default else ""
    return f"; MPI plugins {', '.join(sorted(info.srun_mpi_plugins))}{default}"


def _topology_lines(env: Optional[Mapping[str, str]]) -> List[str]:
    from hpdl.comm.topology import discover_topology

    topo = discover_topology(env)
    cross = (
        f", cross {topo.cross_rank} of {topo.cross_size}" if topo.complete else ""
    )
    return [
        f"    launcher: {topo.launcher}",
        f"    rank {topo.rank} of {topo.size} (local {topo.local_rank} of {topo.local_size}{cross})",
    ]


def _spark_lines(env: Optional[Mapping[str, str]]) -> List[str]:
    return [f"    {_box(ok)} {text}" for ok, text in spark_status(env)]


def settings_error(env: Optional[Mapping[str, str]] = None) -> Optional[str]:
    """Why the ``HPDL_*`` variables of ``env`` (default ``os.environ``) are not valid settings, or None."""
    from hpdl.config import Settings, SettingsError

    try:
        Settings.from_env(env)
    except SettingsError as err:
        return str(err)
    return None


def _settings_lines(env: Optional[Mapping[str, str]]) -> List[str]:
    error = settings_error(env)
    if error is not None:
        return [f"    [ ] HPDL_* settings (error: {error})"]
    names = sorted(k for k in (os.environ if env is None else env) if k.startswith("HPDL_"))
    return [f"    [X] HPDL_* settings ({', '.join(names) if names else 'none set'})"]


def check_report(env: Optional[Mapping[str, str]] = None, info: Optional[LauncherInfo] = None) -> List[str]:
    """Return the lines of the `hpdl check` report.

    Args:
        env: the environment whose topology to show (default ``os.environ``).
        info: the launchers found (default: :func:`detect_launchers`).
    """
    sections: List[Tuple[str, List[str]]] = [
        ("Available frameworks:", _guard(_torch_lines, "PyTorch")),
        ("Available backends:", _guard(_mpi_line, "MPI") + _guard(_torch_backend_lines, "Gloo / NCCL")),
        ("Available launchers:", _guard(lambda: _launcher_lines(info or detect_launchers(env)), "launchers")),
        ("Topology of this process:", _guard(lambda: _topology_lines(env), "topology")),
        ("Spark (hpdl.spark.run):", _guard(lambda: _spark_lines(env), "pyspark and Java")),
        ("Settings:", _guard(lambda: _settings_lines(env), "HPDL_* settings")),
    ]
    lines = [f"hpdl v{__version__} (Python {sys.version.split()[0]}):", ""]
    for title, body in sections:
        lines += [title] + body + [""]
    return lines[:-1]


def print_check(env: Optional[Mapping[str, str]] = None) -> int:
    """Print the `hpdl check` report; return 0, or 2 when an ``HPDL_*`` setting is invalid (as
    hpdl's other commands exit on one): a job started here would fail on it."""
    print("\n".join(check_report(env)), flush=True)
    return 0 if settings_error(env) is None else 2
