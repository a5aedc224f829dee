"""Which launchers this machine has, and which MPI an ``mpiexec`` belongs to.

The MPI flavour decides the syntax of every option we pass (``-n`` or ``-np``, ``-genv K V``
or ``-x K=V``), so it is read from ``mpiexec --version``, as accelerate does, rather than
guessed from the mpi4py in this interpreter, which may be built against another MPI.
:func:`mpi_flavour_from_version` is pure; :func:`detect_launchers` is the one function that
looks at PATH and runs a program, and the builders take its result as an argument.
"""

from __future__ import annotations

import dataclasses
import os
import re
import shutil
import socket
import subprocess
from typing import FrozenSet, Mapping, Optional

MPICH = "mpich"
OPENMPI = "openmpi"
MVAPICH2 = "mvapich2"
INTELMPI = "intelmpi"
UNKNOWN = "unknown"

FLAVOUR_NAMES = {
    MPICH: "MPICH (Hydra)",
    OPENMPI: "Open MPI",
    MVAPICH2: "MVAPICH2 (Hydra)",
    INTELMPI: "Intel MPI (Hydra)",
    UNKNOWN: "unknown MPI",
}
HYDRA_FLAVOURS = (MPICH, MVAPICH2, INTELMPI)


def mpi_flavour_from_version(text: str) -> str:
    """Return the MPI flavour ("mpich", "openmpi", "mvapich2", "intelmpi" or "unknown").

    Args:
        text: what ``mpiexec --version`` printed (stdout and stderr together).
    """
    lowered = text.lower()
    # Order matters: MVAPICH2 and Intel MPI ship Hydra too, so their own names win over it.
    if "intel(r) mpi" in lowered or "intel mpi" in lowered:
        return INTELMPI
    if "mvapich" in lowered:
        return MVAPICH2
    if "open mpi" in lowered or "openrte" in lowered or "open-mpi.org" in lowered or "prrte" in lowered:
        return OPENMPI
    if "hydra" in lowered or "mpich" in lowered:
        return MPICH
    return UNKNOWN


def mpi_version_from_version(text: str) -> str:
    """Return the version number in ``mpiexec --version`` output (e.g. "4.1.5"), or ""."""
    for pattern in (
        r"\((?:Open MPI|OpenRTE|PRRTE)\)\s+(\S+)",  # mpirun (Open MPI) 5.0.3
        r"Version:?\s+(\d[\w.]*(?:\s+Update\s+\d+)?)",  # Hydra and Intel MPI
    ):
        match = re.search(pattern, text)
        if match:
            return match.group(1)
    return ""


@dataclasses.dataclass(frozen=True)
class LauncherInfo:
    """The launchers found on this machine, as the builders need them.

    ``mpiexec``, ``srun`` and ``torchrun`` hold the command name to run (None when absent);
    ``*_path`` fields hold where it was found, for reports.
    """

    mpiexec: Optional[str] = None
    mpiexec_path: str = ""
    mpi_flavour: str = UNKNOWN
    mpi_version_text: str = ""
    srun: Optional[str] = None
    srun_path: str = ""
    torchrun: Optional[str] = None
    torchrun_path: str = ""
    hostnames: FrozenSet[str] = frozenset({"localhost", "127.0.0.1", "::1"})
    cwd: str = "/"

    @property
    def mpi_version(self) -> str:
        return mpi_version_from_version(self.mpi_version_text)

    def is_local(self, host: str) -> bool:
        """Return whether ``host`` names this machine."""
        return host in self.hostnames or host.split(".")[0] in self.hostnames


def _version_text(executable: str, timeout_s: float = 10.0) -> str:
    try:
        done = subprocess.run(
            [executable, "--version"], stdin=subprocess.DEVNULL, stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT, timeout=timeout_s, check=False,
        )
    except (OSError, subprocess.SubprocessError):
        return ""
    return done.stdout.decode("utf-8", "replace")


def _local_names() -> FrozenSet[str]:
    names = {"localhost", "127.0.0.1", "::1"}
    try:
        full = socket.gethostname()
        names.update({full, full.split(".")[0], socket.getfqdn()})
    except OSError:  # pragma: no cover - a machine without a host name
        pass
    return frozenset(n for n in names if n)


def detect_launchers(env: Optional[Mapping[str, str]] = None) -> LauncherInfo:
    """Find mpiexec (or mpirun), srun and torchrun on PATH and read mpiexec's flavour."""
    env = os.environ if env is None else env
    path = env.get("PATH", os.defpath)
    mpiexec = mpiexec_path = None
    for name in ("mpiexec", "mpirun"):
        mpiexec_path = shutil.which(name, path=path)
        if mpiexec_path:
            mpiexec = name
            break
    text = _version_text(mpiexec_path) if mpiexec_path else ""
    srun_path = shutil.which("srun", path=path)
    torchrun_path = shutil.which("torchrun", path=path)
    return LauncherInfo(
        mpiexec=mpiexec,
        mpiexec_path=mpiexec_path or "",
        mpi_flavour=mpi_flavour_from_version(text) if mpiexec else UNKNOWN,
        mpi_version_text=text,
        srun="srun" if srun_path else None,
        srun_path=srun_path or "",
        torchrun="torchrun" if torchrun_path else None,
        torchrun_path=torchrun_path or "",
        hostnames=_local_names(),
        cwd=os.getcwd(),
    )
