"""hpdl/launch/process_tree.py: a job's processes found through /proc and ended, whatever
sessions they started (what the test harness and scripts/gpu_check.py end jobs with)."""

import os
import subprocess
import sys
import time

import pytest

from hpdl.launch.process_tree import alive, descendants, end_processes, kill_tree, processes_with_env

pytestmark = pytest.mark.skipif(not os.path.isdir("/proc/self"), reason="needs Linux /proc")

# A child that starts a grandchild in a session of its own (as a launcher's rank may be), says
# its pid, and waits.
TREE = ("import subprocess, sys; g = subprocess.Popen(['sleep', '300'], start_new_session=True); "
        "print(g.pid, flush=True); g.wait()")


def _wait_until(condition, seconds=10.0):
    deadline = time.monotonic() + seconds
    while not condition() and time.monotonic() < deadline:
        time.sleep(0.05)
    return condition()


def test_a_tree_is_found_across_sessions_and_killed_whole():
    proc = subprocess.Popen([sys.executable, "-c", TREE], stdout=subprocess.PIPE, text=True)
    try:
        grandchild = int(proc.stdout.readline())
        assert grandchild in descendants(proc.pid) and alive(grandchild)
        kill_tree(proc.pid)
        assert proc.wait(timeout=10) == -9
        assert _wait_until(lambda: not alive(grandchild)), "the grandchild outlived kill_tree"
    finally:
        if proc.poll() is None:
            kill_tree(proc.pid)
            proc.wait()


def test_processes_are_found_by_their_environment_mark_and_ended():
    mark = f"HPDL_PROCESS_TREE_TEST={os.getpid()}.{time.monotonic_ns()}"
    proc = subprocess.Popen(["sleep", "300"], env={**os.environ, mark.split("=")[0]: mark.split("=")[1]},
                            start_new_session=True)
    try:
        # Until the child has exec'd, /proc shows the parent's environment, without the mark.
        assert _wait_until(lambda: processes_with_env(mark) == [proc.pid])
        end_processes([proc.pid], grace_s=5)
        assert proc.wait(timeout=10) == -15  # SIGTERM was enough
        assert processes_with_env(mark) == [] and not alive(proc.pid)
    finally:
        if proc.poll() is None:
            proc.kill()
