"""What is left when a job ends badly, and what the readers make of files that are not profiles:
the engine's timeline written as the job runs, profiles and bench files that are no regular
file, profiles naming a rank twice or one the job did not have, and a profile path that is the
timeline's."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from hpdl.engine import events as ev
from hpdl.engine.timeline import Timeline
from hpdl.profile import schema
from hpdl.profile.analysis import Analysis
from hpdl.profile.report import render_compare
from test_profile_units import make_profile

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _events(t: float, name: str):
    return [ev.Event(ev.QUEUED, "allreduce", (name,), t), ev.Event(ev.NEGOTIATED, "allreduce", (name,), t + 10),
            ev.Event(ev.COLLECTIVE, "allreduce", (name,), t + 11, duration_us=5, nbytes=64, op="MPI_ALLREDUCE"),
            ev.Event(ev.DONE, "allreduce", (name,), t + 20)]


def test_timeline_holds_every_record_whole_before_it_is_closed(tmp_path):
    # A rank that is killed never closes its timeline: what it has written must load (viewers
    # accept a trace without its closing "]"), with every event up to the kill.
    path = tmp_path / "t.json"
    timeline = Timeline(str(path))
    t = ev.now_us()
    for i in range(200):
        for event in _events(t + 100 * i, f"grad.{i % 7}"):
            timeline.observe(event)
    text = path.read_text()
    assert text.startswith("[\n") and text.rstrip().endswith("}")
    records = json.loads(text + "]")
    assert sum(r.get("name") == "MPI_ALLREDUCE" for r in records) == 200
    timeline.close()
    assert json.loads(path.read_text())[-1] == records[-1]


def test_timeline_in_a_missing_directory_is_written_there(tmp_path):
    path = tmp_path / "new" / "sub" / "t.json"
    timeline = Timeline(str(path))
    timeline.close()
    assert json.loads(path.read_text())[0]["name"] == "process_name"


def test_timeline_that_cannot_be_written_names_the_file(tmp_path):
    (tmp_path / "d").mkdir()
    (tmp_path / "f").write_text("")
    for path in (tmp_path / "d", tmp_path / "f" / "t.json"):
        with pytest.raises(ValueError, match=f"cannot write the timeline to {path}: "):
            Timeline(str(path))


def _cli(*args: str) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONPATH": ROOT}
    return subprocess.run([sys.executable, "-m", "hpdl", *args], capture_output=True, text=True, env=env, timeout=60)


def _one_line(result: subprocess.CompletedProcess, *fragments: str) -> None:
    assert result.returncode == 2, result
    assert "Traceback" not in result.stderr and result.stderr.count("\n") == 1, result.stderr
    for fragment in fragments:
        assert fragment in result.stderr, result.stderr


@pytest.mark.parametrize("command", [["report"], ["compare"], ["timeline", "-o", "-"], ["bench"]])
def test_a_fifo_is_refused_at_once_not_waited_on(tmp_path, command):
    # Reading a FIFO no one writes to waited forever.
    fifo = tmp_path / "p.json"
    os.mkfifo(fifo)
    good = tmp_path / "good.json"
    good.write_text(json.dumps(make_profile()))
    args = {"report": ["report", str(fifo)], "compare": ["compare", str(good), str(fifo)],
            "timeline": ["timeline", str(fifo), "-o", "-"],
            "bench": ["report", str(good), "--bench", str(fifo)]}[command[0]]
    _one_line(_cli("profile", *args), str(fifo), "not a regular file")


def test_a_directory_is_refused_in_one_line(tmp_path):
    good = tmp_path / "good.json"
    good.write_text(json.dumps(make_profile()))
    _one_line(_cli("profile", "report", str(tmp_path)), str(tmp_path), "is a directory")
    _one_line(_cli("profile", "report", str(good), "--bench", str(tmp_path)), str(tmp_path), "is a directory")


@pytest.mark.parametrize("change, fragment", [
    (lambda p: p["ranks"][1].update(rank=0), "ranks[1] is rank 0 again"),
    (lambda p: p["ranks"][0].update(rank=5), "ranks[0] is rank 5, not a rank of a job of 2 ranks"),
    (lambda p: p["ranks"][0].update(rank=-1), "ranks[0] is rank -1"),
    (lambda p: p.update(version=0), "must be a schema version from 1, got 0"),
], ids=["rank-twice", "rank-beyond-size", "negative-rank", "version-0"])
def test_profiles_with_impossible_ranks_or_version_are_refused(change, fragment):
    # A rank twice was averaged as two ranks, and its collectives matched against itself.
    profile = make_profile()
    change(profile)
    with pytest.raises(schema.ProfileError, match=fragment.replace("[", r"\[").replace("]", r"\]")):
        schema.check(profile, "x.json")


def test_compare_shows_no_messages_per_step_for_a_profile_without_steps():
    # A profile without steps had 0.0 messages per step, shown as a -100% change.
    with_steps = make_profile()
    without = make_profile()
    for rank in without["ranks"]:
        rank["steps"]["rows"] = []
    text = render_compare(Analysis(with_steps), "a.json", Analysis(without), "b.json")
    row = next(line for line in text.splitlines() if line.startswith("messages per step"))
    assert row.split()[-2:] == ["-", "-"] and "-100%" not in row, row


def test_a_profile_path_that_is_the_timeline_is_refused(tmp_path):
    # The profile, replacing the file at shutdown, left nothing of the timeline.
    from hpdl.torch.profiler import session

    target = tmp_path / "x.json"
    assert "the timeline (HPDL_TIMELINE) is written there" in session._unwritable(str(target), str(target))
    link = tmp_path / "link.json"
    target.write_text("[")
    link.symlink_to(target)
    assert "the timeline" in session._unwritable(str(link), str(target))
    assert session._unwritable(str(tmp_path / "other.json"), str(target)) is None


def test_a_rank_in_join_is_not_reported_late_at_the_collectives_it_joins():
    # Rank 0 runs out of data after 2 steps and joins: it takes part in rank 1's last two
    # allreduces without submitting them. Those had its backend start as its arrival, so rank 0
    # was "last at most collectives" and named a straggler while it was waiting in join.
    from hpdl.profile.findings import findings
    from hpdl.profile.recorder import Recorder
    from test_profile_units import feed_step

    ranks = []
    for rank in (0, 1):
        recorder = Recorder(rank=rank, zero_us=0.0)
        recorder._step_start = 0.0
        t = 1000.0
        for step in range(4):
            if rank == 0 and step >= 2:  # joined: the allreduce runs here when rank 1 submits it, 50 ms on
                common = dict(kind="allreduce", names=("g0",), nbytes=4096, fused=1)
                recorder.observe(ev.Event(ev.COLLECTIVE, time_us=t + 50_000, duration_us=100, op="MPI_ALLREDUCE",
                                          sizes=(4096,), dtype="float32", backend="mpi", **common))
                recorder.observe(ev.Event(ev.DONE, "allreduce", ("g0",), t + 50_100))
            else:
                feed_step(recorder, t, [4096])
            t += 100_000
        part = recorder.snapshot()
        part.update(host="h", clock_offset_us=0.0, clock_offset_applied=False, engine={})
        ranks.append(part)
    profile = {"format": schema.FORMAT, "version": schema.VERSION, "ranks": ranks,
               "job": {"size": 2, "backend": "mpi", "hosts": ["h", "h"], "missing_ranks": [],
                       "settings": {"fusion_threshold": 1 << 26, "inplace_threshold": 1 << 20}}}
    schema.check(profile, "made-up")
    analysis = Analysis(profile)
    assert analysis.arrival.collectives == 1  # step 1 alone: step 0 is start-up, steps 2-3 rank 0 joined
    assert analysis.arrival.max_spread_us < 1000
    assert not any("rank 0 is" in f for f in findings(analysis))


def test_the_90th_percentile_of_arrival_spread_is_not_below_its_median():
    # Of two spreads, the lower one was taken as the 90th percentile, below their median.
    profile = make_profile(steps=3)
    rows = profile["ranks"][1]["collectives"]["rows"]
    ready = schema.COLLECTIVE_COLUMNS.index("ready_us")
    rows[1][ready] += 30.0
    rows[2][ready] += 70.0
    arrival = Analysis(profile).arrival
    assert arrival.collectives == 2
    assert arrival.median_spread_us <= arrival.p90_spread_us <= arrival.max_spread_us


def test_a_tensor_name_with_a_newline_keeps_its_row_on_one_line():
    from hpdl.profile.report import render

    profile = make_profile(sizes=(4096,))
    for part in profile["ranks"]:
        part["tensors"] = ["grad\nof\tlayer" if name == "g0" else name for name in part["tensors"]]
    text = render(Analysis(profile), "made-up", [])
    rows = [line for line in text.splitlines() if "grad" in line]
    assert rows and all(r"grad\nof\tlayer" in row for row in rows), text
