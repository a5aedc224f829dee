"""The profiler's pieces on made-up events: subscriptions, the recorder, the analysis, findings,
the comparison, the timeline and the HTML page."""

from __future__ import annotations

import json
import logging
import re
from typing import Optional, Sequence

import pytest

from hpdl.engine import events as ev
from hpdl.profile import schema
from hpdl.profile.analysis import Analysis, class_labels, parse_buckets
from hpdl.profile.findings import findings
from hpdl.profile.recorder import Recorder
from hpdl.profile.report import render, render_compare
from hpdl.profile.timeline import trace

MiB = 1 << 20


# -- the event stream ---------------------------------------------------------------------------

def test_subscription_reaches_buses_made_before_and_after_and_ends_with_unsubscribe():
    seen = []
    old_bus = ev.EventBus()
    assert not old_bus.active
    ev.subscribe(seen.append)
    try:
        new_bus = ev.EventBus()  # an engine started after subscribing (a later init())
        assert old_bus.active and new_bus.active
        old_bus.emit(ev.Event(ev.QUEUED, "allreduce", ("a",), 1.0))
        new_bus.emit(ev.Event(ev.QUEUED, "allreduce", ("b",), 2.0))
    finally:
        ev.unsubscribe(seen.append)
    assert [e.names for e in seen] == [("a",), ("b",)]
    assert not old_bus.active and not new_bus.active


def test_a_failing_observer_is_reported_once_and_others_still_receive(caplog):
    def broken(event):
        raise RuntimeError("observer bug")

    seen = []
    bus = ev.EventBus()
    bus.add(broken)
    bus.add(seen.append)
    with caplog.at_level(logging.WARNING, logger="hpdl.engine.events"):
        for t in range(3):
            bus.emit(ev.Event(ev.QUEUED, "allreduce", ("a",), float(t)))
    assert len(seen) == 3
    reports = [r for r in caplog.records if "failed" in r.getMessage()]
    assert len(reports) == 1 and "observer bug" in caplog.text


def test_a_failing_observer_is_reported_once_per_process_across_engines(caplog):
    class Tool:
        def observe(self, event):
            raise RuntimeError("tool bug")

    tool = Tool()
    ev.subscribe(tool.observe)  # a bound method: a new object at each access, equal to the others
    try:
        with caplog.at_level(logging.WARNING, logger="hpdl.engine.events"):
            for _ in range(2):  # two init()/shutdown() cycles: each engine has a bus of its own
                bus = ev.EventBus()
                for t in range(2):
                    bus.emit(ev.Event(ev.QUEUED, "allreduce", ("a",), float(t)))
    finally:
        ev.unsubscribe(tool.observe)
    assert len([r for r in caplog.records if "failed" in r.getMessage()]) == 1, caplog.text


def test_mark_step_carries_the_time_blocked_since_the_last_step():
    seen = []
    bus = ev.EventBus()
    bus.add(seen.append)
    ev.WAITS.take()
    ev.WAITS.blocked_s += 0.25
    ev.mark_step(bus, rank=3)
    ev.mark_step(bus, rank=3)
    assert [e.phase for e in seen] == [ev.STEP, ev.STEP] and seen[0].rank == 3
    assert seen[0].duration_us == pytest.approx(250_000) and seen[1].duration_us == 0


# -- the recorder -------------------------------------------------------------------------------

def feed_step(recorder: Recorder, t: float, sizes, late: float = 0.0, blocked: float = 0.0, ps: int = 0,
              start: float = 100.0, negotiate: float = 20.0, queue: float = 10.0) -> float:
    """One step: the tensors of ``sizes`` queued at ``t + late``, taken by the engine ``queue`` µs
    later, agreed ``negotiate`` µs after that, fused into one message; return its end."""
    names = tuple(f"g{i}" for i in range(len(sizes)))
    for i, name in enumerate(names):
        recorder.observe(ev.Event(ev.QUEUED, "allreduce", (name,), t + late + i, process_set_id=ps))
    ready = t + late + len(names) - 1
    for name in names:
        recorder.observe(ev.Event(ev.NEGOTIATED, "allreduce", (name,), ready + queue + negotiate,
                                  drained_us=ready + queue, process_set_id=ps))
    common = dict(kind="allreduce", names=names, nbytes=sum(sizes), fused=len(names), process_set_id=ps)
    begin = ready + queue + negotiate
    if len(names) > 1:
        recorder.observe(ev.Event(ev.MEMCPY_IN, time_us=begin, duration_us=5, **common))
    recorder.observe(ev.Event(ev.COLLECTIVE, time_us=begin + 5, duration_us=start, op="MPI_ALLREDUCE",
                              sizes=tuple(sizes), dtype="float32", backend="mpi", **common))
    if len(names) > 1:
        recorder.observe(ev.Event(ev.MEMCPY_OUT, time_us=begin + 5 + start, duration_us=7, **common))
    for name in names:
        recorder.observe(ev.Event(ev.DONE, "allreduce", (name,), begin + 12 + start, process_set_id=ps))
    end = begin + 20 + start
    recorder.observe(ev.Event(ev.STEP, "step", (), end, duration_us=blocked))
    return end


