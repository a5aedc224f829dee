"""Pure builders of the command that `hpdl run` hands over to: mpiexec, srun or torchrun.

:func:`build_run` takes the options, the environment and what :func:`detect_launchers` found,
and returns ``(commands, env)``: one command for ``os.execvpe``, or, for torchrun on several
hosts, one command per host that starts torchrun there through the remote shell (torchrun has
no way of starting itself elsewhere: its documentation has it run on every node). It runs
nothing and reads nothing, so every launcher and MPI flavour is tested by comparing lists.
The choice of launcher:

1. ``--launcher`` other than auto: that one;
2. inside a Slurm allocation (``SLURM_JOB_ID``) with backend auto or mpi: ``srun``;
3. backend gloo/nccl/torch on this host only: ``torchrun --standalone``; on several hosts,
   ``mpiexec`` starts the ranks and hpdl rendezvouses torch.distributed through MPI;
4. otherwise ``mpiexec``, in the syntax of its flavour (and ``torchrun`` when there is no
   mpiexec, the backend is auto and the job stays on this host).

srun is given the MPI plugin that the MPI found needs (``--mpi=pmi2`` for MPICH, Intel MPI
and MVAPICH2, ``--mpi=pmix`` for Open MPI) unless the user, SLURM_MPI_TYPE or the site's
MpiDefault chose one (:func:`srun_mpi_plugin`), and ``--kill-on-bad-exit=1`` so that a failed
task ends the others instead of leaving them waiting for it.

Hosts are reached through a remote shell: ssh by default, or ``--remote-shell`` / ``HPDL_RSH``
(which ``hpdl emulate`` sets to its stand-in), handed to Hydra as ``-launcher-exec``, to Open
MPI as ``plm_rsh_agent``, and used directly to start torchrun on each host.

Settings options become ``HPDL_*`` variables, placed in the returned environment (which ranks
on this host inherit) and, for mpiexec, also on its command line so remote ranks get them.
When the running interpreter's directory is not on PATH (an environment used without being
activated), the returned PATH starts with it, so the launcher, and ``python`` on the ranks,
are the ones installed beside hpdl.
"""

from __future__ import annotations

import dataclasses
import os
import shlex
from typing import Any, Dict, List, Mapping, Optional, Sequence, Tuple

from hpdl.comm.devices import nccl_refusal
from hpdl.config import BACKENDS, Settings, SettingsError
from hpdl.launch.detect import (
    FLAVOUR_NAMES, HYDRA_FLAVOURS, INTELMPI, MPICH, MVAPICH2, OPENMPI, UNKNOWN, LauncherInfo, ranks_path,
)
from hpdl.launch.hosts import HostList, LaunchError
from hpdl.launch.limits import RUN_SETTINGS, check_number, flag, run_spec, setting_text, setting_variable

LAUNCHERS = ("auto", "mpiexec", "srun", "torchrun")
_TORCH_BACKENDS = ("gloo", "nccl", "torch")
# Forwarded by name to remote Open MPI ranks, whose ssh session would otherwise start with a
# minimal environment that cannot find the virtualenv's python or its libraries.
_OPENMPI_FORWARD = ("PATH", "PYTHONPATH", "LD_LIBRARY_PATH")
# The srun MPI plugin through which each MPI's tasks find each other; without one (srun's
# default "none" on a stock install) every MPICH task starts as a world of its own.
_SRUN_MPI_PLUGINS = {MPICH: "pmi2", INTELMPI: "pmi2", MVAPICH2: "pmi2", OPENMPI: "pmix"}
# Passed by name to torchrun on other hosts: a remote shell starts with a minimal environment.
_REMOTE_FORWARD = ("PATH", "PYTHONPATH", "LD_LIBRARY_PATH", "OMP_NUM_THREADS", "GLOO_SOCKET_IFNAME",
                   "NCCL_SOCKET_IFNAME", "NCCL_IB_DISABLE", "UCX_TLS")
