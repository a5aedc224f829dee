"""Run a rank's command as a child, and say in one line how it ended when it died on its own:
``python -m hpdl.launch.rank_watch -- COMMAND ...``.

`hpdl run` starts every rank's command this way. A rank that dies hard (SIGKILL, ``os._exit``,
a crash in C code) cannot say so itself, and no launcher says it in a line naming the rank:
MPICH's mpiexec kills the others and prints a banner with a pid, torchrun a ChildFailedError
traceback. Only a process's parent learns how it ended, so this process stays the command's
parent, and when the command ends by a signal, or with an exit code other than 0 that it gave
no reason for (a process running hpdl notes an exit through Python, which prints its reason:
:mod:`hpdl.rank_exit`), and no one asked for that end (no signal passed on from here came
before), it prints to stderr, which the launcher passes on as the rank's own::

    hpdl run: rank 1 (host node2) was killed by signal 9 (SIGKILL)
    hpdl run: rank 1 (host node2) ended with exit code 7

It then ends as the command did (killed by the same signal, or with the same exit code), so
that the launcher sees the rank's end and acts on it as without this process; under MPICH's
mpiexec, an exit code no one explained also aborts the job through mpiexec's own process
manager interface, which otherwise let the other ranks wait in MPI_Init for a rank that failed
before it started MPI.

Signals: the command runs in a process group of its own, so that a signal the launcher or a
terminal's Ctrl-C sends to this process's group reaches the command once, passed on from here
(Slurm signals every process of a step, so there the command gets it twice, nearly at once);
and with the kernel's parent-death signal set to SIGKILL, so that a launcher killing this
process (MPICH's mpiexec ends the survivors of a lost rank with SIGKILL) kills the command
too. The command keeps the launcher's variables and the descriptors this process inherited
(the PMI_FD through which MPICH's and Slurm's ranks meet).

Environment: the command also gets Horovod's launcher variables, HOROVOD_HOSTNAME, HOROVOD_RANK,
HOROVOD_SIZE, HOROVOD_LOCAL_RANK/SIZE and HOROVOD_CROSS_RANK/SIZE, as horovodrun gives its
workers, because scripts written for Horovod read them. The launchers `hpdl run` uses set none
of them, and this is the one process of `hpdl run` that runs on the rank's host, with the
launcher's variables, before the command, under every launcher. Only those the launcher's
variables decide are set, and none that is set already (:mod:`hpdl.launch.horovod_env`).

Output: the command's stdout and stderr reach the launcher in whole lines (line_relay.py), so
that Open MPI's --tag-output, which tags every chunk it reads, tags every line, and ranks that
share a stream do not interleave inside lines.
"""

from __future__ import annotations

import ctypes
import os
import resource
import signal
import socket
import subprocess
import sys
import time
from typing import Callable, List, Optional, Sequence, Set

from hpdl import rank_exit
from hpdl.launch.horovod_env import horovod_environment
from hpdl.launch.line_relay import LineRelay

# Passed on to the command; the first four end it by default, so an end that follows one of
# them was asked for.
_ENDING = (signal.SIGHUP, signal.SIGINT, signal.SIGQUIT, signal.SIGTERM)
_PASSED_ON = _ENDING + (signal.SIGUSR1, signal.SIGUSR2, signal.SIGTSTP, signal.SIGCONT, signal.SIGWINCH)
_PR_SET_PDEATHSIG = 1  # <linux/prctl.h>
_REPORT_PASSES_S = 0.5  # for a report line to pass hydra's proxy before the job is aborted


def watched(command: Sequence[str]) -> List[str]:
    """``command`` run through this module, as `hpdl run` starts every rank's."""
    return [sys.executable, "-m", "hpdl.launch.rank_watch", "--", *command]


def ending_words(returncode: int) -> str:
    """How a process with this ``subprocess`` return code ended, in words."""
    if returncode < 0:
        try:
            name = signal.Signals(-returncode).name
        except ValueError:
            return f"was killed by signal {-returncode}"
        return f"was killed by signal {-returncode} ({name})"
    return f"ended with exit code {returncode}"


def report_line(returncode: int, env: Optional[dict] = None) -> str:
    """The line that names this rank, its host and how its command ended."""
    from hpdl.comm.topology import discover_topology

    try:
        rank = str(discover_topology(os.environ if env is None else env).rank)
    except ValueError:  # started outside a launcher: no rank to name
        rank = "?"
    return f"hpdl run: rank {rank} (host {socket.gethostname()}) {ending_words(returncode)}\n"


def asked_for(returncode: int, passed_on: Set[int]) -> bool:
    """Whether the command's end followed from a signal passed on to it (the launcher ending the job)."""
    if returncode < 0:
        return -returncode in passed_on
    return bool(passed_on.intersection(_ENDING))


