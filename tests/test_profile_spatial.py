"""The profiler and a spatial-parallel job: halo exchanges and the spatial groups' collectives
are their own kind (per step, per layer, in the timelines), and the figures that assume the
engine's collectives (arrival, negotiation, fusion, messages) leave them out. Made-up events
first, then a real 2-rank job under `hpdl run --profile`."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys

import pytest
from test_profile_units import MiB, feed_step, make_profile

from hpdl.engine import events as ev
from hpdl.engine.timeline import Timeline
from hpdl.profile import schema
from hpdl.profile.analysis import Analysis
from hpdl.profile.findings import findings
from hpdl.profile.recorder import Recorder
from hpdl.profile.report import render, render_compare
from hpdl.profile.timeline import trace
from ranks import ROOT, SCRIPTS

KiB = 1 << 10


def feed_group(recorder: Recorder, t: float, kind: str, layer: str, nbytes: int, duration: float,
               op: str = "SENDRECV") -> None:
    """One halo exchange or group collective of ``layer``, as hpdl.torch.spatial.comm reports it."""
    recorder.observe(ev.Event(ev.COLLECTIVE, kind, (layer,), t, duration, nbytes=nbytes, op=op,
                              sizes=(nbytes // 2, nbytes - nbytes // 2), dtype="float32", backend="mpi"))


def spatial_profile(halo_us: float = 30_000.0, steps: int = 4) -> dict:
    """make_profile's two ranks, each also exchanging halos twice per step (forward and backward)
    in body.0 and body.1 and summing batch statistics once, ``halo_us`` of halos per step."""
    profile = make_profile(steps=steps)
    for rank in profile["ranks"]:
        recorder = Recorder(rank=rank["rank"], zero_us=0.0)
        for step in range(steps):
            t = 1000.0 + step * 200_000.0
            for i, layer in enumerate(("body.0", "body.1", "body.1", "body.0")):
                feed_group(recorder, t + 10 * i, ev.HALO, layer, 64 * KiB, halo_us / 4)
            feed_group(recorder, t + 100, ev.SPATIAL, "bn", 512, 1000.0, op="ALLREDUCE")
            recorder.observe(ev.Event(ev.STEP, "step", (), t + 150_000.0))
        part = recorder.snapshot()
        names = rank["tensors"]
        for table in schema.OPTIONAL_TABLES:  # the layer names join the rank's name table
            stored = part[table]
            column = stored["columns"].index("name") if "name" in stored["columns"] else None
            for row in stored["rows"] if column is not None else ():
                layer = part["tensors"][row[column]]
                if layer not in names:
                    names.append(layer)
                row[column] = names.index(layer)
            rank[table] = stored
    schema.check(profile, "made-up")
    return profile


# -- the recorder -------------------------------------------------------------------------------

def test_halo_exchanges_and_group_collectives_are_kept_apart_from_the_engines_collectives():
    recorder = Recorder(rank=0, zero_us=0.0)
    recorder._step_start = 0.0
    t = 1000.0
    for step in range(3):
        feed_group(recorder, t, ev.HALO, "body.0", 64 * KiB, 500.0)
        feed_group(recorder, t + 600, ev.SPATIAL, "bn", 512, 200.0, op="ALLGATHER")
        feed_group(recorder, t + 900, ev.HALO, "body.0", 64 * KiB, 700.0)
        t = feed_step(recorder, t + 2000, [MiB]) + 100
    part = recorder.snapshot()
    collectives = list(schema.records(part, "collectives"))
    assert [c["kind"] for c in collectives] == ["allreduce"] * 3
    assert [c["seq"] for c in collectives] == [0, 1, 2]  # halos take no sequence number: ranks still match
    assert [m["kind"] for m in schema.records(part, "messages")] == ["allreduce"]
    assert {part["tensors"][t["name"]] for t in schema.records(part, "tensors_time")} == {"g0"}
    for s in schema.records(part, "steps"):  # the engine's figures of the step, without the halos
        assert (s["messages"], s["bytes"], s["comm_us"]) == (1, MiB, 100)  # a lone tensor: no copies
    layers = {(r["kind"], part["tensors"][r["name"]], r["op"]): r for r in schema.records(part, "spatial_layers")}
    assert set(layers) == {("halo", "body.0", "SENDRECV"), ("spatial", "bn", "ALLGATHER")}
    halo = layers[("halo", "body.0", "SENDRECV")]
    assert (halo["calls"], halo["bytes"], halo["time_us"]) == (6, 64 * KiB, 3600.0)
    per_step = [(s["step"], s["kind"], s["calls"], s["bytes"], s["time_us"]) for s in schema.records(part, "spatial_steps")]
    assert per_step == [(step, kind, calls, nbytes, time_us) for step in range(3)
                        for kind, calls, nbytes, time_us in (("halo", 2, 128 * KiB, 1200.0), ("spatial", 1, 512, 200.0))]
    events = list(schema.records(part, "spatial_events"))
    assert [(e["step"], e["kind"], e["start_us"], e["duration_us"]) for e in events[:3]] == \
        [(0, "halo", 1000.0, 500.0), (0, "spatial", 1600.0, 200.0), (0, "halo", 1900.0, 700.0)]


def test_layer_rows_are_capped_keeping_the_most_time():
    recorder = Recorder(rank=0, zero_us=0.0, tensor_rows=2)
    for i in range(6):
        feed_group(recorder, 100.0 * i, ev.HALO, f"conv{i}", 1000, 10.0 * (i + 1))
    part = recorder.snapshot()
    rows = {part["tensors"][r["name"]]: r for r in schema.records(part, "spatial_layers")}
    assert set(rows) == {"conv5", "conv4", schema.OTHER_LAYERS}
    assert rows[schema.OTHER_LAYERS]["calls"] == 4 and rows[schema.OTHER_LAYERS]["time_us"] == 100.0
    assert part["layers_folded"] == 4


def test_raw_spatial_events_are_a_bounded_window():
    recorder = Recorder(rank=0, zero_us=0.0, raw_window=5)
    for i in range(12):
        feed_group(recorder, 10.0 * i, ev.HALO, "conv", 100, 1.0)
    part = recorder.snapshot()
    assert len(part["spatial_events"]["rows"]) == 5 and part["spatial_events_dropped"] == 7
    assert next(schema.records(part, "spatial_layers"))["calls"] == 12  # totals keep every call


# -- analysis, reports, timelines ----------------------------------------------------------------

def test_per_step_compute_leaves_out_the_spatial_communication():
    a = Analysis(spatial_profile(halo_us=30_000.0))
    s = a.steps
    assert s.spatial_us == pytest.approx(31_000.0)  # halos and the batch statistics' allreduce
    assert s.compute_us == pytest.approx(s.step_us - s.exposed_us - s.spatial_us)
    halo = a.spatial.kind("halo")
    assert (halo.calls, halo.nbytes, halo.time_us) == (4, 256 * KiB, 30_000.0)
    assert [(r.name, r.kind) for r in a.spatial.layers[:2]] == [("body.0", "halo"), ("body.1", "halo")]
    assert a.spatial.layers[0].calls == 8 and a.spatial.layers[0].bytes_per_call == 64 * KiB
    # The engine's figures are those of the engine's collectives alone.
    assert a.arrival.collectives == 3 and a.fusion.messages_per_step == 1.0
    assert [r.kind for r in a.by_message] == ["allreduce"]


def test_report_shows_the_spatial_communication_per_kind_and_layer():
    a = Analysis(spatial_profile())
    found = findings(a)
    text = render(a, "p.json", found)
    assert "Spatial communication per step" in text and "Top layers by spatial communication (of 3" in text
    kinds = {line.split()[0]: line.split() for line in text.splitlines()
             if line.startswith(("halo exchanges ", "group collectives ")) and line.split()[2].isdigit()}
    assert kinds["halo"][2:5] == ["4", "256", "KiB"] and kinds["group"][2:5] == ["1", "512", "B"]
    assert "spatial comm ms" in text
    spatial = [f for f in found if f.startswith("the spatial communication takes")]
    assert spatial and "the layer with the most is body.0 (SENDRECV" in spatial[0], found


def test_a_profile_without_spatial_communication_reports_as_before():
    profile = make_profile()
    for rank in profile["ranks"]:
        for table in schema.OPTIONAL_TABLES:
            del rank[table]
    schema.check(profile, "older")  # read as empty tables
    a = Analysis(profile)
    text = render(a, "p.json", findings(a))
    assert not a.spatial.present and "Spatial" not in text and "spatial comm ms" not in text
    assert "Spatial" not in render_compare(a, "a.json", a, "b.json")


def test_compare_puts_the_spatial_communication_side_by_side():
    text = render_compare(Analysis(spatial_profile(halo_us=30_000.0)), "a.json",
                          Analysis(spatial_profile(halo_us=15_000.0)), "b.json")
    assert "Spatial communication (per step, medians)" in text
    line = next(line for line in text.splitlines() if line.startswith("halo exchanges ms"))
    assert line.split()[-3:] == ["30.00", "15.00", "-50%"]
    assert "spatial comm ms" in text


def test_profile_timeline_puts_halos_and_group_collectives_on_tracks_of_their_own():
    from test_profile_units import assert_tracks_nest

    events = trace(spatial_profile())["traceEvents"]
    assert_tracks_nest(events)
    threads = {(e["pid"], e["args"]["name"]) for e in events if e["name"] == "thread_name"}
    assert {(0, "halo exchanges"), (1, "group collectives")} <= threads
    halos = [e for e in events if e["name"] == "halo body.0" and e["pid"] == 1]
    assert len(halos) == 8 and all(e["args"]["bytes"] == 64 * KiB and e["args"]["op"] == "SENDRECV" for e in halos)
    assert {e["args"]["step"] for e in halos} == {0, 1, 2, 3}


def test_engine_timeline_gives_each_layers_halo_a_track(tmp_path):
    path = tmp_path / "timeline.json"
    timeline = Timeline(str(path))
    timeline.observe(ev.Event(ev.COLLECTIVE, ev.HALO, ("body.0",), ev.now_us(), 120.0, nbytes=4096, op="SENDRECV",
                              backend="mpi"))
    timeline.observe(ev.Event(ev.COLLECTIVE, ev.SPATIAL, ("bn",), ev.now_us(), 80.0, nbytes=64, op="ALLREDUCE",
                              backend="mpi"))
    timeline.close()
    records = json.loads(path.read_text())
    processes = {r["pid"]: r["args"]["name"] for r in records if r.get("name") == "process_name"}
    slices = [(processes[r["pid"]], r["name"], r["args"]["bytes"]) for r in records if r.get("ph") == "X"]
    assert slices == [("halo: body.0", "HALO_SENDRECV", 4096), ("spatial: bn", "SPATIAL_ALLREDUCE", 64)]


# -- a real job ---------------------------------------------------------------------------------

def _cli(*args: str, cwd=None, env=None) -> subprocess.CompletedProcess:
    full_env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1", **(env or {})}
    return subprocess.run([sys.executable, "-m", "hpdl", *args], capture_output=True, text=True, cwd=cwd,
                          env=full_env, timeout=240)


@pytest.fixture(scope="module")
def spatial_job(tmp_path_factory):
    """A small ResNet (batch norm, pooling, convolutions) in 2 row bands, 4 steps, profiled by
    `hpdl run --profile` with the engine's timeline on."""
    if shutil.which("mpiexec") is None:
        pytest.skip("mpiexec not found (pip install 'hpdl[mpi]')")
    cwd = tmp_path_factory.mktemp("spatial")
    result = _cli("run", "-np", "2", "--profile", "p.json", "--", sys.executable, str(SCRIPTS / "spatial_train.py"),
                  "resnet-small", "97x83", "4", cwd=cwd, env={"HPDL_TIMELINE": "timeline.json"})
    assert result.returncode == 0, result.stderr[-3000:]
    return cwd