def test_recorder_phases_of_a_fused_message_and_its_step():
    recorder = Recorder(rank=0, zero_us=0.0)
    recorder._step_start = 0.0
    feed_step(recorder, 1000.0, [4 * MiB, 2 * MiB], blocked=40.0)
    part = recorder.snapshot()
    (c,) = list(schema.records(part, "collectives"))
    assert c["ready_us"] == 1001.0  # the last member's submission
    assert c["member_ready_us"] == [1000.0, 1001.0]  # each member's: a gradient's ready time
    assert (c["queue_us"], c["negotiate_us"], c["copy_in_us"], c["backend_us"], c["copy_out_us"]) == (10, 20, 5, 100, 7)
    assert c["bytes"] == 6 * MiB and c["sizes"] == [4 * MiB, 2 * MiB] and c["tensors"] == 2
    assert [part["tensors"][i] for i in c["names"]] == ["g0", "g1"]
    (s,) = list(schema.records(part, "steps"))
    assert s["blocked_us"] == 40 and s["comm_us"] == 112 and s["messages"] == 1 and s["end_us"] == 1151
    (m,) = list(schema.records(part, "messages"))
    assert (m["calls"], m["backend_us"], m["copy_in_us"], m["copy_out_us"]) == (1, 100, 5, 7)
    shares = {part["tensors"][t["name"]]: t["time_us"] for t in schema.records(part, "tensors_time")}
    assert shares == pytest.approx({"g0": 100 * 4 / 6, "g1": 100 * 2 / 6}, abs=0.05)  # stored to 0.1 µs


def test_recorder_keeps_totals_but_bounded_windows():
    recorder = Recorder(rank=0, zero_us=0.0, raw_window=3, step_window=2)
    t = 0.0
    for _ in range(10):
        t = feed_step(recorder, t + 10, [MiB])
    part = recorder.snapshot()
    assert len(part["collectives"]["rows"]) == 3 and part["collectives_dropped"] == 7
    assert len(part["steps"]["rows"]) == 2 and part["steps_dropped"] == 8
    assert list(schema.records(part, "messages"))[0]["calls"] == 10


def feed_call(recorder: Recorder, kind: str, names, t: float, sizes=None, backend_us: float = 100.0) -> None:
    """One collective of ``names`` (not fused unless several), submitted at ``t``."""
    names = tuple(names)
    sizes = tuple(sizes or [16] * len(names))
    for name in names:
        recorder.observe(ev.Event(ev.QUEUED, kind, (name,), t))
    recorder.observe(ev.Event(ev.COLLECTIVE, kind, names, t + 10, duration_us=backend_us, nbytes=sum(sizes),
                              fused=len(names), sizes=sizes, dtype="float32", backend="mpi"))
    for name in names:
        recorder.observe(ev.Event(ev.DONE, kind, (name,), t + 20 + backend_us))


def tensor_rows(part: dict) -> dict:
    return {(t["kind"], part["tensors"][t["name"]]): t for t in schema.records(part, "tensors_time")}


def test_unnamed_collectives_share_one_tensor_row_per_kind():
    from hpdl.torch.calls import call_name as _name  # the automatic names, as hpdl.torch makes them

    recorder = Recorder(rank=0, zero_us=0.0)
    for call in range(300):
        feed_call(recorder, "allreduce", [_name("allreduce", None)], 1000.0 * call)
        feed_call(recorder, "barrier", [_name("barrier.0", None)], 1000.0 * call + 500, sizes=[0])
        group = _name("grouped_allreduce", None)
        feed_call(recorder, "allreduce", [f"{group}.0", f"{group}.1"], 1000.0 * call + 700)
    # Stable names stay their own rows, also the optimizer's for unnamed parameters.
    feed_call(recorder, "allreduce", ["allreduce.allreduce.noname.0.1", "allreduce.body.0.weight"], 9e6)
    rows = tensor_rows(recorder.snapshot())
    assert sorted(rows) == [("allreduce", "allreduce.allreduce.noname.0.1"), ("allreduce", "allreduce.body.0.weight"),
                            ("allreduce", "allreduce.noname"), ("allreduce", "grouped_allreduce.noname"),
                            ("barrier", "barrier.0.noname")]
    assert rows[("allreduce", "allreduce.noname")]["calls"] == 300
    assert rows[("allreduce", "grouped_allreduce.noname")]["calls"] == 600
    assert rows[("barrier", "barrier.0.noname")]["calls"] == 300


