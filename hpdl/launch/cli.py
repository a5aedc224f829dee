"""`hpdl run` and `hpdl check`: argument parsing and the two thin handlers.

The handlers turn the namespace into :class:`RunOptions`, call the pure builder, and then
either print the command (``--dry-run``) or ``os.execvpe`` it, so the launcher replaces this
process and owns signals, exit codes and output from then on; each rank's command runs under
:mod:`hpdl.launch.rank_watch`, which names a rank that dies hard. The one exception is torchrun on
several hosts: one torchrun per host, started over the remote shell and waited for here.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import random
import shlex
import signal
import subprocess
import sys
import time
from typing import Dict, List, Optional, Sequence

from hpdl.cli_error import CliError
from hpdl.config import Settings, SettingsError
from hpdl.launch import horovodrun, torchrun_main
from hpdl.launch.builders import LAUNCHERS, RunOptions, build_run, format_command
from hpdl.launch.elastic.options import add_elastic_options, is_elastic
from hpdl.launch.detect import FLAVOUR_NAMES, OPENMPI, LauncherInfo, detect_launchers, program_problem
from hpdl.launch.hosts import LaunchError, parse_hosts, read_hostfile
from hpdl.launch.limits import RUN_SETTINGS, add_setting_options, check_number, flag, numeric_options
from hpdl.launch.rank_watch import watched
from hpdl.output_files import OutputRule, same_file

_RUN_DESCRIPTION = """\
Start COMMAND as N ranks of an hpdl job through mpiexec, srun or torchrun, then get out of
the way: hpdl builds the launcher's command line and replaces itself with it. Each rank's
COMMAND runs under a small parent that passes signals on to it and, when the rank dies hard
(a signal, os._exit, a crash in C code), prints one line naming the rank, its host and how it
ended. COMMAND's program must exist here (on PATH or as a path) when every rank runs here.

Launcher choice (unless --launcher says otherwise):
  inside a Slurm allocation (SLURM_JOB_ID set), backend auto or mpi   -> srun
  backend gloo, nccl or torch on this host only                      -> torchrun --standalone
  backend gloo, nccl or torch on several hosts                       -> mpiexec (ranks meet
                                                                        through MPI)
  otherwise                                                          -> mpiexec, in the syntax
      of its MPI (MPICH, Open MPI, MVAPICH2 or Intel MPI, read from `mpiexec --version`);
      torchrun if there is no mpiexec, the backend is auto and the job stays on this host.

Under srun, hpdl passes the MPI plugin the MPI found needs (--mpi=pmi2 for MPICH, Intel MPI
and MVAPICH2; --mpi=pmix for Open MPI when srun lists it) unless --mpi-args, SLURM_MPI_TYPE
or the site's MpiDefault names one, and --kill-on-bad-exit=1 (unless -K is in --mpi-args or
SLURM_KILL_BAD_EXIT is set), so that a task that fails ends the job, as mpiexec ends it.

Other hosts are reached through ssh, or --remote-shell (HPDL_RSH). With --launcher torchrun
on several hosts, hpdl starts one torchrun per host through it (a static rendezvous on the
first host, --nnodes/--node-rank) and waits for them, ending the others if one fails.

Launchers are looked for beside the Python running hpdl too. When its directory is not on
PATH (an environment used without activating it, as from cron or an IDE), the ranks get it
first on their PATH, so `python` in COMMAND is this Python; --dry-run shows that PATH.

Settings options become HPDL_* environment variables on every rank; HPDL_* variables already
set are passed on too, and all are checked before anything starts.

horovodrun's spellings work too: -hostfile, --gloo/--mpi, --timeline-filename,
--stall-check-warning-time-seconds, --stall-check-shutdown-time-seconds (0: keep hpdl's
timeout), and its --config-file (YAML: controller and the sections params, timeline,
stall_check; the command line wins over the file, the file over the environment). So do its
other options (see "horovodrun's options" below); those hpdl has no counterpart for print one
warning each and change nothing. As horovodrun, hpdl gives Open MPI --allow-run-as-root
--tag-output, and -H localhost:N when no hosts are given, so N may exceed the cores.