@pytest.mark.multirank
def test_a_spatial_jobs_profile_has_its_halos_per_layer_and_step(spatial_job):
    sys.path.insert(0, str(SCRIPTS))
    from spatial_models import build

    data = schema.load(str(spatial_job / "p.json"))
    modules = dict(build("resnet-small").named_modules())
    halo_per_step = []
    for rank in data["ranks"]:
        names = rank["tensors"]
        assert {c["kind"] for c in schema.records(rank, "collectives")} <= {"allreduce", "broadcast", "allgather",
                                                                             "alltoall"}
        layers = {(r["kind"], names[r["name"]], r["op"]) for r in schema.records(rank, "spatial_layers")}
        halo_layers = {name for kind, name, _ in layers if kind == "halo"}
        # Window layers exchange halos; the names are their paths in the model.
        assert {"conv1", "maxpool", "layer1.0.conv2"} <= halo_layers <= set(modules)
        assert {("spatial", "avgpool", "ALLREDUCE"), ("spatial", "bn1", "ALLGATHER"), ("spatial", "bn1", "ALLREDUCE")} <= layers
        steps = list(schema.records(rank, "spatial_steps"))
        assert {s["step"] for s in steps} == {0, 1, 2, 3}
        halo_per_step.append([(s["calls"], s["bytes"]) for s in steps if s["kind"] == "halo"])
    # Each rank sends what the other receives: the same bytes both ways on both ranks.
    assert halo_per_step[0] == halo_per_step[1] and all(nbytes > 0 for _, nbytes in halo_per_step[0])