def test_tensor_rows_are_capped_keeping_the_most_time_and_folding_the_rest():
    recorder = Recorder(rank=0, zero_us=0.0, tensor_rows=10)
    for call in range(500):  # a new name every call, and later calls take longer
        feed_call(recorder, "allreduce", [f"loss.{call}"], 1000.0 * call, backend_us=100.0 + call)
        assert len(recorder._tensors) <= 2 * 10 + 1  # bounded all along, not only in the file
    part = recorder.snapshot()
    rows = tensor_rows(part)
    assert len(rows) == 11 and part["tensors_folded"] == 490
    assert {name for _, name in rows} - {schema.OTHER_TENSORS} == {f"loss.{call}" for call in range(490, 500)}
    other = rows[("allreduce", schema.OTHER_TENSORS)]
    assert other["calls"] == 490 and other["bytes"] == 16  # bytes per call
    assert sum(t["time_us"] for t in rows.values()) == pytest.approx(sum(100.0 + c for c in range(500)))
    text = render(Analysis(two_ranks_of(part)), "p.json", [])
    assert "Top tensors (of 500, 490 of them folded into the '(other tensors)' rows;" in text


def test_tensor_rows_fold_again_to_one_top_set_across_ranks(monkeypatch):
    from hpdl.profile import recorder as rec

    monkeypatch.setattr(rec, "TENSOR_ROWS", 10)
    parts = []
    for rank in (0, 1):  # the same 500 tensors; each rank's slowest are others' fastest
        recorder = Recorder(rank=rank, zero_us=0.0, tensor_rows=10)
        for call in range(500):
            slow = call if rank == 0 else 499 - call
            feed_call(recorder, "allreduce", [f"loss.{call}"], 1000.0 * call, backend_us=100.0 + slow)
        parts.append(recorder.snapshot())
    profile = two_ranks_of(parts[0])
    profile["ranks"][1] = dict(parts[1], rank=1, host="h", engine={})
    a = Analysis(profile)
    assert a.tensor_count == 500 and a.tensors_folded == 490
    assert len(a.by_tensor) == 11  # one top set of 10 and one "(other tensors)" row
    assert sum(r.time_us for r in a.by_tensor) == pytest.approx(sum(100.0 + c for c in range(500)))
    assert "Top tensors (of 500, 490 of them folded" in render(a, "p.json", [])


def two_ranks_of(part: dict) -> dict:
    """A profile of two ranks that both recorded ``part``."""
    ranks = [dict(part, rank=rank, host="h", engine={}) for rank in (0, 1)]
    profile = {"format": schema.FORMAT, "version": schema.VERSION, "ranks": ranks,
               "job": {"size": 2, "backend": "mpi", "hosts": ["h", "h"], "missing_ranks": [],
                       "settings": {"fusion_threshold": 64 * MiB, "inplace_threshold": MiB}}}
    schema.check(profile, "made-up")
    return profile


def test_paused_recorder_records_nothing():
    recorder = Recorder(rank=0, zero_us=0.0)
    recorder.paused = True
    feed_step(recorder, 0.0, [MiB])
    assert recorder.snapshot()["collectives"]["rows"] == []


# -- analysis, findings, reports ------------------------------------------------------------------

def make_profile(late_rank1: float = 0.0, blocked: float = 0.0, sizes=(64 * MiB,), backend_us: float = 100_000.0,
                 steps: int = 4, fusion_threshold: int = 64 * MiB, round_us: Optional[float] = None,
                 queue_late_rank1: Sequence[float] = ()) -> dict:
    """Two ranks' profile. With ``round_us``, every round takes that long and rank 0 also waits
    for a late rank 1 in negotiation (else each rank's negotiation is 20 µs). Rank 1's engine
    thread takes its request ``queue_late_rank1[step]`` µs later than rank 0's (0 for the
    steps not given), and rank 0 waits that much longer in negotiation."""
    ranks = []
    for rank in (0, 1):
        recorder = Recorder(rank=rank, zero_us=0.0)
        recorder._step_start = 0.0
        t = 1000.0
        for step in range(steps):
            queue_late = queue_late_rank1[step] if step < len(queue_late_rank1) else 0.0
            negotiate = 20.0 if round_us is None else round_us + (0.0 if rank else late_rank1 + queue_late)
            period = backend_us + 1000 + (0.0 if round_us is None else round_us + late_rank1 + queue_late)
            feed_step(recorder, t, list(sizes), late=late_rank1 if rank else 0.0, blocked=blocked, start=backend_us,
                      negotiate=negotiate, queue=10.0 + (queue_late if rank else 0.0))
            t += period
        part = recorder.snapshot()
        part.update(host="h", clock_offset_us=0.0, clock_offset_applied=False,
                    engine={"fusion_buffer_hits": 3, "fusion_buffer_misses": 1})
        ranks.append(part)
    profile = {"format": schema.FORMAT, "version": schema.VERSION, "ranks": ranks,
               "job": {"size": 2, "backend": "mpi", "hosts": ["h", "h"], "missing_ranks": [],
                       "settings": {"fusion_threshold": fusion_threshold, "inplace_threshold": MiB}}}
    schema.check(profile, "made-up")
    return profile


