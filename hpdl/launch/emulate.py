"""`hpdl emulate`: a cluster of N nodes on this machine, to run multi-node jobs for real.

Each node is a network namespace with its own address, host name (a UTS namespace) and
``/etc/hosts`` (``ip netns exec`` mounts ``/etc/netns/<namespace>/hosts`` over it), joined to
the others through a bridge that lives in a namespace of its own, so nothing is added to the
host's network. Every link is shaped with the ``tbf`` qdisc on both of its ends (``netem``, for
added delay, where the kernel has it). Rank discovery inside a node sees a real, different host:
MPI splits ranks by shared-memory node and hpdl by host name, and nothing is faked.

A job reaches the nodes the way it reaches real ones: ``hpdl run`` reads the hostfile from
``HPDL_HOSTFILE`` and the remote shell from ``HPDL_RSH`` (the stand-in for ssh written here:
``node-shell HOST COMMAND...`` runs COMMAND inside HOST's namespaces, as ``ssh HOST COMMAND``
would). Everything created is named after this process (``hpdl<pid>...``) and removed on exit,
after a failure and on SIGINT/SIGTERM; what a killed ``hpdl emulate`` left behind is removed by
the next one.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Dict, List, Optional, Sequence

__all__ = ["ClusterSpec", "EmulatedCluster", "EmulateError", "node_shell", "register"]

_PREFIX = "hpdl"  # of every namespace, link and directory created here: hpdl<pid>n<i>, hpdl<pid>sw
_RUN_ROOT = Path("/run/hpdl-emulate")  # persistent UTS namespaces (bind mounts) and cluster files
_NETNS_ETC = Path("/etc/netns")
_RATE = re.compile(r"^\d+(\.\d+)?(bit|kbit|mbit|gbit|tbit|bps|kbps|mbps|gbps|tbps)$", re.IGNORECASE)
_DELAY = re.compile(r"^\d+(\.\d+)?(us|ms|s)$")
_SIGNALS = (signal.SIGINT, signal.SIGTERM)


class EmulateError(RuntimeError):
    """The cluster cannot be created or used; the message is one line."""


@dataclasses.dataclass(frozen=True)
class ClusterSpec:
    """What to emulate: ``nodes`` hosts of ``slots`` slots, links of ``rate`` (tc syntax)."""

    nodes: int
    slots: int = 1
    rate: str = "1gbit"
    delay: Optional[str] = None  # one-way, added with netem on each link end

    def __post_init__(self) -> None:
        if self.nodes < 1 or self.nodes > 250:
            raise EmulateError(f"--nodes must be from 1 to 250, got {self.nodes}")
        if self.slots < 1:
            raise EmulateError(f"--slots must be at least 1, got {self.slots}")
        if not _RATE.match(self.rate):
            raise EmulateError(f"--rate {self.rate!r} is not a rate (e.g. 1gbit, 100mbit, 500kbit)")
        if self.delay is not None and not _DELAY.match(self.delay):
            raise EmulateError(f"--delay {self.delay!r} is not a time (e.g. 100us, 2ms)")


@dataclasses.dataclass(frozen=True)
class Node:
    """One emulated node: its host name, namespace, address and persistent UTS namespace."""

    name: str
    netns: str
    address: str
    uts: str  # file the node's UTS namespace is bound to

    def argv(self, command: Sequence[str]) -> List[str]:
        """The argv running ``command`` on this node (its network, host name and /etc/hosts)."""
        return ["ip", "netns", "exec", self.netns, "nsenter", f"--uts={self.uts}", "--", *command]


def _run(argv: Sequence[str], what: str) -> None:
    done = subprocess.run(list(argv), stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, check=False)
    if done.returncode != 0:
        raise EmulateError(f"{what} failed: {' '.join(argv)}: {done.stdout.strip().splitlines()[-1:] or ['?']}")


def _quiet(argv: Sequence[str]) -> None:
    subprocess.run(list(argv), stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, check=False)


class EmulatedCluster:
    """Create the nodes of ``spec`` on entering, remove every trace of them on leaving."""

    def __init__(self, spec: ClusterSpec, owner: Optional[int] = None):
        self.spec = spec
        self.owner = os.getpid() if owner is None else owner
        tag = f"{_PREFIX}{self.owner}"
        self.tag = tag
        self.switch = f"{tag}sw"
        # A /24 of the 10/8 private range per owner: clusters of concurrent owners never meet.
        net = f"10.{(self.owner >> 8) % 256}.{self.owner % 256}"
        self.nodes = [Node(f"n{i}", f"{tag}n{i}", f"{net}.{i}", str(_RUN_ROOT / tag / f"uts-n{i}"))
                      for i in range(1, spec.nodes + 1)]
        self.dir = _RUN_ROOT / tag
        self.hostfile = self.dir / "hostfile"
        self.shell = self.dir / "node-shell"
        self._up = False

    # -- lifecycle ----------------------------------------------------------------------------

    def __enter__(self) -> "EmulatedCluster":
        self.up()
        return self

    def __exit__(self, *exc) -> None:
        self.down()

    def up(self) -> None:
        """Create the switch, the nodes, their links and files."""
        _check_can_emulate()
        remove_stale()
        self._up = True
        try:
            self.dir.mkdir(parents=True, exist_ok=True)
            _run(["ip", "netns", "add", self.switch], "creating the switch namespace")
            _run(["ip", "-n", self.switch, "link", "add", "br0", "type", "bridge"], "creating the bridge")
            _run(["ip", "-n", self.switch, "link", "set", "br0", "up"], "starting the bridge")
            # The IPv4-mapped form too: a dual-stack listener (torch's TCPStore) sees its peers
            # as ::ffff:a.b.c.d and names them by reverse lookup, which otherwise fails here.
            hosts = "127.0.0.1 localhost\n" + "".join(f"{n.address} {n.name}\n::ffff:{n.address} {n.name}\n"
                                                       for n in self.nodes)
            for index, node in enumerate(self.nodes, start=1):
                self._add_node(node, index, hosts)
            self.hostfile.write_text("".join(f"{n.name} slots={self.spec.slots}\n" for n in self.nodes))
            self.shell.write_text(f"#!{sys.executable}\nimport sys\nfrom hpdl.launch.emulate import node_shell\n"
                                  f"sys.exit(node_shell(sys.argv[1:], {str(self.dir / 'nodes.json')!r}))\n")
            self.shell.chmod(0o755)
            (self.dir / "nodes.json").write_text(json.dumps([dataclasses.asdict(n) for n in self.nodes]))
        except BaseException:
            self.down()
            raise

    def _add_node(self, node: Node, index: int, hosts: str) -> None:
        _run(["ip", "netns", "add", node.netns], f"creating node {node.name}")
        etc = _NETNS_ETC / node.netns
        etc.mkdir(parents=True, exist_ok=True)
        (etc / "hosts").write_text(hosts)
        Path(node.uts).touch()
        _run(["unshare", f"--uts={node.uts}", "hostname", node.name], f"naming node {node.name}")
        port = f"p{index}"  # the switch's end of the node's link
        _run(["ip", "-n", self.switch, "link", "add", port, "type", "veth", "peer", "name", "eth0",
              "netns", node.netns], f"linking node {node.name}")
        _run(["ip", "-n", self.switch, "link", "set", port, "master", "br0", "up"], f"linking node {node.name}")
        _run(["ip", "-n", node.netns, "addr", "add", f"{node.address}/24", "dev", "eth0"], f"addressing {node.name}")
        _run(["ip", "-n", node.netns, "link", "set", "eth0", "up"], f"starting {node.name}'s link")
        _run(["ip", "-n", node.netns, "link", "set", "lo", "up"], f"starting {node.name}'s loopback")
        for netns, dev in ((node.netns, "eth0"), (self.switch, port)):
            self._shape(netns, dev)

    def _shape(self, netns: str, dev: str) -> None:
        tbf = ["tbf", "rate", self.spec.rate, "burst", "256kb", "latency", "100ms"]
        if self.spec.delay is None:
            _run(["ip", "netns", "exec", netns, "tc", "qdisc", "add", "dev", dev, "root", *tbf], "shaping a link")
            return
        try:
            _run(["ip", "netns", "exec", netns, "tc", "qdisc", "add", "dev", dev, "root", "handle", "1:", "netem",
                  "delay", self.spec.delay], "adding delay")
        except EmulateError:
            raise EmulateError("--delay needs the netem qdisc, which this kernel does not have") from None
        _run(["ip", "netns", "exec", netns, "tc", "qdisc", "add", "dev", dev, "parent", "1:", "handle", "2:", *tbf],
             "shaping a link")

    def down(self) -> None:
        """Remove everything of this cluster (idempotent; processes inside are killed first)."""
        if not self._up:
            return
        self._up = False
        blocked = signal.pthread_sigmask(signal.SIG_BLOCK, _SIGNALS)  # a second Ctrl-C must not stop the clean-up
        try:
            _remove_owner(self.tag)
        finally:
            signal.pthread_sigmask(signal.SIG_SETMASK, blocked)

    # -- use ----------------------------------------------------------------------------------

    def env(self, base: Optional[Dict[str, str]] = None) -> Dict[str, str]:
        """The environment that tells `hpdl run` about the nodes (hostfile and remote shell)."""
        env = dict(os.environ if base is None else base)
        env.update({"HPDL_HOSTFILE": str(self.hostfile), "HPDL_RSH": str(self.shell)})
        # The nodes share this machine's memory: without these, MPICH's UCX would pass messages
        # between "nodes" through shared memory and gloo might pick another interface than the
        # shaped link. Intra-node messages then go over TCP on loopback, which is not shaped.
        env.setdefault("UCX_TLS", "tcp,self")
        env.setdefault("GLOO_SOCKET_IFNAME", "eth0")
        return env

    def run(self, command: Sequence[str], node: int = 0, env: Optional[Dict[str, str]] = None) -> int:
        """Run ``command`` on node ``node`` (first by default) to its end; return its exit status.

        SIGINT and SIGTERM are passed on to it; whatever it leaves running is killed on ``down``.
        """
        proc = subprocess.Popen(self.nodes[node].argv(command), env=self.env(env), start_new_session=True)
        forwarded: List[int] = []

        def forward(signum, _frame):
            forwarded.append(signum)
            try:
                os.killpg(proc.pid, signum)
            except OSError:
                pass

        previous = {s: signal.signal(s, forward) for s in _SIGNALS}
        try:
            code = proc.wait()
        finally:
            for s, handler in previous.items():
                signal.signal(s, handler)
        return 128 - code if code < 0 else code  # killed by signal N: 128 + N, as shells report it


def _check_can_emulate() -> None:
    if os.geteuid() != 0:
        raise EmulateError("hpdl emulate needs root to create network namespaces (run it as root, e.g. with sudo)")
    for tool in ("ip", "tc", "nsenter", "unshare"):
        if shutil.which(tool) is None:
            raise EmulateError(f"hpdl emulate needs {tool!r} (Debian: iproute2 and util-linux), which is not on PATH")


def _namespaces() -> List[str]:
    done = subprocess.run(["ip", "netns", "list"], stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True,
                          check=False)
    return [line.split()[0] for line in done.stdout.splitlines() if line.strip()]


def _remove_owner(tag: str) -> None:
    """Kill what runs in ``tag``'s namespaces, then delete them and their files."""
    mine = [ns for ns in _namespaces() if re.fullmatch(rf"{tag}(sw|n\d+)", ns)]
    for _ in range(3):  # processes may fork while being killed
        pids = set()
        for ns in mine:
            done = subprocess.run(["ip", "netns", "pids", ns], stdout=subprocess.PIPE, stderr=subprocess.DEVNULL,
                                  text=True, check=False)
            pids.update(int(p) for p in done.stdout.split() if p.isdigit())
        if not pids:
            break
        for pid in pids:
            try:
                os.kill(pid, signal.SIGKILL)
            except OSError:
                pass
        time.sleep(0.2)
    for ns in mine:
        _quiet(["ip", "netns", "del", ns])
        shutil.rmtree(_NETNS_ETC / ns, ignore_errors=True)
    directory = _RUN_ROOT / tag
    if directory.is_dir():
        for uts in directory.glob("uts-*"):
            _quiet(["umount", str(uts)])
        shutil.rmtree(directory, ignore_errors=True)
    for parent in (_NETNS_ETC, _RUN_ROOT):
        try:
            parent.rmdir()  # only when empty: never remove what others put there
        except OSError:
            pass