# Variables of the resource managers whose allocation Open MPI reads for its hosts; outside one,
# Open MPI gives this host one slot per core and refuses more ranks.
_ALLOCATION_VARIABLES = ("SLURM_JOB_ID", "PBS_JOBID", "LSB_JOBID")
# Open MPI's options that name hosts, as given through --mpi-args.
_OPENMPI_HOST_OPTIONS = ("-H", "--host", "-host", "--hostfile", "-hostfile", "--machinefile", "-machinefile",
                         "--default-hostfile")


@dataclasses.dataclass(frozen=True)
class RunOptions:
    """What `hpdl run` was asked to do; None means "not given" for every setting."""

    command: Tuple[str, ...]
    np: Optional[int] = None
    hosts: Optional[HostList] = None
    launcher: str = "auto"
    mpi_args: Tuple[str, ...] = ()
    # The options that set settings, by their names in RUN_SETTINGS (hpdl/launch/limits.py, from
    # the declarations in hpdl/config.py), in their own units: {"fusion_threshold_mb": 64, ...}.
    settings: Mapping[str, Any] = dataclasses.field(default_factory=dict)
    remote_shell: Optional[str] = None  # how to reach other hosts (default: ssh)
    binding_args: Tuple[str, ...] = ()  # Open MPI's process binding, in place of --bind-to none
    rendezvous_port: int = 29400  # torchrun's static rendezvous on the first host, across hosts

    def __post_init__(self) -> None:
        unknown = sorted(set(self.settings) - set(RUN_SETTINGS))
        if unknown:
            raise ValueError(f"RunOptions.settings: no `hpdl run` option sets {', '.join(unknown)}")

    @property
    def backend(self) -> Optional[str]:
        """The backend asked for (``--backend``), or None."""
        return self.settings.get("backend")


def settings_env(options: RunOptions, env: Mapping[str, str], cwd: str) -> Dict[str, str]:
    """Return the ``HPDL_*`` variables every rank gets: those already set, then the options'.

    Raises:
        LaunchError: naming the option and the value given when an option is out of its
            range, or the variable when the result is not a valid :class:`~hpdl.config.Settings`.
    """
    out = {k: v for k, v in env.items() if k.startswith("HPDL_")}
    for option in RUN_SETTINGS:
        value = options.settings.get(option)
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            check_number(flag(option), option, value)
        text = setting_text(option, value)
        if text is not None:
            out[setting_variable(option)] = os.path.join(cwd, text) if run_spec(option).path else text
    try:
        # Validate here, once, so a bad value fails before any rank starts.
        Settings.from_env(out)
    except SettingsError as err:
        raise LaunchError(str(err)) from None
    return out


def _is_single_host(hosts: Optional[HostList], info: LauncherInfo) -> bool:
    return hosts is None or (len(hosts.hosts) == 1 and info.is_local(hosts.hosts[0].name))


def choose_launcher(options: RunOptions, backend: str, env: Mapping[str, str], info: LauncherInfo) -> str:
    """Return "mpiexec", "srun" or "torchrun" for this job (see the module docstring)."""
    if options.launcher != "auto":
        return options.launcher
    single = _is_single_host(options.hosts, info)
    if "SLURM_JOB_ID" in env and backend in ("auto", "mpi"):
        return "srun"
    if backend in _TORCH_BACKENDS:
        if single:
            return "torchrun"
        if info.mpiexec is None:
            raise LaunchError(
                f"backend {backend} on several hosts needs mpiexec to start the ranks "
                "(hpdl then meets through MPI), but mpiexec was not found on PATH"
            )
        return "mpiexec"
    if info.mpiexec is None and backend == "auto" and single and info.torchrun is not None:
        return "torchrun"
    return "mpiexec"