def test_size_classes_use_the_study_edges_and_put_64_mib_in_32_64():
    a = Analysis(make_profile(sizes=(40 * MiB, 24 * MiB)))
    assert [r.label for r in a.classes] == ["<= 128 KiB", "128 KiB-16 MiB", "16 MiB-32 MiB", "32 MiB-64 MiB", "> 64 MiB"]
    top = a.classes[3]
    assert top.calls == 4 and top.share == pytest.approx(1.0)
    # 64 MiB in 0.1 s on 2 ranks: algbw 0.671 GB/s, busbw x 2(p-1)/p = x 1.
    assert top.busbw_gbps == pytest.approx(64 * MiB / 0.1 / 1e9, rel=1e-3)
    assert a.classes[2].calls == 0


def test_buckets_parse_and_label():
    assert parse_buckets("1K,1M") == (1024, MiB)
    assert class_labels((1024, MiB)) == ["<= 1 KiB", "1 KiB-1 MiB", "> 1 MiB"]
    for bad in ("", "1M,1K", "0,1K", "1K,1K", "big"):
        with pytest.raises(ValueError):
            parse_buckets(bad)


def test_straggler_is_named_with_its_lateness():
    a = Analysis(make_profile(late_rank1=8000.0))  # 8 % of a 101 ms step
    arrival = a.arrival
    assert arrival.collectives == 3  # the start-up step left out
    assert arrival.ranks[1].last == 3 and arrival.ranks[1].mean_late_us == pytest.approx(8000.0)
    assert arrival.median_spread_us == pytest.approx(8000.0)
    text = " ".join(findings(a))
    assert "rank 1 arrives 8.0 ms after the first rank on average over all 3 collectives matched across ranks, 100% " \
           "of all ranks' time behind" in text, text


def test_straggler_is_weighed_by_time_behind_not_by_how_often_last():
    profile = make_profile(late_rank1=30_000.0, steps=6)
    # Rank 0 is last, by a hair, at 3 of the 5 steady collectives; rank 1 is far behind at the others.
    for rank in profile["ranks"]:
        table = rank["collectives"]
        col = {name: i for i, name in enumerate(table["columns"])}
        for row in table["rows"]:
            if row[col["step"]] >= 3:
                row[col["ready_us"]] += 100.0 if rank["rank"] == 0 else -30_000.0
    a = Analysis(profile)
    ranks = a.arrival.ranks
    assert ranks[0].last == 3 and ranks[1].last == 2 and ranks[1].mean_late_us > 10 * ranks[0].mean_late_us
    text = " ".join(findings(a))
    assert "rank 1 arrives 12.0 ms after" in text and "the last to arrive at 40% of them" in text, text


def test_negotiation_finding_tells_slow_rounds_from_late_ranks():
    # Every rank, the last to arrive included, waits 50 ms per round: the rounds are slow.
    a = Analysis(make_profile(backend_us=10_000.0, round_us=50_000.0))
    assert a.waits.waiting_share == pytest.approx(0.0)
    text = " ".join(findings(a))
    assert "100% of it is what even the last rank to join a collective waits for its round, so the rounds are " \
           "slow, not the ranks" in text, text
    # Rank 1 submits 40 ms late and rank 0 waits for it; rank 1's own round is quick.
    a = Analysis(make_profile(backend_us=10_000.0, round_us=100.0, late_rank1=40_000.0))
    text = " ".join(findings(a))
    assert "100% of it is ranks waiting for the last to join" in text and "Rank 1 joins last at 100% of collectives, " \
           "and at those it joins 40.0 ms after the first on average: it submits them late" in text, text
    assert "the rounds are slow" not in text