The stall check off (--no-stall-check, the file's stall_check.enabled: false, or
HOROVOD_STALL_CHECK_DISABLE=1) means no stall warning before the stall timeout ends the job,
whatever Horovod warning time comes with it, as in Horovod. Only hpdl's explicit warning time
outranks it: --stall-warning-s on the command line over the file's switch, HPDL_STALL_WARNING
over HOROVOD_STALL_CHECK_DISABLE."""

_RUN_EPILOG = """\
examples:
  hpdl run -np 4 -- python train.py --epochs 10
  hpdl run -np 8 -H node1:4,node2:4 --timeline trace.json -- python train.py
  hpdl run -np 2 --profile p.json -- python train.py   # then: hpdl profile report p.json
  hpdl run --hostfile hosts.txt --backend gloo -- hpdl sr train --config edsr_baseline_x2
  hpdl run -np 2 --dry-run -- python train.py      # print the command, run nothing

hostfile lines: 'node1 slots=4', 'node1:4' or 'node1' (one slot); '#' starts a comment
(-hostfile, horovodrun's spelling, is --hostfile).
With hosts given, Open MPI refuses more ranks than a host's cores unless told
--mpi-args=--oversubscribe (write the "=" when the value starts with "-")."""


# horovodrun's --log-level values.
HOROVOD_LOG_LEVELS = ("TRACE", "DEBUG", "INFO", "WARNING", "ERROR", "FATAL")
# Horovod's timeline "file" that opens none: the script starts it with hvd.start_timeline().
DYNAMIC_TIMELINE = "DYNAMIC"


def register(subparsers) -> None:
    """Add the `run` and `check` subcommands."""
    run = subparsers.add_parser(
        "run",
        help="launch a training command on N ranks (mpiexec, srun or torchrun)",
        description=_RUN_DESCRIPTION,
        epilog=_RUN_EPILOG,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    where = run.add_argument_group("ranks and hosts")
    where.add_argument(
        "-np", "-n", "--num-proc", dest="np", type=int, metavar="N",
        help="number of ranks (default: total slots of the hosts, or SLURM_NTASKS inside a Slurm allocation, else 1)",
    )
    hosts = where.add_mutually_exclusive_group()
    hosts.add_argument(
        "-H", "--hosts", dest="hosts", metavar="HOST[:SLOTS],...",
        help="comma-separated hosts with their slot counts, e.g. node1:4,node2:4 (slots default to 1)",
    )
    hosts.add_argument(
        # -hostfile is horovodrun's and mpirun's spelling; without it argparse would read
        # "-h ostfile" and stop at the help flag.
        "--hostfile", "-hostfile", metavar="FILE",
        help="file of hosts, one per line: 'host slots=N', 'host:N' or 'host' (default: HPDL_HOSTFILE, "
        "which `hpdl emulate` sets)",
    )
    where.add_argument(
        "--remote-shell", metavar="PROGRAM", default=None,
        help="how to reach the other hosts, in place of ssh: given to mpiexec as its bootstrap "
        "(Hydra's -launcher-exec, Open MPI's plm_rsh_agent) and used to start torchrun on each "
        "host (default: HPDL_RSH, which `hpdl emulate` sets, else ssh)",
    )
    how = run.add_argument_group("launcher")
    backend = how.add_mutually_exclusive_group()
    how.add_argument(
        "--launcher", choices=LAUNCHERS, default="auto",
        help="force the launcher instead of choosing one as described above (default: auto)",
    )
    how.add_argument(
        "--mpi-args", default="", metavar="'ARGS'",
        help="extra arguments for mpiexec or srun, given as one quoted string that is split "
        "as a shell would split it (for example the Open MPI option --oversubscribe, or srun's "
        "--mpi=pmix instead of the plugin hpdl picks)",
    )
    how.add_argument(
        "--dry-run", action="store_true",
        help="print the command (with the variables it sets) instead of running it",
    )
    how.add_argument("--verbose", action="store_true",
                     help="print the command (with the variables it sets) to stderr, then run it")
    how.add_argument("--config-file", metavar="FILE",
                     help=f"horovodrun's YAML config file: controller (gloo or mpi), sections "
                          f"{horovodrun.config_sections_text()}; its other settings (elastic, ...) get a warning "
                          "each; options on the command line win")
    how.add_argument("--output-filename", metavar="DIR",
                     help="write each rank's output to DIR/rank.<rank>/stdout and stderr instead of the terminal")
    remote = run.add_argument_group("remote hosts")
    remote.add_argument("-p", "--ssh-port", type=int, metavar="PORT",
                        help="port of the ssh that starts remote ranks (mpiexec's, or the one that starts "
                             "torchrun on each host); with every rank on this host: ignored, with a note")
    remote.add_argument("-i", "--ssh-identity-file", metavar="FILE",
                        help="identity (private key) file of that ssh")
    remote.add_argument("--network-interfaces", metavar="IF[,IF...]",
                        help="network interfaces for the ranks' traffic, e.g. eth0,ib0 (gloo, NCCL, and the "
                             "MPI's TCP transport)")
    knobs = run.add_argument_group("settings passed to every rank")
    stall_timeout = knobs.add_mutually_exclusive_group()
    tune = run.add_argument_group(
        "autotuning", "the fusion threshold and cycle time tuned as the job runs; one set explicitly stays fixed")
    # Every option that sets a setting, as its setting declares it (hpdl/config.py).
    add_setting_options({group.title: group for group in (where, how, knobs, tune)},
                        placed={"backend": backend, "stall_timeout_s": stall_timeout})
    backend.add_argument("--gloo", dest="backend", action="store_const", const="gloo",
                         help="horovodrun's spelling of --backend gloo")
    backend.add_argument("--mpi", dest="backend", action="store_const", const="mpi",
                         help="horovodrun's spelling of --backend mpi")
    knobs.add_argument("--no-stall-check", action="store_true", default=None,
                       help="no stall warning before the stall timeout ends the job, even with a warning time "
                            "given (horovodrun's)")
    stall_timeout.add_argument("--stall-check-shutdown-time-seconds", dest="stall_shutdown_s", type=float,
                               metavar="S", help="horovodrun's spelling of --stall-timeout-s, where 0 (never) "
                                                 "keeps hpdl's timeout")
    horovod = run.add_argument_group("horovodrun's options", "so that horovodrun command lines run unchanged")
    horovod.add_argument("-cb", "--check-build", action="store_true",
                         help="print `hpdl check`'s report of what is available here, and exit")
    horovod.add_argument("--disable-cache", action="store_true",
                         help="accepted: hpdl keeps no cache of its launcher checks (horovodrun's keeps them an "
                              "hour); the response cache is --cache-capacity")
    horovod.add_argument("--tcp", action="store_true",
                         help="NCCL over sockets, not InfiniBand (NCCL_IB_DISABLE=1), as horovodrun")
    horovod.add_argument("--binding-args", metavar="'ARGS'",
                         help="Open MPI's process binding, in place of --bind-to none (ignored with a warning by "
                              "the other launchers, as by horovodrun)")
    horovod.add_argument("-prefix-timestamp", "--prefix-output-with-timestamp", action="store_true",
                         help="timestamp every output line (Open MPI's --timestamp-output; ignored with a warning "
                              "by the other launchers)")
    horovod.add_argument("--log-level", type=str.upper, choices=HOROVOD_LOG_LEVELS,
                         help="not honoured (a warning): hpdl prints warnings and errors")
    horovod.add_argument("--hierarchical-allgather", action="store_true",
                         help="not honoured (a warning): hpdl's allgather is flat")
    horovod.add_argument("--mpi-threads-disable", action="store_true",
                         help="not honoured (a warning): hpdl's engine thread calls MPI")
    horovod.add_argument("--num-nccl-streams", type=int, metavar="N", help="not honoured (a warning)")
    add_elastic_options(run.add_argument_group(
        "elastic jobs", "workers leave and join while the job runs (horovodrun's elastic mode, docs/elastic.md); "
        "any of --min-np, --max-np, --host-discovery-script asks for it"))
    run.add_argument(
        "command", nargs=argparse.REMAINDER, metavar="-- COMMAND ...",
        help="the program each rank runs, after '--', e.g. -- python train.py --lr 0.1",
    )
    run.set_defaults(func=run_command)

    check = subparsers.add_parser(
        "check",
        help="show the frameworks, backends and launchers available here",
        description="Report the hpdl and PyTorch versions, CUDA, the backends (MPI with its flavour, "
        "gloo, nccl), the launchers on PATH, this process's place in a job and whether its HPDL_* "
        "settings are valid. Exits 0, or 2 when an HPDL_* setting is invalid (a failed line names it).",
    )
    check.set_defaults(func=check_command)


def options_from_args(args: argparse.Namespace) -> RunOptions:
    """Turn the `hpdl run` namespace into :class:`RunOptions`, reading the hostfile if any."""
    command: List[str] = list(args.command)
    if command and command[0] == "--":
        command = command[1:]
    if not command:
        raise LaunchError("no command to run; put it after '--', e.g. hpdl run -np 2 -- python train.py")
    try:
        mpi_args = tuple(shlex.split(args.mpi_args))
    except ValueError as err:
        raise LaunchError(f"--mpi-args {args.mpi_args!r}: {err}") from None
    try:
        binding_args = tuple(shlex.split(args.binding_args or ""))
    except ValueError as err:
        raise LaunchError(f"--binding-args {args.binding_args!r}: {err}") from None
    if args.stall_shutdown_s:
        args.stall_timeout_s = args.stall_shutdown_s
    if args.hosts is not None:
        host_list = parse_hosts(args.hosts)
    elif args.hostfile or os.environ.get("HPDL_HOSTFILE"):
        host_list = read_hostfile(args.hostfile or os.environ["HPDL_HOSTFILE"])
    else:
        host_list = None
    settings = {option: getattr(args, option) for option in RUN_SETTINGS}
    if args.timeline == DYNAMIC_TIMELINE:
        settings["timeline"] = None
    return RunOptions(
        command=tuple(command),
        np=args.np,
        hosts=host_list,
        launcher=args.launcher,
        mpi_args=mpi_args,
        settings=settings,
        remote_shell=args.remote_shell or os.environ.get("HPDL_RSH") or None,
        rendezvous_port=random.randint(20000, 29999),
        binding_args=binding_args,
    )


def apply_config_file(args: argparse.Namespace) -> None:
    """Fill the options not given on the command line from ``--config-file``."""
    if not args.config_file:
        return
    values, ignored = horovodrun.read_config_file(args.config_file)
    for line in ignored:
        sys.stderr.write(f"hpdl run: warning: {args.config_file}: {line}; ignoring it\n")
    shutdown_s = values.pop("stall_shutdown_s", None)
    if shutdown_s:  # horovodrun's 0: never; hpdl keeps its timeout
        values["stall_timeout_s"] = shutdown_s
    if values.pop("stall_check", True) is False:
        # As Horovod: the check off makes the file's warning time moot; a warning time on the
        # command line still wins over the file.
        values.pop("stall_warning_s", None)
        if args.stall_warning_s is None:
            values["no_stall_check"] = True
    for option, value in values.items():
        if getattr(args, option) is None:
            setattr(args, option, value)


def run_command(args: argparse.Namespace) -> int:
    """Handle `hpdl run`: build the launcher command, then print it or exec it."""
    if args.check_build:
        return check_command(args)
    try:
        start_env = dict(os.environ)
        apply_config_file(args)
        if args.tcp:
            start_env["NCCL_IB_DISABLE"] = "1"
        start_env.update(horovodrun.interface_env(args.network_interfaces))
        check_numbers(args)
        check_written_files(args)
        options = options_from_args(args)
        if is_elastic(args):
            return _run_elastic(args, options, start_env)
        program = options.command[0]
        if args.no_stall_check:
            options = dataclasses.replace(options, settings={**options.settings,
                                                             "stall_warning_s": _stall_timeout(options, start_env)})
        if args.output_filename:
            options = dataclasses.replace(options, command=tuple(
                horovodrun.output_wrapper(args.output_filename, options.command)))
        # Every rank runs under a parent that names it when it dies on its own (rank_watch.py).
        options = dataclasses.replace(options, command=tuple(watched(options.command)))
        info = detect_launchers(start_env, probe_srun=options.launcher == "srun")
        commands, env = build_run(options, start_env, info)
        missing = None if args.dry_run else program_problem(program, env.get("PATH", os.defpath), info.cwd)
        if missing is not None and _every_rank_here(options, start_env, info):
            raise LaunchError(missing)
        if env.get("HPDL_BACKEND") == "nccl" and _every_rank_here(options, start_env, info):
            _check_nccl_here()
        ssh_port, ssh_identity_file = args.ssh_port, args.ssh_identity_file
        if (ssh_port is not None or ssh_identity_file is not None) and _every_rank_here(options, start_env, info):
            sys.stderr.write("hpdl run: note: every rank runs on this host; ignoring --ssh-port and "
                             "--ssh-identity-file\n")
            ssh_port = ssh_identity_file = None
        commands, remote = horovodrun.remote_options(info, commands, ssh_port, ssh_identity_file,
                                                     args.network_interfaces)
    except LaunchError as err:
        raise CliError(str(err)) from None
    env.update(remote)
    if missing is not None:  # other hosts start it: it may be installed there only
        sys.stderr.write(f"hpdl run: warning: {missing} on this host\n")
    openmpi = info.mpi_flavour == OPENMPI and commands[0][0] == info.mpiexec
    for line in _not_honoured(args, None if openmpi else _launcher_name(commands, info)):
        sys.stderr.write(f"hpdl run: warning: {line}; ignoring it\n")
    forward = list(horovodrun.INTERFACE_VARIABLES) if args.network_interfaces else []
    if args.tcp:
        forward.append("NCCL_IB_DISABLE")
    commands = [with_openmpi_defaults(argv, info, forward, args.prefix_output_with_timestamp) for argv in commands]
    if args.dry_run or args.verbose:
        for argv in commands:
            print(format_command(argv, env, os.environ), file=sys.stdout if args.dry_run else sys.stderr, flush=True)
    if args.dry_run:
        return 0
    sys.stdout.flush()
    sys.stderr.flush()
    if len(commands) > 1:
        return _run_on_every_host(commands, env)
    argv = commands[0]
    if info.torchrun is not None and argv[0] == info.torchrun:
        argv = torchrun_main.command(argv)  # torchrun's main; a failed rank ends it in one line
    try:
        os.execvpe(argv[0], argv, env)
    except OSError as err:
        raise CliError(f"cannot start {argv[0]}: {err.strerror or err}") from None
    return 1  # pragma: no cover - execvpe does not return


def _run_elastic(args: argparse.Namespace, options: RunOptions, start_env: Dict[str, str]) -> int:
    """`hpdl run` with horovodrun's elastic options: check them all, then drive the job here
    (hpdl/launch/elastic/driver.py) until it ends."""
    from hpdl.launch.builders import settings_env
    from hpdl.launch.elastic.driver import run_elastic
    from hpdl.launch.elastic.options import elastic_job

    cwd = os.getcwd()
    env = dict(start_env)
    env.update(settings_env(options, start_env, cwd))
    try:
        settings = Settings.from_env(env)
    except SettingsError as err:
        raise LaunchError(str(err)) from None
    command = options.command
    if args.output_filename:
        command = tuple(horovodrun.output_wrapper(args.output_filename, command))
    info = detect_launchers(start_env)
    elastic, workers = elastic_job(args, command, options.hosts, info.hostnames,
                                   settings.elastic_discovery_interval_s, settings.elastic_discovery_timeout_s, env, cwd)
    missing = program_problem(options.command[0], env.get("PATH", os.defpath), cwd)
    if missing is not None:
        raise LaunchError(missing)
    if args.dry_run:
        print(f"elastic job: {shlex.join(command)} on {elastic.np} worker(s) (--min-np {elastic.min_np}, "
              f"--max-np {elastic.max_np if elastic.max_np < 1 << 30 else 'unbounded'}), hosts from "
              f"{elastic.hosts.describe()}")
        return 0
    sys.stdout.flush()
    sys.stderr.flush()
    return run_elastic(elastic, workers)


def check_numbers(args: argparse.Namespace) -> None:
    """Refuse a numeric option out of its range (:mod:`hpdl.launch.limits`), before anything starts."""
    for option in numeric_options():
        value = getattr(args, option)
        for each in value if isinstance(value, (list, tuple)) else [value]:  # nargs: each number checked
            check_number(flag(option), option, each)


def check_written_files(args: argparse.Namespace) -> None:
    """Refuse, before the job runs, a --profile, --timeline or --autotune-log-file that rank 0
    could never write.

    Checked on this host, where rank 0 usually runs (rank 0 checks --profile again at
    hvd.init()); a directory still missing is made when the file is written.
    """
    written = {}
    outputs = OutputRule(overwrite=True)  # each job replaces its files (they are no inputs)
    for option, path in (("--profile", args.profile), ("--timeline", args.timeline),
                         ("--autotune-log-file", args.autotune_log_file)):
        if not path or (option == "--timeline" and path == DYNAMIC_TIMELINE):
            continue
        path = os.path.abspath(path)
        outputs.refuse(path, option)
        written[option] = path
    if "--profile" in written and "--timeline" in written and same_file(written["--profile"], written["--timeline"]):
        # The profile, written at the end, would replace the whole timeline.
        raise LaunchError(f"--profile and --timeline name the same file, {written['--profile']}; "
                          "give them different files")


def _stall_timeout(options: RunOptions, env: Dict[str, str]) -> float:
    """The stall timeout the ranks will have: the stall check off puts the warning there."""
    if options.settings.get("stall_timeout_s"):
        return options.settings["stall_timeout_s"]
    try:
        return Settings.from_env(env).stall_timeout_s
    except SettingsError:
        return Settings.stall_timeout_s  # the bad variable is reported when the command is built


def _check_nccl_here() -> None:
    """Refuse backend nccl before launching when this host's PyTorch cannot run it (every rank
    runs here); on other hosts it is their PyTorch that counts, and hvd.init() checks it there."""
    from hpdl.comm.select import BackendUnavailableError, check_nccl_available

    try:
        check_nccl_available()
    except BackendUnavailableError as err:
        raise LaunchError(str(err)) from None


def _every_rank_here(options: RunOptions, env: Dict[str, str], info: LauncherInfo) -> bool:
    """Whether the job's ranks all run on this host, so that no ssh starts any of them."""
    if options.launcher == "srun" or "SLURM_JOB_ID" in env:
        return False  # srun places the ranks on the allocation's nodes
    return options.hosts is None or all(info.is_local(name) for name in options.hosts.names)


