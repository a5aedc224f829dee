"""Which launchers this machine has, which MPI an ``mpiexec`` belongs to, and which Java Spark would use.

The MPI flavour decides the syntax of every option we pass (``-n`` or ``-np``, ``-genv K V``
or ``-x K=V``), so it is read from ``mpiexec --version``, as accelerate does, rather than
guessed from the mpi4py in this interpreter, which may be built against another MPI.
Inside a Slurm allocation (or when srun is asked for by name) srun is asked which MPI
plugins it has and which one the site made the default, since srun's own default ("none" on
a stock install) starts MPICH tasks as worlds of one. The parsers of these outputs are pure;
:func:`detect_launchers` is the one function that looks at PATH and runs programs, and the
builders take its result as an argument. :func:`detect_java` likewise finds and asks the
``java`` that pyspark would start (``$JAVA_HOME/bin/java``, else ``java`` on PATH), and
:func:`spark_status` says whether Spark can start from Python here (pyspark installed, a Java
it runs on), for `hpdl check` and for the tests, which skip with the reason where it cannot:
the package's version and ``java -version`` tell, without importing pyspark or starting a JVM.
"""

from __future__ import annotations

import dataclasses
import importlib.metadata
import importlib.util
import os
import re
import shutil
import socket
import subprocess
import sys
from typing import FrozenSet, List, Mapping, Optional, Tuple

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
_PLUGIN_NAME = re.compile(r"[a-z][a-z0-9_]*")


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


def srun_mpi_plugins_from_list(text: str) -> FrozenSet[str]:
    """Return the MPI plugin names in what ``srun --mpi=list`` printed (any Slurm's layout).

    Slurm 22 and later print a header, one tab-indented name a line and a line of specific
    PMIx versions ("...available: pmix_v4"); older ones prefix every line with "srun: ".
    """
    names = set()
    for line in text.splitlines():
        line = line.strip()
        line = line[len("srun:"):].strip() if line.startswith("srun:") else line
        if "available:" in line:
            names.update(_PLUGIN_NAME.findall(line.split("available:", 1)[1]))
        elif _PLUGIN_NAME.fullmatch(line):
            names.add(line)
    return frozenset(names)


def mpi_default_from_config(text: str) -> str:
    """Return the site's ``MpiDefault`` in ``scontrol show config`` output, or "" if absent."""
    match = re.search(r"^MpiDefault\s*=\s*(\S+)", text, re.MULTILINE)
    return match.group(1) if match else ""


def ranks_path(path: str, python_bin: str) -> str:
    """Return the ranks' PATH: ``path`` with ``python_bin`` first when it is not on it at all.

    ``python_bin`` is the directory of the running interpreter, where ``pip install hpdl[mpi]``
    put hpdl, mpiexec and torchrun. It is missing from PATH when that environment is not
    activated (cron, batch scripts, IDEs); an activated environment or a system interpreter
    keeps the PATH it has, so an MPI chosen by PATH order stays chosen.
    """
    if not python_bin:
        return path
    entries = {os.path.normpath(entry) for entry in path.split(os.pathsep) if entry}
    if os.path.normpath(python_bin) in entries:
        return path
    return os.pathsep.join([python_bin, path]) if path else python_bin


def program_problem(program: str, path: str, cwd: str) -> Optional[str]:
    """Why ``program`` could not be started, looked for as execvp looks for it (a name with a
    "/" is a path from ``cwd``, any other a name on ``path``), or None when it could."""
    if os.sep not in program:
        return None if shutil.which(program, path=path) else f"{program}: no such program on PATH"
    where = os.path.join(cwd, program)
    if not os.path.exists(where):
        return f"{program}: no such file"
    if os.path.isdir(where):
        return f"{program}: is a directory"
    if not os.access(where, os.X_OK):
        return f"{program}: not executable (make it so with chmod +x, or run it through its interpreter)"
    return None


@dataclasses.dataclass(frozen=True)
class LauncherInfo:
    """The launchers found on this machine, as the builders need them.

    ``mpiexec``, ``srun`` and ``torchrun`` hold the command name to run (None when absent);
    ``*_path`` fields hold where it was found, for reports. ``srun_mpi_plugins`` and
    ``srun_mpi_default`` (the site's MpiDefault) are empty when srun was not asked.
    ``python_bin`` is the running interpreter's directory (see :func:`ranks_path`).
    """

    mpiexec: Optional[str] = None
    mpiexec_path: str = ""
    mpi_flavour: str = UNKNOWN
    mpi_version_text: str = ""
    srun: Optional[str] = None
    srun_path: str = ""
    srun_mpi_plugins: FrozenSet[str] = frozenset()
    srun_mpi_default: str = ""
    torchrun: Optional[str] = None
    torchrun_path: str = ""
    hostnames: FrozenSet[str] = frozenset({"localhost", "127.0.0.1", "::1"})
    cwd: str = "/"
    python_bin: str = ""

    @property
    def mpi_version(self) -> str:
        return mpi_version_from_version(self.mpi_version_text)

    def is_local(self, host: str) -> bool:
        """Return whether ``host`` names this machine."""
        return host in self.hostnames or host.split(".")[0] in self.hostnames


def _output(argv: List[str], timeout_s: float = 10.0) -> str:
    try:
        done = subprocess.run(
            argv, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT, timeout=timeout_s, check=False,
        )
    except (OSError, subprocess.SubprocessError):
        return ""
    return done.stdout.decode("utf-8", "replace")


def _version_text(executable: str) -> str:
    return _output([executable, "--version"])


def _srun_mpi(srun_path: str, path: str) -> Tuple[FrozenSet[str], str]:
    """The MPI plugins srun lists and the site's default one (asks the controller)."""
    plugins = srun_mpi_plugins_from_list(_output([srun_path, "--mpi=list"]))
    scontrol = shutil.which("scontrol", path=path)
    return plugins, mpi_default_from_config(_output([scontrol, "show", "config"])) if scontrol else ""