def remove_stale() -> List[str]:
    """Remove the clusters of ``hpdl emulate`` processes that no longer run; return their tags."""
    owners = set()
    for ns in _namespaces():
        match = re.fullmatch(rf"{_PREFIX}(\d+)(sw|n\d+)", ns)
        if match:
            owners.add(int(match.group(1)))
    if _RUN_ROOT.is_dir():
        for entry in _RUN_ROOT.iterdir():
            match = re.fullmatch(rf"{_PREFIX}(\d+)", entry.name)
            if match:
                owners.add(int(match.group(1)))
    stale = [f"{_PREFIX}{pid}" for pid in sorted(owners) if not _alive(pid)]
    for tag in stale:
        _remove_owner(tag)
    return stale


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def leftovers(owner: Optional[int] = None) -> List[str]:
    """Namespaces and directories of ours (of ``owner``'s cluster, or anyone's) that exist now."""
    tag = rf"{_PREFIX}{owner}" if owner is not None else rf"{_PREFIX}\d+"
    found = [ns for ns in _namespaces() if re.fullmatch(rf"{tag}(sw|n\d+)", ns)]
    if _RUN_ROOT.is_dir():
        found += [str(p) for p in _RUN_ROOT.iterdir() if re.fullmatch(tag, p.name)]
    return found