@pytest.mark.multirank
def test_report_compare_and_timelines_of_a_spatial_job(spatial_job):
    result = _cli("profile", "report", "p.json", "--html", "report.html", cwd=spatial_job)
    assert result.returncode == 0, result.stderr
    out = result.stdout
    for text in ("Spatial communication per step", "halo exchanges", "group collectives",
                 "Top layers by spatial communication", "spatial comm ms", "Arrival at collectives",
                 "the spatial communication takes"):
        assert text in out, out
    page = (spatial_job / "report.html").read_text()
    assert "Spatial communication by layer" in page and "<script" not in page
    compare = _cli("profile", "compare", "p.json", "p.json", cwd=spatial_job)
    assert compare.returncode == 0 and "halo exchanges ms" in compare.stdout
    assert _cli("profile", "timeline", "p.json", "-o", "trace.json", cwd=spatial_job).returncode == 0
    events = json.loads((spatial_job / "trace.json").read_text())["traceEvents"]
    assert {"halo conv1", "spatial bn1"} <= {e["name"] for e in events}
    # The engine's timeline, written as the job ran (HPDL_TIMELINE), by rank 0.
    text = (spatial_job / "timeline.json").read_text().rstrip().rstrip(",")
    records = json.loads(text if text.endswith("]") else text + "]")
    processes = {r["pid"]: r["args"]["name"] for r in records if r.get("name") == "process_name"}
    halos = [r for r in records if r.get("name") == "HALO_SENDRECV"]
    assert halos and {processes[r["pid"]] for r in halos} >= {"halo: conv1", "halo: maxpool"}