def build_run(options: RunOptions, env: Mapping[str, str], info: LauncherInfo) -> Tuple[List[List[str]], Dict[str, str]]:
    """Return ``(commands, env)`` that start ``options.command`` on every rank.

    ``commands`` holds one argv to exec, or one per host to start together (torchrun on
    several hosts).

    Args:
        options: the parsed `hpdl run` options.
        env: the environment to start from (normally ``os.environ``).
        info: the launchers found, from :func:`hpdl.launch.detect_launchers`.

    Raises:
        LaunchError: for any request that cannot be met, with a one-line reason.
    """
    command = list(options.command)
    if not command:
        raise LaunchError("no command to run; put it after '--', e.g. hpdl run -np 2 -- python train.py")
    backend = options.backend or env.get("HPDL_BACKEND") or "auto"
    if backend not in BACKENDS:
        raise LaunchError(f"unknown backend {backend!r}; use one of {', '.join(BACKENDS)}")
    if options.launcher not in LAUNCHERS:
        raise LaunchError(f"unknown launcher {options.launcher!r}; use one of {', '.join(LAUNCHERS)}")
    hpdl_env = settings_env(options, env, info.cwd)
    refusal = nccl_refusal(backend, Settings.from_env(hpdl_env).ranks_per_gpu > 1)
    if refusal is not None:
        raise LaunchError(refusal)
    launcher = choose_launcher(options, backend, env, info)
    hosts = options.hosts
    np = _num_ranks(options, env, launcher)

    out_env = dict(env)
    out_env.update(hpdl_env)
    path = ranks_path(env.get("PATH", os.defpath), info.python_bin)
    if path != env.get("PATH"):
        out_env["PATH"] = path  # so that `python` on the ranks is the interpreter that has hpdl
    if launcher == "mpiexec":
        if info.mpiexec is None:
            raise LaunchError("launcher mpiexec was not found on PATH (install an MPI, e.g. pip install mpich)")
        argv = build_mpiexec(info.mpiexec, info.mpi_flavour, np, hosts, hpdl_env, options.mpi_args, command, out_env,
                             options.remote_shell, options.binding_args)
    elif launcher == "srun":
        if info.srun is None:
            raise LaunchError("launcher srun was not found on PATH (is Slurm installed here?)")
        plugin = srun_mpi_plugin(info, env, options.mpi_args)
        argv = build_srun(info.srun, np, hosts, options.mpi_args, command, plugin,
                          kill_on_bad_exit=not _chooses_kill_on_bad_exit(options.mpi_args, env))
    else:
        if info.torchrun is None:
            raise LaunchError("launcher torchrun was not found on PATH (it comes with PyTorch)")
        if backend == "mpi":
            raise LaunchError("backend mpi cannot run under torchrun; use --launcher mpiexec or srun")
        if options.mpi_args:
            raise LaunchError("--mpi-args applies to mpiexec and srun, not torchrun")
        if not _is_single_host(hosts, info):
            forwarded = {k: v for k, v in out_env.items() if k.startswith("HPDL_") or k in _REMOTE_FORWARD}
            return build_torchrun_hosts(info.torchrun, np, hosts, command, forwarded, info.cwd,
                                        options.remote_shell or "ssh", options.rendezvous_port), out_env
        argv = build_torchrun(info.torchrun, np, command)
    return [argv], out_env


def _num_ranks(options: RunOptions, env: Mapping[str, str], launcher: str) -> int:
    hosts = options.hosts
    if options.np is not None:
        np = options.np
    elif hosts is not None:
        np = hosts.total_slots
    elif (launcher == "srun" or "SLURM_JOB_ID" in env) and env.get("SLURM_NTASKS", "").isdigit():
        # Inside an allocation every launcher gets the allocation's task count (srun's own
        # default), gloo's torchrun and a forced mpiexec too, rather than one rank.
        np = int(env["SLURM_NTASKS"])
        nodes = env.get("SLURM_JOB_NUM_NODES", env.get("SLURM_NNODES", "1"))
        if launcher == "torchrun" and nodes.isdigit() and int(nodes) > 1:
            raise LaunchError(
                f"torchrun starts every rank on this host, but the allocation spans {nodes} nodes; "
                "give -np for the ranks to run here, or --launcher srun to spread them over the allocation")
    else:
        np = 1
    if np < 1:
        raise LaunchError(f"-np must be at least 1, got {np}")
    if hosts is not None and np > hosts.total_slots:
        source = f"hostfile {hosts.path}" if hosts.path else "-H"
        raise LaunchError(f"-np {np} is more than the {hosts.total_slots} slots that {source} lists")
    return np


