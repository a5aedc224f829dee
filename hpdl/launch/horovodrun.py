"""horovodrun's options that `hpdl run` takes beside its own, where they need more than a new spelling.

- ``--config-file``: horovodrun's YAML file (``controller`` and the sections ``params``,
  ``timeline``, ``stall_check``, ...), read into the values of `hpdl run`'s options; the command
  line wins over the file. What hpdl has no counterpart for gets one warning line, unless its
  value asks for what hpdl does anyway (``hierarchical_allgather: false``).
- ``-p/--ssh-port``, ``-i/--ssh-identity-file``, ``--network-interfaces``: variables that the
  launcher or the backends read (mpiexec passes ssh options to the ssh that starts remote
  ranks; gloo, NCCL and MPI's TCP transport keep to the named interfaces), or options of the
  ssh that starts torchrun on each host.
- ``--output-filename DIR``: each rank runs its command through :mod:`hpdl.launch.rank_output`,
  which sends its output to ``DIR/rank.<rank>/stdout`` and ``stderr``, as horovodrun does.
"""

from __future__ import annotations

import os
import sys
from typing import Any, Dict, List, Optional, Sequence, Tuple

from hpdl.atomic_file import make_directories
from hpdl.launch.detect import INTELMPI, MPICH, MVAPICH2, OPENMPI, LauncherInfo
from hpdl.launch.hosts import LaunchError
from hpdl.launch.limits import RUN_SETTINGS, check_number, numeric_options, option_type, run_spec

# horovodrun config file: (section, key) -> (`hpdl run` option, type): the keys that set settings,
# as the settings declare them (hpdl/config.py), then the stall check's switch and horovodrun's
# shutdown time, which set none of their own (hpdl/launch/cli.py: apply_config_file).
CONFIG_KEYS: Dict[Tuple[str, str], Tuple[str, type]] = {
    **{run_spec(option).config_key: (option, option_type(option))
       for option in RUN_SETTINGS if run_spec(option).config_key is not None},
    ("stall_check", "enabled"): ("stall_check", bool),
    ("stall_check", "shutdown_time_seconds"): ("stall_shutdown_s", float),
}
# horovodrun's one top-level setting that is not a section: the controller, gloo or mpi.
CONTROLLERS = ("gloo", "mpi")
# Sections of horovodrun's file whose settings hpdl has no counterpart for: one warning each
# (one per key in library_options and logging, whose keys are unrelated settings).
UNHONOURED_SECTIONS = ("elastic", "library_options", "logging")
# Keys hpdl has no counterpart for, in sections that it reads.
UNHONOURED_KEYS = {("params", "hierarchical_allgather"), ("params", "torus_allreduce")}
# Values that ask for what hpdl does anyway: no warning for them.
_HPDL_BEHAVIOUR = {("params", "hierarchical_allgather"): False,
                   ("params", "torus_allreduce"): False, ("library_options", "mpi_threads_disable"): False}

# Where each MPI's mpiexec takes extra arguments for the ssh that starts remote ranks, and the
# interface to use (Hydra-based mpiexecs take one interface only).
_SSH_ARGS_VARIABLE = {OPENMPI: "OMPI_MCA_plm_rsh_args", MPICH: "HYDRA_LAUNCHER_EXTRA_ARGS",
                      MVAPICH2: "HYDRA_LAUNCHER_EXTRA_ARGS", INTELMPI: "I_MPI_HYDRA_BOOTSTRAP_EXEC_EXTRA_ARGS"}
_HYDRA_IFACE_VARIABLE = {MPICH: "HYDRA_IFACE", MVAPICH2: "HYDRA_IFACE", INTELMPI: "I_MPI_HYDRA_IFACE"}
# Variables the backends read; Open MPI passes them on to remote ranks only when told to.
INTERFACE_VARIABLES = ("GLOO_SOCKET_IFNAME", "NCCL_SOCKET_IFNAME")


def config_sections_text() -> str:
    """The sections of the config file that hpdl reads, with their keys: "params (fusion_threshold_mb, ...), ..."."""
    sections: Dict[str, List[str]] = {}
    for section, key in CONFIG_KEYS:
        sections.setdefault(section, []).append(key)
    return ", ".join(f"{section} ({', '.join(keys)})" for section, keys in sections.items())


