"""`hpdl profile`: read a communication profile (report, compare, timeline, predict)."""

from __future__ import annotations

import argparse
import contextlib
from typing import Iterator

from hpdl.cli_error import CliError
from hpdl.output_files import OutputRule
from hpdl.profile.schema import UNUSABLE, unusable

# What reading a damaged profile can raise in the arithmetic and formatting of its values
# (the schema check catches what it can name; these are the rest).

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
    predict = sub.add_parser(
        "predict", help="predict step time, img/s and scaling efficiency at other rank counts",
        formatter_class=argparse.RawDescriptionHelpFormatter,
        description="Predict how the profiled job scales: each of the profile's last steps is replayed through the "
        "engine's own scheduling and fusion, its gradients at their recorded moments in backward, over a model of "
        "the network at each rank count (docs/predict.md). Prints what it assumed, then per rank count the step "
        "time, img/s, scaling efficiency and the exposed communication; --what-if adds variants beside the baseline.",
        epilog="examples:\n"
        "  hpdl profile predict p.json --batch-size 16 --ranks 1,2,4,8 --network intra=shm\n"
        "  hpdl profile predict p.json --batch-size 16 --ranks 1,4,16,64,512 --gpus-per-node 4 \\\n"
        "      --network intra=nvlink2,inter=ib-edr --compute-rate 11 --what-if fp16 --what-if 'bandwidth>=16MB:x2'\n\n"
        "network: LEVEL=PRESET, LEVEL=LABEL:BANDWIDTH:LATENCY or LEVEL=measured:FILE, comma-separated, LEVEL intra or "
        "inter (docs/predict.md lists the presets)\n"
        "what-ifs: fp16, hierarchical, fusion-threshold=SIZE, batch-size=Nx, bandwidth>=SIZE:xN")
    predict.add_argument("file", help="profile JSON file (schema 3: recorded by this hpdl)")
    predict.add_argument("--ranks", default="1,2,4,8,16,32,64,128,256,512", metavar="N,N,...",
                         help="rank counts to predict (default 1,2,4,...,512)")
    predict.add_argument("--gpus-per-node", type=int, default=1, metavar="G", help="ranks per node (default 1)")
    predict.add_argument("--nics-per-node", type=int, default=1, metavar="K",
                         help="network adapters a node's ranks share between nodes (default 1)")
    predict.add_argument("--network", required=True, metavar="SPEC", help="the network's levels (see below)")
    predict.add_argument("--algorithm", choices=("auto", "ring", "tree", "hierarchical"), default="auto",
                         help="the allreduce algorithm (default auto: the cheapest by the model, per message)")
    predict.add_argument("--backend", choices=("mpi", "gloo", "nccl"), default=None,
                         help="the target job's backend: with mpi the engine waits for each collective among the "
                              "ranks of one node (blocking calls); default: the profile's")
    predict.add_argument("--batch-size", type=int, required=True, metavar="B", help="images per rank per step")
    predict.add_argument("--compute-rate", type=float, metavar="IMG_PER_S",
                         help="another device's measured images per second on one device: the profile's compute "
                              "scaled to it, the gradients' moments with it")
    predict.add_argument("--what-if", action="append", default=[], metavar="CHANGE",
                         help="a variant predicted beside the baseline (repeatable)")
    predict.add_argument("--json", metavar="FILE", help="also write the prediction as JSON ('-': stdout only)")
    predict.add_argument("--plot", metavar="FILE", help="also plot img/s and efficiency against ranks, ideal beside")
    predict.add_argument("--overwrite", action="store_true", help="replace --json or --plot files if they exist")
    predict.set_defaults(func=_predict)
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
    except UNUSABLE as err:
        raise CliError(unusable(path, err)) from None


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


def _require_matplotlib(option: str = "--html") -> None:
    """Refuse ``option`` before the analysis where matplotlib, which draws its figures, is missing."""
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        raise CliError(f"{option} needs matplotlib: pip install 'hpdl[profile]'") from None


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