def build_mpiexec(
    mpiexec: str,
    flavour: str,
    np: int,
    hosts: Optional[HostList],
    hpdl_env: Mapping[str, str],
    mpi_args: Sequence[str],
    command: Sequence[str],
    env: Optional[Mapping[str, str]] = None,
    remote_shell: Optional[str] = None,
    binding_args: Sequence[str] = (),
) -> List[str]:
    """Return the mpiexec argv in the syntax of ``flavour`` (a flavour constant of ``detect``).

    Args:
        hpdl_env: the ``HPDL_*`` variables to set on every rank.
        env: the launching environment, consulted for variables to forward.
        remote_shell: the program that reaches other hosts instead of ssh.
        binding_args: Open MPI's process binding options (other MPIs: not used).
    """
    env = {} if env is None else env
    if flavour == OPENMPI:
        argv = [mpiexec, "-np", str(np)]
        if remote_shell:
            argv += ["--mca", "plm_rsh_agent", remote_shell]
        if hosts is not None:
            if hosts.path and hosts.styles <= {"slots", "bare"}:
                argv += ["--hostfile", hosts.path]
            else:
                argv += ["-H", hosts.colon_form()]
        elif not any(key in env for key in _ALLOCATION_VARIABLES) and not _names_hosts(mpi_args):
            # As horovodrun: this host with a slot per rank, so -np may exceed the cores.
            argv += ["-H", f"localhost:{np}"]
        # Open MPI binds each rank to a core by default; hpdl's engine thread needs another.
        argv += list(binding_args) or ["--bind-to", "none"]
        for key, value in hpdl_env.items():
            argv += ["-x", f"{key}={value}"]
        if hosts is not None:
            for key in _OPENMPI_FORWARD:
                if key in env:
                    argv += ["-x", key]
        return argv + list(mpi_args) + list(command)

    if flavour in HYDRA_FLAVOURS:
        argv = [mpiexec]
        for key, value in hpdl_env.items():
            argv += ["-genv", key, value]
        if flavour == MVAPICH2 and "MV2_ENABLE_AFFINITY" not in env:
            # MVAPICH2 pins each rank to one core, starving hpdl's background engine thread.
            argv += ["-genv", "MV2_ENABLE_AFFINITY", "0"]
        if remote_shell:  # Hydra's bootstrap: ssh's interface, this program
            word = "-bootstrap" if flavour == INTELMPI else "-launcher"
            argv += [word, "ssh", f"{word}-exec", remote_shell]
        argv += list(mpi_args)
        if flavour == INTELMPI and hosts is not None:
            return argv + _intel_hosts(np, hosts, command)
        argv += ["-n", str(np)]
        if hosts is not None:
            if hosts.path and hosts.styles <= {"colon", "bare"}:
                argv += ["-f", hosts.path]
            else:
                argv += ["-hosts", hosts.colon_form()]
        return argv + list(command)

    # An unrecognised mpiexec: '-n' is the MPI standard's one portable option; the HPDL_*
    # variables reach local ranks through the inherited environment.
    if hosts is not None:
        raise LaunchError(
            f"cannot tell how to pass hosts to {mpiexec} ({FLAVOUR_NAMES[UNKNOWN]}); "
            "give them through --mpi-args"
        )
    return [mpiexec, "-n", str(np)] + list(mpi_args) + list(command)


def _names_hosts(mpi_args: Sequence[str]) -> bool:
    """Whether ``mpi_args`` give Open MPI its hosts."""
    return any(arg in _OPENMPI_HOST_OPTIONS or arg.startswith(tuple(f"{o}=" for o in _OPENMPI_HOST_OPTIONS))
               for arg in mpi_args)


def _intel_hosts(np: int, hosts: HostList, command: Sequence[str]) -> List[str]:
    # Intel MPI's -f ignores slot counts (its -machinefile keeps them) and its -hosts takes
    # plain names with one -ppn for all; unequal slot counts need one MPMD section per host.
    if hosts.path and hosts.styles <= {"colon", "bare"}:
        return ["-n", str(np), "-machinefile", hosts.path] + list(command)
    if hosts.uniform_slots is not None:
        return ["-n", str(np), "-ppn", str(hosts.uniform_slots), "-hosts", ",".join(hosts.names)] + list(command)
    sections: List[str] = []
    for name, count in hosts.fill(np):
        if sections:
            sections.append(":")
        sections += ["-n", str(count), "-host", name] + list(command)
    return sections