def test_negotiation_finding_weighs_by_time_and_names_a_late_engine_thread():
    # As in a real profile: rank 1's engine thread takes two of six requests 40 ms late (its
    # submissions are on time) and rank 0 waits that long; every other round is quick. The
    # medians see only quick rounds; the time is in the two waits.
    a = Analysis(make_profile(steps=7, backend_us=5_000.0, round_us=100.0,
                              queue_late_rank1=[0, 40_000, 0, 0, 40_000, 0, 0]))
    assert a.arrival.ranks[1].mean_late_us == 0  # by submission, no one is late
    assert a.waits.ranks[1].late_queue_us == pytest.approx(80_000.0)
    text = " ".join(findings(a))
    assert "ranks waiting for the last to join" in text and "Rank 1 joins last" in text, text
    assert "40.0 ms after the first on average, 100% of that in its queue: rank 1's engine thread is late to " \
           "take requests from its queue" in text, text
    assert "the rounds are slow" not in text


def test_negotiation_finding_of_one_rank_blames_the_rounds_not_the_ranks():
    profile = make_profile(backend_us=10_000.0, round_us=50_000.0)
    profile["ranks"] = profile["ranks"][:1]
    profile["job"].update(size=1, hosts=["h"])
    text = " ".join(findings(Analysis(profile)))
    assert "with one rank there is no one to wait for" in text, text
    assert "different times" not in text


def test_exposed_communication_finding_suggests_fp16():
    a = Analysis(make_profile(blocked=18_200.0))  # steps of 101 ms, 18.2 ms of them blocked
    assert a.steps.exposed_us == 18_200 and a.steps.exposed_share == pytest.approx(18_200 / a.steps.step_us)
    text = " ".join(findings(a))
    assert re.search(r"exposed communication is 18% of the step .*try fp16 gradients, half the bytes "
                     r"\(`compression=hvd.Compression.fp16`", text), text


def test_size_finding_compares_with_the_bench_curve():
    a = Analysis(make_profile())
    bench = {32 * MiB: (10_000.0, 3.0), 64 * MiB: (13_000.0, 5.1)}
    text = findings(a, bench)[0]
    assert text.startswith("100% of communication time is in 32 MiB-64 MiB messages")
    assert "at 0.67 GB/s bus bandwidth, against 5.10 GB/s that `hpdl bench allreduce` reached at 64 MiB" in text
    assert "7.6x faster" in text


def test_report_and_compare_text():
    before, after = Analysis(make_profile()), Analysis(make_profile(backend_us=50_000.0))
    text = render(before, "p.json", findings(before))
    assert "32 MiB-64 MiB" in text and "exposed comm ms" in text and "Findings" in text
    compare = render_compare(before, "a.json", after, "b.json")
    row = next(line for line in compare.splitlines() if line.startswith("32 MiB-64 MiB"))
    assert "-50%" in row and "settings: the same" in compare and "job: the same (2 ranks, mpi, 1 host(s))" in compare
    tuned = make_profile(fusion_threshold=32 * MiB)
    assert "settings changed: fusion_threshold 67108864 -> 33554432" in render_compare(
        before, "a.json", Analysis(tuned), "b.json")


def test_compare_reports_job_differences_and_fractional_messages_per_step():
    one_rank = make_profile()
    one_rank["ranks"] = one_rank["ranks"][:1]
    one_rank["job"].update(size=1, hosts=["h"])
    gloo = make_profile()
    gloo["job"].update(backend="gloo", hosts=["h", "g"])
    text = render_compare(Analysis(one_rank), "a.json", Analysis(gloo), "b.json")
    assert "job changed: ranks 1 -> 2, backend mpi -> gloo, hosts 1 -> 2" in text, text
    assert "settings: the same" in text
    # Rank 0 sends 1 message per step and rank 1 sends 2: the median step sends 1.5.
    mixed = make_profile()
    steps = mixed["ranks"][1]["steps"]
    column = steps["columns"].index("messages")
    for row in steps["rows"]:
        row[column] = 2
    text = render_compare(Analysis(mixed), "a.json", Analysis(make_profile()), "b.json")
    row = next(line for line in text.splitlines() if line.startswith("messages per step"))
    assert row.split() == ["messages", "per", "step", "1.5", "1.0", "-33%"], row


def test_timeline_tracks_and_phases():
    events = trace(make_profile())["traceEvents"]
    assert {e["pid"] for e in events} == {0, 1}
    threads = {(e["pid"], e["args"]["name"]) for e in events if e["name"] == "thread_name"}
    assert {(1, "backend calls"), (0, "copies (fusion buffer)"), (0, "training")} <= threads
    backend = [e for e in events if e["name"] == "MPI_ALLREDUCE"]
    assert len(backend) == 8 and all(e["dur"] == 100_000 for e in backend)
    waits = [e for e in events if e.get("cat") == "waiting"]
    assert {e["ph"] for e in waits} == {"b", "e"} and len(waits) == 2 * 2 * 8


