"""What `hpdl run`'s tests describe launchers with: real `--version` outputs of each MPI and srun,
and the fake LauncherInfo and build_run calls built from them."""

from hpdl.launch import LauncherInfo, RunOptions, build_run, srun_mpi_plugins_from_list
from hpdl.launch.limits import RUN_SETTINGS
from hpdl.launch import detect

# --- realistic `mpiexec --version` outputs ----------------------------------------------

MPICH_TEXT = """\
HYDRA build details:
    Version:                                 4.1.2
    Release Date:                            Wed Jun  7 15:22:45 CDT 2023
    CC:                              gcc    -Wdate-time -D_FORTIFY_SOURCE=2 -g -O2
    Configure options:                       '--disable-option-checking' '--prefix=/usr' '--with-device=ch4:ofi' '--with-pm=hydra'
    Process Manager:                         pmi
    Launchers available:                     ssh rsh fork slurm ll lsf sge manual persist
    Topology libraries available:            hwloc
    Resource management kernels available:   user slurm ll lsf sge pbs cobalt
    Demux engines available:                 poll select
"""
OPENMPI4_TEXT = """\
mpiexec (OpenRTE) 4.1.5

Report bugs to http://www.open-mpi.org/community/help/
"""
OPENMPI5_TEXT = """\
mpiexec (Open MPI) 5.0.3

Report bugs to https://www.open-mpi.org/community/help/
"""
MVAPICH2_TEXT = """\
HYDRA build details:
    Version:                                 3.2.1
    Release Date:                            General Availability Release
    CC:                              gcc    -DNDEBUG -DNVALGRIND -O2
    CXX:                             g++   -DNDEBUG -DNVALGRIND -O2
    Configure options:                       '--disable-option-checking' '--prefix=/opt/mvapich2/2.3.7' '--with-device=ch3:mrail' '--with-rdma=gen2' 'MPICHLIB_CFLAGS=-O2'
    Process Manager:                         pmi
    Launchers available:                     ssh rsh fork slurm ll lsf sge manual persist
    Topology libraries available:            hwloc
    Resource management kernels available:   user slurm ll lsf sge pbs cobalt
    Demux engines available:                 poll select
"""
INTEL_TEXT = """\
Intel(R) MPI Library for Linux* OS, Version 2021.10 Build 20230619 (id: c2e19c2f3e)
Copyright 2003-2023, Intel Corporation.
"""
INTEL2019_TEXT = "Intel(R) MPI Library for Linux* OS, Version 2019 Update 9 Build 20200923 (id: abd58e492)\n"


SRUN_LIST_22 = """\
MPI plugin types are...
\tpmix
\tnone
\tcray_shasta
\tpmi2
specific pmix plugin versions available: pmix_v4
"""
SRUN_LIST_OLD = "srun: MPI types are...\nsrun: none\nsrun: openmpi\nsrun: pmi2\n"
ALL_PLUGINS = srun_mpi_plugins_from_list(SRUN_LIST_22)


def info(flavour=detect.MPICH, mpiexec="mpiexec", torchrun="torchrun", srun=None, plugins=frozenset(),
         mpi_default="", python_bin=""):
    return LauncherInfo(
        mpiexec=mpiexec, mpi_flavour=flavour, torchrun=torchrun, srun=srun, srun_mpi_plugins=plugins,
        srun_mpi_default=mpi_default, hostnames=frozenset({"localhost", "127.0.0.1", "vm"}), cwd="/job",
        python_bin=python_bin,
    )


def run(command=("python", "train.py"), env=None, launchers=None, **options):
    """``(argv, env)`` of a launch that is one command (every launch but torchrun across hosts).

    ``options`` are RunOptions' fields and the options that set settings (its ``settings``).
    """
    settings = {name: options.pop(name) for name in list(options) if name in RUN_SETTINGS}
    commands, out_env = build_run(RunOptions(command=tuple(command), settings=settings, **options), env or {},
                                  launchers or info())
    assert len(commands) == 1, commands
    return commands[0], out_env