def _launcher_name(commands: List[List[str]], info: LauncherInfo) -> str:
    """What starts the ranks: "the mpiexec of MPICH (Hydra)", "srun" or "torchrun"."""
    if len(commands) == 1 and commands[0][0] == info.mpiexec:
        return f"the mpiexec of {FLAVOUR_NAMES[info.mpi_flavour]}"
    return "torchrun" if len(commands) > 1 else os.path.basename(commands[0][0])


def _not_honoured(args: argparse.Namespace, launcher: Optional[str]) -> List[str]:
    """The warning lines for the horovodrun options given that this job does not honour.

    Args:
        launcher: what starts the ranks, or None for Open MPI's mpiexec (which honours the
            launcher options, as under horovodrun).
    """
    lines = [f"{option} is not honoured by hpdl" for option, given in (
        ("--hierarchical-allgather", args.hierarchical_allgather),
        ("--mpi-threads-disable", args.mpi_threads_disable), ("--num-nccl-streams", args.num_nccl_streams is not None),
        ("--log-level", args.log_level is not None)) if given]
    if launcher is not None:
        lines += [f"{option} is not honoured under {launcher}" for option, given in (
            ("--binding-args", args.binding_args is not None),
            ("--prefix-output-with-timestamp", args.prefix_output_with_timestamp)) if given]
    return lines


