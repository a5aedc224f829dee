"""The profile commands' output files: never an input, never an existing file without
--overwrite, written atomically; and a profile path rank 0 could not write, refused up front."""

from __future__ import annotations

import logging

import pytest

from hpdl.profile.recorder import Recorder
from test_profile_units import make_profile


def _profile_file(tmp_path, name: str = "p.json"):
    import json

    path = tmp_path / name
    path.write_text(json.dumps(make_profile()))
    return path


def _one_line_error(capsys, *fragments: str) -> str:
    err = capsys.readouterr().err
    assert "Traceback" not in err and err.count("\n") == 1 and err.startswith("hpdl: error: "), err
    for fragment in fragments:
        assert fragment in err, err
    return err


@pytest.mark.parametrize("command, output", [
    (["report", "{p}", "--html"], "{p}"),
    (["report", "{p}", "--html"], "{link}"),
    (["report", "{p}", "--bench", "{bench}", "--html"], "{bench}"),
    (["timeline", "{p}", "-o"], "{p}"),
    (["timeline", "{p}", "-o"], "{link}"),
], ids=["report-over-profile", "report-through-link", "report-over-bench", "timeline-over-profile",
        "timeline-through-link"])
@pytest.mark.parametrize("overwrite", [[], ["--overwrite"]], ids=["plain", "overwrite"])
def test_profile_outputs_never_replace_an_input(tmp_path, capsys, command, output, overwrite):
    import json

    from hpdl.cli import main

    profile = _profile_file(tmp_path)
    bench = tmp_path / "b.json"
    bench.write_text(json.dumps({"benchmark": "allreduce", "ranks": 2, "records": []}))
    (tmp_path / "link.json").symlink_to(profile)
    names = {"p": profile, "link": tmp_path / "link.json", "bench": bench}
    before = {path: path.read_bytes() for path in (profile, bench)}
    argv = [a.format(**names) for a in command + [output]] + overwrite
    assert main(["profile", *argv]) == 2
    _one_line_error(capsys, "is the input", "write to another file")
    assert {path: path.read_bytes() for path in (profile, bench)} == before
    assert sorted(p.name for p in tmp_path.iterdir()) == ["b.json", "link.json", "p.json"]  # no temp file


@pytest.mark.parametrize("command", [["report", "{p}", "--html", "{out}"], ["timeline", "{p}", "-o", "{out}"]],
                         ids=["report", "timeline"])
def test_profile_outputs_replace_an_existing_file_only_with_overwrite(tmp_path, capsys, command):
    from hpdl.cli import main

    profile = _profile_file(tmp_path)
    out = tmp_path / "out.file"
    out.write_text("a user's file\n")
    argv = [a.format(p=profile, out=out) for a in command]
    assert main(["profile", *argv]) == 2
    _one_line_error(capsys, f"{out}: already exists; pass --overwrite to replace it")
    assert out.read_text() == "a user's file\n"
    assert main(["profile", *argv, "--overwrite"]) == 0
    written = out.read_text()
    assert written.startswith("<!DOCTYPE html>" if command[0] == "report" else '{"traceEvents":'), written[:40]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["out.file", "p.json"]  # no temp file


@pytest.mark.parametrize("output, fragment", [
    ("{dir}", "is a directory; name a file"),
    ("{file}/t.json", "{file} is a file, not a directory"),
    ("{tmp}/missing/t.json", "its directory does not exist"),
], ids=["directory", "under-a-file", "missing-directory"])
@pytest.mark.parametrize("command", [["report", "{p}", "--html"], ["timeline", "{p}", "-o"]], ids=["report", "timeline"])
def test_profile_outputs_that_cannot_be_files_are_refused_before_reading(tmp_path, capsys, command, output, fragment):
    from hpdl.cli import main

    profile = _profile_file(tmp_path)
    (tmp_path / "d").mkdir()
    (tmp_path / "f").write_text("x")
    names = dict(p=profile, dir=tmp_path / "d", file=tmp_path / "f", tmp=tmp_path)
    assert main(["profile", *[a.format(**names) for a in command + [output]]]) == 2
    _one_line_error(capsys, f"{command[-1]} {output.format(**names)}: {fragment.format(**names)}")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["d", "f", "p.json"] and not any((tmp_path / "d").iterdir())


def test_a_failed_profile_write_leaves_no_temp_file_and_names_the_file(tmp_path):
    from hpdl.torch.profiler import session as sess

    target = tmp_path / "p.json"
    target.mkdir()  # the rename cannot replace a directory
    with pytest.raises(OSError) as caught:
        sess._write_json(str(target), {"a": 1})
    assert caught.value.filename == str(target) and "Is a directory" in caught.value.strerror
    assert [p.name for p in tmp_path.iterdir()] == ["p.json"]