def read_config_file(path: str) -> Tuple[Dict[str, Any], List[str]]:
    """Read horovodrun's YAML config file.

    Returns:
        the `hpdl run` option values it sets, and a line for each of its settings that hpdl
        does not honour ("elastic is not honoured: ...").

    Raises:
        LaunchError: naming the file and key, for an unreadable file, an unknown key or a bad value.
    """
    try:
        import yaml
    except ImportError:
        raise LaunchError("--config-file needs PyYAML (pip install pyyaml)") from None
    try:
        with open(path, encoding="utf-8") as f:
            document = yaml.safe_load(f)
    except OSError as err:
        raise LaunchError(f"--config-file {path}: {err.strerror or err}") from None
    except UnicodeDecodeError:
        raise LaunchError(f"--config-file {path}: not a text file (UTF-8)") from None
    except yaml.YAMLError as err:
        raise LaunchError(f"--config-file {path}: not YAML: {str(err).splitlines()[0]}") from None
    except ValueError as err:  # a value YAML's types cannot hold (an integer of over 4300 digits)
        # Its advice after ";" (sys.set_int_max_str_digits) is for programmers, not for this file.
        raise LaunchError(f"--config-file {path}: unreadable value: {str(err).split(';')[0]}") from None
    if document is None:
        return {}, []
    if not isinstance(document, dict):
        raise LaunchError(f"--config-file {path}: expected sections such as 'params:', got {type(document).__name__}")
    values: Dict[str, Any] = {}
    ignored: List[str] = []
    sections = {section for section, _ in CONFIG_KEYS}
    for section, entries in document.items():
        if section == "controller":
            if not isinstance(entries, str) or entries.lower() not in CONTROLLERS:
                raise LaunchError(f"--config-file {path}: controller must be gloo or mpi, got {entries!r}")
            values["backend"] = entries.lower()
            continue
        if section not in sections and section not in UNHONOURED_SECTIONS:
            known = ", ".join(sorted(sections | set(UNHONOURED_SECTIONS) | {"controller"}))
            raise LaunchError(f"--config-file {path}: unknown section {section!r} (known: {known})")
        if entries is None:
            continue  # a section left empty sets nothing
        if not isinstance(entries, dict):
            raise LaunchError(f"--config-file {path}: section {section} must hold keys, got {entries!r}")
        if section in UNHONOURED_SECTIONS:
            ignored += _unhonoured(section, entries)
            continue
        for key, value in entries.items():
            if (section, key) in UNHONOURED_KEYS:
                ignored += _unhonoured(section, {key: value})
                continue
            if (section, key) not in CONFIG_KEYS:
                known = ", ".join(k for s, k in CONFIG_KEYS if s == section)
                raise LaunchError(f"--config-file {path}: unknown key {section}.{key} (known in {section}: {known})")
            option, kind = CONFIG_KEYS[(section, key)]
            values[option] = _typed(path, f"{section}.{key}", value, kind)
    return values, ignored


def _unhonoured(section: str, entries: Dict[Any, Any]) -> List[str]:
    """The warning lines for the settings in ``entries`` (of ``section``) that hpdl has no counterpart for."""
    if section == "elastic":
        return ["the elastic section is not honoured: give them as options (--min-np, --elastic-timeout, ...)"] \
            if entries else []
    return [f"{section}.{key} is not honoured by hpdl" for key, value in entries.items()
            if value != _HPDL_BEHAVIOUR.get((section, key), _NO_VALUE)]


_NO_VALUE = object()  # unequal to every value: settings with no value that means what hpdl does


def _typed(path: str, key: str, value: Any, kind: type) -> Any:
    """Return ``value`` as ``kind``; YAML's own types must match (no "2" for a number, no 1 for true)."""
    if kind is bool or kind is str:
        ok = isinstance(value, kind)
    else:
        number = isinstance(value, (int, float)) and not isinstance(value, bool)
        # An int is whole however large (float() of a 400-digit one overflows); .nan is no integer.
        ok = number and (kind is float or isinstance(value, int) or value.is_integer())
    if not ok:
        raise LaunchError(f"--config-file {path}: {key} must be {_KIND_NAMES[kind]}, got {value!r}")
    option = CONFIG_KEYS[tuple(key.split("."))][0]
    if option in numeric_options():
        check_number(f"--config-file {path}: {key}", option, value)
    return kind(value)