def assert_tracks_nest(events) -> None:
    """Complete slices on one track must nest (viewers misdraw or drop the others)."""
    tracks = {}
    for e in events:
        if e.get("ph") == "X":
            tracks.setdefault((e["pid"], e["tid"]), []).append(e)
    for track, slices in tracks.items():
        open_ends = []
        for e in sorted(slices, key=lambda e: (e["ts"], -e["dur"])):
            while open_ends and open_ends[-1] <= e["ts"] + 1e-3:
                open_ends.pop()
            end = e["ts"] + e["dur"]
            assert not open_ends or end <= open_ends[-1] + 1e-3, \
                f"track {track}: {e['name']} at {e['ts']} overlaps an open slice ending at {open_ends[-1]}"
            open_ends.append(end)


def test_timeline_tracks_nest_when_fused_messages_overlap():
    # As with gloo's two fusion buffers: each message is copied in while the one before is in
    # flight, and its backend call starts where that one's ends; a long copy-out even runs
    # into the next message's copy-in.
    profile = make_profile(sizes=(MiB, MiB), steps=6)
    rank = profile["ranks"][0]
    columns = rank["collectives"]["columns"]
    for k, row in enumerate(rank["collectives"]["rows"]):
        cell = dict(zip(columns, row))
        cell.update(start_us=10_000.0 + 500 * k, copy_in_us=300.0, backend_us=500.0, copy_out_us=250.0,
                    ready_us=9_000.0 + 500 * k, queue_us=10.0, negotiate_us=20.0)
        row[:] = [cell[c] for c in columns]
    events = trace(profile)["traceEvents"]
    assert_tracks_nest(events)
    mine = [e for e in events if e["pid"] == 0 and e.get("ph") == "X"]
    assert len([e for e in mine if e["name"] == "MPI_ALLREDUCE"]) == 6
    assert len([e for e in mine if e["name"] in ("copy in", "copy out")]) == 12
    threads = {e["args"]["name"] for e in events if e["pid"] == 0 and e["name"] == "thread_name"}
    assert "copies (fusion buffer) 2" in threads  # the copy-out that runs into the next copy-in


def test_html_page_is_self_contained_with_plots():
    from hpdl.profile.html import render_html

    a = Analysis(make_profile(late_rank1=3000.0, blocked=10_000.0))
    page = render_html(a, "p.json", findings(a), {MiB: (900.0, 2.0), 64 * MiB: (13_000.0, 5.1)})
    assert page.count("<svg") == 4  # size classes, latency and bandwidth, steps, skew
    assert "<script" not in page and "<link" not in page and "@import" not in page
    assert not re.search(r"""(src|href)\s*=\s*["']?(https?:)?//""", page)
    assert "32 MiB-64 MiB" in page and "exposed communication is" in page


def test_shutdown_hook_on_the_failure_path_leaves_no_error_of_its_own(monkeypatch, caplog):
    # The gather fails (a peer is gone): write() takes the failure path, which ends the recording.
    from hpdl.torch.profiler import session as sess
    from hpdl.torch import runtime

    class Engine:
        def stats(self):
            return {"cycles": 1}

    recording = object.__new__(sess.Session)
    recording.engine_counters = {}
    recording.recorder = Recorder(0, 0.0)
    monkeypatch.setattr(sess, "_session", recording)
    monkeypatch.setattr(runtime, "engine", lambda: Engine())
    monkeypatch.setattr(sess, "write", lambda s: sess._end(s))
    monkeypatch.setattr(runtime, "_shutdown_hooks", {stage: [] for stage in runtime.ShutdownStage})
    runtime.add_shutdown_hook(sess._at_shutdown, runtime.ShutdownStage.WRITE_RECORDS)
    with caplog.at_level(logging.ERROR, logger="hpdl"):
        failures = runtime._run_shutdown_hooks()
    assert sess._session is None and not failures and not caplog.records, (failures, caplog.text)


