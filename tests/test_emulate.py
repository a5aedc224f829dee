"""`hpdl emulate`: emulated nodes are real namespaces with their own names and shaped links, and
nothing of them is left afterwards, whatever ends the run."""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest

import hpdl
from hpdl.launch.emulate import ClusterSpec, EmulatedCluster, EmulateError, leftovers

pytestmark = pytest.mark.skipif(
    os.geteuid() != 0 or shutil.which("ip") is None or shutil.which("tc") is None,
    reason="emulated nodes need root and iproute2 (ip, tc)",
)


def _hpdl(*args, **kwargs):
    return subprocess.Popen([sys.executable, "-m", "hpdl", *args], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True, **kwargs)


def _out(cluster, node, *command):
    return subprocess.run(cluster.nodes[node].argv(command), capture_output=True, text=True, check=True).stdout


@pytest.fixture(scope="module")
def cluster():
    with EmulatedCluster(ClusterSpec(nodes=2, slots=2, rate="100mbit")) as c:
        yield c
    assert leftovers(os.getpid()) == []


def test_nodes_are_separate_hosts_with_their_own_names_and_addresses(cluster):
    names = [_out(cluster, i, "hostname").strip() for i in range(2)]
    assert names == ["n1", "n2"]
    assert cluster.nodes[0].address in _out(cluster, 0, "ip", "-4", "addr", "show", "eth0")
    # Each node resolves every node's name to its address, through its own /etc/hosts.
    assert cluster.nodes[1].address in _out(cluster, 0, "getent", "hosts", "n2")
    # And names a peer by its address, also as a dual-stack socket sees it (::ffff:a.b.c.d).
    assert _out(cluster, 0, "getent", "hosts", cluster.nodes[1].address).split()[-1] == "n2"
    assert _out(cluster, 0, "getent", "hosts", "::ffff:" + cluster.nodes[1].address).split()[-1] == "n2"
    assert cluster.hostfile.read_text() == "n1 slots=2\nn2 slots=2\n"


def test_every_link_is_shaped_on_both_ends(cluster):
    node_side = _out(cluster, 0, "tc", "qdisc", "show", "dev", "eth0")
    switch_side = subprocess.run(["ip", "netns", "exec", cluster.switch, "tc", "qdisc", "show", "dev", "p1"],
                                 capture_output=True, text=True, check=True).stdout
    for shown in (node_side, switch_side):
        assert "tbf" in shown and "rate 100Mbit" in shown, shown


def test_the_remote_shell_runs_a_command_on_the_named_node_as_ssh_would(cluster):
    env = cluster.env()
    done = subprocess.run(cluster.nodes[0].argv([env["HPDL_RSH"], "-x", "-p", "22", "n2", "echo", "$(hostname)"]),
                          capture_output=True, text=True, env=env)
    assert done.stdout.strip() == "n2", done.stderr
    bad = subprocess.run([env["HPDL_RSH"], "nowhere", "true"], capture_output=True, text=True)
    assert bad.returncode == 255 and "no such emulated node" in bad.stderr


def test_the_command_runs_on_the_first_node_and_its_status_is_returned(tmp_path):
    proc = _hpdl("emulate", "--nodes", "2", "--", "sh", "-c", 'hostname; echo "$HPDL_HOSTFILE"; exit 3')
    out, err = proc.communicate(timeout=60)
    assert proc.returncode == 3, err
    assert out.splitlines()[0] == "n1"
    assert leftovers(proc.pid) == []


def test_sigterm_ends_the_command_and_removes_everything():
    proc = _hpdl("emulate", "--nodes", "2", "--", "sh", "-c", "echo up; sleep 60")
    assert proc.stdout.readline().strip() == "up"
    assert len(leftovers(proc.pid)) == 4  # the switch, two nodes and the cluster's directory
    proc.send_signal(signal.SIGTERM)
    proc.communicate(timeout=30)
    assert proc.returncode == 128 + signal.SIGTERM
    assert leftovers(proc.pid) == []