# -- the remote shell -------------------------------------------------------------------------

# ssh options that take a value: skipped with it, as ssh would consume them.
_SSH_VALUE_OPTIONS = set("BbcDEeFIiJLlmOoPpQRSWw")


def node_shell(args: Sequence[str], nodes_file: str) -> int:
    """Act as ``ssh [options] HOST COMMAND...`` for the emulated nodes: run COMMAND on HOST.

    As ssh does, the words of COMMAND are joined and run by a shell on the remote host.
    """
    nodes = {n["name"]: Node(**n) for n in json.loads(Path(nodes_file).read_text())}
    rest = list(args)
    while rest and rest[0].startswith("-"):
        option = rest.pop(0)
        if len(option) == 2 and option[1] in _SSH_VALUE_OPTIONS and rest:
            rest.pop(0)
    if not rest:
        print("node-shell: usage: node-shell [ssh options] HOST COMMAND...", file=sys.stderr)
        return 255
    host, command = rest[0], rest[1:]
    node = nodes.get(host) or next((n for n in nodes.values() if n.address == host), None)
    if node is None:
        print(f"node-shell: {host}: no such emulated node (nodes: {', '.join(nodes)})", file=sys.stderr)
        return 255
    argv = node.argv(["sh", "-c", " ".join(command)] if command else ["sh"])
    os.execvp(argv[0], argv)
    return 255  # pragma: no cover - execvp does not return


