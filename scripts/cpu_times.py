"""Where the test suite's time goes: sum the lines of ``pytest --cpu-times FILE`` by test file.

    bash scripts/test.sh --cpu-times /tmp/cpu.jsonl
    python scripts/cpu_times.py /tmp/cpu.jsonl [--tests N]

Prints, costliest first, each file's wall time and CPU time (its worker's own and that of the
processes its tests waited for: ranks, launchers, commands), then the N costliest tests. On a
machine whose cores the suite keeps busy, CPU time is what a test takes from the others.
"""

from __future__ import annotations

import argparse
import json
import sys
from collections import defaultdict


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("file", help="the JSON lines pytest --cpu-times wrote")
    parser.add_argument("--tests", type=int, default=25, help="how many of the costliest tests to list (25)")
    args = parser.parse_args(argv)
    try:
        with open(args.file) as f:
            rows = [json.loads(line) for line in f if line.strip()]
    except (OSError, ValueError) as e:
        print(f"cpu_times: cannot read {args.file}: {e}", file=sys.stderr)
        return 1
    by_file = defaultdict(lambda: [0.0, 0.0, 0])
    for row in rows:
        row["cpu"] = row["cpu_s"] + row["children_cpu_s"]
        entry = by_file[row["test"].split("::")[0]]
        entry[0] += row["wall_s"]
        entry[1] += row["cpu"]
        entry[2] += 1
    total_wall, total_cpu = sum(e[0] for e in by_file.values()), sum(e[1] for e in by_file.values())
    print(f"{len(rows)} tests: {total_wall:.0f} s of wall time (summed over workers), {total_cpu:.0f} s of CPU")
    print(f"{'CPU s':>8} {'share':>6} {'wall s':>8} {'tests':>6}  file")
    for name, (wall, cpu, count) in sorted(by_file.items(), key=lambda kv: -kv[1][1]):
        print(f"{cpu:8.1f} {cpu / total_cpu:6.1%} {wall:8.1f} {count:6d}  {name}")
    print(f"\nthe {args.tests} costliest tests:")
    for row in sorted(rows, key=lambda r: -r["cpu"])[:args.tests]:
        print(f"{row['cpu']:8.1f} {row['wall_s']:8.1f}  {row['test']}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