def test_a_killed_emulation_is_cleaned_up_by_the_next_one():
    proc = _hpdl("emulate", "--nodes", "2", "--", "sh", "-c", "echo up; sleep 60.417")
    assert proc.stdout.readline().strip() == "up"
    proc.kill()  # no chance to clean up: the command goes on running inside node n1
    proc.wait(timeout=30)
    proc.stdout.close()
    proc.stderr.close()
    assert len(leftovers(proc.pid)) == 4
    done = _hpdl("emulate", "--nodes", "1", "--", "true")
    done.communicate(timeout=60)
    assert done.returncode == 0
    assert leftovers(proc.pid) == [] and leftovers(done.pid) == []
    orphans = subprocess.run(["pgrep", "-f", "sleep 60.417"], capture_output=True, text=True).stdout.split()
    assert orphans == [], "the killed emulation's command still runs"


@pytest.mark.parametrize("args,message", [
    (["--nodes", "0"], "--nodes must be from 1 to 250, got 0"),
    (["--nodes", "2", "--rate", "fast"], "--rate 'fast' is not a rate"),
    (["--nodes", "2", "--delay", "1ms"], "--delay needs the netem qdisc"),
    (["--nodes", "2"], "no command to run"),
])
def test_bad_requests_are_one_line(args, message):
    command = [] if message == "no command to run" else ["--", "true"]
    proc = _hpdl("emulate", *args, *command)
    out, err = proc.communicate(timeout=60)
    if "netem" in message and proc.returncode == 0:
        pytest.skip("this kernel has netem: delay works")
    assert proc.returncode == 2 and err.strip().count("\n") == 0 and message in err, err
    assert leftovers(proc.pid) == []


def test_without_root_it_refuses_in_one_line():
    if shutil.which("setpriv") is None:
        pytest.skip("setpriv (util-linux) is needed to drop root")
    # The checkout may lie where the unprivileged user cannot read it (a clone under
    # `mktemp -d`), so the command runs from a copy of the package in a directory it can read,
    # found before the installed one (the current directory comes first on sys.path).
    readable = Path(tempfile.mkdtemp(prefix="hpdl-nobody-"))
    try:
        shutil.copytree(Path(hpdl.__file__).parent, readable / "hpdl", ignore=shutil.ignore_patterns("__pycache__"))
        for path in [readable, *readable.rglob("*")]:
            path.chmod(0o755 if path.is_dir() else 0o644)
        env = {"PATH": os.environ.get("PATH", os.defpath), "HOME": str(readable), "PYTHONDONTWRITEBYTECODE": "1"}
        drop_root = ["setpriv", "--reuid=65534", "--regid=65534", "--clear-groups", sys.executable]
        started = subprocess.run([*drop_root, "-c", "pass"], capture_output=True, text=True, env=env, cwd=readable)
        if started.returncode != 0:
            pytest.skip(f"the unprivileged user cannot start {sys.executable}: {started.stderr.strip()}")
        done = subprocess.run([*drop_root, "-m", "hpdl", "emulate", "--nodes", "2", "--", "true"],
                              capture_output=True, text=True, env=env, cwd=readable)
    finally:
        shutil.rmtree(readable)
    assert done.returncode == 2, done.stderr
    assert done.stderr.strip() == ("hpdl: error: hpdl emulate needs root to create network namespaces "
                                   "(run it as root, e.g. with sudo)")


def test_spec_rejects_bad_values_before_touching_anything():
    with pytest.raises(EmulateError, match="--slots must be at least 1"):
        ClusterSpec(nodes=2, slots=0)
    with pytest.raises(EmulateError, match="--delay '5' is not a time"):
        ClusterSpec(nodes=2, delay="5")


def test_zz_no_namespace_or_link_of_a_finished_emulation_is_left():
    # Runs last in this module: every cluster whose owner has ended must be gone (clusters of
    # owners still running, such as another test session's, are theirs to remove).
    stale = [entry for entry in leftovers() if not _owner_alive(entry)]
    assert stale == []


def _owner_alive(entry: str) -> bool:
    import re

    pid = int(re.search(r"hpdl(\d+)", entry).group(1))
    return os.path.exists(f"/proc/{pid}")