def test_unwritable_profile_paths_are_named_before_any_recording(tmp_path):
    from hpdl.torch.profiler import session as sess

    (tmp_path / "d").mkdir()
    (tmp_path / "f").write_text("x")
    assert sess._unwritable(str(tmp_path / "d")) == f"cannot write the profile to {tmp_path / 'd'}: it is a directory; name a file"
    assert sess._unwritable(str(tmp_path / "f" / "p.json")) == (
        f"cannot write the profile to {tmp_path / 'f' / 'p.json'}: {tmp_path / 'f'} is a file, not a directory")
    assert sess._unwritable(str(tmp_path / "new" / "p.json")) is None
    assert [p.name for p in (tmp_path / "new").iterdir()] == []  # the directory is made, the probe removed


def test_a_profile_write_failing_at_shutdown_says_so_in_one_line(monkeypatch, caplog):
    from hpdl.torch.profiler import session as sess
    from hpdl.torch import runtime

    class Engine:
        def stats(self):
            return {"cycles": 1}

    def write(session):
        raise OSError(21, "Is a directory", "/data/p.json")

    recording = object.__new__(sess.Session)
    recording.engine_counters = {}
    recording.recorder = Recorder(0, 0.0)
    monkeypatch.setattr(sess, "_session", recording)
    monkeypatch.setattr(sess, "_dying_from", None)
    monkeypatch.setattr(runtime, "engine", lambda: Engine())
    monkeypatch.setattr(sess, "write", write)
    monkeypatch.setattr(runtime, "_shutdown_hooks", {stage: [] for stage in runtime.ShutdownStage})
    runtime.add_shutdown_hook(sess._at_shutdown, runtime.ShutdownStage.WRITE_RECORDS)
    with caplog.at_level(logging.ERROR, logger="hpdl"):
        failures = runtime._run_shutdown_hooks()
    # The hook's failure is shutdown()'s to raise (or, at exit, the job's error line), not a log line.
    assert failures == ["the profile was not written: cannot write /data/p.json: Is a directory"]
    assert not caplog.records, caplog.text
    assert sess._session is None


def test_init_refuses_an_hpdl_profile_it_could_not_write(tmp_path):
    # One rank, no launcher: the refusal comes from hvd.init(), before the job's work.
    import os
    import subprocess
    import sys

    (tmp_path / "pdir").mkdir()
    env = {k: v for k, v in os.environ.items() if not k.startswith("HPDL_")}
    env.update(HPDL_PROFILE=str(tmp_path / "pdir"), HPDL_BACKEND="gloo", OMP_NUM_THREADS="1",
               MASTER_ADDR="127.0.0.1", MASTER_PORT="0", RANK="0", WORLD_SIZE="1")
    done = subprocess.run([sys.executable, "-c", "import hpdl.torch as hvd; hvd.init(); print('ran')"], env=env,
                          capture_output=True, text=True, timeout=120, cwd=str(tmp_path))
    assert done.returncode != 0 and "ran" not in done.stdout, done.stdout + done.stderr
    assert done.stderr.strip().splitlines()[-1].endswith(  # torch.distributed may prefix "[rank0]: "
        f"ValueError: cannot write the profile to {tmp_path / 'pdir'}: it is a directory; name a file"), done.stderr
    assert sorted(p.name for p in tmp_path.iterdir()) == ["pdir"]


@pytest.mark.parametrize("ending", ["at exit", "by hvd.shutdown()"])
def test_a_profile_lost_at_the_end_fails_the_job_naming_the_file(tmp_path, ending):
    # The last write fails (the profile's directory became a file during the job): the job must
    # not end as a success with its profile lost, whether the script shuts hpdl down itself or
    # leaves it to the exit, where an exception would not change the exit code.
    import os
    import subprocess
    import sys

    out = tmp_path / "out"
    env = {k: v for k, v in os.environ.items() if not k.startswith("HPDL_")}
    env.update(HPDL_PROFILE=str(out / "p.json"), HPDL_BACKEND="gloo", OMP_NUM_THREADS="1",
               MASTER_ADDR="127.0.0.1", MASTER_PORT="0", RANK="0", WORLD_SIZE="1")
    script = ("import os, shutil, torch, hpdl.torch as hvd\n"
              "hvd.init()\n"
              "hvd.allreduce(torch.ones(4), name='x')\n"
              f"shutil.rmtree({str(out)!r}); open({str(out)!r}, 'w').close()\n"
              + ("hvd.shutdown()\n" if ending == "by hvd.shutdown()" else "")
              + "print('ran')\n")
    done = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True, text=True, timeout=120,
                          cwd=str(tmp_path))
    lost = f"the profile was not written: cannot write {out / 'p.json'}: {out} is a file, not a directory"
    assert done.returncode == 1, done.stdout + done.stderr
    last = done.stderr.strip().splitlines()[-1]  # torch.distributed may prefix "[rank0]: "
    if ending == "at exit":
        assert "ran" in done.stdout and last.endswith(f"hpdl: error: {lost}"), done.stderr
    else:
        assert "ran" not in done.stdout and last.endswith(f"ShutdownError: {lost}"), done.stderr
    assert sorted(p.name for p in tmp_path.iterdir()) == ["out"]  # no temp file left
