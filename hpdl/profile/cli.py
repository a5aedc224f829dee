"""`hpdl profile`: read a communication profile (report, compare, timeline)."""

from __future__ import annotations

import argparse
import contextlib
from typing import Iterator

from hpdl.cli_error import CliError
from hpdl.output_files import OutputRule

# What reading a damaged profile can raise in the arithmetic and formatting of its values
# (the schema check catches what it can name; these are the rest).
_UNUSABLE = (KeyError, TypeError, ValueError, IndexError, ZeroDivisionError, AttributeError, OverflowError)

_DESCRIPTION = """\
Read a communication profile: record one with `hpdl run --profile p.json -- ...`,
HPDL_PROFILE=p.json, or hvd.start_profile() / hvd.stop_profile() (docs/profile.md).

examples:
  hpdl run -np 2 --profile p.json -- python train.py
  hpdl profile report p.json
  hpdl profile report p.json --bench b.json --html report.html   # b.json: hpdl bench allreduce --json
  hpdl profile compare before.json after.json
  hpdl profile timeline p.json -o trace.json                      # open in ui.perfetto.dev"""


def register(subparsers) -> None:
    """Add ``profile`` and its subcommands."""
    profile = subparsers.add_parser(
        "profile", help="read a communication profile: report, compare, timeline",
        description=_DESCRIPTION, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = profile.add_subparsers(dest="profile_command", metavar="SUBCOMMAND")
    buckets = dict(default="128K,16M,32M,64M", metavar="SIZES",
                   help="edges of the message-size classes (default 128K,16M,32M,64M)")

    report = sub.add_parser(
        "report", help="time by message size, per step, per rank, fusion, findings",
        description="Print a profile's tables and findings: communication time by message size, top messages "
        "and tensors, per step (compute, exposed communication, efficiency estimate), arrival per rank, fusion. "
        "--html writes them with plots into a directory that must exist; it never replaces an input, and an "
        "existing file only with --overwrite.")
    report.add_argument("file", help="profile JSON file")
    report.add_argument("--buckets", **buckets)
    report.add_argument("--bench", metavar="FILE",
                        help="`hpdl bench allreduce --json` output: compare with what the backend reaches alone")
    report.add_argument("--html", metavar="FILE", help="also write a self-contained HTML report with plots")
    report.add_argument("--overwrite", action="store_true", help="replace the --html file if it exists (never an input)")
    report.set_defaults(func=_report)

    compare = sub.add_parser("compare", help="two profiles side by side, with changes in percent",
                             description="Print two profiles' figures side by side (time by message size, per "
                             "step, fusion), with the changes from A to B and the settings that differ.")
    compare.add_argument("before", help="profile A (before the change)")
    compare.add_argument("after", help="profile B (after the change)")
    compare.add_argument("--buckets", **buckets)
    compare.set_defaults(func=_compare)

    timeline = sub.add_parser(
        "timeline", help="write a Chrome-trace / Perfetto file, one track per rank",
        description="Write a profile as a Chrome trace for ui.perfetto.dev or chrome://tracing: one process per "
        "rank with its steps, backend calls, copies and waits. The file goes into a directory that must exist; "
        "it never replaces the profile, and an existing file only with --overwrite.")
    timeline.add_argument("file", help="profile JSON file")
    timeline.add_argument("-o", "--output", required=True, metavar="FILE", help="trace file to write ('-': stdout)")
    timeline.add_argument("--overwrite", action="store_true", help="replace the trace file if it exists (never the profile)")
    timeline.set_defaults(func=_timeline)
    profile.set_defaults(func=lambda args: profile.print_help() or 2)


def _analysis(path: str, buckets: str):
    from hpdl.profile.analysis import Analysis, parse_buckets
    from hpdl.profile.schema import ProfileError, load

    try:
        edges = parse_buckets(buckets)
    except ValueError as err:
        raise CliError(str(err)) from None
    try:
        profile = load(path)
    except ProfileError as err:
        raise CliError(str(err)) from None
    with _reading(path):
        return Analysis(profile, edges)


@contextlib.contextmanager
def _reading(path: str) -> Iterator[None]:
    """Turn an error while analysing or rendering the profile ``path`` into one line naming it."""
    try:
        yield
    except _UNUSABLE as err:
        raise CliError(f"{path}: profile has an unusable value ({type(err).__name__}: {err})") from None


def _report(args) -> int:
    from hpdl.profile.findings import findings, load_bench
    from hpdl.profile.report import render
    from hpdl.profile.schema import ProfileError

    inputs = [("input", path) for path in [args.file] + ([args.bench] if args.bench else [])]
    outputs = OutputRule(inputs, args.overwrite, make_directories=False)
    if args.html:
        outputs.refuse(args.html, "--html")
        _require_matplotlib()
    analysis = _analysis(args.file, args.buckets)
    try:
        bench = load_bench(args.bench) if args.bench else None
    except ProfileError as err:
        raise CliError(str(err)) from None
    with _reading(args.file):
        found = findings(analysis, bench)
        page = None
        if args.html:
            from hpdl.profile.html import render_html

            page = render_html(analysis, args.file, found, bench)
        text = render(analysis, args.file, found)
    if page is not None:
        outputs.write(args.html, lambda f: f.write(page), option="--html")
    print(text)
    if args.html:
        print(f"\nHTML report: {args.html}")
    return 0


def _require_matplotlib() -> None:
    """Refuse --html before the analysis where matplotlib, which draws its figures, is missing."""
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        raise CliError("--html needs matplotlib: pip install 'hpdl[profile]'") from None


def _compare(args) -> int:
    from hpdl.profile.report import render_compare

    before, after = _analysis(args.before, args.buckets), _analysis(args.after, args.buckets)
    with _reading(f"{args.before} or {args.after}"):
        text = render_compare(before, args.before, after, args.after)
    print(text)
    return 0


def _timeline(args) -> int:
    from hpdl.profile.timeline import dump_trace, trace, write_trace

    to_stdout = args.output == "-"
    outputs = OutputRule([("input", args.file)], args.overwrite, make_directories=False)
    if not to_stdout:
        outputs.refuse(args.output, "-o")
    analysis = _analysis(args.file, "128K")
    with _reading(args.file):
        document = trace(analysis.profile)
    if to_stdout:
        write_trace(document, "-")  # a reader gone away ends the CLI quietly, as for any output
        return 0
    outputs.write(args.output, lambda f: dump_trace(document, f), option="-o")
    print(f"wrote {args.output}: {len(document['traceEvents'])} trace events, one track per rank (open in "
          "ui.perfetto.dev or chrome://tracing)")
    return 0
