"""How busy the network was in a profiled job: the share of each step during which some
allreduce was under way on every rank, the rate while it was, and the longest idle gaps.

An allreduce moves data only once every rank has started it, so each one counts from the
latest start to the earliest end across the ranks (the ranks of an emulated cluster share one
clock; on real nodes the profile's clock offsets are applied first). Steps 0 and 1 (start-up)
are left out.

Usage (docs/perf-notes/priorities.md quotes the figures):
    hpdl emulate --nodes 2 --rate 1gbit -- hpdl run -np 2 --profile P.json -- hpdl bench synthetic ...
    python scripts/link_use.py P.json [--gaps 5]
"""

from __future__ import annotations

import argparse
import bisect
import json
import sys
from typing import Dict, List, Optional, Tuple


def _rows(table: dict) -> List[dict]:
    return [dict(zip(table["columns"], row)) for row in table["rows"]]


def joint_intervals(profile: dict) -> Tuple[List[Tuple[float, float, int]], List[dict]]:
    """The allreduces every rank took part in, as (start, end, bytes) in rank 0's clock, and
    rank 0's steps."""
    ranks = profile["ranks"]
    by_rank: List[Dict[int, dict]] = []
    for part in ranks:
        offset = 0.0 if part.get("clock_offset_applied") else float(part.get("clock_offset_us") or 0.0)
        flights = {}
        for row in _rows(part["collectives"]):
            if row["kind"] != "allreduce":
                continue
            start = row["start_us"] + offset
            flights[row["seq"]] = dict(row, start=start, end=start + row["copy_in_us"] + row["backend_us"])
        by_rank.append(flights)
    intervals = []
    for seq, first in by_rank[0].items():
        others = [flights.get(seq) for flights in by_rank[1:]]
        if any(other is None for other in others):
            continue
        members = [first] + others
        start, end = max(m["start"] for m in members), min(m["end"] for m in members)
        intervals.append((start, max(start, end), first["bytes"]))
    return sorted(intervals), _rows(ranks[0]["steps"])


def link_use(profile: dict, skip_steps: int = 2) -> Optional[dict]:
    intervals, steps = joint_intervals(profile)
    steps = steps[skip_steps:]
    if not steps or not intervals:
        return None
    begin, finish = steps[0]["start_us"], steps[-1]["end_us"]
    inside = [iv for iv in intervals if begin <= iv[0] < finish]
    busy, gaps, current = 0.0, [], None
    for start, end, _ in inside:
        if current is None:
            current = [start, end]
        elif start > current[1]:
            busy += current[1] - current[0]
            gaps.append((current[1], start))
            current = [start, end]
        else:
            current[1] = max(current[1], end)
    if current is not None:
        busy += current[1] - current[0]
    span = finish - begin
    nbytes = sum(iv[2] for iv in inside)
    return {"steps": len(steps), "step_ms": span / len(steps) / 1e3, "busy_share": busy / span,
            "rate_mb_s": nbytes / busy if busy else 0.0, "mb_per_step": nbytes / len(steps) / 1e6,
            "gaps": gaps, "step_starts": [s["start_us"] for s in steps]}


def main(argv: Optional[List[str]] = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("profile", help="a file written by hpdl run --profile")
    parser.add_argument("--gaps", type=float, default=0.0, metavar="MS",
                        help="also list the idle gaps of at least MS milliseconds, by step")
    args = parser.parse_args(argv)
    try:
        with open(args.profile) as handle:
            profile = json.load(handle)
        if len(profile["ranks"]) < 2:
            print(f"link_use: {args.profile}: one rank only, no network to measure", file=sys.stderr)
            return 1
        result = link_use(profile)
    except (OSError, ValueError, KeyError, TypeError) as err:
        print(f"link_use: cannot read {args.profile}: {err}", file=sys.stderr)
        return 1
    if result is None:
        print(f"link_use: {args.profile}: no allreduce after the start-up steps", file=sys.stderr)
        return 1
    print(f"{result['steps']} steps of {result['step_ms']:.0f} ms: {result['mb_per_step']:.1f} MB of allreduces per "
          f"step, the network busy {result['busy_share'] * 100:.0f} % of the time, at "
          f"{result['rate_mb_s']:.1f} MB/s while busy")
    if args.gaps:
        starts = result["step_starts"]
        for gap_start, gap_end in result["gaps"]:
            if (gap_end - gap_start) / 1e3 >= args.gaps:
                step = max(0, bisect.bisect_right(starts, gap_start) - 1)
                print(f"  idle {(gap_end - gap_start) / 1e3:6.1f} ms from {(gap_start - starts[step]) / 1e3:7.1f} ms "
                      f"into step {step + 2}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
