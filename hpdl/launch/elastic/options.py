"""horovodrun's elastic options, read and checked before anything starts.

Elastic mode is asked for by ``--min-np``, ``--max-np`` or ``--host-discovery-script``. Their
meanings are horovodrun's: ``-np`` workers at the start (default: the slots of ``-H``, or
``--min-np`` with a discovery script), never fewer than ``--min-np`` (default ``-np``) for
longer than ``--elastic-timeout``, never more than ``--max-np`` (default: ``-np`` with fixed
hosts, every slot found with a discovery script).
"""

from __future__ import annotations

import argparse
import os
import socket
from typing import Callable, Dict, FrozenSet, Optional, Tuple

from hpdl.launch.elastic.discovery import DiscoveryScript, FixedHosts
from hpdl.launch.elastic.driver import ElasticOptions
from hpdl.launch.elastic.workers import ProcessWorkers
from hpdl.launch.hosts import HostList, LaunchError

# horovodrun's spellings, each with hpdl's name for it.
OPTION_NAMES = {"min_np": ("--min-np", "--min-num-proc"), "max_np": ("--max-np", "--max-num-proc"),
                "slots_per_host": ("--slots-per-host", "--slots"), "elastic_timeout": ("--elastic-timeout",),
                "reset_limit": ("--reset-limit",), "cooldown_range": ("--blacklist-cooldown-range",),
                "discovery_script": ("--host-discovery-script",)}


def add_elastic_options(group: argparse._ArgumentGroup) -> None:
    """Add horovodrun's elastic options to ``group``."""
    group.add_argument(*OPTION_NAMES["min_np"], dest="min_np", type=int, metavar="N",
                       help="elastic: the fewest workers the job goes on with (default: -np); below it for "
                            "--elastic-timeout seconds, the job ends")
    group.add_argument(*OPTION_NAMES["max_np"], dest="max_np", type=int, metavar="N",
                       help="elastic: the most workers (default: -np with -H, every slot found with a discovery script)")
    group.add_argument(*OPTION_NAMES["discovery_script"], dest="discovery_script", metavar="SCRIPT",
                       help="elastic: an executable printing one 'host' or 'host:slots' line per available host; "
                            "run every HPDL_ELASTIC_DISCOVERY_INTERVAL seconds (1)")
    group.add_argument(*OPTION_NAMES["slots_per_host"], dest="slots_per_host", type=int, metavar="N",
                       help="elastic: slots of a host the discovery script prints without ':slots' (default 1)")
    group.add_argument(*OPTION_NAMES["elastic_timeout"], dest="elastic_timeout", type=float, metavar="S",
                       help="elastic: seconds to wait for --min-np workers before the job ends (default 600)")
    group.add_argument(*OPTION_NAMES["reset_limit"], dest="reset_limit", type=int, metavar="N",
                       help="elastic: the most times the world may be formed again before the job ends")
    group.add_argument(*OPTION_NAMES["cooldown_range"], dest="cooldown_range", type=float, nargs=2,
                       metavar=("A", "B"),
                       help="elastic: a failed host is admitted again after A seconds, doubling each time it "
                            "fails again, at most B (default: never)")


def is_elastic(args: argparse.Namespace) -> bool:
    return any(getattr(args, name, None) is not None for name in ("min_np", "max_np", "discovery_script"))


def elastic_job(args: argparse.Namespace, command: tuple, host_list: Optional[HostList],
                local_names: FrozenSet[str], discovery_interval_s: float, discovery_timeout_s: float,
                env: Dict[str, str], cwd: str) -> Tuple[ElasticOptions, ProcessWorkers]:
    """Check the elastic options given to `hpdl run`; return the job's :class:`ElasticOptions`
    and the starter of its workers (``command`` in ``cwd`` with ``env``, over the remote shell
    on other hosts).

    Raises:
        LaunchError: one line naming the option; nothing has started.
    """
    given = {name for name in ("min_np", "max_np", "slots_per_host", "elastic_timeout", "reset_limit",
                               "cooldown_range", "discovery_script") if getattr(args, name, None) is not None}
    if args.backend == "mpi":
        raise LaunchError("elastic options with the MPI backend: an MPI world cannot change its size; elastic jobs "
                          "run on torch.distributed (--backend gloo, nccl or torch)")
    if args.launcher != "auto":
        raise LaunchError(f"elastic options with --launcher {args.launcher}: {args.launcher} cannot change a running "
                          "world; hpdl run starts an elastic job's workers itself (under torchrun, use its "
                          "--nnodes=MIN:MAX and hvd.elastic.run: docs/elastic.md)")
    # Each number's range is checked with every option's (hpdl/launch/limits.py).
    cooldown = tuple(args.cooldown_range) if args.cooldown_range is not None else None
    if cooldown is not None and cooldown[0] > cooldown[1]:
        raise LaunchError(f"--blacklist-cooldown-range {cooldown[0]:g} {cooldown[1]:g}: give A <= B seconds")
    if args.discovery_script is not None:
        if host_list is not None:
            raise LaunchError("--host-discovery-script with -H or a hostfile: give one or the other")
        hosts = DiscoveryScript(args.discovery_script, args.slots_per_host, discovery_timeout_s)
        hosts.check()
        found = hosts.find()
        if not found:
            raise LaunchError(f"--host-discovery-script {args.discovery_script} printed no host")
        slots = sum(found.values())
    else:
        if "slots_per_host" in given:
            raise LaunchError("--slots-per-host is for the hosts of --host-discovery-script; -H gives each "
                              "host's slots (host:slots)")
        if host_list is None:
            from hpdl.launch.hosts import Host

            host_list = HostList((Host("localhost", args.np or args.min_np or 1),))
        hosts = FixedHosts(host_list)
        slots = host_list.total_slots
    np = args.np if args.np is not None else ((args.min_np or 1) if args.discovery_script else slots)
    min_np = args.min_np if args.min_np is not None else np
    max_np = args.max_np if args.max_np is not None else (np if args.discovery_script is None else 1 << 30)
    if min_np > max_np:
        raise LaunchError(f"--min-np {min_np} is above --max-np {max_np}")
    if not min_np <= np <= max_np:
        raise LaunchError(f"-np {np} is outside --min-np {min_np} and --max-np "
                          f"{max_np if max_np < 1 << 30 else 'unbounded'}")
    if args.discovery_script is None and min_np > slots:
        raise LaunchError(f"--min-np {min_np} is more than the {slots} slot(s) of the hosts given")
    names = set(local_names) | _addresses()
    options = ElasticOptions(
        np=np, min_np=min_np, max_np=max_np, hosts=hosts,
        elastic_timeout_s=args.elastic_timeout if args.elastic_timeout is not None else 600.0,
        reset_limit=args.reset_limit, cooldown_range_s=cooldown, discovery_interval_s=discovery_interval_s,
        verbose=bool(getattr(args, "verbose", False)))
    workers = ProcessWorkers(command, env, cwd, remote_shell=args.remote_shell or os.environ.get("HPDL_RSH") or "ssh",
                             is_local=_is_local_to(frozenset(names)))
    return options, workers


def _addresses() -> set:
    """This machine's own addresses (a host list may name it by one)."""
    found = set()
    try:
        for info in socket.getaddrinfo(socket.gethostname(), None):
            found.add(info[4][0])
    except OSError:
        pass
    return found


def _is_local_to(names: FrozenSet[str]) -> Callable[[str], bool]:
    def is_local(host: str) -> bool:
        return host in names or host.split(".")[0] in names or host.startswith("127.")

    return is_local