# -- the command ------------------------------------------------------------------------------

_DESCRIPTION = """\
Emulate a cluster on this machine and run COMMAND on its first node: NODES network
namespaces, each with its own address, host name and /etc/hosts, joined by a bridge, every
link shaped to RATE (tc's tbf). COMMAND sees HPDL_HOSTFILE (the nodes, SLOTS each) and
HPDL_RSH (a stand-in for ssh into the nodes), which `hpdl run` uses, and, unless already
set, UCX_TLS=tcp,self and GLOO_SOCKET_IFNAME=eth0 (so that traffic between nodes crosses the
shaped links), so
  hpdl emulate --nodes 2 --rate 1gbit -- hpdl run -np 2 -- python job.py
runs one rank on each node. Everything is removed afterwards, also after a failure and on
Ctrl-C or SIGTERM. Needs root."""


def register(subparsers) -> None:
    """Add the `emulate` subcommand."""
    p = subparsers.add_parser("emulate", help="run a command on an emulated multi-node cluster (root)",
                              description=_DESCRIPTION, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--nodes", type=int, required=True, metavar="N", help="number of nodes")
    p.add_argument("--slots", type=int, default=1, metavar="S", help="slots (ranks) per node in the hostfile (default 1)")
    p.add_argument("--rate", default="1gbit", help="bandwidth of every link, tc syntax (default 1gbit)")
    p.add_argument("--delay", default=None, help="one-way delay added to every link end, e.g. 100us (needs netem)")
    p.add_argument("command", nargs=argparse.REMAINDER, metavar="-- COMMAND ...", help="what to run on the first node")
    p.set_defaults(func=_run_emulate)


def _run_emulate(args: argparse.Namespace) -> int:
    from hpdl.cli_error import CliError

    command = list(args.command)
    if command and command[0] == "--":
        command = command[1:]
    if not command:
        raise CliError("no command to run; put it after '--', e.g. hpdl emulate --nodes 2 -- hpdl run -np 2 -- python job.py")
    def terminate(signum, _frame):  # until the command runs (which gets it passed on), clean up and end
        raise SystemExit(128 + signum)

    signal.signal(signal.SIGTERM, terminate)
    try:
        spec = ClusterSpec(args.nodes, args.slots, args.rate, args.delay)
        with EmulatedCluster(spec) as cluster:
            return cluster.run(command)
    except EmulateError as err:
        raise CliError(str(err)) from None