def _parent_death_signal() -> Optional[Callable[[], None]]:
    """The step, run in the child before exec, that makes it die with this process; None where
    the kernel has no parent-death signal (not Linux)."""
    try:
        prctl = ctypes.CDLL(None, use_errno=True).prctl  # looked up here: no dlopen after fork
    except (OSError, AttributeError):
        return None
    parent = os.getpid()

    def prepare() -> None:
        os.setpgid(0, 0)
        if prctl(_PR_SET_PDEATHSIG, int(signal.SIGKILL), 0, 0, 0) != 0 or os.getppid() != parent:
            os._exit(127)  # no parent-death signal, or the parent died before it was set

    return prepare


def _end_as(returncode: int) -> int:
    """End this process as the command ended: killed by the same signal, else its exit code."""
    if returncode >= 0:
        return returncode
    signum = -returncode
    sys.stdout.flush()
    sys.stderr.flush()
    # This process's own core file would only mislead (the command's, if any, is written).
    resource.setrlimit(resource.RLIMIT_CORE, (0, resource.getrlimit(resource.RLIMIT_CORE)[1]))
    try:
        signal.signal(signum, signal.SIG_DFL)
    except (OSError, ValueError):  # SIGKILL and SIGSTOP have no handler to reset
        pass
    os.kill(os.getpid(), signum)
    return 128 + signum  # a signal whose default is not to end the process


def main(argv: Optional[List[str]] = None) -> int:
    """Start the command, pass signals on to it, report its end if no one asked for it, end as it did."""
    args = sys.argv[1:] if argv is None else argv
    if len(args) < 2 or args[0] != "--":
        sys.stderr.write("usage: python -m hpdl.launch.rank_watch -- COMMAND ...\n")
        return 2
    command = args[1:]
    passed_on: Set[int] = set()
    child: List[subprocess.Popen] = []
    early: List[int] = []  # signals that came before the command started
    relay = LineRelay.open()

    def pass_on(signum: int, _frame) -> None:
        passed_on.add(signum)
        if signum == signal.SIGWINCH and relay is not None:
            relay.resized()
        if not child:
            early.append(signum)
            return
        try:
            os.kill(child[0].pid, signum)
        except ProcessLookupError:
            pass

    # Before the start, so that no signal is lost; the command gets the default handlers back
    # at exec.
    for signum in _PASSED_ON:
        signal.signal(signum, pass_on)
    notes, note_end = rank_exit.pipe()
    env = dict(os.environ, **{rank_exit.ENV: rank_exit.channel(note_end)})
    env.update(horovod_environment(os.environ))  # for scripts written for Horovod, before they start
    outputs = {"stdout": relay.stdout, "stderr": relay.stderr} if relay is not None else {}
    try:
        child.append(subprocess.Popen(command, close_fds=False, env=env, preexec_fn=_parent_death_signal(),
                                      **outputs))
    except OSError as err:
        sys.stderr.write(f"hpdl: error: cannot start {command[0]}: {err.strerror or err}\n")
        return 127
    finally:
        os.close(note_end)
        if relay is not None:
            relay.started()
    while early:
        pass_on(early.pop(0), None)
    returncode = relay.run(child[0]) if relay is not None else child[0].wait()
    ended, started_mpi = rank_exit.noted(notes)
    if returncode != 0 and not asked_for(returncode, passed_on) and \
            not (returncode > 0 and child[0].pid in ended):
        sys.stderr.write(report_line(returncode))
        if returncode > 0 and child[0].pid not in started_mpi:
            _abort_an_mpich_job(returncode)
    return _end_as(returncode)


def _abort_an_mpich_job(returncode: int) -> None:
    """Under MPICH's mpiexec, end the whole job through its process manager's own interface (the
    PMI ``abort`` command on the rank's PMI_FD): hydra sees a rank that ended with an exit code
    before it started MPI (it failed before importing hpdl) as no loss, and the other ranks
    waited in MPI_Init for ever. (A rank that started MPI is counted: hydra ends the job when
    this process ends.) Only hydra's ranks have HYDI_CONTROL_FD; under Slurm or Open MPI the
    launcher sees the end itself."""
    if "HYDI_CONTROL_FD" not in os.environ:
        return
    # The abort tears the job down without forwarding what is still in the proxy's pipes: the
    # report above goes first.
    sys.stderr.flush()
    time.sleep(_REPORT_PASSES_S)
    try:
        os.write(int(os.environ["PMI_FD"]), f"cmd=abort exitcode={returncode}\n".encode())
    except (KeyError, ValueError, OSError):
        pass


if __name__ == "__main__":
    sys.exit(main())