# What horovodrun passes to Open MPI's mpiexec: containers commonly run as root, which Open MPI
# refuses without the first; the second prefixes each output line with the rank it came from.
OPENMPI_DEFAULTS = ("--allow-run-as-root", "--tag-output")


def with_openmpi_defaults(argv: Sequence[str], info: LauncherInfo, forward: Sequence[str] = (),
                          timestamp_output: bool = False) -> List[str]:
    """Return ``argv`` with horovodrun's Open MPI options added when it starts Open MPI's mpiexec.

    Args:
        forward: variables for Open MPI to pass on to every rank (it passes none by default).
        timestamp_output: prefix every output line with the time (horovodrun's
            --prefix-output-with-timestamp).
    """
    if info.mpi_flavour != OPENMPI or not argv or argv[0] != info.mpiexec:
        return list(argv)
    extra = [flag for flag in OPENMPI_DEFAULTS + (("--timestamp-output",) if timestamp_output else ())
             if flag not in argv]
    for name in forward:
        extra += ["-x", name]
    return [argv[0], *extra, *argv[1:]]


def _run_on_every_host(commands: List[List[str]], env: dict) -> int:
    """Start one launcher per host (each over the remote shell) and wait for all of them.

    When one fails, the others that have not ended within ``_OTHERS_END_S`` are ended too
    (their torchrun would wait for the lost host until its rendezvous times out), SIGINT and
    SIGTERM are passed on, and the first failure's status is returned.
    """
    procs = []
    try:
        for argv in commands:
            procs.append(subprocess.Popen(argv, env=env))
    except OSError as err:
        _end(procs, signal.SIGTERM)
        raise CliError(f"cannot start {commands[len(procs)][0]}: {err.strerror or err}") from None
    ending_since: List[float] = []

    def end(signum: int) -> None:
        ending_since.append(time.monotonic())
        _end(procs, signum)

    handlers = {s: signal.signal(s, lambda signum, _f: end(signum)) for s in (signal.SIGINT, signal.SIGTERM)}
    try:
        first_failure, failed_at = 0, 0.0
        while None in [p.poll() for p in procs]:  # every one polled: poll() reaps and sets returncode
            failed = [p.returncode for p in procs if p.returncode not in (None, 0)]
            if failed and not first_failure:
                first_failure, failed_at = failed[0], time.monotonic()
            if first_failure and not ending_since and time.monotonic() - failed_at > _OTHERS_END_S:
                end(signal.SIGTERM)
            if ending_since and time.monotonic() - ending_since[0] > _KILL_AFTER_S:
                _end(procs, signal.SIGKILL)  # a torchrun blocked in its rendezvous defers SIGTERM
            time.sleep(0.1)
        codes = [p.returncode for p in procs]
    finally:
        for s, handler in handlers.items():
            signal.signal(s, handler)
    status = first_failure or next((c for c in codes if c), 0)
    return 128 - status if status < 0 else status


# When one host's launcher fails, the ranks elsewhere usually fail on their own within moments
# (their peer's connections closed) and report it, naming the lost ranks; they get this long to
# do so before their launchers are ended.
_OTHERS_END_S = 10.0
_KILL_AFTER_S = 10.0  # from SIGTERM to SIGKILL when ending the launchers of the other hosts


def _end(procs: list, signum: int) -> None:
    for proc in procs:
        if proc.poll() is None:
            try:
                proc.send_signal(signum)
            except OSError:
                pass


def check_command(args: argparse.Namespace) -> int:
    """Handle `hpdl check`: print the availability report."""
    from hpdl.launch.check import print_check

    return print_check()