def _predict(args) -> int:
    import dataclasses
    import json

    from hpdl.profile.predict import predictor
    from hpdl.profile.predict.network import parse_network
    from hpdl.profile.schema import ProfileError, load

    ranks = _rank_counts(args.ranks)
    for option, value in (("--gpus-per-node", args.gpus_per_node), ("--nics-per-node", args.nics_per_node),
                          ("--batch-size", args.batch_size)):
        if value < 1:
            raise CliError(f"{option} {value}: give at least 1")
    if args.compute_rate is not None and not args.compute_rate > 0:
        raise CliError(f"--compute-rate {args.compute_rate:g}: give images per second above 0")
    outputs = OutputRule([("input", args.file)], args.overwrite, make_directories=False)
    for option, path in (("--json", args.json), ("--plot", args.plot)):
        if path and path != "-":
            outputs.refuse(path, option)
    if args.plot:
        _require_matplotlib("--plot")
    try:
        network = parse_network(args.network)
        what_ifs = [predictor.BASELINE] + [predictor.parse_what_if(w) for w in args.what_if]
        profile = load(args.file)
    except (ValueError, ProfileError) as err:
        raise CliError(str(err)) from None
    with _reading(args.file):
        shapes, recorded = predictor.step_shapes(profile, args.file)
    settings = predictor.job_settings(recorded)
    backend = args.backend or str(profile.get("job", {}).get("backend") or "nccl")
    try:
        points = predictor.predict(shapes, settings, network, ranks, args.gpus_per_node, args.batch_size,
                                   args.algorithm, args.nics_per_node, what_ifs, args.compute_rate, backend)
    except ValueError as err:
        raise CliError(str(err)) from None
    assumed = predictor.assumptions(shapes, settings, network, args.gpus_per_node, args.algorithm, args.batch_size,
                                    args.compute_rate, backend)
    record = {"profile": args.file, "assumptions": assumed,
              "points": [dataclasses.asdict(p) for p in points]}
    if args.json == "-":
        print(json.dumps(record, indent=1))
        return 0
    print(_prediction_text(assumed, points))
    if args.json:
        outputs.write(args.json, lambda f: f.write(json.dumps(record, indent=1) + "\n"), option="--json")
        print(f"wrote {args.json}")
    if args.plot:
        outputs.write(args.plot, lambda f: _plot_prediction(points, f), option="--plot", binary=True)
        print(f"wrote {args.plot}")
    return 0


def _rank_counts(text: str):
    try:
        ranks = [int(part) for part in text.split(",") if part.strip()]
    except ValueError:
        ranks = []
    if not ranks or any(r < 1 for r in ranks):
        raise CliError(f"--ranks {text!r}: give positive whole numbers, comma-separated (e.g. 1,2,4,8)")
    return sorted(set(ranks))


def _prediction_text(assumed, points) -> str:
    from hpdl.formatting import format_table

    lines = ["assumed:"] + [f"  {line}" for line in assumed] + [""]
    rows = []
    for p in points:
        worst = max(p.exposed_by_class.items(), key=lambda kv: kv[1], default=None)
        rows.append([p.what_if, p.ranks, f"{p.step_s * 1e3:.1f}", f"{p.img_per_s:.1f}", f"{100 * p.efficiency:.0f} %",
                     f"{p.exposed_s * 1e3:.1f}", f"{worst[0]} ({worst[1] * 1e3:.1f} ms)" if worst else "-",
                     p.algorithm])
    lines.append(format_table(["variant", "ranks", "step ms", "img/s", "efficiency", "exposed ms",
                               "exposed most", "algorithm at 1 MiB"], rows))
    return "\n".join(lines)


def _plot_prediction(points, stream) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    figure, (rate, efficiency) = plt.subplots(1, 2, figsize=(10, 4))
    variants = list(dict.fromkeys(p.what_if for p in points))
    for name in variants:
        mine = [p for p in points if p.what_if == name]
        xs = [p.ranks for p in mine]
        rate.plot(xs, [p.img_per_s for p in mine], marker="o", label=name)
        efficiency.plot(xs, [100 * p.efficiency for p in mine], marker="o", label=name)
        if name == variants[0]:
            single = mine[0].img_per_s / (mine[0].ranks * mine[0].efficiency)
            rate.plot(xs, [single * x for x in xs], linestyle="--", color="grey", label="ideal")
    efficiency.axhline(100, linestyle="--", color="grey")
    for axes, title in ((rate, "img/s"), (efficiency, "scaling efficiency (%)")):
        axes.set_xscale("log", base=2)
        axes.set_xlabel("ranks")
        axes.set_title(title)
        axes.legend()
    rate.set_yscale("log")
    figure.tight_layout()
    figure.savefig(stream, format="png")
    plt.close(figure)