def test_an_uncaught_exception_is_noted_and_passed_on_and_the_hooks_are_restored(monkeypatch):
    import sys
    import threading

    from hpdl.torch.profiler import session as sess

    seen = []
    monkeypatch.setattr(sys, "excepthook", lambda *a: seen.append(("sys", a[0])))
    monkeypatch.setattr(threading, "excepthook", lambda args: seen.append(("thread", args.exc_type)))
    earlier = (sys.excepthook, threading.excepthook)
    monkeypatch.setattr(sess, "_dying_from", None)
    sess._wrap_excepthooks()
    try:
        thread = threading.Thread(target=lambda: 1 / 0)
        thread.start()
        thread.join()
        assert sess._dying_from == "ZeroDivisionError" and seen == [("thread", ZeroDivisionError)]
        sys.excepthook(KeyError, KeyError("k"), None)
        assert seen[-1] == ("sys", KeyError) and sess._dying_from == "ZeroDivisionError"
    finally:
        sess._restore_excepthooks()
    assert (sys.excepthook, threading.excepthook) == earlier and sess._previous_hooks is None


def test_bus_bandwidth_factors_follow_nccl_tests():
    from hpdl.profile.analysis import bus_factor

    # Allgather: nccl-tests' size is the gathered output (input x p), with (p-1)/p.
    for p in (2, 3, 8):
        assert bus_factor("allgather", p) == pytest.approx(p * (p - 1) / p)
        assert bus_factor("allreduce", p) == pytest.approx(2 * (p - 1) / p)
        assert bus_factor("reducescatter", p) == bus_factor("alltoall", p) == pytest.approx((p - 1) / p)
        assert bus_factor("broadcast", p) == 1.0
    profile = make_profile(sizes=(4 * MiB,))
    for rank in profile["ranks"]:
        for row in rank["messages"]["rows"]:
            row[rank["messages"]["columns"].index("kind")] = "allgather"
    # 4 MiB per rank gathered on 2 ranks in 0.1 s: 8 MiB output x 1/2 / 0.1 s.
    assert Analysis(profile).classes[1].busbw_gbps == pytest.approx(8 * MiB / 2 / 0.1 / 1e9, rel=1e-3)


def test_per_step_row_adds_up_when_step_and_wait_medians_come_from_different_steps():
    profile = make_profile(steps=5)
    # Long steps that wait little, short steps that wait long: each column's own median
    # would come from different steps, and compute + exposed would not be the step.
    lengths, waits = (100_000, 300_000, 200_000, 400_000), (90_000, 10_000, 50_000, 20_000)
    for rank in profile["ranks"]:
        table = rank["steps"]
        col = {name: i for i, name in enumerate(table["columns"])}
        start = 0.0
        for row, length, wait in zip(table["rows"], (0, *lengths), (0, *waits)):
            row[col["start_us"]], row[col["end_us"]], row[col["blocked_us"]] = start, start + length, wait
            start += length
    a = Analysis(profile)
    for s in (*a.per_rank_steps, a.steps):
        assert s.compute_us + s.exposed_us == pytest.approx(s.step_us)
        assert s.exposed_share + s.efficiency == pytest.approx(1.0)
    out = render(a, "p.json", [])
    row = next(line for line in out.splitlines() if line.startswith("all ranks"))
    step, compute, _comm, exposed = (float(x) for x in row.split()[3:7])
    assert compute + exposed == pytest.approx(step, abs=0.02)


def test_one_rank_and_an_empty_profile_read_plainly():
    one = make_profile()
    one["ranks"] = one["ranks"][:1]
    one["job"].update(size=1, hosts=["h"])
    a = Analysis(one)
    assert "p.json: 1 rank (mpi)" in render(a, "p.json", findings(a))
    assert "job: the same (1 rank, mpi, 1 host(s))" in render_compare(a, "a.json", a, "b.json")
    empty = make_profile(steps=0)
    for rank in empty["ranks"]:
        rank["messages"]["rows"] = []
        rank["tensors_time"]["rows"] = []
    a = Analysis(empty)
    text = render(a, "p.json", findings(a))
    assert "nothing recorded" in text and "Findings" not in text and "messages per step" not in text, text


def test_timeline_to_stdout(tmp_path, capsys, monkeypatch):
    import json

    from hpdl.profile.timeline import write_trace

    monkeypatch.chdir(tmp_path)  # not a file named "-"
    document = trace(make_profile())
    assert write_trace(document, "-") == len(document["traceEvents"])
    assert json.loads(capsys.readouterr().out) == document


# -- the training thread's wait for a core -------------------------------------------------------

def test_each_step_records_how_long_the_stepping_thread_waited_for_a_core(monkeypatch):
    import threading

    from hpdl.profile import recorder as recorder_module

    waits = iter([1_000_000, 4_000_000, 9_000_000, 5_000_000])  # ns, as the kernel counts them
    monkeypatch.setattr(recorder_module, "core_wait_ns", lambda: next(waits))
    recorder = Recorder(rank=0, zero_us=0.0)  # reads 1 ms on this thread
    feed_step(recorder, 1000.0, [MiB])  # 4 ms: 3 ms waited in this step
    feed_step(recorder, 2000.0, [MiB])  # 9 ms: 5 ms
    # A step marked from another thread: that thread's count starts there, nothing to subtract.
    other = threading.Thread(target=feed_step, args=(recorder, 3000.0, [MiB]))
    other.start(), other.join()
    rows = list(schema.records(recorder.snapshot(), "steps"))
    assert [r["core_wait_us"] for r in rows] == [3000.0, 5000.0, None]