def srun_mpi_plugin(info: LauncherInfo, env: Mapping[str, str], launcher_args: Sequence[str]) -> Optional[str]:
    """Return the ``--mpi`` plugin srun needs for the MPI found, or None to leave srun's choice.

    The choice is left to srun when ``launcher_args`` name a plugin, when SLURM_MPI_TYPE picks
    one, when the site's MpiDefault is not "none", or when srun does not list the plugin.
    """
    if any(arg == "--mpi" or arg.startswith("--mpi=") for arg in launcher_args):
        return None
    if env.get("SLURM_MPI_TYPE", "none") != "none" or info.srun_mpi_default not in ("", "none"):
        return None
    wanted = _SRUN_MPI_PLUGINS.get(info.mpi_flavour)
    return wanted if wanted in info.srun_mpi_plugins else None


def _chooses_kill_on_bad_exit(launcher_args: Sequence[str], env: Mapping[str, str]) -> bool:
    """Whether the user already told srun what to do when a task fails (-K, or SLURM_KILL_BAD_EXIT)."""
    return "SLURM_KILL_BAD_EXIT" in env or any(
        arg.startswith(("-K", "--kill-on-bad-exit")) for arg in launcher_args)


def build_srun(srun: str, np: int, hosts: Optional[HostList], launcher_args: Sequence[str],
               command: Sequence[str], mpi_plugin: Optional[str] = None, kill_on_bad_exit: bool = True) -> List[str]:
    """Return ``srun --ntasks N [--nodelist h1,h2] [--kill-on-bad-exit=1] [--mpi=PLUGIN] [args] command``."""
    argv = [srun, "--ntasks", str(np)]
    if hosts is not None:
        argv += ["--nodelist", ",".join(hosts.names)]
    if kill_on_bad_exit:
        # srun's default (KillOnBadExit=0) lets the other tasks run on when one dies of a signal
        # or exits before hvd.init(): they wait for it in a collective or at the rendezvous until
        # the stall timeout or the time limit. mpiexec ends the job then; so does srun with this.
        argv.append("--kill-on-bad-exit=1")
    if mpi_plugin:
        argv.append(f"--mpi={mpi_plugin}")
    return argv + list(launcher_args) + list(command)


def build_torchrun(torchrun: str, np: int, command: Sequence[str]) -> List[str]:
    """Return ``torchrun --nproc-per-node N --standalone --no-python command``."""
    # --no-python: the command is run as given ("python train.py", "python -m pkg", a script),
    # not handed to torchrun's own interpreter as a script path.
    return [torchrun, "--nproc-per-node", str(np), "--standalone", "--no-python"] + list(command)


def build_torchrun_hosts(torchrun: str, np: int, hosts: HostList, command: Sequence[str],
                         forwarded: Mapping[str, str], cwd: str, remote_shell: str, port: int) -> List[List[str]]:
    """Return one ``REMOTE_SHELL HOST 'cd CWD && exec env K=V... torchrun ...'`` per host used.

    Every torchrun joins a static rendezvous on the first host (``--nnodes``, ``--node-rank``,
    ``--master-addr``); ranks are placed host by host, slot by slot, as mpiexec places them.
    The remote shell runs the line with a shell, as ssh does, so every word is quoted.
    """
    placed = hosts.fill(np)
    first = placed[0][0]
    variables = [f"{k}={v}" for k, v in sorted(forwarded.items())]
    commands = []
    for node_rank, (host, count) in enumerate(placed):
        line = [torchrun, "--nnodes", str(len(placed)), "--node-rank", str(node_rank), "--nproc-per-node",
                str(count), "--master-addr", first, "--master-port", str(port), "--no-python", *command]
        remote = f"cd {shlex.quote(cwd)} && exec env {shlex.join(variables + line)}"
        commands.append([remote_shell, host, remote])
    return commands


def format_command(argv: Sequence[str], env: Mapping[str, str], base_env: Mapping[str, str]) -> str:
    """Return a shell line showing ``argv`` with the variables that differ from ``base_env``."""
    changed = [f"{k}={shlex.quote(v)}" for k, v in sorted(env.items()) if base_env.get(k) != v]
    return " ".join(changed + [shlex.join(argv)])