_KIND_NAMES = {bool: "true or false", str: "a string", int: "an integer", float: "a number"}


def _interfaces(network_interfaces: str) -> List[str]:
    names = [n.strip() for n in network_interfaces.split(",") if n.strip()]
    if not names:
        raise LaunchError(f"--network-interfaces {network_interfaces!r}: expected names such as eth0,ib0")
    return names


def interface_env(network_interfaces: Optional[str]) -> Dict[str, str]:
    """Return the variables that keep gloo's and NCCL's traffic to the named interfaces."""
    if network_interfaces is None:
        return {}
    joined = ",".join(_interfaces(network_interfaces))
    return {variable: joined for variable in INTERFACE_VARIABLES}


def remote_options(info: LauncherInfo, commands: List[List[str]], ssh_port: Optional[int],
                   ssh_identity_file: Optional[str], network_interfaces: Optional[str]
                   ) -> Tuple[List[List[str]], Dict[str, str]]:
    """Apply the ssh and network-interface options to the launcher commands of a job.

    ``commands`` are :func:`~hpdl.launch.builders.build_run`'s: one launcher, or one remote
    shell per host (torchrun on several hosts).

    Returns:
        the commands (with the ssh options where ssh starts them) and the variables for the
        launcher (where mpiexec's ssh and MPI transport read them).

    Raises:
        LaunchError: when the launcher that will run cannot take them.
    """
    env: Dict[str, str] = {}
    mpiexec = len(commands) == 1 and info.mpiexec is not None and commands[0][0] == info.mpiexec
    if ssh_port is not None or ssh_identity_file is not None:
        if ssh_identity_file is not None and not os.path.isfile(ssh_identity_file):
            raise LaunchError(f"--ssh-identity-file {ssh_identity_file}: no such file")
        ssh_args = (["-p", str(ssh_port)] if ssh_port is not None else []) + \
            (["-i", os.path.abspath(ssh_identity_file)] if ssh_identity_file is not None else [])
        if mpiexec:
            variable = _SSH_ARGS_VARIABLE.get(info.mpi_flavour)
            if variable is None:
                raise LaunchError(f"cannot tell how to pass ssh options to {info.mpiexec} (an MPI hpdl does not know)")
            env[variable] = " ".join(ssh_args)
        elif len(commands) > 1 and os.path.basename(commands[0][0]) == "ssh":
            commands = [[argv[0], *ssh_args, *argv[1:]] for argv in commands]
        else:
            raise LaunchError(f"--ssh-port and --ssh-identity-file apply to the ssh that starts remote ranks; "
                              f"this job starts through {os.path.basename(commands[0][0])}")
    if network_interfaces is not None and mpiexec:
        names = _interfaces(network_interfaces)
        if info.mpi_flavour == OPENMPI:
            env["OMPI_MCA_btl_tcp_if_include"] = env["OMPI_MCA_oob_tcp_if_include"] = ",".join(names)
        elif info.mpi_flavour in _HYDRA_IFACE_VARIABLE:
            if len(names) > 1:
                raise LaunchError(f"--network-interfaces {','.join(names)}: this mpiexec (Hydra) uses one "
                                  "interface; name one")
            env[_HYDRA_IFACE_VARIABLE[info.mpi_flavour]] = names[0]
    return commands, env


def output_wrapper(directory: str, command: Sequence[str]) -> List[str]:
    """Return ``command`` run through the per-rank output redirection into ``directory``.

    Raises:
        LaunchError: when ``directory`` cannot be a directory of rank logs.
    """
    directory = os.path.abspath(directory)
    try:
        make_directories(directory)
    except OSError as err:
        raise LaunchError(f"--output-filename {directory}: {err.strerror or err}") from None
    if not os.access(directory, os.W_OK):
        raise LaunchError(f"--output-filename {directory}: not writable")
    return [sys.executable, "-m", "hpdl.launch.rank_output", directory, "--", *command]