def test_a_platform_that_does_not_tell_records_no_wait(monkeypatch):
    from hpdl.profile import recorder as recorder_module

    monkeypatch.setattr(recorder_module, "core_wait_ns", lambda: None)
    recorder = Recorder(rank=0, zero_us=0.0)
    feed_step(recorder, 1000.0, [MiB])
    assert [r["core_wait_us"] for r in schema.records(recorder.snapshot(), "steps")] == [None]


def test_the_kernel_counts_the_wait_of_a_thread_that_shares_its_core():
    # Real counts: a process spinning on this thread's one core makes it wait, runnable.
    import os
    import subprocess
    import sys
    import time

    from hpdl.profile.recorder import core_wait_ns

    if core_wait_ns() is None or not hasattr(os, "sched_setaffinity"):
        pytest.skip("no per-thread scheduler statistics here (Linux's /proc/thread-self/schedstat)")
    core = sorted(os.sched_getaffinity(0))[0]
    saved = os.sched_getaffinity(0)
    spinner = subprocess.Popen([sys.executable, "-c", f"import os; os.sched_setaffinity(0, {{{core}}})\nwhile True: pass"])
    try:
        os.sched_setaffinity(0, {core})
        time.sleep(0.2)  # the spinner is running
        before = core_wait_ns()
        end = time.thread_time() + 0.3
        while time.thread_time() < end:  # 0.3 s of this thread's own CPU, shared with the spinner
            pass
        waited_s = (core_wait_ns() - before) / 1e9
    finally:
        os.sched_setaffinity(0, saved)
        spinner.kill()
        spinner.wait()
    assert waited_s > 0.1, waited_s  # about as long as it ran, on a fair scheduler


def _with_core_wait(profile, wait_us):
    for rank in profile["ranks"]:
        table = rank["steps"]
        col = table["columns"].index("core_wait_us")
        for row in table["rows"]:
            row[col] = wait_us
    return profile


def test_a_training_thread_kept_waiting_for_a_core_is_a_finding():
    a = Analysis(_with_core_wait(make_profile(), 20_000.0))  # steps of 101 ms, 20 ms of it waiting
    assert a.steps.core_wait_us == 20_000.0
    text = " ".join(findings(a))
    assert re.search(r"the training thread waited 20\.0 ms per step for a core, ready to run \(2\d% of its compute", text)
    row = next(line for line in render(a, "p.json", []).splitlines() if line.startswith("all ranks"))
    assert row.split()[-1] == "20.00"
    assert "core wait ms" in render_compare(a, "a.json", a, "b.json")
    quiet = Analysis(_with_core_wait(make_profile(), 1_000.0))  # 1 % of compute: nothing to say
    assert "for a core" not in " ".join(findings(quiet))


def test_a_version_1_profile_reads_with_the_wait_unknown():
    profile = make_profile()
    profile["version"] = 1
    for rank in profile["ranks"]:
        rank["steps"]["columns"] = rank["steps"]["columns"][:-1]
        rank["steps"]["rows"] = [row[:-1] for row in rank["steps"]["rows"]]
    schema.check(profile, "old.json")
    a = Analysis(profile)
    assert a.steps.core_wait_us is None and "for a core" not in " ".join(findings(a))
    assert next(line for line in render(a, "old.json", []).splitlines() if line.startswith("all ranks")).endswith("-")


def test_a_version_2_profile_reads_with_its_members_ready_times_unknown(tmp_path):
    recorder = Recorder(rank=0, zero_us=0.0)
    recorder._step_start = 0.0
    feed_step(recorder, 1000.0, [4 * MiB, 2 * MiB], blocked=40.0)
    part = recorder.snapshot()
    columns = part["collectives"]["columns"]
    part["collectives"] = schema.table(columns[:-1], [row[:-1] for row in part["collectives"]["rows"]])
    path = tmp_path / "v2.json"
    path.write_text(json.dumps({"format": schema.FORMAT, "version": 2, "job": {"size": 1}, "ranks": [part]}))
    (c,) = list(schema.records(schema.load(str(path))["ranks"][0], "collectives"))
    assert c["member_ready_us"] == [] and c["ready_us"] == 1001.0
