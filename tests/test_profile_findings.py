"""What the report tells a user: advice their own job can follow, figures that say what they
average over, an empty profile said plainly on every page, and autotuned settings named as such."""

from __future__ import annotations

from hpdl.profile.analysis import Analysis
from hpdl.profile.findings import findings
from hpdl.profile.report import NOTHING_RECORDED, render, render_compare
from test_profile_units import MiB, make_profile


def _exposed_finding(profile: dict) -> str:
    a = Analysis(profile)
    return next(text for text in findings(a) if text.startswith("exposed communication"))


def _with_command(profile: dict, command: list) -> dict:
    profile["job"]["command"] = command
    return profile


def test_fp16_advice_is_spelt_as_the_profiled_job_takes_it():
    blocked = dict(blocked=18_200.0)  # 18 % of a 101 ms step exposed
    script = _exposed_finding(_with_command(make_profile(**blocked), ["train.py", "--epochs", "3"]))
    assert "`compression=hvd.Compression.fp16` in `hvd.DistributedOptimizer`" in script, script
    assert "--fp16-allreduce" not in script, script
    sr_train = _exposed_finding(_with_command(make_profile(**blocked), ["/venv/bin/hpdl", "sr", "train", "--config",
                                                                        "demo"]))
    assert "(`compression=fp16`)" in sr_train and "hvd.Compression" not in sr_train, sr_train
    bench = _exposed_finding(_with_command(make_profile(**blocked), ["/venv/bin/hpdl", "bench", "synthetic"]))
    assert "`--fp16-allreduce`" in bench, bench


def test_no_fp16_advice_for_gradients_sent_in_half_precision_already():
    profile = make_profile(blocked=18_200.0)
    for rank in profile["ranks"]:
        table = rank["messages"]
        column = table["columns"].index("dtype")
        for row in table["rows"]:
            row[column] = "float16"
    text = _exposed_finding(profile)
    assert "backward does not hide it" in text and "fp16" not in text and "HPDL_FUSION_THRESHOLD" in text, text


def test_messages_at_the_backends_speed_get_the_jobs_own_fp16_spelling():
    a = Analysis(make_profile())  # 64 MiB in 0.1 s: 0.67 GB/s, as the bench reached
    text = findings(a, {64 * MiB: (100_000.0, 0.7)})[0]
    assert "already run at the backend's speed" in text and "hvd.Compression.fp16" in text, text
    assert "--fp16-allreduce" not in text, text


def test_a_one_rank_profile_advises_nothing_about_exchanges():
    profile = make_profile(blocked=18_200.0)
    profile["ranks"] = profile["ranks"][:1]
    profile["job"].update(size=1, hosts=["h"])
    text = _exposed_finding(profile)
    assert "with one rank nothing is exchanged" in text, text
    assert "fp16" not in text and "HPDL_FUSION_THRESHOLD" not in text, text


def test_the_straggler_and_the_late_joiner_say_what_they_average_over():
    # Rank 1 submits 40 ms late at every collective: both findings name it, by different measures.
    a = Analysis(make_profile(backend_us=10_000.0, round_us=100.0, late_rank1=40_000.0))
    found = findings(a)
    straggler = next(text for text in found if text.startswith("rank 1 "))
    negotiation = next(text for text in found if text.startswith("collectives wait"))
    assert "rank 1 arrives 40.0 ms after the first rank on average over all 3 collectives matched across ranks" \
        in straggler, straggler
    assert "Rank 1 joins last at 100% of collectives, and at those it joins 40.0 ms after the first on average" \
        in negotiation, negotiation
    assert "its submission plus its queue wait" in negotiation, negotiation
    assert not any("behind the first on average" in text for text in found), found


def _empty_profile() -> dict:
    empty = make_profile(steps=0)
    for rank in empty["ranks"]:
        rank["messages"]["rows"] = []
        rank["tensors_time"]["rows"] = []
    return empty


def test_the_html_page_of_an_empty_profile_says_it_is_empty():
    from hpdl.profile.html import render_html

    a = Analysis(_empty_profile())
    page = render_html(a, "p.json", findings(a))
    assert NOTHING_RECORDED in page and NOTHING_RECORDED in render(a, "p.json", findings(a))
    assert "Findings" not in page and "<table" not in page and "<svg" not in page, page
    assert "tensors per message" not in page, page


def test_the_html_page_has_no_findings_heading_without_findings():
    from hpdl.profile.html import render_html

    page = render_html(Analysis(make_profile()), "p.json", [])
    assert "Findings" not in page and "<table" in page


def _autotuned(profile: dict, threshold: int) -> dict:
    profile["job"]["settings"].update(autotune=True, fusion_threshold=threshold, cycle_time_ms=10.0)
    return profile


def test_compare_names_autotuning_and_its_values_at_the_end():
    plain, tuned = make_profile(), _autotuned(make_profile(), 8 * MiB)
    plain["job"]["settings"]["cycle_time_ms"] = 1.0
    text = render_compare(Analysis(plain), "a.json", Analysis(tuned), "b.json")
    line = next(line for line in text.splitlines() if line.startswith("settings"))
    assert line == ("settings changed: autotune off -> on, cycle_time_ms 1.0 -> 10.0 (autotuned, at the end), "
                    "fusion_threshold 67108864 -> 8388608 (autotuned, at the end)"), line


def test_an_autotuned_profile_says_its_fill_is_against_the_threshold_at_the_end():
    # 4 MiB messages of two tensors against the 64 MiB threshold in force at the end: 6 % full.
    a = Analysis(_autotuned(make_profile(sizes=(2 * MiB, 2 * MiB)), 64 * MiB))
    text = render(a, "p.json", findings(a))
    row = next(line for line in text.splitlines() if line.startswith("fill of"))
    assert row.startswith("fill of the 64 MiB fusion buffer (autotuned: the threshold at the end of the recording)"), \
        row
    fill = next(line for line in text.splitlines() if line.startswith("- fused messages fill"))
    assert "(autotuned: the threshold at the end of the recording)" in fill, fill
