"""`hpdl run` and `hpdl check`: build an mpiexec / srun / torchrun command and exec it.

Everything that decides the command is a pure function of (options, environment, launchers
found), so it is tested without MPI, Slurm or a second machine.
"""

from hpdl.launch.builders import (
    LAUNCHERS,
    RunOptions,
    build_mpiexec,
    build_run,
    build_srun,
    build_torchrun,
    choose_launcher,
    format_command,
    settings_env,
    srun_mpi_plugin,
)
from hpdl.launch.check import check_report, print_check
from hpdl.launch.detect import (
    LauncherInfo,
    detect_launchers,
    mpi_default_from_config,
    mpi_flavour_from_version,
    mpi_version_from_version,
    ranks_path,
    srun_mpi_plugins_from_list,
)
from hpdl.launch.hosts import Host, HostList, LaunchError, parse_hostfile, parse_hosts, read_hostfile

__all__ = [
    "LAUNCHERS",
    "Host",
    "HostList",
    "LaunchError",
    "LauncherInfo",
    "RunOptions",
    "build_mpiexec",
    "build_run",
    "build_srun",
    "build_torchrun",
    "check_report",
    "choose_launcher",
    "detect_launchers",
    "format_command",
    "mpi_default_from_config",
    "mpi_flavour_from_version",
    "mpi_version_from_version",
    "parse_hostfile",
    "parse_hosts",
    "print_check",
    "ranks_path",
    "read_hostfile",
    "settings_env",
    "srun_mpi_plugin",
    "srun_mpi_plugins_from_list",
]