def _local_names() -> FrozenSet[str]:
    names = {"localhost", "127.0.0.1", "::1"}
    try:
        full = socket.gethostname()
        names.update({full, full.split(".")[0], socket.getfqdn()})
    except OSError:  # pragma: no cover - a machine without a host name
        pass
    return frozenset(n for n in names if n)


def detect_launchers(env: Optional[Mapping[str, str]] = None, probe_srun: bool = False,
                     python_bin: Optional[str] = None) -> LauncherInfo:
    """Find mpiexec (or mpirun), srun and torchrun and read mpiexec's flavour.

    Args:
        env: the environment whose PATH to search (default ``os.environ``); the running
            interpreter's directory is searched first when PATH lacks it (:func:`ranks_path`).
        probe_srun: ask srun for its MPI plugins even outside a Slurm allocation (inside one,
            with SLURM_JOB_ID set, it is always asked).
        python_bin: the interpreter's directory (default: that of ``sys.executable``).
    """
    env = os.environ if env is None else env
    if python_bin is None:
        python_bin = os.path.dirname(os.path.abspath(sys.executable)) if sys.executable else ""
    path = ranks_path(env.get("PATH", os.defpath), python_bin)
    mpiexec = mpiexec_path = None
    for name in ("mpiexec", "mpirun"):
        mpiexec_path = shutil.which(name, path=path)
        if mpiexec_path:
            mpiexec = name
            break
    text = _version_text(mpiexec_path) if mpiexec_path else ""
    srun_path = shutil.which("srun", path=path)
    torchrun_path = shutil.which("torchrun", path=path)
    plugins, mpi_default = (
        _srun_mpi(srun_path, path) if srun_path and (probe_srun or "SLURM_JOB_ID" in env) else (frozenset(), "")
    )
    return LauncherInfo(
        mpiexec=mpiexec,
        mpiexec_path=mpiexec_path or "",
        mpi_flavour=mpi_flavour_from_version(text) if mpiexec else UNKNOWN,
        mpi_version_text=text,
        srun="srun" if srun_path else None,
        srun_path=srun_path or "",
        srun_mpi_plugins=plugins,
        srun_mpi_default=mpi_default,
        torchrun="torchrun" if torchrun_path else None,
        torchrun_path=torchrun_path or "",
        hostnames=_local_names(),
        cwd=os.getcwd(),
        python_bin=python_bin,
    )


def java_version_from_text(text: str) -> str:
    """Return the version ``java -version`` printed (``"17.0.15"``, ``"1.8.0_392"``), or "" if none."""
    match = re.search(r'version "([^"]+)"', text)
    return match.group(1) if match else ""


def java_major(version: str) -> int:
    """Return Java's major version of a version string: 17 for "17.0.15", 8 for "1.8.0_392"; 0 if unknown."""
    parts = re.findall(r"\d+", version)
    if not parts:
        return 0
    return int(parts[1]) if parts[0] == "1" and len(parts) > 1 else int(parts[0])


def detect_java(env: Optional[Mapping[str, str]] = None) -> Tuple[str, str]:
    """Find the ``java`` pyspark starts and ask its version: ``(path or "", version or "")``.

    As pyspark's launcher does: ``$JAVA_HOME/bin/java`` when JAVA_HOME is set, else ``java`` on PATH.
    """
    env = os.environ if env is None else env
    if env.get("JAVA_HOME"):
        path = os.path.join(env["JAVA_HOME"], "bin", "java")
        if not os.access(path, os.X_OK):
            return "", ""
    else:
        path = shutil.which("java", path=env.get("PATH", os.defpath)) or ""
    return path, java_version_from_text(_output([path, "-version"])) if path else ""


def pyspark_version() -> Optional[str]:
    """The installed pyspark's version, or None when it is not installed."""
    if importlib.util.find_spec("pyspark") is None:
        return None
    try:
        return importlib.metadata.version("pyspark")
    except importlib.metadata.PackageNotFoundError:  # importable from a Spark distribution's python/
        import pyspark

        return getattr(pyspark, "__version__", "unknown")


def java_needed(pyspark: str) -> int:
    """The oldest Java major version a pyspark release runs on: 17 from Spark 4, 8 before."""
    major = pyspark.split(".")[0]
    return 17 if major.isdigit() and int(major) >= 4 else 8


def spark_status(env: Optional[Mapping[str, str]] = None) -> List[Tuple[bool, str]]:
    """``(usable, description)`` of pyspark and of Java, in that order."""
    env = os.environ if env is None else env
    version = pyspark_version()
    if version is None:
        status = [(False, "pyspark (not installed: pip install 'hpdl[spark]')")]
    else:
        status = [(True, f"pyspark {version}")]
    path, java = detect_java(env)
    needed = java_needed(version) if version else 17
    where = "$JAVA_HOME/bin/java" if env.get("JAVA_HOME") else "java on PATH"
    if not path:
        status.append((False, f"Java (no {where}; Spark {version or '4'} needs Java {needed} or later)"))
    elif not java:
        status.append((False, f"Java ({path} printed no version)"))
    elif java_major(java) < needed:
        status.append((False, f"Java {java} ({path}; pyspark {version} needs Java {needed} or later)"))
    else:
        status.append((True, f"Java {java} ({path})"))
    return status


def spark_unusable_reason(env: Optional[Mapping[str, str]] = None) -> Optional[str]:
    """Why Spark cannot start here (one line), or None when pyspark and Java are both usable."""
    missing = [text for ok, text in spark_status(env) if not ok]
    return "; ".join(missing) if missing else None
